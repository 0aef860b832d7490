"""HR@K / NDCG@K and the rank convention (ties count against the model)."""

import math

import numpy as np
import pytest
import torch

from fedrec_flwr.metrics import (
    hit_ratio_at_k,
    mean_metrics,
    ndcg_at_k,
    rank_of_target,
    ranking_metrics,
    ranking_metrics_batch,
    ranks_batch,
)


@pytest.mark.parametrize(
    "rank_1based, expected",
    [(1, 1.0), (2, 0.6309297535714575), (3, 0.5), (10, 0.2890648263178879), (11, 0.0)],
)
def test_ndcg_at_10_table(rank_1based, expected):
    assert ndcg_at_k(rank_1based - 1, 10) == pytest.approx(expected, abs=1e-12)
    assert hit_ratio_at_k(rank_1based - 1, 10) == (1.0 if rank_1based <= 10 else 0.0)


def test_rank_counts_higher_scores():
    scores = np.array([0.5, 0.9, 0.1, 0.7])
    assert rank_of_target(scores, 0) == 2
    assert rank_of_target(scores, 1) == 0
    assert rank_of_target(scores, 2) == 3


@pytest.mark.parametrize("target", [0, 1, 50, 99])
def test_all_equal_scores_give_worst_rank_anywhere(target):
    scores = np.zeros(100)
    assert rank_of_target(scores, target) == 99
    metrics = ranking_metrics(scores, target, ks=(10,))
    assert metrics == {"HR@10": 0.0, "NDCG@10": 0.0}


def test_ties_count_against_target():
    scores = np.array([1.0, 1.0, 0.0])
    assert rank_of_target(scores, 0) == 1
    assert rank_of_target(scores, 1) == 1


def test_target_position_invariance():
    rng = np.random.default_rng([0, 1])
    scores = rng.normal(size=100)
    base = ranking_metrics(scores, 0)
    for pos in (1, 37, 99):
        moved = np.insert(np.delete(scores, 0), pos, scores[0])
        assert ranking_metrics(moved, pos) == base


def test_nan_scores_raise():
    with pytest.raises(ValueError, match="NaN"):
        rank_of_target(np.array([0.1, np.nan, 0.3]), 0)
    with pytest.raises(ValueError, match="NaN"):
        ranking_metrics_batch(np.array([[0.1, np.nan]]), 0)


def test_bad_target_index_raises():
    with pytest.raises(ValueError, match="out of range"):
        rank_of_target(np.zeros(3), 3)


def test_accepts_tensors():
    assert rank_of_target(torch.tensor([0.2, 0.5, 0.1]), 0) == 1


def test_batch_matches_single():
    rng = np.random.default_rng([0, 2])
    scores = rng.integers(0, 5, size=(30, 100)).astype(float)  # many ties
    batch = ranking_metrics_batch(scores, 0, ks=(5, 10, 20))
    for u in range(30):
        single = ranking_metrics(scores[u], 0, ks=(5, 10, 20))
        for key, value in single.items():
            assert batch[key][u] == pytest.approx(value)
    targets = rng.integers(0, 100, size=30)
    np.testing.assert_array_equal(
        ranks_batch(scores, targets), [rank_of_target(scores[u], targets[u]) for u in range(30)]
    )


def test_metric_keys_and_values():
    scores = np.arange(100, dtype=float)[::-1].copy()  # target (index 7) ranks 8th
    metrics = ranking_metrics(scores, 7, ks=(5, 10))
    assert set(metrics) == {"HR@5", "NDCG@5", "HR@10", "NDCG@10"}
    assert metrics["HR@5"] == 0.0 and metrics["HR@10"] == 1.0
    assert metrics["NDCG@10"] == pytest.approx(1 / math.log2(9))


# ------------------------------------------------------------------ edge cases (as recommender libraries pin them)
@pytest.mark.parametrize(
    ("scores", "target", "rank"),
    [
        ([np.inf, 1.0, 2.0], 0, 0),  # +inf target beats every finite score
        ([1.0, np.inf, 2.0], 0, 2),  # a +inf competitor beats it
        ([-np.inf, 1.0, -5.0], 0, 2),  # -inf target: worst
        ([np.inf, np.inf, 0.0], 0, 1),  # tie at +inf: counted against the target
        ([-np.inf, -np.inf, -np.inf], 2, 2),  # all -inf: a tie, worst rank
        ([0.5, -np.inf, -np.inf], 0, 0),
    ],
)
def test_infinite_scores_are_ordered_and_ties_at_infinity_count_against(scores, target, rank):
    assert rank_of_target(np.array(scores), target) == rank
    assert ranks_batch(np.array([scores]), target).tolist() == [rank]
    assert rank_of_target(torch.tensor(scores, dtype=torch.float32), target) == rank


