"""A malformed user or item id is refused with file, 1-based line, column and value, in every loader.

Before this check an id such as ``abc`` in MovieLens-100K's ``u.data`` silently became a 1683rd item.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedrec_flwr.data import GenericSource, load_interactions
from fedrec_flwr.errors import DataError

ML_USERS = "".join(f"{u}|24|M|student|00000\n" for u in (1, 2, 3))

BAD_INTEGER_IDS = ["abc", "12.5", "-3", "1e3", "nan"]


def _write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


def _ml100k(tmp_path: Path, rows: list[str]) -> Path:
    folder = _write(tmp_path / "ml-100k", "u.data", "\n".join(rows) + "\n")
    return _write(folder, "u.user", ML_USERS)


def _refused(dataset: str, folder: Path | None, match: str, generic: GenericSource | None = None) -> str:
    with pytest.raises(DataError, match=match) as info:
        load_interactions(
            dataset, folder, cache_dir=folder or Path(generic.path).parent, generic=generic, download=False
        )
    return str(info.value)


@pytest.mark.parametrize("bad", BAD_INTEGER_IDS)
def test_ml100k_item_id_not_an_integer_names_file_line_column_value(tmp_path, bad):
    folder = _ml100k(tmp_path, ["1\t10\t3\t100", "2\t11\t4\t101", "3\t10\t5\t102", f"1\t{bad}\t3\t103"])
    message = _refused("ml-100k", folder, r"u\.data, line 4: item column 1 \(field 2\)")
    assert repr(bad) in message and "non-negative integer" in message


def test_ml100k_user_id_bad_and_user_file_id_bad(tmp_path):
    folder = _ml100k(tmp_path, ["1\t10\t3\t100", "2.0\t11\t4\t101"])
    _refused("ml-100k", folder, r"u\.data, line 2: user column 0 \(field 1\) has value '2\.0'")
    folder = _ml100k(tmp_path, ["1\t10\t3\t100", "2\t11\t4\t101"])
    _write(folder, "u.user", "1|24|M|student|00000\nx2|30|F|writer|11111\n")
    _refused("ml-100k", folder, r"u\.user, line 2: user id column 0 \(field 1\) has value 'x2'")


def test_ml100k_empty_item_field_is_refused(tmp_path):
    folder = _ml100k(tmp_path, ["1\t10\t3\t100", "2\t\t4\t101"])
    _refused("ml-100k", folder, r"u\.data, line 2: item column 1 \(field 2\) is empty")


def test_filmtrust_and_lastfm_ids_must_be_integers(tmp_path):
    folder = _write(tmp_path / "filmtrust", "ratings.txt", "1 1 2\n1 2 4\n12.5 3 3.5\n")
    _refused("filmtrust", folder, r"ratings\.txt, line 3: user column 0 \(field 1\) has value '12\.5'")
    folder = _write(tmp_path / "lastfm-2k", "user_artists.dat", "userID\tartistID\tweight\n2\t51\t10\n2\t-52\t9\n")
    _refused("lastfm-2k", folder, r"user_artists\.dat, line 3: item column 'artistID' has value '-52'")


def test_amazon_ids_must_be_reviewer_ids_and_asins(tmp_path):
    good = "AGZ8SM1BGK3CK,B000GFDAUG,5.0,1198195200\r\n"
    folder = _write(tmp_path / "amazon-video", "ratings.dat", good + "A9RNMO9MUSMTJ,12.5,2.0,1281052800\r\n")
    _refused("amazon-video", folder, r"ratings\.dat, line 2: item column 1 \(field 2\) has value '12\.5', not an ASIN")
    folder = _write(tmp_path / "amazon-video", "ratings.dat", good + "a9rn mo,B000GIOPK2,2.0,1281052800\r\n")
    _refused("amazon-video", folder, r"ratings\.dat, line 2: user column 0 \(field 1\) has value 'a9rn mo'")


def test_amazon_well_formed_ids_load(tmp_path):
    folder = _write(
        tmp_path / "amazon-video",
        "ratings.dat",
        "AGZ8SM1BGK3CK,B000GFDAUG,5.0,1198195200\r\nA9RNMO9MUSMTJ,B000GIOPK2,2.0,1281052800\r\n",
    )
    frame = load_interactions("amazon-video", folder, cache_dir=folder, download=False).frame
    assert list(frame["item"]) == ["B000GFDAUG", "B000GIOPK2"]


@pytest.mark.parametrize("bad", BAD_INTEGER_IDS)
def test_generic_integer_id_column_refuses_a_non_integer(tmp_path, bad):
    rows = ["user,item,rating,ts", "1,10,4,1", "1,11,4,2", "2,10,5,3", f"2,{bad},3,4"]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    source = GenericSource(
        path=str(tmp_path / "d.csv"), user_col="user", item_col="item", rating_col="rating", timestamp_col="ts"
    )
    message = _refused("generic", None, r"d\.csv, line 5: item column 'item' has value", generic=source)
    assert repr(bad) in message and message.endswith(
        "not a non-negative integer id (digits only); 3 of the 4 ids of item column 'item' are integers, at least "
        "half, so every id must be one"
    )


def test_generic_label_ids_stay_accepted(tmp_path):
    (tmp_path / "d.csv").write_text("user,item\nalice,i1\nbob,i2.5\nalice,-3\n")
    source = GenericSource(path=str(tmp_path / "d.csv"), user_col="user", item_col="item")
    frame = load_interactions("generic", generic=source).frame
    assert list(frame["item"]) == ["i1", "i2.5", "-3"] and list(frame["user"]) == ["alice", "bob", "alice"]


def test_generic_attributes_user_ids_are_checked(tmp_path):
    (tmp_path / "d.csv").write_text("user,item\n1,10\n2,11\n")
    (tmp_path / "attrs.csv").write_text("user,gender\n1,M\n2,F\n2.5,F\n")
    source = GenericSource(
        path=str(tmp_path / "d.csv"), user_col="user", item_col="item", attributes_path=str(tmp_path / "attrs.csv")
    )
    _refused("generic", None, r"attrs\.csv, line 4: attributes user column 'user' has value '2\.5'", generic=source)


def test_a_split_cached_before_ids_were_checked_is_not_reused(tmp_path, monkeypatch):
    """A cache hit skips parsing, so a split cached by format 2 (before ids were checked) from a file with a bad id
    must not be found: format 3's key differs, the file is parsed again and the bad id refused."""
    import fedrec_flwr.data.cache as cache_module
    import fedrec_flwr.data.split as split_module
    from fedrec_flwr.data import load_split, save_split
    from fedrec_flwr.data.loaders import locate_source

    rows = [f"{u}\t{i}\t3\t{100 * u + i}" for u in (1, 2, 3) for i in range(10 + 3 * u, 17 + 3 * u)]
    good = load_split(
        "ml-100k",
        _ml100k(tmp_path / "good", rows),
        cache_dir=tmp_path / "c1",
        download=False,
        min_user_interactions=3,
        num_test_negatives=2,
    )
    bad = _ml100k(tmp_path / "bad", rows + ["2\tabc\t3\t999"])
    cache = tmp_path / "cache"
    sha = locate_source("ml-100k", bad, cache_dir=cache, download=False).combined_sha256
    params = dict(min_user_interactions=3, tie_rule="random", seed=0, num_test_negatives=2, holdout_validation=False)
    monkeypatch.setattr(split_module, "FORMAT_VERSION", 2)
    stale_key = split_module.split_cache_key("ml-100k", sha, **params)
    monkeypatch.undo()
    good.meta.update(cache_key=stale_key, format_version=2)
    save_split(cache / "processed" / f"ml-100k-{stale_key}.npz", good)  # what format 2 left for the bad file
    assert cache_module.FORMAT_VERSION == 3
    with pytest.raises(DataError, match="abc"):
        load_split("ml-100k", bad, cache_dir=cache, download=False, **params)


