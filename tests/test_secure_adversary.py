"""FedAU²'s server-trained h_w under ``secure-aggregation = "secagg+"`` and ``adversary-weight-rule = "adaptive"``
(:mod:`fedrec_flwr.adversary.secure`): the secure step equals the clear one up to SecAgg+'s quantization bound, no
reply or server record holds a node's own vector, a node that drops mid-protocol leaves the right sum of the others,
the adaptive eps moves, is in the diagnostics and survives a resume, and a curious server has nothing to attack."""

from __future__ import annotations

import signal

import numpy as np
import pandas as pd
import pytest
from conftest import MessageRecorder
from test_checkpoint_resume import run_killed
from test_fedau2_server import _config

from fedrec_flwr.adversary import ADVERSARY_MODULE
from fedrec_flwr.adversary.adaptive import statistics_length
from fedrec_flwr.adversary.diagnostics import DIAGNOSTICS_FILE
from fedrec_flwr.adversary.secure import STATISTICS_KEY, VECTOR_RECORD, WEIGHT_KEY
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.privacy.secagg import COLLECT_MASKED_VECTORS
from fedrec_flwr.wire import NUM_EXAMPLES, sample_users

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PREFIX = ADVERSARY_MODULE + "."
LR = 0.3
SECAGG = "query.secagg"


def _run(folder, mods=(), **overrides):
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial

    options = dict(adversary_server_optimizer="sgd", adversary_server_learning_rate=LR, num_server_rounds=1)
    config = _config(folder, **{**options, **overrides})
    initial = {
        k: v.numpy().astype(np.float64)
        for k, v in get_runtime(config).model.shared_state().items()
        if k.startswith(PREFIX)
    }
    recorder = MessageRecorder(folder / "messages")
    out = run_serial(config, client_app=make_client_app(config, mods=[*mods, recorder]))
    with np.load(out / "final_arrays.npz") as data:
        final = {k: data[k].copy() for k in data.files}
    return config, initial, final, recorder.records(), out


def _bound(config, train_records) -> tuple[float, float]:
    """The bound on every element of the secure mean gradient's error: numerator and weight are each within
    ``e = n * S * step`` of their sums (``S``: the largest node weight), so the mean is within
    ``e (1 + |g|) / (W - e)``. Returns ``(e, W)``."""
    weights = [float(r["reply-metrics"]["metrics"][NUM_EXAMPLES]) for r in train_records]
    cfg = RunConfig.from_mapping(config)
    step = 2 * cfg.secure_aggregation_clipping_range / (cfg.secure_aggregation_quantization_range - 1)
    error = len(weights) * max(weights) * step
    return error, sum(weights)


def _vectors(records, kind: str = "train") -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """``(round, partition) ->`` the vector a node kept after its ``kind`` handler (``"train"``: the train step's;
    ``"query.adversary_gradient"``: a query step's), read from the node state the recorder saw."""
    return {
        (int(r["round"]), int(r["partition-id"])): dict(r["state"][VECTOR_RECORD])
        for r in records
        if r["type"] == kind and VECTOR_RECORD in r["state"]
    }


def test_the_secure_step_equals_the_clear_step_within_the_quantization_bound(tmp_path):
    _, initial, clear, _, _ = _run(tmp_path / "off")
    config, initial_on, secure, records, _ = _run(tmp_path / "on", secure_aggregation="secagg+")
    assert all(np.array_equal(initial[k], initial_on[k]) for k in initial)
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == 12 and len([r for r in records if r["type"] == SECAGG]) == 4 * 12
    error, weight = _bound(config, train)
    for key in initial:
        gradient = (initial[key] - clear[key].astype(np.float64)) / LR
        tolerance = LR * error * (1 + np.abs(gradient)) / (weight - error) + 1e-6
        assert np.all(np.abs(secure[key] - clear[key]) <= tolerance), key
    for key in clear:  # the other arrays are the clear run's: only h_w's path changed
        if not key.startswith(PREFIX):
            np.testing.assert_array_equal(clear[key], secure[key], err_msg=key)


def _matches(value: np.ndarray, vector: dict[str, np.ndarray]) -> bool:
    """Whether ``value`` equals (within float32 rounding) one of the node's vector parts, or its mean per weight."""
    value = np.asarray(value)
    if value.dtype.kind != "f":
        return False
    weight = float(vector[WEIGHT_KEY][0])
    for key, part in vector.items():
        if key == WEIGHT_KEY or part.shape != value.shape:
            continue
        for candidate in (part, part / weight):
            if np.any(candidate) and np.allclose(value, candidate, rtol=1e-4, atol=1e-7):
                return True
    return False


