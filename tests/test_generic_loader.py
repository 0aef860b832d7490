"""The user's own CSV/TSV files: named or indexed columns, header or not, timestamps or not, attributes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedrec_flwr.data import GenericSource, load_interactions, load_split, preprocess
from fedrec_flwr.errors import DataError

NUM_USERS, PER_USER, NUM_ITEMS = 6, 8, 40


def _rows():
    """(user, item, rating, timestamp): user u's latest item is item 5u + 7 (mod 40)."""
    for u in range(NUM_USERS):
        for k in range(PER_USER):
            yield f"user{u}", str((5 * u + k) % NUM_ITEMS), float(1 + k % 5), 1_600_000_000 + 60 * k
    for i in range(NUM_ITEMS):  # a heavy user so that every item exists
        if i % 2 or i > 32:
            yield "heavy", str(i), 3.0, 1_500_000_000 + i


def _write(path: Path, sep: str, header: bool, with_ts: bool) -> Path:
    names = ["uid", "iid", "score"] + (["when"] if with_ts else [])
    lines = [sep.join(names)] if header else []
    for user, item, rating, ts in _rows():
        fields = [user, item, f"{rating:g}"] + ([str(ts)] if with_ts else [])
        lines.append(sep.join(fields))
    path.write_text("\n".join(lines) + "\n")
    return path


def _check_latest(split) -> None:
    for u in range(NUM_USERS):
        user = split.user_ids == f"user{u}"
        (index,) = np.flatnonzero(user)
        assert split.item_ids[split.test_items[index]] == str((5 * u + PER_USER - 1) % NUM_ITEMS)


@pytest.mark.parametrize("sep", [",", "\t"])
def test_named_columns_with_header_and_timestamps(tmp_path, sep):
    path = _write(tmp_path / f"data{'.csv' if sep == ',' else '.tsv'}", sep, header=True, with_ts=True)
    source = GenericSource(str(path), user_col="uid", item_col="iid", rating_col="score", timestamp_col="when")
    inter = load_interactions("generic", generic=source)
    assert list(inter.frame.columns[:4]) == ["user", "item", "rating", "timestamp"]
    assert inter.frame["rating"].dtype == np.float64 and inter.frame["timestamp"].dtype == np.int64
    split = load_split("generic", cache_dir=tmp_path / "cache", generic=source, num_test_negatives=10)
    assert split.num_users == NUM_USERS + 1 and split.num_items == NUM_ITEMS
    assert list(split.item_ids[:3]) == ["0", "1", "2"]  # integer ids sort numerically
    _check_latest(split)
    assert split.meta["timestamps"] == "file" and split.attributes == {}


def test_indexed_columns_without_header_explicit_sep(tmp_path):
    path = _write(tmp_path / "data.tsv", "\t", header=False, with_ts=True)
    source = GenericSource(str(path), user_col=0, item_col=1, timestamp_col=3, sep="\t", header=False)
    inter = load_interactions("generic", generic=source)
    assert inter.frame["rating"].isna().all()  # no rating column named
    split = preprocess(inter, num_test_negatives=10)
    _check_latest(split)


def test_without_timestamps_uses_seeded_random_order(tmp_path):
    path = _write(tmp_path / "data.csv", ",", header=True, with_ts=False)
    source = GenericSource(str(path), user_col="uid", item_col="iid")
    inter = load_interactions("generic", generic=source)
    a = preprocess(inter, num_test_negatives=10, seed=3)
    assert a.equals(preprocess(inter, num_test_negatives=10, seed=3))
    b = preprocess(inter, num_test_negatives=10, seed=4)
    assert not np.array_equal(a.test_items, b.test_items) or not np.array_equal(a.test_negatives, b.test_negatives)
    assert a.meta["users_with_tied_latest"] == 0 and "random order" in a.meta["timestamps"]


