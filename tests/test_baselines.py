"""Popularity baseline, evaluate_model and train_centralized on a tiny hand-built split."""

import numpy as np
import pytest
import torch

from fedrec_flwr.baselines import evaluate_model, evaluate_popularity, popularity_scores, train_centralized
from fedrec_flwr.data import Split
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.models import build_model


def tiny_split(with_val=False) -> Split:
    """3 users, 8 items. Train positives: u0 {0,1,2}, u1 {0,1}, u2 {0,3}. Counts: item0 3, item1 2, item2 1, item3 1."""
    return Split(
        dataset="tiny",
        num_users=3,
        num_items=8,
        train_indptr=np.array([0, 3, 5, 7], dtype=np.int64),
        train_items=np.array([0, 1, 2, 0, 1, 0, 3], dtype=np.int64),
        test_items=np.array([3, 2, 1], dtype=np.int64),
        test_negatives=np.array([[4, 5, 6], [3, 4, 5], [2, 6, 7]], dtype=np.int64),
        val_items=np.array([4, 4, 4], dtype=np.int64) if with_val else None,
        val_negatives=np.array([[5, 6, 7], [5, 6, 7], [5, 6, 7]], dtype=np.int64) if with_val else None,
        user_ids=np.array(["a", "b", "c"]),
        item_ids=np.array([str(i) for i in range(8)]),
        attributes={},
        meta={},
    )


def test_popularity_scores_are_train_counts():
    np.testing.assert_array_equal(popularity_scores(tiny_split()), [3, 2, 1, 1, 0, 0, 0, 0])


def test_popularity_ties_count_against_the_baseline():
    # u0: target 3 (count 1) vs 4,5,6 (0) -> rank 0. u1: target 2 (1) vs item 3 (1, tie) -> rank 1.
    # u2: target 1 (2) vs 2 (1), 6, 7 -> rank 0.
    metrics = evaluate_popularity(tiny_split(), ks=(1, 2))
    assert metrics["HR@1"] == pytest.approx(2 / 3)
    assert metrics["HR@2"] == pytest.approx(1.0)
    assert metrics["NDCG@2"] == pytest.approx((1 + 1 / np.log2(3) + 1) / 3)
    val = evaluate_popularity(tiny_split(with_val=True), ks=(1,), which="val")
    assert val["HR@1"] == 0.0  # every candidate has count 0: ties against


def test_evaluate_model_and_errors():
    split = tiny_split()
    model = build_model("mf", 3, 8, embedding_dim=2)
    with torch.no_grad():
        model.user_embedding.weight.fill_(1.0)
        model.item_embedding.weight.zero_()
        model.item_embedding.weight[split.test_items] = 1.0  # every test item scores 2, the rest 0
    metrics = evaluate_model(model, split, ks=(1,))
    # u1's negatives include item 3 and u2's include item 2 (other users' targets, also scored 2): ties, so only
    # u0 (negatives 4, 5, 6 scored 0) is a hit.
    assert metrics["HR@1"] == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match="holdout_validation"):
        evaluate_model(model, split, which="val")
    with pytest.raises(ConfigError, match="which"):
        evaluate_popularity(split, which="train")
    with pytest.raises(ValueError, match="users"):
        evaluate_model(build_model("mf", 4, 8), split)


@pytest.mark.parametrize("loss", ["bce", "bpr"])
def test_train_centralized_is_deterministic(loss):
    split = tiny_split(with_val=True)
    seen = []
    runs = [
        train_centralized(
            split,
            "ncf",
            epochs=3,
            batch_size=4,
            learning_rate=0.01,
            loss=loss,
            embedding_dim=4,
            mlp_layers=(8, 4),
            eval_every=2,
            eval_which="val",
            ks=(1, 3),
            seed=seed,
            progress=seen.append,
        )
        for seed in (1, 1, 2)
    ]
    history = runs[0].history
    assert [sorted(h) for h in history] == [
        ["epoch", "loss", "seconds"],
        ["HR@1", "HR@3", "NDCG@1", "NDCG@3", "epoch", "loss", "seconds"],
        ["HR@1", "HR@3", "NDCG@1", "NDCG@3", "epoch", "loss", "seconds"],
    ]
    assert len(seen) == 9
    strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h]  # noqa: E731
    assert strip(runs[0].history) == strip(runs[1].history)
    assert strip(runs[0].history) != strip(runs[2].history)
    assert runs[0].model.num_users == 3


def test_train_centralized_rejects_bad_arguments():
    split = tiny_split()
    with pytest.raises(ConfigError, match="epochs"):
        train_centralized(split, epochs=0)
    with pytest.raises(ConfigError, match="optimizer"):
        train_centralized(split, optimizer="lbfgs")
    with pytest.raises(ConfigError, match="holdout_validation"):
        train_centralized(split, eval_which="val")
    with pytest.raises(ConfigError, match="unknown model"):
        train_centralized(split, model_name="gru4rec")