def test_no_reply_or_server_record_holds_a_nodes_own_vector(tmp_path):
    """Secure + adaptive, two h_w steps per round, checkpoints: every array of every reply (train, adversary_gradient,
    the four SecAgg+ stages), the checkpoint and the results folder's arrays differ from each node's own h_w gradient
    sum, its mean and its statistics; the train replies carry zeros under h_w's keys and no statistics record; the
    query replies carry num-examples only."""
    config, _, _, records, out = _run(
        tmp_path,
        secure_aggregation="secagg+",
        adversary_weight_rule="adaptive",
        adversary_server_steps=2,
        num_server_rounds=2,
        checkpoint_every=1,
    )
    vectors = _vectors(records)
    assert len(vectors) == 2 * 12
    for vector in vectors.values():
        assert set(vector) == {*(k for k in vector if k.startswith(PREFIX)), WEIGHT_KEY, STATISTICS_KEY}
        assert vector[STATISTICS_KEY].shape == (statistics_length(2),)
    queried = _vectors(records, "query.adversary_gradient")
    assert len(queried) == 2 * 12
    vectors = {**{("train", *k): v for k, v in vectors.items()}, **{("query", *k): v for k, v in queried.items()}}
    for record in records:
        for name, arrays in record["reply-arrays"].items():
            assert name != STATISTICS_KEY
            for key, value in arrays.items():
                if record["type"] == "train" and key.startswith(PREFIX):
                    assert not np.any(value), key
                for vector in vectors.values():
                    assert not _matches(value, vector), (record["type"], name, key)
        for metrics in record["reply-metrics"].values():
            for value in metrics.values():
                if isinstance(value, list):
                    for vector in vectors.values():
                        assert not _matches(np.asarray(value, dtype=np.float64), vector)
        if record["type"] == "query.adversary_gradient":
            assert not record["reply-arrays"] and set(record["reply-metrics"]["metrics"]) == {NUM_EXAMPLES}
    stored = [p for p in out.rglob("*.npz")]
    assert stored, "the run wrote checkpoints and its final arrays"
    for path in stored:
        with np.load(path) as data:
            for key in data.files:
                for vector in vectors.values():
                    assert not _matches(data[key], vector), (path.name, key)


def test_a_node_that_drops_at_the_masked_vectors_leaves_the_sum_of_the_others(tmp_path):
    from fedrec_flwr.privacy.secagg_records import from_content

    seed = RunConfig.from_mapping(_config(tmp_path / "probe")).seed
    victim = int(sample_users(seed, 1, 24, 0.5)[0])  # a node the round samples (one user per node)

    def drop_victim(message, context, call_next):
        if message.metadata.message_type == SECAGG and int(context.node_config["partition-id"]) == victim:
            if from_content(message.content)[0] == COLLECT_MASKED_VECTORS:
                raise RuntimeError("the node stops mid-protocol")
        return call_next(message, context)

    config, initial, final, records, _ = _run(tmp_path, mods=[drop_victim], secure_aggregation="secagg+")
    vectors = {p: v for (_, p), v in _vectors(records).items()}
    assert victim in vectors and len(vectors) == 12
    survivors = [v for p, v in vectors.items() if p != victim]
    weight = sum(float(v[WEIGHT_KEY][0]) for v in survivors)
    train = [r for r in records if r["type"] == "train"]
    error, _ = _bound(config, train)
    for key in initial:
        gradient = sum(v[key] for v in survivors) / weight
        expected = initial[key] - LR * gradient
        tolerance = LR * error * (1 + np.abs(gradient)) / (weight - error) + 1e-6
        assert np.all(np.abs(final[key] - expected) <= tolerance), key
    everyone = sum(v[PREFIX + "head.bias"] for v in vectors.values()) / sum(v[WEIGHT_KEY][0] for v in vectors.values())
    assert not np.allclose(final[PREFIX + "head.bias"], initial[PREFIX + "head.bias"] - LR * everyone, atol=1e-5)


ADAPTIVE = dict(
    adversary_weight_rule="adaptive",
    adaptive_rate=2.0,
    adversary_epsilon=0.5,
    adaptive_epsilon_min=0.001,
    adaptive_epsilon_max=100.0,
    num_server_rounds=3,
)


def test_the_adaptive_eps_moves_from_round_to_round_in_the_diagnostics(tmp_path):
    """In the clear (secure-aggregation off) the train replies carry their node's summed statistics; eps and the
    signal are in adversary-diagnostics.csv, and eps changes every round."""
    _, _, _, records, out = _run(tmp_path, **ADAPTIVE)
    train = [r for r in records if r["type"] == "train"]
    assert all(r["reply-arrays"][STATISTICS_KEY][STATISTICS_KEY].shape == (statistics_length(2),) for r in train)
    diagnostics = pd.read_csv(out / DIAGNOSTICS_FILE)
    assert list(diagnostics["round"]) == [1, 2, 3]
    assert diagnostics["epsilon"].nunique() == 3 and np.isfinite(diagnostics["adaptive-signal"]).all()
    assert 0.5 not in set(diagnostics["epsilon"])


