"""The FedRecGEL experiment scripts: method configs validate, filter normalisation, and the report's tables."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from experiments.fedrecgel.landscape import filter_normalised_direction
from experiments.fedrecgel.methods import ABLATIONS, METHODS, PROTOCOL, RHO_GRID
from experiments.fedrecgel.report import load_runs, main_table, mean_std
from fedrec_flwr.config import make_run_config


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_config_validates(method):
    config = make_run_config(**{**PROTOCOL, **METHODS[method]})
    assert config.num_server_rounds == 100 and config.holdout_validation and config.evaluate_validation
    for extra in ABLATIONS.values():
        make_run_config(**{**PROTOCOL, **METHODS["FedRecGEL"], **extra})
    assert 0.0 in RHO_GRID and 1.0 in RHO_GRID


def test_filter_normalised_direction_matches_row_norms_and_zeroes_biases():
    shared = {"table": torch.randn(6, 4), "layer.weight": torch.randn(3, 5), "layer.bias": torch.randn(3)}
    d = filter_normalised_direction(shared, torch.Generator().manual_seed(0))
    for key in ("table", "layer.weight"):
        torch.testing.assert_close(d[key].norm(dim=1), shared[key].norm(dim=1))
    assert not d["layer.bias"].any()


def _fake_run(base, dataset, name, seed, hr_final, hr_val_rounds):
    folder = base / dataset / f"{name}-seed{seed}"
    folder.mkdir(parents=True)
    rows = [{"round": r, "HR@10": hr, "NDCG@10": hr / 2, "val-HR@10": v} for r, hr, v in hr_val_rounds]
    (folder / "metrics.json").write_text(json.dumps(rows))
    (folder / "config.json").write_text(json.dumps({"run-config": {"seed": seed}}))
    best = max(rows, key=lambda r: (r["val-HR@10"], -r["round"]))
    (folder / "summary.json").write_text(
        json.dumps(
            {
                "final": {"HR@10": hr_final, "NDCG@10": hr_final / 2},
                "selected-on-validation": best,
                "total-seconds": 1.0,
            }
        )
    )


def test_report_averages_seeds_and_never_selects_on_test(tmp_path):
    runs = tmp_path / "runs" / "main"
    # the test HR@10 peaks at round 10, but the validation item prefers round 20: the report must take round 20
    for seed, final in ((0, 0.5), (1, 0.7)):
        _fake_run(runs, "filmtrust", "fedrecgel", seed, final, [(10, 0.9, 0.2), (20, final, 0.4)])
        _fake_run(runs, "filmtrust", "fedncf", seed, final - 0.1, [(10, 0.3, 0.3), (20, final - 0.1, 0.1)])
    frame = load_runs(runs)
    assert len(frame) == 4
    gel = frame[frame["run"] == "fedrecgel"]
    assert gel["sel-round"].tolist() == [20, 20] and gel["sel-HR@10"].tolist() == [0.5, 0.7]
    summary = mean_std(frame, ["dataset", "run"], ["HR@10"])
    row = summary[summary["run"] == "fedrecgel"].iloc[0]
    assert row["HR@10-mean"] == pytest.approx(0.6) and row["HR@10-std"] == pytest.approx(np.std([0.5, 0.7], ddof=1))
    main_table(tmp_path, None)
    text = (tmp_path / "main.md").read_text()
    assert "0.6000 ± 0.1414" in text and "FedRecGEL" in text
    assert (tmp_path / "main.csv").is_file()


def test_landscape_plots_are_written(tmp_path):
    """The landscape's plotting step (after its grid CSV): both figures are written from a small grid."""
    from experiments.fedrecgel import landscape

    a, b = np.meshgrid(landscape.GRID, landscape.GRID)
    grids = {"FedNCF": 0.7 + a**2 + b**2, "FedRecGEL": 0.6 + 0.5 * (a**2 + b**2)}
    landscape._plots("tiny", grids, tmp_path)
    for kind in ("contour", "surface"):
        assert (tmp_path / f"landscape-tiny-{kind}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
