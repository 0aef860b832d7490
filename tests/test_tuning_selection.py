"""The tuning protocol chooses settings and epochs on the validation item only."""

from __future__ import annotations

import pytest

from experiments.tuning import grid as G
from experiments.tuning.report import random_ranker
from experiments.tuning.selection import row_at_round, select_epoch, select_setting
from fedrec_flwr.config import make_run_config


def test_select_setting_follows_validation_where_test_disagrees():
    # the test metrics would choose lr=0.1 (HR@10 0.70); the validation item chooses lr=0.03
    results = [
        ("learning-rate=0.01", {"HR@10": 0.50, "NDCG@10": 0.30, "val-HR@10": 0.40, "val-NDCG@10": 0.20}),
        ("learning-rate=0.03", {"HR@10": 0.45, "NDCG@10": 0.25, "val-HR@10": 0.60, "val-NDCG@10": 0.30}),
        ("learning-rate=0.1", {"HR@10": 0.70, "NDCG@10": 0.50, "val-HR@10": 0.55, "val-NDCG@10": 0.35}),
    ]
    assert select_setting(results) == "learning-rate=0.03"
    # a validation HR@10 tie is broken by validation NDCG@10, never by test metrics
    tie = [
        ("a", {"HR@10": 0.9, "NDCG@10": 0.9, "val-HR@10": 0.5, "val-NDCG@10": 0.2}),
        ("b", {"HR@10": 0.1, "NDCG@10": 0.1, "val-HR@10": 0.5, "val-NDCG@10": 0.3}),
    ]
    assert select_setting(tie) == "b"


def test_selection_refuses_test_metrics_and_rows_without_validation():
    with pytest.raises(ValueError, match="validation metric"):
        select_setting([("a", {"HR@10": 0.5, "val-HR@10": 0.1, "val-NDCG@10": 0.1})], key="HR@10")
    with pytest.raises(ValueError, match="no 'val-HR@10'"):
        select_setting([("a", {"HR@10": 0.5, "NDCG@10": 0.3})])
    with pytest.raises(ValueError, match="no finished"):
        select_setting([])


def test_select_epoch_follows_validation_and_takes_the_earliest_tie():
    history = [
        {"epoch": 1, "loss": 0.5},  # not evaluated
        {"epoch": 2, "HR@10": 0.9, "val-HR@10": 0.3, "val-NDCG@10": 0.1},
        {"epoch": 3, "HR@10": 0.2, "val-HR@10": 0.6, "val-NDCG@10": 0.2},
        {"epoch": 4, "HR@10": 0.3, "val-HR@10": 0.6, "val-NDCG@10": 0.2},
    ]
    assert select_epoch(history)["epoch"] == 3


def test_row_at_round_takes_the_evaluated_row_of_that_round():
    rows = [{"round": 99, "train-loss": 0.3}, {"round": 100, "train-loss": 0.3, "HR@10": 0.4}]
    assert row_at_round(rows, 100)["HR@10"] == 0.4 and row_at_round(rows, 99) is None


def test_every_grid_point_is_a_valid_run_config_with_validation_on():
    for method in G.METHODS:
        fixed = G.default_setting(method)
        for stage in range(len(G.GRIDS[method])):
            for setting in G.stage_settings(method, stage, fixed):
                config = make_run_config(**G.run_overrides(method, setting, "ml-100k", 0, G.GRID_ROUNDS))
                assert config.holdout_validation and config.evaluate_validation
    assert G.METHODS["FedRecGEL w/o SAM"]["rho-shared"] == G.METHODS["FedRecGEL w/o SAM"]["rho-private"] == 0.0


def test_random_ranker_expectation():
    expected = random_ranker(100)
    assert expected["HR@10"] == pytest.approx(0.10) and expected["HR@20"] == pytest.approx(0.20)
    assert 0 < expected["NDCG@5"] < expected["NDCG@10"] < expected["HR@10"]


def test_centralized_both_records_test_and_validation_metrics_per_epoch():
    from fedrec_flwr.baselines import evaluate_model, train_centralized
    from tests.test_baselines import tiny_split

    split = tiny_split(with_val=True)
    result = train_centralized(
        split, "mf", epochs=2, batch_size=4, learning_rate=0.01, embedding_dim=4, eval_which="both", ks=(1, 2)
    )
    last = result.history[-1]
    assert last["HR@1"] == evaluate_model(result.model, split, (1, 2), "test")["HR@1"]
    assert last["val-HR@2"] == evaluate_model(result.model, split, (1, 2), "val")["HR@2"]
    with pytest.raises(Exception, match="validation item"):
        train_centralized(tiny_split(), "mf", epochs=1, eval_which="both")