def test_a_secured_adaptive_run_killed_in_round_3_resumes_to_the_same_eps_and_arrays(tmp_path):
    """Killed after two train replies of round 3 and resumed from its round-2 checkpoint (node state on disk, the
    protocol's state forgotten), the run ends with the uninterrupted run's eps and arrays."""
    from fedrec_flwr.serial import run_serial
    from fedrec_flwr.state.checkpoint import load_checkpoint

    overrides = dict(
        ADAPTIVE,
        secure_aggregation="secagg+",
        checkpoint_every=1,
        client_state_dir=str(tmp_path / "device"),
        adversary_server_optimizer="adam",
    )
    whole = run_serial(_config(tmp_path / "whole", run_name="whole", **overrides))
    config = _config(tmp_path / "killed", run_name="killed", **overrides)
    done = run_killed(config, 3)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    killed = tmp_path / "killed" / "results" / "killed"
    assert load_checkpoint(killed).server_round == 2
    folder = run_serial({**config, "resume-from": str(killed)})
    key = "adversary-step/adaptive/epsilon"
    eps = [float(load_checkpoint(f).strategy_arrays[key]) for f in (whole, folder)]
    assert eps[0] == eps[1] != 0.5
    with np.load(whole / "final_arrays.npz") as a, np.load(folder / "final_arrays.npz") as b:
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"adversary_weight_rule": "adaptive", "adversary_epsilon": 1e-5}, "adaptive-epsilon-min"),
        ({"secure_aggregation": "secagg+", "adversary_training": "per-client"}, "secure-aggregation"),
        ({"secure_aggregation": "secagg+", "secure_aggregation_num_shares": 4}, "num-shares"),
        ({"adversary_weight_rule": "sometimes"}, "adversary-weight-rule"),
        ({"adversary_weight_rule": "adaptive", "strategy": "flwr.serverapp.strategy:FedAvg"}, "Flower strategy"),
    ],
)
def test_a_bad_secure_or_adaptive_setting_is_one_config_error_line(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        RunConfig.from_mapping(_config(tmp_path, **overrides))
    assert "\n" not in str(err.value)


def test_a_curious_server_on_a_secured_run_attacks_only_the_sum_one_guess_for_every_user_of_a_round(tmp_path):
    """The curious server (iDLG on every single-user reply) on a secured run with one user per node: every train
    reply's h_w arrays are zeros and no adversary_gradient reply carries arrays, so the only thing it attacks is the
    round's SecAgg+ sum: one guess per round, recorded for every user the round trained (``from-sum`` = 1)."""
    _, _, _, records, out = _run(
        tmp_path,
        strategy="curious-item-fedavg",
        secure_aggregation="secagg+",
        adversary_server_steps=2,
        num_server_rounds=2,
    )
    train = [r for r in records if r["type"] == "train"]
    assert train and all(
        not np.any(v) for r in train for k, v in r["reply-arrays"]["arrays"].items() if k.startswith(PREFIX)
    )
    assert all(not r["reply-arrays"] for r in records if r["type"] == "query.adversary_gradient")
    log = pd.read_csv(out / "label-leakage.csv")
    assert set(log["from-sum"]) == {1} and set(log["round"]) == {1, 2}
    for round_, rows in log.groupby("round"):
        trained = sorted(u for r in train if r["round"] == round_ for u in r["users"])
        assert sorted(rows["user"]) == trained  # every user of the round, once
        assert rows["idlg-label"].nunique() == 1 and rows["idlg-label"].iloc[0] in (0, 1)
        assert (rows["idlg-linked-label"] == -1).all()


def test_flowers_ray_simulation_gives_the_serial_grids_secured_adaptive_run(tmp_path):
    """The SecAgg+ stages, the kept vectors and the adaptive eps only use messages and node state: Flower's Ray
    simulation (2 actors, replies in any order) ends bit-identical to the serial grid."""
    from conftest import simulate

    from fedrec_flwr.serial import run_serial

    overrides = dict(ADAPTIVE, secure_aggregation="secagg+", adversary_server_steps=2, users_per_node=3)
    overrides["num_server_rounds"] = 2
    ray = simulate(_config(tmp_path / "ray", **overrides), num_cpus=2, cpus_per_client=1)
    serial = run_serial(_config(tmp_path / "serial", **overrides))
    with np.load(ray / "final_arrays.npz") as a, np.load(serial / "final_arrays.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