def test_whitespace_file_is_sniffed(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("".join(f"{u} {i}  {r}\n" for u, i, r, _ in _rows()))
    inter = load_interactions("generic", generic=GenericSource(str(path), 0, 1, rating_col=2, header=False))
    assert len(inter.frame) == len(list(_rows())) == NUM_USERS * PER_USER + 23


def test_attributes_file(tmp_path):
    path = _write(tmp_path / "data.csv", ",", header=True, with_ts=True)
    attrs = tmp_path / "users.tsv"
    attrs.write_text(
        "id\tgender\tage\n"
        + "".join(f"user{u}\t{'MF'[u % 2]}\t{20 + u}\n" for u in range(NUM_USERS))
        + "heavy\tF\t50\nnobody\tM\t1\n"
    )
    source = GenericSource(
        str(path), "uid", "iid", timestamp_col="when", attributes_path=str(attrs), attributes_user_col="id"
    )
    inter = load_interactions("generic", generic=source)
    assert inter.attributes.loc["user3", "age"] == 23
    split = preprocess(inter, num_test_negatives=10)
    gender, age = split.attributes["gender"], split.attributes["age"]
    assert gender.shape == age.shape == (split.num_users,) and age.dtype == np.int64
    for index, raw in enumerate(split.user_ids):
        expected = 50 if raw == "heavy" else 20 + int(raw[4:])
        assert age[index] == expected
    # a user without attributes is an error, not a silent gap
    attrs.write_text("id\tgender\tage\nuser0\tM\t20\n")
    with pytest.raises(DataError, match="attributes lack"):
        preprocess(load_interactions("generic", generic=source), num_test_negatives=10)


def test_cache_key_depends_on_column_choice(tmp_path):
    path = _write(tmp_path / "data.csv", ",", header=True, with_ts=True)
    with_ts = GenericSource(str(path), "uid", "iid", timestamp_col="when")
    without = GenericSource(str(path), "uid", "iid")
    cache = tmp_path / "cache"
    a = load_split("generic", cache_dir=cache, generic=with_ts, num_test_negatives=10)
    b = load_split("generic", cache_dir=cache, generic=without, num_test_negatives=10)
    assert a.meta["cache_key"] != b.meta["cache_key"]
    assert len(list((cache / "processed").glob("*.npz"))) == 2


def test_generic_columns_that_list_the_header_are_matched_by_name(tmp_path):
    """Header ``user,item,timestamp`` and ``generic-columns = "user,item,timestamp"``: the third column is read as
    the timestamps, not as ratings (and the split does not fall back to a seeded random order); a role's name
    in another role's position is refused naming both."""
    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.errors import ConfigError

    path = tmp_path / "data.csv"
    rows = [(user, item, ts) for user, item, _, ts in _rows()]
    rows = rows[::-1]  # file order is not time order
    path.write_text("user,item,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    common = dict(
        dataset="generic",
        generic_file=str(path),
        cache_dir=str(tmp_path / "cache"),
        num_test_negatives=10,
        ks="5",
        min_user_interactions=2,
    )
    for columns in ("user,item,timestamp", "item,user,,timestamp", "user,item,,timestamp"):
        config = make_run_config(generic_columns=columns, **common)
        assert config.generic_column_names == ("user", "item", None, "timestamp")
        split = load_split_for(config)
        assert split.meta["timestamps"] == "file"
        _check_latest(split)
    with pytest.raises(
        ConfigError,
        match=r"'generic-columns' = 'user,item,when,rating': column 'when' is in the "
        r"rating position \(position 3 of user,item,rating,timestamp\), but column "
        r"'rating' names the rating column by its name",
    ):
        make_run_config(generic_columns="user,item,when,rating", **common)
    with pytest.raises(ConfigError, match="columns 'user' and 'USER' both name the user column"):
        make_run_config(generic_columns="user,item,USER", **common)


def test_timestamps_in_the_rating_position_are_pointed_out(tmp_path, caplog):
    """A header ``uid,iid,time`` listed as ``generic-columns = "uid,iid,time"`` puts ``time`` in the rating position:
    unix times there are announced, and dates there are refused with the way to name a timestamp column."""
    import logging

    path = tmp_path / "data.csv"
    path.write_text("uid,iid,time\n" + "".join(f"{u},{i},{1614834367 + 60 * int(i)}\n" for u, i, _, _ in _rows()))
    with caplog.at_level(logging.WARNING, logger="fedrec_flwr.data"):
        load_interactions("generic", generic=GenericSource(str(path), "uid", "iid", rating_col="time"))
    assert any(
        "the rating column 'time' holds values from 1.61483e+09 to" in r.getMessage()
        and '(e.g. "user,item,,time")' in r.getMessage()
        for r in caplog.records
    ), caplog.text
    path.write_text("uid,iid,time\n" + "".join(f"{u},{i},2021-03-04\n" for u, i, _, _ in _rows()))
    with pytest.raises(
        DataError,
        match=r"line 2: rating column 'time' has non-numeric value '2021-03-04' \(a date: "
        r"name a timestamp column in the timestamp position of 'generic-columns'",
    ):
        load_interactions("generic", generic=GenericSource(str(path), "uid", "iid", rating_col="time"))
