"""HR@K / NDCG@K and the rank convention (ties count against the model)."""

import math

import numpy as np
import pytest
import torch

from fedrec_flwr.metrics import (
    hit_ratio_at_k,
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
