"""Leave-one-out split of the real MovieLens-100K: counts, negatives, determinism, tie rules, attributes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import dataset_dir

from fedrec_flwr.data import load_interactions, load_split, preprocess, sample_train_negatives


@pytest.fixture(scope="module")
def ml100k() -> Path:
    return dataset_dir("ml-100k")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def split(ml100k, cache):
    return load_split("ml-100k", ml100k, cache_dir=cache)


def test_counts(split):
    assert (split.num_users, split.num_items) == (943, 1682)
    assert split.user_ids[0] == "1" and split.user_ids[-1] == "943"  # numeric, not string, order
    assert split.item_ids[9] == "10"
    assert split.stats()["interactions"] == 100_000
    assert split.train_indptr.shape == (944,) and split.train_indptr.dtype == np.int64
    assert split.train_indptr[-1] == len(split.train_items) == 100_000 - 943


def test_one_test_item_and_99_clean_negatives_per_user(split):
    assert split.test_items.shape == (943,) and split.test_items.dtype == np.int64
    assert split.test_negatives.shape == (943, 99) and split.test_negatives.dtype == np.int64
    for u in range(split.num_users):
        pos = split.positives(u)
        assert np.all(np.diff(pos) > 0)
        assert split.test_items[u] not in pos
        negs = split.test_negatives[u]
        assert len(np.unique(negs)) == 99
        assert not np.isin(negs, split.interacted(u)).any()
    assert split.val_items is None and split.val_negatives is None


def test_test_item_is_a_latest_interaction(split, cache, ml100k):
    frame = load_interactions("ml-100k", ml100k, cache_dir=cache).frame
    latest = frame.groupby("user")["timestamp"].max()
    ts = frame.set_index(["user", "item"])["timestamp"]
    for u in range(0, 943, 37):
        raw_user, raw_item = split.user_ids[u], split.item_ids[split.test_items[u]]
        assert ts[(raw_user, raw_item)] == latest[raw_user]


def test_train_negatives_may_hit_test_item_never_positives(split):
    hits = 0
    for u in range(20):
        pos = split.positives(u)
        for rnd in range(300):
            negs = sample_train_negatives(split, u, rnd, 1, seed=0)
            assert negs.shape == (len(pos),) and negs.dtype == np.int64
            assert not np.isin(negs, pos).any()
            assert negs.min() >= 0 and negs.max() < split.num_items
            hits += int(np.any(negs == split.test_items[u]))
    assert hits > 0  # the held-out item is a legitimate (unknown to the client) negative


def test_train_negatives_deterministic_and_seeded(split):
    a = sample_train_negatives(split, 5, 3, 4, seed=0)
    assert a.shape == (4 * len(split.positives(5)),)
    np.testing.assert_array_equal(a, sample_train_negatives(split, 5, 3, 4, seed=0))
    assert not np.array_equal(a, sample_train_negatives(split, 5, 4, 4, seed=0))
    assert not np.array_equal(a, sample_train_negatives(split, 5, 3, 4, seed=1))


def test_split_deterministic_and_seed_dependent(split, cache, tmp_path, ml100k):
    rebuilt = load_split("ml-100k", ml100k, cache_dir=tmp_path)  # fresh cache: built again from the files
    assert rebuilt.equals(split)
    in_memory = preprocess(load_interactions("ml-100k", ml100k, cache_dir=cache))
    assert in_memory.equals(split)
    other = load_split("ml-100k", ml100k, cache_dir=tmp_path, seed=1)
    assert not np.array_equal(other.test_negatives, split.test_negatives)
    assert other.meta["seed"] == 1


def _popularity_hr10(s) -> float:
    """HR@10 of a popularity ranker over (test item + 99 negatives); ties count against the model."""
    counts = s.train_counts()
    test_score = counts[s.test_items]
    rank = (counts[s.test_negatives] >= test_score[:, None]).sum(axis=1)
    return float(np.mean(rank < 10))


def test_tie_rule_moves_popularity_hr(cache, ml100k):
    """The seeded split (seed 0) gives exact popularity HR@10 per tie rule (the README's 0.317 / 0.393 / 0.470 /
    0.463): 299, 371, 443 and 437 hits of 943 users."""
    hr = {}
    for rule in ("largest-item", "random", "smallest-item", "fedrecgel"):
        s = load_split("ml-100k", ml100k, cache_dir=cache, tie_rule=rule)
        assert s.meta["tie_rule"] == rule
        hr[rule] = _popularity_hr10(s)
    print("popularity HR@10 on ML-100K:", hr)
    assert hr == {"largest-item": 299 / 943, "random": 371 / 943, "smallest-item": 443 / 943, "fedrecgel": 437 / 943}


def test_smallest_and_fedrecgel_rules_pick_the_same_test_items(cache, ml100k):
    a = load_split("ml-100k", ml100k, cache_dir=cache, tie_rule="smallest-item")
    b = load_split("ml-100k", ml100k, cache_dir=cache, tie_rule="fedrecgel")
    np.testing.assert_array_equal(a.test_items, b.test_items)
    assert a.meta["users_with_tied_latest"] == 415  # ~44% of users have a tied latest timestamp


def test_holdout_validation(cache, ml100k):
    s = load_split("ml-100k", ml100k, cache_dir=cache, holdout_validation=True)
    assert s.val_items.shape == (943,) and s.val_negatives.shape == (943, 99)
    assert np.all(s.val_items != s.test_items)
    for u in range(0, 943, 50):
        assert s.val_items[u] not in s.positives(u)
        assert len(s.interacted(u)) == len(s.positives(u)) + 2
        assert not np.isin(s.val_negatives[u], s.interacted(u)).any()
    assert s.stats()["interactions"] == 100_000


def test_attributes_for_all_users(split):
    assert set(split.attributes) >= {"gender", "age", "occupation"}
    gender, age = split.attributes["gender"], split.attributes["age"]
    assert gender.shape == (943,) and set(np.unique(gender)) == {"M", "F"}
    assert (gender == "M").sum() == 670
    assert age.dtype == np.int64 and age.min() == 7 and age.max() == 73
    assert split.attributes["occupation"][0] == "technician"  # user "1" in u.user
