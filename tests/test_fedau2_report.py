"""The FedAU² main tables' ΔHR@10 compares each arm with its own unchanged model on the same seeds
(``experiments.fedau2.report.paired_change``), not a single-seed run with the unchanged model's mean over other
seeds."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from experiments.common import slug
from experiments.fedau2.methods import CHOSEN_ARM
from experiments.fedau2.report import main_tables

GEL_ARM = "FedAU2-GEL-server w/o DSVAE, 20 server steps, prior, linear, entropy (ours), always, rate 0.001, eps 0.1"


def _run(root, model, arm, seed, hr, attribute=None):
    name = f"{slug(arm)}-{attribute}-seed{seed}" if attribute else f"{slug(arm)}-seed{seed}"
    folder = root / "runs" / "main" / model / name
    folder.mkdir(parents=True)
    config = {"seed": seed, "adversary-epsilon": 1.0}
    if attribute:
        config["protected-attribute"] = attribute
    (folder / "config.json").write_text(json.dumps({"run-config": config}))
    (folder / "summary.json").write_text(json.dumps({"final": {"HR@10": hr, "NDCG@10": hr / 2}, "total-seconds": 1.0}))
    attacks = {
        f"{a}/{c}": {"auc": 0.5, "balanced-accuracy": 0.5, "macro-f1": 0.5}
        for a in ("gender", "age")
        for c in ("logreg", "mlp")
    }
    (folder / "attack.json").write_text(json.dumps({"attribute-inference": attacks, "label-leakage": {}}))


def test_hr_change_pairs_each_arm_with_its_unchanged_model_on_the_same_seeds(tmp_path):
    for seed, hr in enumerate((0.40, 0.50, 0.60)):
        _run(tmp_path, "FedNCF", "original", seed, hr)
    for seed, hr in enumerate((0.40, 0.40, 0.55)):
        _run(tmp_path, "FedNCF", "original (FedRecGEL client)", seed, hr)
    _run(tmp_path, "FedNCF", CHOSEN_ARM, 2, 0.57, "gender")  # one seed: against seed 2's 0.60, not the mean 0.50
    _run(tmp_path, "FedNCF", GEL_ARM, 0, 0.38, "gender")  # fedau2-gel: against FedRecGEL's client, seeds 0-1
    _run(tmp_path, "FedNCF", GEL_ARM, 1, 0.42, "gender")
    _run(tmp_path, "FedNCF", CHOSEN_ARM, 5, 0.70, "age")  # no seed shared with the original: no change shown
    main_tables(tmp_path)
    table = pd.read_csv(tmp_path / "main-gender.csv").set_index("arm")["HR@10-change-%"]
    assert table[CHOSEN_ARM] == pytest.approx(100 * (0.57 / 0.60 - 1), abs=1e-4)  # -5.0 (old code: +14.0)
    assert table[GEL_ARM] == pytest.approx(0.0, abs=1e-4)  # 0.40 vs 0.40
    assert table["original (FedRecGEL client)"] == pytest.approx(100 * (0.45 / 0.50 - 1), abs=1e-4)
    assert table["original"] == pytest.approx(0.0, abs=1e-4)
    assert "| -5.0% |" in (tmp_path / "main-gender.md").read_text()
    age = pd.read_csv(tmp_path / "main-age.csv").set_index("arm")["HR@10-change-%"]
    assert age[CHOSEN_ARM] != age[CHOSEN_ARM]  # NaN: no shared seed
    assert f"| {CHOSEN_ARM} | 0.7000 | 0.3500 | - |" in (tmp_path / "main-age.md").read_text()


def test_the_tradeoff_plot_pairs_each_point_by_seed_and_shows_the_validation_sweep(tmp_path):
    """``tradeoff.png``'s points: the arm's mean LR AUC (std over seeds) and its HR@10 change against the original
    of the same seeds; the plot is written with the FedNCF validation sweep's panel."""
    from experiments.fedau2.report import _change_points, load_runs, tradeoff_plot

    for seed, hr in enumerate((0.40, 0.50, 0.60)):
        _run(tmp_path, "FedNCF", "original", seed, hr)
    _run(tmp_path, "FedNCF", CHOSEN_ARM, 1, 0.45, "gender")
    _run(tmp_path, "FedNCF", CHOSEN_ARM, 2, 0.66, "gender")
    runs = load_runs(tmp_path / "runs" / "main")
    points = {arm: rest for arm, *rest in _change_points(runs, "FedNCF", ("original", CHOSEN_ARM, "DP b=0.1"))}
    assert set(points) == {"original", CHOSEN_ARM}  # an arm without runs is left out
    auc, std, change, seeds = points[CHOSEN_ARM]
    assert (auc, std, seeds) == (pytest.approx(0.5), pytest.approx(0.0), 2)
    assert change == pytest.approx(100 * (1.11 / 1.10 - 1))  # seeds 1-2 only: (0.45 + 0.66) / (0.5 + 0.6)
    selection = pd.DataFrame(
        {
            "model": "FedNCF",
            "attribute": "gender",
            "embedding-step": "local",
            "seed": 3,
            "epsilon": [0.0, 0.1, 1.0],
            "logreg-auc": [0.65, 0.5, 0.46],
            "val-HR@10-change-%": [0.0, -2.0, -8.0],
            "chosen": [False, True, False],
        }
    )
    tradeoff_plot(tmp_path, runs, selection)
    assert (tmp_path / "tradeoff.png").stat().st_size > 10_000
