"""Bad input, data cases 1-4 (numbered across the tests/test_bad_input_*.py files): exact timestamps, the attributes
file's user column, the split's facts in config.json, and the generic loader meeting ``data-dir``. Tiny generated
files only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedrec_flwr.app.runtime import load_split_for
from fedrec_flwr.config import make_run_config
from fedrec_flwr.data import GenericSource, load_interactions, load_split, preprocess
from fedrec_flwr.errors import ConfigError, DataError

NUM_ITEMS = 30


def _timestamp_csv(path: Path, stamps: list[str], num_users: int = 4) -> Path:
    """Each user rates 6 items; its k-th item gets ``stamps[k]``, written to the file in shuffled order, so only the
    timestamps' exact order says which item is the latest (item ``5`` of the user's block)."""
    rng = np.random.default_rng(0)
    lines = ["user,item,rating,timestamp"]
    for user in range(num_users):
        rows = [f"u{user},i{(7 * user + k) % NUM_ITEMS},4,{stamps[k]}" for k in range(6)]
        lines += [rows[i] for i in rng.permutation(6)]
    for item in range(20):  # a heavy user, with room for negatives
        lines.append(f"heavy,i{item},3,{stamps[0]}")
    path.write_text("\n".join(lines) + "\n")
    return path


NANOSECONDS = [str(1556559573141592653 + k) for k in range(6)]
"""Case 1: neighbouring nanosecond timestamps, all above 2**53 (float64 would merge them)."""


@pytest.mark.parametrize(
    "stamps",
    [
        NANOSECONDS,
        [f"1556559573.14159265{k}" for k in range(3, 9)],  # decimal seconds with nanosecond digits
        [str(1556559573141 + k) for k in range(6)],  # milliseconds
    ],
    ids=["nanoseconds", "decimal-seconds", "milliseconds"],
)
def test_timestamps_keep_their_exact_order_in_any_unit(tmp_path, stamps):
    path = _timestamp_csv(tmp_path / "ts.csv", stamps)
    source = GenericSource(str(path), user_col="user", item_col="item", rating_col="rating", timestamp_col="timestamp")
    frame = load_interactions("generic", generic=source).frame
    assert frame["timestamp"].dtype == np.int64
    if stamps is NANOSECONDS:  # integers are kept as they are, not rounded
        assert sorted(set(frame["timestamp"].tolist())) == [int(s) for s in NANOSECONDS]
    split = load_split(
        "generic", cache_dir=tmp_path / "cache", generic=source, num_test_negatives=5, min_user_interactions=2
    )
    assert split.meta["users_with_tied_latest"] == 1  # only 'heavy', whose rows share one timestamp
    for user in range(4):
        index = int(np.flatnonzero(split.user_ids == f"u{user}")[0])
        assert split.item_ids[split.test_items[index]] == f"i{(7 * user + 5) % NUM_ITEMS}"


def test_a_float_frame_with_exact_ties_and_out_of_range_integer_timestamps(tmp_path):
    # a timestamp beyond int64 is named, not wrapped or rounded
    path = _timestamp_csv(tmp_path / "big.csv", NANOSECONDS[:5] + ["99999999999999999999"])
    source = GenericSource(str(path), user_col="user", item_col="item", rating_col="rating", timestamp_col="timestamp")
    with pytest.raises(
        DataError,
        match=r"line \d+: timestamp column 'timestamp' value '99999999999999999999' is "
        "outside the 64-bit integer range",
    ):
        load_interactions("generic", generic=source)


def _interactions_csv(
    path: Path, user_col: str = "user", with_ts: bool = True, per_user: int = 6, num_users: int = 6
) -> Path:
    header = [user_col, "item", "rating"] + (["timestamp"] if with_ts else [])
    lines = [",".join(header)]
    for user in range(num_users):
        for k in range(per_user):
            lines.append(
                ",".join([f"u{user}", f"i{(3 * user + k) % NUM_ITEMS}", "4"] + ([str(100 + k)] if with_ts else []))
            )
    for item in range(10):
        lines.append(",".join(["heavy", f"i{item}", "3"] + (["50"] if with_ts else [])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _attributes_csv(path: Path, user_col: str) -> Path:
    rows = [f"{user_col},gender"] + [f"u{u},{'FM'[u % 2]}" for u in range(6)] + ["heavy,F"]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_the_attributes_user_column_is_the_one_named_in_generic_columns(tmp_path):
    """Case 2: an attributes file whose id column is ``user_id``, as in the interactions file."""
    data = _interactions_csv(tmp_path / "ratings.csv", user_col="user_id")
    attributes = _attributes_csv(tmp_path / "users.csv", "user_id")
    config = make_run_config(
        dataset="generic",
        generic_file=str(data),
        generic_attributes_file=str(attributes),
        generic_columns="user_id,item,rating,timestamp",
        cache_dir=str(tmp_path / "cache"),
        num_test_negatives=5,
        ks="5",
        min_user_interactions=2,
    )
    split = load_split_for(config)
    genders = dict(zip(split.user_ids.tolist(), split.attributes["gender"].tolist()))
    assert genders["u0"] == "F" and genders["u1"] == "M" and genders["heavy"] == "F"
    # the old name still works, and a file with neither names both tried
    source = GenericSource(
        str(data),
        user_col="user_id",
        item_col="item",
        attributes_path=str(_attributes_csv(tmp_path / "old.csv", "user")),
    )
    assert load_interactions("generic", generic=source).attributes.loc["u1", "gender"] == "M"
    source = GenericSource(
        str(data),
        user_col="user_id",
        item_col="item",
        attributes_path=str(_attributes_csv(tmp_path / "other.csv", "uid")),
    )
    with pytest.raises(DataError, match=r"attributes user column not found: tried \['user_id', 'user'\].*'uid'"):
        load_interactions("generic", generic=source)


def test_config_json_records_what_the_split_did(tmp_path):
    """Case 3: duplicates removed, users/items dropped by min-user-interactions, and the order without timestamps."""
    from fedrec_flwr.serial import run_serial
    from tests.conftest import tiny_run_config, write_tiny_dataset

    path = write_tiny_dataset(tmp_path / "data")
    lines = path.read_text().splitlines()
    rows = [line.rsplit(",", 1)[0] for line in lines[1:]]  # drop the timestamp
    rows += rows[:3]  # 3 duplicate rows
    rows += ["lonely,i_only_lonely,5"]  # a user with 1 interaction, and an item only it has
    (tmp_path / "data" / "nots.csv").write_text("\n".join(["user,item,rating"] + rows) + "\n")
    config = tiny_run_config(
        tmp_path,
        generic_file=str(tmp_path / "data" / "nots.csv"),
        generic_columns="user,item,rating",
        min_user_interactions=3,
        num_server_rounds=1,
        fraction_train=0.2,
        run_name="facts",
    )
    folder = run_serial(config)
    written = json.loads((folder / "config.json").read_text())
    split = written["split"]
    assert split["duplicates-removed"] == 3
    assert split["dropped-users"] == 1 and split["dropped-items"] == 1 and split["interactions-of-dropped-users"] == 1
    assert split["interactions-in-file"] == len(rows)
    assert split["held-out-order"].startswith("seeded random order (the file has no timestamps")
    assert split["tie-rule-applied"] is False and split["users-with-tied-latest"] == 0
    assert written["tie-rule"].startswith("not applied: seeded random order")
    assert split["min-user-interactions"] == 3
    assert written["run-folder"] == "facts" == folder.name
    generated = run_serial({**config, "run-name": ""})  # an empty run-name: the generated folder name is recorded
    assert json.loads((generated / "config.json").read_text())["run-folder"] == generated.name != ""


def test_generic_data_dir_is_the_file_or_the_folder_relative_names_resolve_in(tmp_path, caplog):
    """Case 4: ``data-dir`` pointing at the CSV, relative ``generic-file`` against ``data-dir``."""
    data = _interactions_csv(tmp_path / "mine" / "x.csv")
    common = dict(
        dataset="generic", num_test_negatives=5, ks="5", min_user_interactions=2, cache_dir=str(tmp_path / "cache")
    )
    by_file = load_split_for(make_run_config(data_dir=str(data), **common))
    by_folder = load_split_for(make_run_config(data_dir=str(tmp_path / "mine"), generic_file="x.csv", **common))
    assert by_file.equals(by_folder) and by_file.num_users == 7
    with pytest.raises(
        ConfigError,
        match=r"'generic-file' = 'y.csv': file '.*mine/y.csv' not found \(resolved "
        r"against data-dir",
    ):
        load_split_for(make_run_config(data_dir=str(tmp_path / "mine"), generic_file="y.csv", **common))
    with pytest.raises(
        ConfigError,
        match="'data-dir' = .* is a file, so it is the interactions file, but "
        "'generic-file' = 'other.csv' names another",
    ):
        load_split_for(make_run_config(data_dir=str(data), generic_file="other.csv", **common))
    with pytest.raises(ConfigError, match="'generic-file' is empty but dataset = 'generic' needs"):
        make_run_config(dataset="generic")


def test_short_rows_and_missing_timestamps_are_named(tmp_path, caplog):
    """Case 4: a row with too few fields names the missing field; a file without timestamps says how to read it, and
    reading it without them says that the held-out item is then chosen by a seeded random order."""
    path = tmp_path / "short.csv"
    path.write_text("user,item,rating,timestamp\n" + "".join(f"u1,i{k},5,{100 + k}\n" for k in range(5)) + "u1,i9\n")
    source = GenericSource(str(path), user_col="user", item_col="item", rating_col="rating", timestamp_col="timestamp")
    with pytest.raises(
        DataError,
        match=r"short.csv, line 7: 2 fields, expected 4: the rating field \('rating', "
        r"field 3\) is missing",
    ):
        load_interactions("generic", generic=source)
    path.write_text("user,item\n" + "".join(f"u1,i{k}\n" for k in range(5)) + "u1\n")
    with pytest.raises(DataError, match=r"line 7: 1 field, expected 2: the item field \('item', field 2\) is missing"):
        load_interactions("generic", generic=GenericSource(str(path), user_col="user", item_col="item"))


def test_a_short_row_of_a_headerless_file_names_the_field_by_position_only(tmp_path):
    """A file without a header (like MovieLens' u.data): pandas labels its columns 0..3, and the message used to quote
    the label ('2'), which read like a value; it names the field by its position only."""
    path = tmp_path / "u.data"
    path.write_text("".join(f"{u}\t{i}\t4\t88125{i}\n" for u in (1, 2) for i in range(1, 8)) + "3\t5\n")
    source = GenericSource(str(path), user_col=0, item_col=1, rating_col=2, timestamp_col=3, sep="\t", header=False)
    with pytest.raises(
        DataError,
        match=r"u.data, line 15: 2 fields, expected 4: the rating field \(field 3\) is "
        r"missing",
    ):
        load_interactions("generic", generic=source)


def test_the_attributes_user_column_can_be_named_in_the_run_config(tmp_path):
    """An attributes file ``uid,gender,age``: ``generic-attributes-user-column = "uid"`` reads it; the key is
    validated in the run config (set without an attributes file, or with a comma) and a name the file lacks is
    refused naming the key and the file's columns."""
    data = _interactions_csv(tmp_path / "ratings.csv")
    attributes = tmp_path / "users.csv"
    attributes.write_text(
        "uid,gender,age\n" + "".join(f"u{u},{'FM'[u % 2]},{20 + u}\n" for u in range(6)) + "heavy,F,40\n"
    )
    common = dict(
        dataset="generic",
        generic_file=str(data),
        generic_attributes_file=str(attributes),
        cache_dir=str(tmp_path / "cache"),
        num_test_negatives=5,
        ks="5",
        min_user_interactions=2,
    )
    split = load_split_for(make_run_config(generic_attributes_user_column="uid", **common))
    genders = dict(zip(split.user_ids.tolist(), split.attributes["gender"].tolist()))
    ages = dict(zip(split.user_ids.tolist(), split.attributes["age"].tolist()))
    assert genders["u1"] == "M" and ages["u3"] == 23 and ages["heavy"] == 40 and "uid" not in split.attributes
    with pytest.raises(
        DataError,
        match=r"attributes user column 'userid' \(run-config key "
        r"'generic-attributes-user-column'\) not found; the file's columns are "
        r"\['uid', 'gender', 'age'\]",
    ):
        load_split_for(make_run_config(generic_attributes_user_column="userid", **common))
    with pytest.raises(
        ConfigError, match="'generic-attributes-user-column' = 'uid' is set but 'generic-attributes-file' is empty"
    ):
        make_run_config(**{**common, "generic_attributes_file": ""}, generic_attributes_user_column="uid")
    with pytest.raises(ConfigError, match="'generic-attributes-user-column' = 'uid,x': give one column name"):
        make_run_config(generic_attributes_user_column="uid,x", **common)
    with pytest.raises(ConfigError, match="'generic-attributes-user-column' is set but dataset = 'ml-100k'"):
        make_run_config(generic_attributes_user_column="uid")


@pytest.mark.parametrize(
    "stamps",
    [
        [f"2021-03-04T05:06:0{k}Z" for k in range(6)],
        # one instant per zone notation; in UTC they are 03:06:07, 03:06:08, ..., so the order is by instant, not text
        [
            "2021-03-04 05:06:07+02:00",
            "2021-03-04T03:06:08Z",
            "2021-03-04T04:06:09+0100",
            "2021-03-04T00:06:10-03",
            "2021-03-04T03:06:10.5+00:00",
            "2021-03-04T03:06:10.500000001Z",
        ],
        [
            "2021-03-04",
            "2021-03-04T00:00:01",
            "2021-03-04 00:01",
            "2021-03-05",
            "2021-03-05T00:00:00.000001",
            "2021-03-05T00:00:00.000002",
        ],
    ],
    ids=["utc", "zones", "naive"],
)
def test_iso_8601_timestamps_are_read_and_ordered_exactly(tmp_path, stamps):
    path = _timestamp_csv(tmp_path / "iso.csv", stamps)
    source = GenericSource(str(path), user_col="user", item_col="item", rating_col="rating", timestamp_col="timestamp")
    frame = load_interactions("generic", generic=source).frame
    assert frame["timestamp"].dtype == np.int64
    split = load_split(
        "generic", cache_dir=tmp_path / "cache", generic=source, num_test_negatives=5, min_user_interactions=2
    )
    assert split.meta["timestamps"] == "file" and split.meta["users_with_tied_latest"] == 1  # 'heavy' only
    for user in range(4):
        index = int(np.flatnonzero(split.user_ids == f"u{user}")[0])
        assert split.item_ids[split.test_items[index]] == f"i{(7 * user + 5) % NUM_ITEMS}"
    own = frame[frame["user"] == "u0"].set_index("item")
    keys = own.loc[[f"i{k}" for k in range(6)], "timestamp"].to_numpy()  # u0's k-th item has stamps[k]
    assert (np.diff(keys) > 0).all()


@pytest.mark.parametrize(
    "stamps, line, match",
    [
        (
            ["1614834367"] * 3 + ["2021-03-04"] * 3,
            None,
            r"has value '2021-03-04', a date, but line 2 has a number "
            r"\('1614834367'\): numbers and dates are mixed \(3 bad values "
            r"in all, on 3 lines .*; a timestamp column holds numbers .* or "
            r"ISO 8601 dates",
        ),
        (
            ["2021-03-04T05:06:07Z"] * 5 + ["1614834367"],
            None,
            r"has value '1614834367', a number, but line 2 has a date",
        ),
        (
            ["2021-03-04T05:06:07Z"] * 5 + ["2021-03-04T05:06:07"],
            None,
            r"has value '2021-03-04T05:06:07' without a time "
            r"zone, but line 2 has '2021-03-04T05:06:07Z' "
            r"with one",
        ),
        (["2021-03-04"] * 5 + ["2021-02-30"], None, r"'2021-02-30', not a valid date and time"),
        (
            ["2021-03-04"] * 5 + ["2021-03-04T05"],
            None,
            r"'2021-03-04T05', not an ISO 8601 date or time of the accepted "
            r"forms; a timestamp column holds numbers",
        ),
        (
            ["5"] * 5 + ["soon"],
            None,
            r"non-numeric value 'soon'; a timestamp column holds numbers \(unix "
            r"time in any unit",
        ),
    ],
)
def test_a_timestamp_column_mixing_kinds_names_the_first_offending_line(tmp_path, stamps, line, match):
    path = tmp_path / "mixed.csv"
    path.write_text("user,item,timestamp\n" + "".join(f"u0,i{k},{v}\n" for k, v in enumerate(stamps)))
    bad = 2 + next(k for k, v in enumerate(stamps) if v != stamps[0])
    source = GenericSource(str(path), user_col="user", item_col="item", timestamp_col="timestamp")
    with pytest.raises(DataError, match=rf"mixed.csv, line {bad}: timestamp column 'timestamp' .*{match}"):
        load_interactions("generic", generic=source)


def test_a_frame_with_datetime_timestamps_is_ordered_by_instant():
    import pandas as pd

    from fedrec_flwr.data import Interactions

    when = pd.to_datetime(["2021-03-04T05:00:00+02:00", "2021-03-04T04:00:00Z", "2021-03-04T03:30:00Z"], utc=True)
    frame = pd.DataFrame(
        {"user": ["a", "a", "a"], "item": ["1", "2", "3"], "rating": np.nan, "timestamp": when, "row": np.arange(3)}
    )
    extra = pd.DataFrame(
        {
            "user": ["b"] * 3,
            "item": ["4", "5", "6"],
            "rating": np.nan,
            "timestamp": pd.to_datetime(["2021-01-01"] * 3, utc=True),
            "row": np.arange(3, 6),
        }
    )
    split = preprocess(
        Interactions(pd.concat([frame, extra], ignore_index=True), None, "x", "frame"),
        min_user_interactions=2,
        num_test_negatives=1,
    )
    assert split.item_ids[split.test_items[0]] == "2"  # 04:00Z is the latest instant (05:00+02:00 is 03:00Z)
