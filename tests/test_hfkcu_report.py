"""HF-KCU's poisoning tables (``experiments.hfkcu.report``): one row per setting and variant, the gap measures, and
the forget-set report keeping the committed rows of runs whose arrays (never committed) are not on this machine."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from experiments.hfkcu.report import _poison_rows, forget_report


def _row(variant, percentile, hr=0.4, seconds=2.0):
    return {
        "variant": variant,
        "target-percentile": percentile,
        "exposure": 0.0,
        "HR@10": hr,
        "NDCG@10": hr / 2,
        "seconds": seconds,
    }


def _setting(root, rows, replays):
    original = root / "poison" / "ml-100k" / "FedMF" / "fakes-20" / "seed-1" / "original"
    original.mkdir(parents=True)
    (original / "phase.json").write_text(json.dumps({"rows": rows}))
    for name, replayed in replays.items():
        (original / name).write_text(json.dumps({"rows": replayed}))
    retrain = original.parent / "retrain-fake-users"
    retrain.mkdir()
    (retrain / "retrain.json").write_text(
        json.dumps({"target-percentile": 0.3, "exposure": 0.0, "HR@10": 0.41, "NDCG@10": 0.2, "train-seconds": 20.0})
    )


def test_a_variant_replayed_twice_counts_once_and_the_gap_measures_are_shares_of_the_gap(tmp_path):
    _setting(
        tmp_path,
        [_row("original", 0.7, seconds=0.0)],
        {
            "replay.json": [_row("original", 0.7), _row("default", 0.1, seconds=4.0), _row("margin", 0.4)],
            "replay-margin.json": [_row("original", 0.7), _row("margin", 0.35, seconds=9.0)],
        },
    )
    frame = pd.DataFrame(_poison_rows(tmp_path / "poison")).set_index("variant")
    assert sorted(frame.index) == ["default", "margin", "original", "retrained without fake users"]
    assert frame.loc["margin", "target-percentile"] == 0.35  # the first file's (name order)
    assert frame.loc["default", "closed"] == pytest.approx((0.7 - 0.1) / (0.7 - 0.3))
    assert frame.loc["default", "overshoot"] == pytest.approx((0.3 - 0.1) / (0.7 - 0.3))
    assert frame.loc["margin", "overshoot"] == 0.0
    assert frame.loc["default", "speedup"] == pytest.approx(20.0 / 4.0)
    assert frame.loc["default", "HR@10-minus-retrained"] == pytest.approx(100 * (0.4 - 0.41))


def test_forget_rows_of_runs_without_their_arrays_are_kept_from_the_committed_table(tmp_path):
    (tmp_path / "forget" / "seed-0").mkdir(parents=True)  # a seed whose runs' npz files are not here
    committed = pd.DataFrame(
        [
            {
                "seed": 0,
                "dataset": "ml-100k",
                "model": "FedMF",
                "forget-set": "1%",
                "forgotten": 9,
                "variant": v,
                "HR@10": 0.37,
                "NDCG@10": 0.19,
                "seconds": s,
                "kl": kl,
                "parameter-gap": 0.0,
                "mia-auc": auc,
                "speedup": sp,
            }
            for v, s, kl, auc, sp in (
                ("retrained (gold standard)", 100.0, 0.0, 0.85, 1.0),
                ("original", float("nan"), 3.1e-4, 0.86, float("nan")),
                ("HF-KCU distributed (default)", 20.0, 4.2e-4, 0.851, 5.0),
            )
        ]
    )
    committed.to_csv(tmp_path / "forget.csv", index=False)
    forget_report(tmp_path, "")
    again = pd.read_csv(tmp_path / "forget.csv")
    assert len(again) == 3 and again["kl"].tolist() == pytest.approx([0.0, 3.1e-4, 4.2e-4], rel=1e-5)
    text = (tmp_path / "forget.md").read_text()
    assert "## seed-0, ml-100k, FedMF, forget 1% (9 users)" in text and "0.000420" in text
