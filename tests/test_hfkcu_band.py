"""The calibrated poisoning benchmark's arithmetic (experiments/hfkcu/band.py) on hand-made numbers: the retraining
band and inside-band, the cheapest retraining budget, cost-ratio, the cost meter and the recipe writer."""

from __future__ import annotations

import math
import types

import numpy as np
import pandas as pd
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from experiments.hfkcu import band as B


def test_band_is_mean_plus_minus_two_sample_std():
    got = B.band([1.0, 2.0, 3.0, 4.0, 5.0])
    std = math.sqrt(2.5)  # ddof = 1
    assert got.mean == 3.0 and got.std == pytest.approx(std, abs=1e-15)
    assert got.low == pytest.approx(3.0 - 2 * std, abs=1e-15) and got.high == pytest.approx(3.0 + 2 * std, abs=1e-15)
    assert (got.min, got.max, got.n) == (1.0, 5.0, 5)
    assert got.contains(-0.16) and got.contains(6.16) and not got.contains(-0.17)
    assert got.contains(6.17) is False


def test_two_sigma_band_holds_min_max_for_five_seeds():
    """Samuelson's inequality: with 5 values and ddof = 1 no value is more than 4/sqrt(5) = 1.79 std from the mean."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.standard_exponential(5) ** 3  # skewed, as exposure is
        got = B.band(x)
        assert got.low <= got.min and got.max <= got.high
        assert np.max(np.abs(x - x.mean())) <= 4 / math.sqrt(5) * got.std + 1e-12


def test_band_refuses_one_value_or_nan():
    with pytest.raises(ValueError, match="at least two"):
        B.band([0.5])
    with pytest.raises(ValueError, match="finite"):
        B.band([0.5, float("nan")])


def test_zero_spread_band_admits_only_that_value():
    got = B.band([0.0, 0.0, 0.0, 0.0, 0.0])
    assert got.contains(0.0) and not got.contains(1 / 943)


def _runs(shift: float = 0.0) -> list[dict]:
    return [
        {"exposure@10": e, "target-percentile": p, "HR@10": h + shift, "NDCG@10": n + shift}
        for e, p, h, n in zip(
            [0.00, 0.01, 0.02, 0.01, 0.00],
            [0.90, 0.91, 0.89, 0.90, 0.88],
            [0.90, 0.91, 0.92, 0.91, 0.90],
            [0.80, 0.81, 0.82, 0.81, 0.80],
        )
    ]


def test_inside_band_needs_every_band_metric():
    target = B.bands(_runs())
    inside = {"exposure@10": 0.01, "target-percentile": 0.2, "HR@10": 0.91, "NDCG@10": 0.81}
    assert B.inside_band(inside, target)  # the percentile is banded but not judged
    for key, bad in (("exposure@10", 0.2), ("HR@10", 0.95), ("NDCG@10", 0.70)):
        assert not B.inside_band({**inside, key: bad}, target), key
    assert B.inside_band({**inside, "NDCG@10": 0.70}, target, keys=("exposure@10", "HR@10"))


def test_cheapest_budget_is_the_fewest_rounds_every_seed_lands_in():
    final = _runs()
    target = B.bands(final)
    early = _runs(shift=-0.2)  # every seed outside at 10 rounds
    mixed = _runs()
    mixed[3] = {**mixed[3], "HR@10": 0.5}  # one seed still outside at 25 rounds
    curves = [{10: early[s], 25: mixed[s], 50: final[s], 100: final[s]} for s in range(5)]
    assert B.cheapest_budget(curves, target) == 50
    curves[2] = {k: v for k, v in curves[2].items() if k != 50}  # rounds not every curve has are skipped
    assert B.cheapest_budget(curves, target) == 100
    with pytest.raises(ValueError, match="no budget"):
        B.cheapest_budget([{10: early[s]} for s in range(5)], target)
    with pytest.raises(ValueError, match="no retraining"):
        B.cheapest_budget([], target)


def test_cost_ratio():
    assert B.cost_ratio(250.0, 1000.0) == 0.25
    assert B.cost_ratio(3000, 1000) == 3.0
    with pytest.raises(ValueError):
        B.cost_ratio(1.0, 0.0)


def test_stronger_attack_sizes():
    assert B.WEAKER.num_fakes(943) == 20
    assert B.STRONGER_FIRST.num_fakes(B.GENUINE_USERS["ml-100k"]) == 236
    assert B.STRONGER.num_fakes(B.GENUINE_USERS["ml-100k"]) == 472
    assert B.STRONGER.fillers > B.WEAKER.fillers


def test_retrain_seeds_start_with_the_poisoned_seed():
    assert B.retrain_seeds(2) == [2, 1002, 2002, 3002, 4002]
    assert len(set(B.retrain_seeds(0))) == B.RETRAIN_SEEDS >= 5


def _message(kind: str, users: list[int], floats: int, config: dict | None = None):
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.zeros(floats, np.float32))}),
            "config": ConfigRecord({"users": users, "server-round": 1} if config is None else config),
        }
    )
    return types.SimpleNamespace(
        metadata=types.SimpleNamespace(message_type=kind), content=content, has_error=lambda: False
    )


def test_meter_counts_trained_and_queried_users_and_bytes_not_evaluation():
    meter = B.Meter(local_epochs=2)

    def reply_with(floats):
        return lambda message, context: _message("reply", [], floats)

    meter.mod(_message("train", [1, 2, 3], 10), None, reply_with(4))  # 3 users x 2 epochs
    meter.mod(_message("query.unlearn-hvp", [4, 5], 6), None, reply_with(6))  # 2 users, one pass each
    meter.mod(_message("evaluate", [1, 2, 3, 4], 100), None, reply_with(100))  # measurement: not counted
    assert meter.total.user_epochs == 3 * 2 + 2
    size = {n: len(Array(np.zeros(n, np.float32)).data) for n in (4, 6, 10)}  # serialized, as sent
    assert size[10] - size[4] == 4 * 6  # float32 payload plus a fixed header
    assert meter.total.bytes_sent == size[10] + size[6] and meter.total.bytes_received == size[4] + size[6]

    grid = types.SimpleNamespace(push_messages=lambda messages: [meter.mod(m, None, reply_with(1)) for m in messages])
    meter.watch(grid)
    grid.push_messages([_message("train", [9], 1)])
    grid.push_messages([])
    assert meter.total.rounds == 1
    meter.exclude(1e6)
    assert meter.now().seconds < 0  # excluded measurement time comes off the wall time


def test_meter_counts_node_level_queries_by_the_affected_reply():
    meter = B.Meter(local_epochs=1)
    node = types.SimpleNamespace(node_id=7)
    counts = {"affected-users": 30, "remaining-users": 90}
    affected = _message("query.unlearn_affected", [], 1, {"exclude": [1]})
    meter.mod(affected, node, lambda m, c: _message("reply", [], 1, counts))
    assert meter.total.user_epochs == 0  # an index look-up
    meter.mod(_message("query.unlearn_hvp", [], 1, {"exclude": [1], "causal": True}), node, lambda m, c: m)
    meter.mod(_message("query.unlearn_loss", [], 1, {"exclude": [1], "causal": False}), node, lambda m, c: m)
    assert meter.total.user_epochs == 30 + 90
    other = types.SimpleNamespace(node_id=8)  # no affected reply from this node yet
    meter.mod(_message("query.unlearn_hvp", [], 1, {"exclude": [1], "causal": True}), other, lambda m, c: m)
    assert meter.total.user_epochs == 120


def _poisoned_and_retrains():
    setting = {"dataset": "filmtrust", "model": "FedMF", "attack": "weaker", "seed": 0}
    final = _runs()
    retrains = []
    for s, seed in enumerate(B.retrain_seeds(0)):
        curve = {}
        for rounds, metrics in ((10, _runs(-0.2)[s]), (25, final[s]), (50, final[s]), (100, final[s])):
            cost = {
                "user-epochs": 100.0 * rounds,
                "bytes-sent": 10 * rounds,
                "bytes-received": rounds,
                "rounds": rounds,
            }
            curve[str(rounds)] = {"metrics": metrics, "cost": {**cost, "seconds": 0.5 * rounds}}
        retrains.append({"setting": setting, "retrain-seed": seed, "curve": curve})
    cost = {"user-epochs": 500.0, "bytes-sent": 7, "bytes-received": 3, "rounds": 3, "seconds": 1.0}
    poisoned = {
        "setting": setting,
        "original": {"exposure@10": 0.3, "target-percentile": 0.97, "HR@10": 0.91, "NDCG@10": 0.81},
        "methods": {
            B.DEFAULT_METHOD: {"metrics": {**final[1], "target-percentile": 0.5}, "cost": cost},
            "HF-KCU": {"metrics": {**final[1], "NDCG@10": 0.6}, "cost": {**cost, "user-epochs": 5000.0}},
        },
    }
    return poisoned, retrains


def test_recipe_rows_columns_and_judgement(tmp_path):
    poisoned, retrains = _poisoned_and_retrains()
    rows, summary = B.recipe_rows(poisoned, retrains)
    frame = B.write_recipe(rows, [summary], tmp_path)
    assert list(frame.columns[: len(B.RECIPE_COLUMNS)]) == list(B.RECIPE_COLUMNS)
    by = frame.set_index("method")
    assert summary["cheapest-budget"] == 25 and summary["budget-user-epochs"] == 2500.0
    assert not by.loc["poisoned (no unlearning)", "inside-band"]  # exposure 0.3 is outside
    assert by.loc[B.DEFAULT_METHOD, "inside-band"] and by.loc[B.DEFAULT_METHOD, "default"]
    assert by.loc[B.DEFAULT_METHOD, "cost-ratio"] == pytest.approx(0.2)
    assert not by.loc["HF-KCU", "inside-band"] and not by.loc["HF-KCU", "default"]  # NDCG@10 counts
    assert by.loc["HF-KCU", "cost-ratio"] == pytest.approx(2.0)
    assert not by.loc["retrain 10 rounds", "inside-band"] and by.loc["retrain 25 rounds", "inside-band"]
    assert by.loc["retrain 100 rounds", "cost-ratio"] == pytest.approx(4.0)
    read = pd.read_csv(tmp_path / "recipe.csv")
    assert list(read.columns[: len(B.RECIPE_COLUMNS)]) == list(B.RECIPE_COLUMNS) and len(read) == 2 + 1 + 4
    text = (tmp_path / "recipe.md").read_text()
    assert f"- {B.DEFAULT_METHOD}: inside band in 1 of 1 settings" in text
    assert "- HF-KCU: inside band in 0 of 1 settings" in text
    assert "- poisoned (no unlearning): inside band in 0 of 1 settings (there the attack" in text
    assert summary["band-over-range"]["HR@10"] > 1.0  # the 2-sigma band is wider than min-max
    assert by.loc[B.DEFAULT_METHOD, "distance-to-band"] == 0.0 and by.loc["HF-KCU", "distance-to-band"] > 0.0
    assert (tmp_path / "frontier" / "frontier-filmtrust-fedmf-weaker.png").is_file()


def test_count_lines_put_the_default_first():
    frame = pd.DataFrame(
        {"method": ["a", B.DEFAULT_METHOD, "a", B.DEFAULT_METHOD], "inside-band": [True, False, True, True]}
    )
    assert B.count_lines(frame) == [
        f"{B.DEFAULT_METHOD}: inside band in 1 of 2 settings",
        "a: inside band in 2 of 2 settings",
    ]


def test_count_lines_count_the_cheap_inside_rows():
    frame = pd.DataFrame(
        {
            "method": [B.DEFAULT_METHOD] * 3,
            "inside-band": [True, True, False],
            "cost-ratio": [0.1, 0.3, 0.05],
        }
    )
    assert B.count_lines(frame) == [
        f"{B.DEFAULT_METHOD}: inside band in 2 of 3 settings (1 at cost-ratio <= 0.2; median cost-ratio 0.1)"
    ]
    settings = {"dataset": ["d"] * 3, "model": ["m"] * 3, "attack": ["a"] * 3, "seed": [0, 1, 2]}
    harmed = pd.DataFrame({k: v[:2] for k, v in settings.items()})  # seeds 0 and 1 harmed
    assert B.count_lines(frame.assign(**settings), harmed) == [
        f"{B.DEFAULT_METHOD}: inside band in 2 of 3 settings (1 at cost-ratio <= 0.2; 1 of the 2 harmed; "
        "median cost-ratio 0.1)"
    ]


def test_distance_to_band_is_the_worst_excess_in_std_units():
    from experiments.hfkcu.frontier import DISTANCE_FLOOR, distance_to_band

    target = {"HR@10": B.band([0.30, 0.32, 0.34]), "exposure@10": B.band([0.0, 0.0]), "kl": B.band([0.1, 0.3])}
    hr = target["HR@10"]
    keys = ("HR@10", "exposure@10")
    assert distance_to_band({"HR@10": hr.mean, "exposure@10": 0.0}, target, keys) == 0.0
    below = distance_to_band({"HR@10": hr.low - hr.std, "exposure@10": 0.0}, target, keys)
    assert below == pytest.approx(1.0)
    # a zero-spread band measures in units of the floor: 0.002 above it is 2 floors
    assert distance_to_band({"HR@10": hr.mean, "exposure@10": 2 * DISTANCE_FLOOR}, target, keys) == pytest.approx(2.0)
    # upper-only: far below the band is no distance, above it is
    kl = target["kl"]
    assert distance_to_band({"kl": -5.0}, target, ("kl",), upper_only=("kl",)) == 0.0
    assert distance_to_band({"kl": kl.high + kl.std}, target, ("kl",), upper_only=("kl",)) == pytest.approx(1.0)
    assert distance_to_band({"HR@10": float("nan"), "exposure@10": 0.0}, target, keys) == math.inf


def test_forget_rows_add_kl_to_the_reference_and_judge_it_one_sided(tmp_path):
    setting = B.forget_setting("ml-100k", "FedMF", "1%", 0)
    seeds = B.retrain_seeds(0)
    rng = np.random.default_rng(1)
    reference = rng.normal(size=(6, 100))

    def save(name, logits):
        path = B._scores_path(tmp_path, setting, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, logits.astype(np.float32))

    retrains = []
    for k, seed in enumerate(seeds):
        curve = {}
        for rounds in B.CURVE_ROUNDS:
            noise = 0.0 if (k == 0 and rounds == 100) else 0.05 * (k + 1) + (100 - rounds) / 100
            save(f"retrain-seed-{seed}-round-{rounds}", reference + noise * rng.normal(size=reference.shape))
            metrics = {"mia-auc": 0.50 + 0.01 * k, "HR@10": 0.40 + 0.01 * k, "NDCG@10": 0.20 + 0.01 * k}
            cost = {"user-epochs": 10.0 * rounds, "bytes-sent": 1, "bytes-received": 1, "rounds": rounds, "seconds": 1}
            curve[str(rounds)] = {"metrics": metrics, "cost": cost}
        retrains.append({"setting": asdict_setting(setting), "retrain-seed": seed, "curve": curve})
    save("original", reference + 2.0 * rng.normal(size=reference.shape))
    save(B.slug_name(B.DEFAULT_METHOD), reference.copy())  # KL 0: below the band, which passes
    metrics = {"mia-auc": 0.52, "HR@10": 0.42, "NDCG@10": 0.22}
    trained = {
        "setting": asdict_setting(setting),
        "original": metrics,
        "methods": {B.DEFAULT_METHOD: {"metrics": metrics, "cost": {**cost, "user-epochs": 100.0}}},
    }
    rows, summary = B.forget_rows(trained, retrains, tmp_path)
    by = {row["method"]: row for row in rows}
    assert by[B.DEFAULT_METHOD]["kl"] == pytest.approx(0.0, abs=1e-6) and by[B.DEFAULT_METHOD]["inside-band"]
    assert by["trained (no unlearning)"]["kl"] > summary["bands"]["kl"]["high"]
    assert not by["trained (no unlearning)"]["inside-band"]  # same metrics as HF-KCU but a KL above the band
    assert by["retrain 100 rounds"]["kl"] == 0.0 and summary["bands"]["kl"]["n"] == len(seeds) - 1
    assert summary["cheapest-budget"] == 100  # the earlier rounds are far in KL
    assert by[B.DEFAULT_METHOD]["cost-ratio"] == pytest.approx(100.0 / 1000.0)


def asdict_setting(setting):
    return {"dataset": setting.dataset, "model": setting.model, "attack": setting.attack, "seed": setting.seed}


def test_adding_methods_runs_only_the_missing_ones_and_needs_an_exact_reproduction(tmp_path):
    done = tmp_path / "poisoned.json"
    assert B._pending(done, {"a": {}}, add=True) == (None, {"a": {}})
    record = {"original": {"HR@10": 0.5, "mia-auc": float("nan")}, "methods": {"a": {"metrics": 1}}, "wall": 3}
    done.write_text(__import__("json").dumps(record))
    previous, todo = B._pending(done, {"a": {}, "b": {"x": 1}}, add=True)
    assert todo == {"b": {"x": 1}} and B._pending(done, {"a": {}, "b": {}}, add=False)[1] == {}
    B._check_reproduced(done, {"HR@10": 0.5, "mia-auc": float("nan")}, previous)  # NaN equals NaN
    with pytest.raises(RuntimeError, match="did not reproduce"):
        B._check_reproduced(done, {"HR@10": 0.5000001, "mia-auc": float("nan")}, previous)
    merged = B._merged({"methods": {"b": {"metrics": 2}}, "wall": 9}, previous)
    assert merged["methods"] == {"a": {"metrics": 1}, "b": {"metrics": 2}} and merged["wall"] == 3