def test_k_at_least_the_number_of_candidates_always_hits():
    scores = np.array([0.1, 0.9, 0.5])  # target (index 0) is last: 0-based rank 2
    for k in (3, 4, 100):
        metrics = ranking_metrics(scores, 0, ks=(k,))
        assert metrics == {f"HR@{k}": 1.0, f"NDCG@{k}": 0.5}  # 1 / log2(2 + 2)
        batch = ranking_metrics_batch(scores[None, :], 0, ks=(k,))
        assert batch[f"HR@{k}"].tolist() == [1.0] and batch[f"NDCG@{k}"].tolist() == [0.5]
    assert ranking_metrics(scores, 0, ks=(2,)) == {"HR@2": 0.0, "NDCG@2": 0.0}
    assert ranking_metrics(np.array([7.0]), 0, ks=(1,)) == {"HR@1": 1.0, "NDCG@1": 1.0}  # one candidate: rank 0


@pytest.mark.parametrize("ks", [(), (0,), (-1, 10), (2.5,), (True,), ("10",), (np.float64(10),), "10"])
def test_invalid_ks_are_rejected_naming_them(ks):
    with pytest.raises(ValueError, match="ks must be a non-empty sequence of positive ints"):
        ranking_metrics(np.zeros(5), 0, ks=ks)
    with pytest.raises(ValueError, match="ks must be a non-empty sequence of positive ints"):
        ranking_metrics_batch(np.zeros((2, 5)), 0, ks=ks)


def test_numpy_integer_ks_are_accepted_as_ints():
    assert ranking_metrics(np.array([1.0, 0.0]), 0, ks=(np.int64(1),)) == {"HR@1": 1.0, "NDCG@1": 1.0}


def test_mean_over_users_is_exact_and_empty_input_raises():
    per_user = ranking_metrics_batch(np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 2.0], [0.0, 1.0, -1.0]]), 0, ks=(1, 2))
    # ranks 0, 2, 1
    assert mean_metrics(per_user) == {
        "HR@1": 1 / 3,
        "NDCG@1": 1 / 3,
        "HR@2": 2 / 3,
        "NDCG@2": (1.0 + 0.0 + 1 / math.log2(3)) / 3,
    }
    with pytest.raises(ValueError, match="no users for HR@5"):
        mean_metrics(ranking_metrics_batch(np.zeros((0, 4)), 0, ks=(5,)))
    with pytest.raises(ValueError, match="no metrics to average"):
        mean_metrics({})


@pytest.mark.parametrize("scores", [np.zeros(0), np.zeros((2, 2))])
def test_empty_or_non_vector_scores_raise(scores):
    with pytest.raises(ValueError, match="non-empty 1-D"):
        rank_of_target(scores, 0)


def test_batch_rejects_no_candidates_and_out_of_range_targets():
    with pytest.raises(ValueError, match=r"shape \(U, C\) with C >= 1"):
        ranks_batch(np.zeros((3, 0)), 0)
    with pytest.raises(ValueError, match="out of range"):
        ranks_batch(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="out of range"):
        ranks_batch(np.zeros((2, 3)), -1)


def test_ks_without_10_gives_a_full_summary_progress_lines_and_curves(tmp_path, caplog):
    """``ks = "5,20"``: the final row, the validation selection, the progress line and the curves use HR@5 / NDCG@5
    (the first K listed) instead of looking for an HR@10 the run never computed."""
    import json
    import logging

    from fedrec_flwr.state.results import RunRecorder, learning_curves_figure

    recorder = RunRecorder(tmp_path / "run", {"ks": "5,20"}, {})
    with caplog.at_level(logging.INFO, logger="fedrec_flwr.progress"):
        for server_round, hr in ((1, 0.25), (2, 0.5)):
            recorder.record(
                server_round,
                {"train-loss": 0.6},
                {"HR@5": hr, "NDCG@5": hr / 2, "HR@20": 2 * hr, "NDCG@20": hr, "val-HR@5": 1 - hr, "val-HR@20": 0.9},
            )
    progress = [r.getMessage() for r in caplog.records if r.name == "fedrec_flwr.progress"]
    assert progress[-1].startswith("round    2 | HR@5 0.5000 | NDCG@5 0.2500 | train loss 0.6000"), progress
    recorder.finish({}, {})
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final"]["round"] == 2 and summary["final"]["HR@5"] == 0.5
    assert summary["selected-on-validation"]["round"] == 1  # the better val-HR@5
    fig = learning_curves_figure(recorder.rows)
    left = fig.axes[0]
    assert [line.get_label().split(" ")[0] for line in left.get_lines()] == ["HR@5", "NDCG@5"]
    assert [list(line.get_ydata()) for line in left.get_lines()] == [[0.25, 0.5], [0.125, 0.25]]
    import matplotlib.pyplot as plt

    plt.close(fig)
    from fedrec_flwr.state.results import headline_k

    assert headline_k("5,10,20") == 10 and headline_k("5,20") == 5 and headline_k("20,5") == 20
    assert headline_k(None, [{"round": 1, "HR@20": 0.1, "HR@5": 0.0}]) == 20 and headline_k(None, []) is None
