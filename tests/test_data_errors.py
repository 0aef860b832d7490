"""Bad input gives a clear DataError/ConfigError (file, line, value), never a hang; the cache heals itself."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from fedrec_flwr.data import (
    GenericSource,
    load_interactions,
    load_item_titles,
    load_split,
    preprocess,
    sample_train_negatives,
)
from fedrec_flwr.data import cache as cache_module
from fedrec_flwr.errors import ConfigError, DataError


def _csv(path: Path, text: str) -> GenericSource:
    path.write_text(text)
    return GenericSource(path=str(path), user_col="user", item_col="item", rating_col="rating", timestamp_col="ts")


def _dense_csv(path: Path, users: int = 12, per_user: int = 10) -> GenericSource:
    """users x per_user distinct items (users * per_user items in all), timestamps 1000 + k."""
    lines = ["user,item,rating,ts"]
    lines += [f"u{u},i{u * per_user + k},4,{1000 + k}" for u in range(users) for k in range(per_user)]
    return _csv(path, "\n".join(lines) + "\n")


def test_missing_column_names_file_and_column(tmp_path):
    source = GenericSource(path=str(tmp_path / "x.csv"), user_col="usr", item_col="item")
    (tmp_path / "x.csv").write_text("user,item\na,b\n")
    with pytest.raises(DataError, match=r"x\.csv.*'usr' not found"):
        load_interactions("generic", generic=source)


def test_non_numeric_rating_names_file_line_and_value(tmp_path):
    source = _csv(tmp_path / "ratings.csv", "user,item,rating,ts\na,1,4,10\na,2,5,11\nb,3,four,12\n")
    with pytest.raises(DataError) as info:
        load_interactions("generic", generic=source)
    message = str(info.value)
    assert "ratings.csv" in message and "line 4" in message and "'four'" in message and "rating" in message


def test_non_numeric_value_in_builtin_format_counts_blank_lines(tmp_path):
    folder = tmp_path / "amazon-video"
    folder.mkdir()
    (folder / "ratings.dat").write_bytes(b"A,B1,5.0,100\r\n\r\nA,B2,x5,200\r\n")
    with pytest.raises(DataError, match=r"ratings\.dat, line 3: rating .*'x5'"):
        load_interactions("amazon-video", folder)


def test_bad_timestamp_and_wrong_field_count(tmp_path):
    source = _csv(tmp_path / "t.csv", "user,item,rating,ts\na,1,4,yesterday\n")
    with pytest.raises(DataError, match=r"line 2: timestamp .*'yesterday'"):
        load_interactions("generic", generic=source)
    folder = tmp_path / "filmtrust"
    folder.mkdir()
    (folder / "ratings.txt").write_text("1 1 2\n1 2 3 4 5\n")
    with pytest.raises(DataError, match="ratings.txt"):
        load_interactions("filmtrust", folder)


def test_duplicates_deduplicated_and_counted(tmp_path):
    text = "user,item,rating,ts\na,1,1,10\na,1,5,30\na,1,3,20\nb,1,2,5\na,2,4,1\nc,3,1,1\nc,4,1,2\n"
    source = _csv(tmp_path / "d.csv", text)
    inter = load_interactions("generic", generic=source)
    assert inter.duplicates_removed == 2
    assert len(inter.frame) == 5
    kept = inter.frame[(inter.frame.user == "a") & (inter.frame.item == "1")]
    assert kept["timestamp"].item() == 30 and kept["rating"].item() == 5  # latest timestamp wins
    split = preprocess(inter, min_user_interactions=2, num_test_negatives=0)
    assert split.meta["duplicates_removed"] == 2
    assert split.item_ids[split.test_items[0]] == "1"  # ts 30 is a's latest


def test_user_with_every_item_is_an_error_not_a_hang(tmp_path):
    text = "user,item,rating,ts\n" + "".join(f"a,{i},1,{i}\n" for i in range(3)) + "b,0,1,1\nb,1,1,2\n"
    inter = load_interactions("generic", generic=_csv(tmp_path / "full.csv", text))
    with pytest.raises(DataError, match=r"user 'a'.*every one of the 3 items"):
        preprocess(inter, min_user_interactions=2, num_test_negatives=0)


def test_too_few_items_for_99_negatives(tmp_path):
    text = "user,item,rating,ts\n" + "".join(f"u{u},i{10 * u + k},1,{k}\n" for u in range(6) for k in range(10))
    inter = load_interactions("generic", generic=_csv(tmp_path / "small.csv", text))
    with pytest.raises(DataError, match=r"user 'u0'.*only 50 never-interacted.*10 interacted of 60.*99 test neg"):
        preprocess(inter)
    assert preprocess(inter, num_test_negatives=50).test_negatives.shape == (6, 50)  # exactly enough is fine


def test_train_negative_sampling_errors(tmp_path):
    split = load_split(
        "generic", cache_dir=tmp_path / "c", generic=_dense_csv(tmp_path / "a.csv"), num_test_negatives=5
    )
    with pytest.raises(ConfigError, match="out of range"):
        sample_train_negatives(split, split.num_users, 0, 1, 0)
    full = type(split)(**{**split.__dict__, "num_items": len(split.positives(0))})
    with pytest.raises(DataError, match="user 0"):
        sample_train_negatives(full, 0, 0, 1, 0)


def test_empty_and_header_only_files(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match=r"empty\.csv.*empty"):
        load_interactions("generic", generic=GenericSource(str(tmp_path / "empty.csv"), "user", "item"))
    (tmp_path / "header.csv").write_text("user,item\n\n")
    with pytest.raises(DataError, match=r"header\.csv.*no data rows"):
        load_interactions("generic", generic=GenericSource(str(tmp_path / "header.csv"), "user", "item"))


def test_missing_file_and_bad_arguments(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path / "nope" / "u.data").replace(".", r"\.")):
        (tmp_path / "nope").mkdir()
        load_interactions("ml-100k", tmp_path / "nope")
    with pytest.raises(DataError, match="does not exist"):
        load_interactions("ml-100k", tmp_path / "absent")
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_interactions("ml-1m", tmp_path)
    with pytest.raises(ConfigError, match="needs generic"):
        load_interactions("generic")
    with pytest.raises(ConfigError, match="tie_rule"):
        load_split("ml-100k", tmp_path, tie_rule="oldest")
    with pytest.raises(ConfigError, match="min_user_interactions"):
        load_split("ml-100k", tmp_path, min_user_interactions=1)


def test_latin1_item_titles(tmp_path):
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    flags = "|0" * 19
    (folder / "u.item").write_bytes(
        f"1|Toy Story (1995)|01-Jan-1995||http://x{flags}\n".encode("latin-1")
        + f"2|Ma vie en rose (1997)|01-Jan-1997||http://y{flags}\n".encode("latin-1")
        + f"3|Misérables, Les (1995)|01-Jan-1995||http://z{flags}\n".encode("latin-1")
    )
    titles = load_item_titles(tmp_path)  # the parent folder is accepted too
    assert titles.loc["3"] == "Misérables, Les (1995)"
    assert list(titles.index) == ["1", "2", "3"]


@pytest.mark.parametrize("damage", ["garbage", "truncate", "wrong-dtype"])
def test_corrupted_cache_is_rebuilt(tmp_path, caplog, damage):
    source = _dense_csv(tmp_path / "a.csv")
    cache = tmp_path / "cache"
    first = load_split("generic", cache_dir=cache, generic=source, num_test_negatives=5)
    (path,) = (cache / "processed").glob("*.npz")
    if damage == "garbage":
        path.write_bytes(b"not an npz at all")
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    else:
        bad = type(first)(**{**first.__dict__, "test_items": first.test_items.astype(np.int32)})
        cache_module.save_split(path, bad)
    with caplog.at_level(logging.WARNING, logger="fedrec_flwr.data"):
        second = load_split("generic", cache_dir=cache, generic=source, num_test_negatives=5)
    assert any("discarding unusable cached split" in r.getMessage() for r in caplog.records)
    if damage == "garbage":
        assert any("not an .npz archive: a file starting with b'not '" in r.getMessage() for r in caplog.records)
    assert second.equals(first)
    assert cache_module.read_split(path).equals(first)  # the rebuilt file is valid again


def test_dropped_duplicates_are_announced_in_one_line(tmp_path, caplog):
    """The console says how many duplicate (user, item) rows were dropped and which row of each pair was kept, as it
    announces missing timestamps (a warning), with and without timestamps."""
    import logging

    text = "user,item,rating,ts\na,1,1,10\na,1,5,30\na,1,3,20\nb,1,2,5\na,2,4,1\nc,3,1,1\nc,4,1,2\n"
    with caplog.at_level(logging.WARNING, logger="fedrec_flwr.data"):
        load_interactions("generic", generic=_csv(tmp_path / "d.csv", text))
    lines = [r.getMessage() for r in caplog.records if "duplicate" in r.getMessage()]
    assert len(lines) == 1 and caplog.records[0].levelno == logging.WARNING
    assert lines[0].endswith(
        "d.csv: dropped 2 duplicate (user, item) rows, keeping for each pair its row with the "
        "latest timestamp (the first of equal ones): line 2 dropped, line 3 kept (user 'a', item "
        "'1'); line 4 dropped, line 3 kept (user 'a', item '1')"
    ), lines
    caplog.clear()
    path = tmp_path / "n.csv"
    path.write_text("user,item\na,1\nb,1\n\na,1\na,2\n")
    with caplog.at_level(logging.WARNING, logger="fedrec_flwr.data"):
        load_interactions("generic", generic=GenericSource(str(path), user_col="user", item_col="item"))
    (line,) = [r.getMessage() for r in caplog.records if "duplicate" in r.getMessage()]
    assert line.endswith(
        "n.csv: dropped 1 duplicate (user, item) row, keeping for each pair its first row (the file "
        "has no timestamps): line 5 dropped, line 2 kept (user 'a', item '1')"
    ), line