def test_a_later_stage_keeps_the_incumbent_when_it_scores_best(tmp_path, monkeypatch):
    """Stage 2 of FedRecGEL (rho-shared) must compare its values against stage 1's winner (rho-shared 0.05 at the
    chosen server rate), not only against each other: on FilmTrust 0.05 scored 0.9128 and 0.02 0.9095, and the
    search without the incumbent chose 0.02."""
    from experiments.tuning import run as R

    val = {
        "server-learning-rate": {0.0003: 0.35, 0.001: 0.40, 0.003: 0.45, 0.01: 0.60, 0.03: 0.50, 0.1: 0.30},
        "rho-shared": {0.02: 0.55, 0.1: 0.58},
    }

    def score(setting):
        if setting["rho-shared"] != 0.05:
            return val["rho-shared"][setting["rho-shared"]]
        return val["server-learning-rate"][setting["server-learning-rate"]]

    ran = []

    def fake_run_one(dataset, method, setting, seed, rounds, data_dir):
        ran.append(G.setting_name(setting))
        return tmp_path / G.setting_name(setting)

    def fake_last_row(folder, rounds):
        setting = dict((k, float(v)) for k, v in (kv.split("=") for kv in folder.name.split(",")))
        # the test metrics would choose rho-shared 0.1; the selection must not read them
        test = 0.9 if setting["rho-shared"] == 0.1 else 0.1
        return {"HR@10": test, "NDCG@10": test, "val-HR@10": score(setting), "val-NDCG@10": 0.1}

    monkeypatch.setattr(R, "run_one", fake_run_one)
    monkeypatch.setattr(R, "last_row", fake_last_row)
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    record = R.tune("ml-100k", "FedRecGEL", "")
    assert record["setting"] == {"rho-shared": 0.05, "server-learning-rate": 0.01}
    assert ran.count("rho-shared=0.05,server-learning-rate=0.01") == 2  # run (skipped when finished) in both stages
    assert {p["stage"] for p in record["grid"] if p["setting"] == record["setting"]} == {0}
    assert len(record["grid"]) == len(G.SERVER_RATES) + 2
    # a later stage's better value still replaces the incumbent
    val["rho-shared"][0.02] = 0.61
    assert R.tune("ml-100k", "FedRecGEL", "")["setting"] == {"rho-shared": 0.02, "server-learning-rate": 0.01}


def test_a_failed_grid_point_keeps_the_runs_own_failure_record_in_its_own_folder(tmp_path, monkeypatch):
    """Each grid point runs in its own folder (results-dir its parent, run-name its setting and seed), so no two
    points share a failure record; but the grid then wrote its own ``failed.json`` (the error only) over the one the
    run had just written there (:func:`fedrec_flwr.state.results.write_failure`: the round, the rounds completed). Now the
    run's record stays, the grid writes its own only for a run that left none (refused before its folder was used),
    and ``tune`` counts both points as failed."""
    import json

    import fedrec_flwr.serial
    from experiments.tuning import run as R
    from fedrec_flwr.errors import ConfigError
    from fedrec_flwr.state.results import write_failure

    def run_serial(config, **_):
        folder = tmp_path / "runs" / "ml-100k" / "fedmf" / f"r{G.GRID_ROUNDS}"
        assert (config.results_dir, config.run_name) == (str(folder), f"learning-rate={config.learning_rate:g}-seed0")
        if config.learning_rate == 0.3:
            raise ConfigError("run-config key 'learning-rate' = 0.3: refused")  # before the run wrote anything
        if config.learning_rate != 0.01:
            error = FloatingPointError(f"non-finite train loss at learning-rate {config.learning_rate:g}")
            write_failure(
                folder / config.run_name,
                error,
                server_round=42,
                rounds_completed=41,
                num_server_rounds=config.num_server_rounds,
            )
            raise error
        (folder / config.run_name / "summary.json").write_text("{}")

    monkeypatch.setattr(fedrec_flwr.serial, "run_serial", run_serial)
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    monkeypatch.setattr(R, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(
        R,
        "last_row",
        lambda folder, rounds: {"val-HR@10": 0.5, "val-NDCG@10": 0.3} if (folder / "summary.json").is_file() else None,
    )
    monkeypatch.setitem(G.GRIDS, "FedMF", [{"learning-rate": (0.01, 0.03, 0.1, 0.3)}])
    record = R.tune("ml-100k", "FedMF", "")
    folders = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.rglob("failed.json")}
    assert sorted(folders) == ["learning-rate=0.03-seed0", "learning-rate=0.1-seed0", "learning-rate=0.3-seed0"]
    for rate in ("0.03", "0.1"):
        failure = folders[f"learning-rate={rate}-seed0"]
        assert failure["round"] == 42 and failure["rounds-completed"] == 41, failure  # the run's own record
        assert failure["error"] == f"FloatingPointError: non-finite train loss at learning-rate {rate}"
    assert folders["learning-rate=0.3-seed0"] == {"error": "ConfigError: run-config key 'learning-rate' = 0.3: refused"}
    assert record["name"] == "learning-rate=0.01"
    assert sorted(p["setting"]["learning-rate"] for p in record["grid"] if p.get("failed")) == [0.03, 0.1, 0.3]
