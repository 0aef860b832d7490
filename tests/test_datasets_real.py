"""The four real datasets load, clean and split to the documented statistics (real files in shared/data)."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import dataset_dir as _need

from fedrec_flwr.data import load_interactions, load_split


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _check_split_invariants(split) -> None:
    assert split.train_indptr[-1] == len(split.train_items)
    for u in range(0, split.num_users, max(1, split.num_users // 200)):
        pos = split.positives(u)
        assert np.all(np.diff(pos) > 0)
        assert split.test_items[u] not in pos
        assert not np.isin(split.test_negatives[u], split.interacted(u)).any()
        assert len(np.unique(split.test_negatives[u])) == split.test_negatives.shape[1]


def test_filmtrust_duplicates_removed_and_counted(cache):
    folder = _need("filmtrust")
    raw = load_interactions("filmtrust", folder, cache_dir=cache)
    assert len(raw.frame) == 35_494  # 35,497 rows, 3 duplicated (user, item) pairs
    assert raw.duplicates_removed == 3
    assert raw.frame["timestamp"].isna().all()
    split = load_split("filmtrust", folder, cache_dir=cache)
    assert split.meta["duplicates_removed"] == 3
    assert (split.num_users, split.num_items) == (1227, 2059)
    assert split.meta["dropped_users"] == 1508 - 1227
    assert split.stats()["interactions"] == 34_886
    _check_split_invariants(split)


def _fedrecgel_reference(path: Path, seed: int, num_neg: int = 99):
    """FedRecGEL's public FilmTrust preprocessing (data_process.ipynb), restated as the procedure is described."""
    df = pd.read_csv(path, sep=r"\s+", header=None, names=["uid", "iid", "rating"], engine="python")
    base = np.random.default_rng(42).integers(low=0, high=10**9, size=len(df), dtype=np.int64)
    df["timestamp"] = base * np.int64(10**6) + df.groupby("uid").cumcount().astype(np.int64)
    counts = df["uid"].value_counts()
    df = df[df["uid"].isin(set(counts[counts >= 5].index))]
    umap = {old: new for new, old in enumerate(sorted(df["uid"].unique()))}
    imap = {old: new for new, old in enumerate(sorted(df["iid"].unique()))}
    df = df.assign(uid=df["uid"].map(umap), iid=df["iid"].map(imap))
    df = df.sort_values(by=["uid", "iid"]).reset_index(drop=True)
    df["latest"] = df.groupby("uid")["timestamp"].rank(method="first", ascending=False)
    test = df[df["latest"] == 1].set_index("uid")["iid"].sort_index()
    rnd = random.Random(seed)
    pool = set(df["iid"].unique())
    status = df.groupby("uid")["iid"].apply(set)
    negatives = {}
    for uid, x in status.items():
        cand = set(rnd.sample(list(pool), num_neg + len(x))) - x
        negatives[uid] = rnd.sample(list(cand), num_neg)
    return test, negatives, len(umap), len(imap)


def test_filmtrust_fedrecgel_mode_reproduces_fedrecgel(cache):
    folder = _need("filmtrust")
    split = load_split("filmtrust", folder, cache_dir=cache, tie_rule="fedrecgel", seed=42)
    test, negatives, num_users, num_items = _fedrecgel_reference(folder / "ratings.txt", seed=42)
    assert (split.num_users, split.num_items) == (num_users, num_items)
    np.testing.assert_array_equal(split.test_items, test.to_numpy())
    np.testing.assert_array_equal(split.test_negatives, np.array([negatives[u] for u in range(num_users)]))
    assert split.meta["tie_rule"] == "fedrecgel"


def test_lastfm_every_row_positive_weight_kept(cache):
    folder = _need("lastfm-2k")
    raw = load_interactions("lastfm-2k", folder, cache_dir=cache)
    assert len(raw.frame) == 92_834
    assert raw.frame["rating"].max() == 352_698  # listening count kept in the rating column
    split = load_split("lastfm-2k", folder, cache_dir=cache)
    assert (split.num_users, split.num_items) == (1877, 17_617)
    assert split.stats()["interactions"] == 92_801
    assert split.meta["users_with_tied_latest"] == 0  # random order: no ties
    _check_split_invariants(split)


def test_amazon_video_loads_and_second_load_reads_cache(cache, caplog):
    folder = _need("amazon-video")
    start = time.perf_counter()
    first = load_split("amazon-video", folder, cache_dir=cache)
    first_s = time.perf_counter() - start
    assert (first.num_users, first.num_items) == (8072, 11_830)
    assert first.stats()["interactions"] == 63_836
    assert first.meta["dropped_users"] == 0 and first.meta["duplicates_removed"] == 0
    _check_split_invariants(first)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedrec_flwr.data"):
        start = time.perf_counter()
        second = load_split("amazon-video", folder, cache_dir=cache)
        second_s = time.perf_counter() - start
    assert any("loaded cached split" in r.getMessage() for r in caplog.records)
    assert first.equals(second)
    # Benchmark only (not asserted): the second load should take well under a second.
    print(f"amazon-video: first load {first_s:.3f} s, cached load {second_s:.3f} s")


def test_a_set_data_variable_that_points_nowhere_fails_and_only_an_unset_one_skips(monkeypatch, tmp_path):
    import conftest

    monkeypatch.setattr(conftest, "SHARED_DATA", tmp_path / "nowhere")
    monkeypatch.setenv("FEDREC_SHARED_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(pytest.fail.Exception, match="is set, but the dataset folder .*ml-100k does not exist"):
        conftest.dataset_dir("ml-100k")
    monkeypatch.delenv("FEDREC_SHARED_DATA")
    with pytest.raises(pytest.skip.Exception, match="FEDREC_SHARED_DATA unset"):
        conftest.dataset_dir("ml-100k")
    (tmp_path / "nowhere" / "ml-100k").mkdir(parents=True)
    assert conftest.dataset_dir("ml-100k") == tmp_path / "nowhere" / "ml-100k"