def test_a_file_with_several_bad_rows_is_refused_once_in_line_order_with_exact_counts(tmp_path):
    """Bad values in different columns (an item id on line 2004, a rating on line 5003, a timestamp on line 103) and
    more than the refusal shows: one refusal, the first few in line order, every bad value and line counted; the
    integer share is exact (2 non-integer ids of 6000 are not "100.0%")."""
    rows = [f"u{k % 50},{k},4,{1000 + k}" for k in range(6000)]
    rows[103 - 2] = "u1,101,4,soon"
    rows[2004 - 2] = "u2,x2004,4,3002"
    rows[5003 - 2] = "u3,5001,bad,6001"
    rows[5500 - 2] = "u4,x5500,bad,6498"  # two bad values on one line
    rows[5900 - 2] = "u5,5898,,6898"
    rows[5950 - 2] = "u6,5948,4.5,"
    (tmp_path / "d.csv").write_text("user,item,rating,ts\n" + "\n".join(rows) + "\n")
    source = GenericSource(
        path=str(tmp_path / "d.csv"), user_col="user", item_col="item", rating_col="rating", timestamp_col="ts"
    )
    message = _refused(
        "generic", None, r"d\.csv, line 103: timestamp column 'ts' has non-numeric value 'soon'", generic=source
    )
    assert (
        "(7 bad values in all, on 6 lines of 6000 data lines; the next in line order: line 2004: item column "
        "'item' has value 'x2004', not a non-negative integer id (digits only); line 5003: rating column 'rating' "
        "has non-numeric value 'bad'; line 5500: item column 'item' has value 'x5500', not a non-negative integer "
        "id (digits only); line 5500: rating column 'rating' has non-numeric value 'bad'; ...); a timestamp "
        "column holds numbers" in message
    ), message
    assert message.endswith(
        "; 5998 of the 6000 ids of item column 'item' are integers, at least half, so every id must be one"
    ), message
    assert "100.0%" not in message and "\n" not in message


def test_an_attributes_file_with_several_bad_rows_is_refused_once(tmp_path):
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    (folder / "u.data").write_text("1\t10\t3\t100\n2\t11\t4\t101\n")
    (folder / "u.user").write_text("1|24|M|student|0\n2|x|F|writer|1\n3|30.5||artist|2\n1|40|M|other|3\n")
    message = _refused(
        "ml-100k",
        folder,
        r"u\.user, line 2: age column 1 has non-numeric value 'x' \(4 bad values "
        r"in all, on 3 lines of 4 data lines; the next in line order: line 3: age "
        r"30\.5 is not an integer; line 3: gender column 2 \(field 3\) is empty; "
        r"line 4: user '1' appears more than once\)",
    )
    assert message.endswith("more than once)")


def test_lines_with_too_many_fields_are_all_counted_in_one_refusal(tmp_path):
    rows = [f"u{k % 9},{k},4" for k in range(3000)]
    for line in (2004, 103, 5003 - 2500, 2999):
        rows[line - 2] += ",extra"
    rows[2999 - 2] += ",more"
    (tmp_path / "d.csv").write_text("user,item,rating\n" + "\n".join(rows) + "\n")
    source = GenericSource(path=str(tmp_path / "d.csv"), user_col="user", item_col="item", rating_col="rating")
    _refused(
        "generic",
        None,
        r"d\.csv, line 103: 4 fields, more than the 3 of line 1 \(4 such lines in all; the next: "
        r"line 2004 \(4 fields\), line 2503 \(4 fields\), line 2999 \(5 fields\)\); check the "
        r"separator \(','\) and quoting$",
        generic=source,
    )
