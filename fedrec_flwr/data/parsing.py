"""Parsing of raw interaction and attribute tables, with every bad cell reported by file, line, column and value.

Every cell is first read as text (:func:`read_table`), so a bad value (an empty field, a non-numeric rating, a user
or item id of the wrong form such as ``abc``, ``12.5`` or ``-3`` where ids are integers) is reported with its file,
1-based line number, column and value (:class:`~fedrec_flwr.errors.DataError`) instead of a pandas traceback. Every
column of a file is checked before it is refused (:class:`Problems`), so one refusal names its first few bad values in
line order and counts all of them; timestamps are numbers in any unit or ISO 8601 dates (:data:`TIMESTAMP_FORMATS`).
The dataset readers (:mod:`fedrec_flwr.data.datasets`, :mod:`fedrec_flwr.data.generic`) are built from these.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

# pandas is imported inside the functions that parse data: the ClientApp reads a cached split and never needs it, and
# importing it costs ~1 s of every ClientApp cold start (a SuperNode starts one process per message)
if TYPE_CHECKING:  # annotations only
    import pandas as pd

from fedrec_flwr.errors import DataError


@dataclass(frozen=True)
class Table:
    """A text table as :func:`read_table` read it: every cell a string, blank lines dropped."""

    df: pd.DataFrame  # every cell str, '' when missing
    lines: np.ndarray  # (len(df),) int64, 1-based line number of each row in the file
    sep: str = ","
    encoding: str = "utf-8"


def sniff_separator(path: str | os.PathLike) -> str:
    """Guess the separator of a text table from its first lines: one of ``, \\t ; |``, else whitespace."""
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        sample = "".join(handle.readline() for _ in range(20))
    try:
        return csv.Sniffer().sniff(sample, delimiters=",\t;|").delimiter
    except csv.Error:  # e.g. a short row among the first lines: go by the first line's most frequent candidate
        first = next((line for line in sample.splitlines() if line.strip()), "")
        counts = {sep: first.count(sep) for sep in ",\t;|"}
        best = max(counts, key=counts.get)
        return best if counts[best] else r"\s+"


def read_table(path: Path, *, sep: str, header: bool, encoding: str = "utf-8") -> Table:
    """Read a text table with every cell as str; blank lines are dropped but counted in ``lines``."""
    import pandas as pd

    if not Path(path).is_file():
        raise DataError(f"file {str(path)!r} not found")
    if Path(path).stat().st_size == 0:
        raise DataError(f"{path}: file is empty")
    try:
        df = pd.read_csv(
            path,
            sep=sep,
            header=0 if header else None,
            dtype=str,
            na_filter=False,
            skip_blank_lines=False,
            encoding=encoding,
            engine="c",
        )
    except pd.errors.EmptyDataError:
        raise DataError(f"{path}: file is empty (no rows)") from None
    except pd.errors.ParserError as exc:
        raise _long_rows(Path(path), sep, encoding) or DataError(
            f"{path}: cannot parse as a {sep!r}-separated table: {exc}"
        ) from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid {encoding} text at byte {exc.start}: {exc.reason}") from None
    if header:
        df.columns = [str(c).strip() for c in df.columns]
    lines = np.arange(len(df), dtype=np.int64) + (2 if header else 1)
    blank = (df == "").all(axis=1).to_numpy() if df.shape[1] else np.ones(len(df), bool)
    if blank.any():
        df = df.loc[~blank].reset_index(drop=True)
        lines = lines[~blank]
    if len(df) == 0:
        raise DataError(f"{path}: file has no data rows")
    return Table(df, lines, sep, encoding)


def _long_rows(path: Path, sep: str, encoding: str) -> DataError | None:
    """The refusal of a table some of whose lines have more fields than its first line, all found in one pass: the
    first :data:`SHOWN_PROBLEMS` such lines in line order and how many there are; ``None`` when there are none or
    the separator is a pattern (pandas' own error is then given)."""
    if len(sep) != 1:
        return None
    long: list[tuple[int, int]] = []
    count, expected = 0, None
    with open(path, encoding=encoding, errors="replace", newline="") as handle:
        reader = csv.reader(handle, delimiter=sep)
        for fields in reader:
            if not fields:
                continue
            if expected is None:
                expected = len(fields)
            elif len(fields) > expected:
                count += 1
                if len(long) < SHOWN_PROBLEMS:
                    long.append((reader.line_num, len(fields)))
    if not long:
        return None
    (line, found), rest = long[0], long[1:]
    more = (
        f" ({count} such lines in all; the next: "
        + ", ".join(f"line {n} ({f} fields)" for n, f in rest)
        + ("; ..." if count > len(long) else "")
        + ")"
        if count > 1
        else ""
    )
    return DataError(
        f"{path}, line {line}: {found} fields, more than the {expected} of line 1{more}; check the "
        f"separator ({sep!r}) and quoting"
    )


def _fields_on_line(path: Path, table: Table, line: int) -> int | None:
    """How many fields line ``line`` (1-based) of ``path`` has, split as the table was; ``None`` if unreadable."""
    try:
        with open(path, encoding=table.encoding, errors="replace", newline="") as handle:
            for number, text in enumerate(handle, start=1):
                if number == line:
                    text = text.rstrip("\r\n")
                    if len(table.sep) == 1:
                        return len(next(csv.reader([text], delimiter=table.sep)))
                    return len(re.split(table.sep, text.strip()))
    except OSError:
        return None
    return None


def _empty_message(table: Table, path: Path, i: int, col, role: str) -> str:
    """What is wrong with the empty cell of row ``i`` (after ``"<file>, line N: "``): names the missing field when
    the line has too few fields."""
    line = int(table.lines[i])
    found = _fields_on_line(path, table, line)
    expected = table.df.shape[1]
    if found is not None and found < expected:
        names = [str(c) for c in table.df.columns]
        key = table.df.columns.get_loc(col) if col in table.df.columns else col
        position = int(key) if isinstance(key, (int, np.integer)) else None
        headerless = position is not None and names[position] == str(position)  # pandas' default column labels
        which = (
            (
                f"the {role} field (field {position + 1})"
                if headerless
                else f"the {role} field ({names[position]!r}, field {position + 1})"
            )
            if position is not None
            else f"the {role} field"
        )
        return f"{found} field{'s' if found != 1 else ''}, expected {expected}: {which} is missing"
    return f"{role} {_column_name(col)} is empty"


def _empty_cell(table: Table, path: Path, i: int, col, role: str) -> DataError:
    """The error for an empty cell (:func:`_empty_message`)."""
    return DataError(f"{path}, line {int(table.lines[i])}: {_empty_message(table, path, i, col, role)}")


SHOWN_PROBLEMS = 5
"""How many of a file's bad values one refusal quotes (in line order); it counts all of them."""


class Problems:
    """The bad values of one file, collected over every check of one read so that a single refusal reports the first
    :data:`SHOWN_PROBLEMS` in line order and exact counts of all (bad values, and lines holding one).

    Each check calls :meth:`add` with its ``(n,)`` mask of bad rows, a function giving the message of one row
    (after ``"<file>, line N: "``; built only for the rows shown) and an optional hint (what the column accepts),
    given once at the end of the refusal however many shown problems share it. :meth:`check` raises.
    """

    def __init__(self, table: Table, path: Path) -> None:
        self.table, self.path = table, path
        self.masks: list[tuple[np.ndarray, Any, str]] = []

    def add(self, mask: np.ndarray, describe, hint: str = "") -> None:
        mask = np.asarray(mask, dtype=bool)
        if mask.any():
            self.masks.append((mask, describe, hint))

    def check(self) -> None:
        """Raise one :class:`DataError` for everything added: ``<file>, line N: <first problem>``, then, when there
        are more, how many bad values on how many lines and the next ones in line order."""
        if not self.masks:
            return
        lines = self.table.lines
        candidates = []  # (line, check order, row index, describe): the first few of each check suffice
        for order, (mask, describe, hint) in enumerate(self.masks):
            candidates += [
                (int(lines[i]), order, int(i), describe, hint) for i in np.flatnonzero(mask)[:SHOWN_PROBLEMS]
            ]
        shown = sorted(candidates, key=lambda c: c[:2])[:SHOWN_PROBLEMS]
        total = sum(int(mask.sum()) for mask, _, _ in self.masks)
        bad_lines = int(np.logical_or.reduce([mask for mask, _, _ in self.masks]).sum())
        first_line, _, first_row, first_describe, _ = shown[0]
        message = f"{self.path}, line {first_line}: {first_describe(first_row)}"
        if total > 1:
            rest = "; ".join(f"line {line}: {describe(i)}" for line, _, i, describe, _ in shown[1:])
            message += (
                f" ({total} bad values in all, on {bad_lines} line{'s' if bad_lines != 1 else ''} of "
                f"{len(lines)} data lines; the next in line order: {rest}"
                + ("; ..." if total > len(shown) else "")
                + ")"
            )
        for hint in dict.fromkeys(c[4] for c in shown if c[4]):
            message += f"; {hint}"
        raise DataError(message)


def _checked(table: Table, path: Path, problems: Problems | None):
    """``(problems, own)``: the collector to add to, and whether the caller made it (then it checks it)."""
    return (problems, False) if problems is not None else (Problems(table, path), True)


def _column_name(col) -> str:
    """``column 'name'`` for a named column, ``column i (field i + 1)`` for a 0-based column index."""
    if isinstance(col, (int, np.integer)) and not isinstance(col, bool):
        return f"column {int(col)} (field {int(col) + 1})"
    return f"column {str(col)!r}"


def _column_key(table: Table, path: Path, col: str | int, role: str) -> str | int:
    df = table.df
    if isinstance(col, (int, np.integer)) and not isinstance(col, bool):
        if 0 <= int(col) < df.shape[1]:
            return df.columns[int(col)]
        raise DataError(f"{path}: {role} column index {col} out of range: the file has {df.shape[1]} columns")
    if col not in df.columns:
        hint = ""
        if role in ("timestamp", "rating"):
            hint = (
                "; timestamps and ratings are optional: name only the columns the file has in 'generic-columns' "
                '(e.g. "user,item,rating", "user,item,timestamp" or "user,item"); without timestamps each '
                "user's held-out item is chosen by a seeded random order"
            )
        raise DataError(f"{path}: {role} column {col!r} not found; columns are {[str(c) for c in df.columns]}{hint}")
    return col


_ID_INTEGER = re.compile(r"\d+")
_INTEGER_ID = (_ID_INTEGER, "a non-negative integer id (digits only)")


def id_column(
    table: Table,
    path: Path,
    col: str | int,
    role: str,
    kind: str | tuple[re.Pattern, str] = "integer",
    problems: Problems | None = None,
) -> np.ndarray:
    """``(n,)`` str raw ids of one column, each checked, so a corrupted id is refused instead of becoming a new
    user or item.

    Args:
        kind: ``"integer"``: every id is a non-negative integer written in digits (MovieLens, FilmTrust, Lastfm
            ids); ``"label"``: any non-empty text; ``(pattern, description)``: every id fully matches ``pattern``
            (Amazon ids); ``"auto"`` (the user's own files, ours): an integer column when at least half its ids are
            integers, then every id must be one; otherwise ids are labels (any non-empty text). Ids are kept as
            written (``007`` and ``7`` stay two ids, as before).
        problems: the file's collector (:class:`Problems`): bad ids are added to it, and the caller checks it;
            ``None``: this column's are checked here.

    Raises:
        DataError: empty ids, or ids of the wrong form: file, 1-based line, column and value of the first few, and
            how many (when ``problems`` is ``None``).
    """
    key = _column_key(table, path, col, role)
    problems, own = _checked(table, path, problems)
    values = table.df[key].str.strip()
    empty = (values == "").to_numpy()
    problems.add(empty, lambda i: _empty_message(table, path, i, key, role))
    out = values.to_numpy(dtype=object).astype(str)
    why = ""
    if kind == "auto":
        integers = int(values.str.fullmatch(_ID_INTEGER).sum())
        filled = int(len(values) - empty.sum())
        if integers * 2 < filled or not filled:
            kind = "label"
        else:
            kind, why = (
                "integer",
                (
                    f"{integers} of the {filled} ids of {role} {_column_name(col)} are integers, "
                    "at least half, so every id must be one"
                ),
            )
    if kind != "label":
        pattern, expected = _INTEGER_ID if kind == "integer" else kind
        wrong = ~values.str.fullmatch(pattern).to_numpy(dtype=bool) & ~empty
        problems.add(wrong, lambda i: f"{role} {_column_name(col)} has value {values.iloc[i]!r}, not {expected}", why)
    if own:
        problems.check()
    return out


def numeric_column(table: Table, path: Path, col: str | int, role: str, problems: Problems | None = None) -> np.ndarray:
    """``(n,)`` float64 values of a numeric column (NaN where a value is bad; see ``problems`` of :func:`id_column`).

    Raises:
        DataError: empty or non-numeric (or infinite) values (when ``problems`` is ``None``).
    """
    import pandas as pd

    key = _column_key(table, path, col, role)
    problems, own = _checked(table, path, problems)
    raw = table.df[key].str.strip()
    values = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    empty = (raw == "").to_numpy()
    problems.add(empty, lambda i: _empty_message(table, path, i, key, role))
    dated = (
        " (a date: name a timestamp column in the timestamp position of 'generic-columns', e.g. "
        "\"user,item,,NAME\", or by the name 'timestamp')"
        if role == "rating"
        else ""
    )
    problems.add(
        ~np.isfinite(values) & ~empty,
        lambda i: (
            f"{role} column {col!r} has non-numeric value {raw.iloc[i]!r}"
            + (dated if _ISO_SHAPE.fullmatch(raw.iloc[i]) else "")
        ),
    )
    if own:
        problems.check()
    return np.where(np.isfinite(values), values, np.nan)


_INTEGER = re.compile(r"[+-]?\d+")
_ISO_SHAPE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ].*)?")
"""What a value meant as a date looks like (a date, then anything): classified as a date, then checked in full."""
_ISO_TIME = r"[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d{1,9})?)?"
_ISO_ZONE = r"(?:Z|[+-]\d{2}(?::?\d{2})?)"
_ISO_DATE = re.compile(rf"\d{{4}}-\d{{2}}-\d{{2}}(?:{_ISO_TIME}{_ISO_ZONE}?)?")
_ISO_AWARE = re.compile(rf"\d{{4}}-\d{{2}}-\d{{2}}{_ISO_TIME}{_ISO_ZONE}")

TIMESTAMP_FORMATS = (
    "numbers (unix time in any unit, integer or decimal: 1614834367, 1614834367123, 1614834367.25) or ISO 8601 "
    "dates and times (2021-03-04, 2021-03-04T05:06, 2021-03-04T05:06:07, 2021-03-04 05:06:07.123456789; a zone Z, "
    "+02:00, +0200 or +02 on every value or on none), one kind for the whole column"
)
"""The timestamp values a file may hold (:func:`timestamp_column`), as the refusals of other values name them."""


def timestamp_column(table: Table, path: Path, col: str | int, problems: Problems | None = None) -> np.ndarray:
    """``(n,)`` int64 exact order keys of a timestamp column: numbers in any unit, or ISO 8601 dates and times.

    Integer timestamps (unix seconds, milliseconds, nanoseconds, ...) are kept as they are, as int64: never through
    float64, which above 2**53 merges neighbouring values (nanosecond timestamps of one user would all tie). Decimal
    timestamps (e.g. ``1556559573.141592653``) are replaced by their exact dense rank (``Decimal`` comparison), so
    equal values stay equal and order is exact; only order matters for the split. ISO 8601 dates and times
    (:data:`TIMESTAMP_FORMATS`) are parsed by pandas (``to_datetime(format="ISO8601", utc=True)``): values with a
    zone are ordered by the instant they name (``2021-03-04 05:06:07+02:00`` is before ``2021-03-04T04:00:00Z``),
    values without one as written; the key is the count of pandas' unit (microseconds, or nanoseconds when a value
    has more than 6 decimals) since 1970-01-01 UTC. The column is a number column or a date column as its first
    number or date is. ``problems``: as in :func:`id_column` (the keys are then only valid once it is checked).

    Raises:
        DataError: values that are empty, neither a number nor an ISO 8601 date, of the other kind than the column's
            first value (numbers and dates mixed), dates with a zone among dates without one or the reverse, invalid
            dates (day 30 of February), or integers outside int64: file, line, value, and the accepted formats.
    """
    import pandas as pd

    key = _column_key(table, path, col, "timestamp")
    problems, own = _checked(table, path, problems)
    raw = table.df[key].str.strip()
    empty = (raw == "").to_numpy()
    problems.add(empty, lambda i: _empty_message(table, path, i, key, "timestamp"))
    numbers = np.isfinite(pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan))
    dates = raw.str.fullmatch(_ISO_SHAPE).to_numpy(dtype=bool) & ~numbers
    kinds = np.where(numbers, "a number", np.where(dates, "a date", ""))
    ref = int(np.flatnonzero(numbers | dates)[0]) if (numbers | dates).any() else 0  # the first number or date
    first = kinds[ref] or "a number"
    expected = dates if first == "a date" else numbers
    other = ~expected & (numbers | dates)
    accepted = f"a timestamp column holds {TIMESTAMP_FORMATS}"
    problems.add(
        other,
        lambda i: (
            f"timestamp column {col!r} has value {raw.iloc[i]!r}, {kinds[i]}, but line "
            f"{table.lines[ref]} has {kinds[ref]} ({raw.iloc[ref]!r}): numbers and dates are "
            "mixed"
        ),
        accepted,
    )
    problems.add(
        ~numbers & ~dates & ~empty,
        lambda i: f"timestamp column {col!r} has non-numeric value {raw.iloc[i]!r}",
        accepted,
    )
    keys = np.zeros(len(raw), dtype=np.int64)
    ok = expected & ~empty
    if first == "a date":
        keys = _date_keys(table, col, raw, ok, problems)
    elif ok.all() and raw.str.fullmatch(_INTEGER).all():
        text = raw.to_numpy(dtype=object).astype(str)
        try:
            keys = text.astype(np.int64)
        except (OverflowError, ValueError):
            outside = np.fromiter((not -(2**63) <= int(v) < 2**63 for v in text), dtype=bool, count=len(text))
            problems.add(
                outside,
                lambda i: f"timestamp column {col!r} value {str(text[i])!r} is outside the 64-bit integer range",
            )
    elif ok.all():
        exact = [Decimal(v) for v in raw.to_numpy(dtype=object).astype(str)]
        rank = {value: index for index, value in enumerate(sorted(set(exact)))}
        keys = np.fromiter((rank[v] for v in exact), dtype=np.int64, count=len(exact))
    if own:
        problems.check()
    return keys


def _date_keys(table: Table, col: str | int, raw: pd.Series, ok: np.ndarray, problems: Problems) -> np.ndarray:
    """``(n,)`` int64 order keys of a column of ISO 8601 dates (see :func:`timestamp_column`); the rows not ``ok``
    are already added to ``problems``, and the keys are only valid when nothing is."""
    import pandas as pd

    strict = raw.str.fullmatch(_ISO_DATE).to_numpy(dtype=bool)
    problems.add(
        ok & ~strict,
        lambda i: (
            f"timestamp column {col!r} has value {raw.iloc[i]!r}, not an ISO 8601 date or time of the accepted forms"
        ),
        f"a timestamp column holds {TIMESTAMP_FORMATS}",
    )
    ok = ok & strict
    aware = raw.str.fullmatch(_ISO_AWARE).to_numpy(dtype=bool)
    first = int(np.flatnonzero(ok)[0]) if ok.any() else 0
    problems.add(
        ok & (aware != aware[first]),
        lambda i: (
            f"timestamp column {col!r} has value {raw.iloc[i]!r} {'with' if aware[i] else 'without'} "
            f"a time zone, but line {table.lines[first]} has {raw.iloc[first]!r} "
            f"{'without' if aware[i] else 'with'} one: give every timestamp a zone (Z, +02:00) or "
            "none, so that their order is defined"
        ),
    )
    ok = ok & (aware == aware[first])
    parsed = pd.to_datetime(raw.where(ok, raw.iloc[first]), format="ISO8601", utc=True, errors="coerce")
    problems.add(
        ok & parsed.isna().to_numpy(),
        lambda i: (
            f"timestamp column {col!r} has value {raw.iloc[i]!r}, not a valid date and time (a month, "
            "day, hour or minute out of range, or a year outside 1677-2262 in a column with "
            "nanosecond digits)"
        ),
    )
    if parsed.isna().any():  # refused: problems holds why
        return np.zeros(len(raw), dtype=np.int64)
    return parsed.astype("int64").to_numpy(dtype=np.int64)


def build_frame(
    table: Table,
    path: Path,
    *,
    user,
    item,
    rating,
    timestamp,
    expect_cols: int | None = None,
    id_kinds: tuple = ("integer", "integer"),
):
    """The interactions frame of :class:`Interactions` from a parsed table; ``id_kinds``: the user and item id
    checks (``kind`` of :func:`id_column`). Every column is checked before anything is refused, so one refusal
    names the file's first bad values in line order and counts all of them (:class:`Problems`).

    Raises:
        DataError: wrong column count, bad ids, ratings or timestamps (file, line, column, value; counts).
    """
    import pandas as pd

    if expect_cols is not None and table.df.shape[1] != expect_cols:
        raise DataError(f"{path}: expected {expect_cols} columns per line, found {table.df.shape[1]}")
    n = len(table.df)
    for col, role in ((user, "user"), (item, "item"), (rating, "rating"), (timestamp, "timestamp")):
        if col is not None:
            _column_key(table, path, col, role)  # a missing column first: it is not a bad value
    problems = Problems(table, path)
    users = id_column(table, path, user, "user", id_kinds[0], problems)
    items = id_column(table, path, item, "item", id_kinds[1], problems)
    ratings = numeric_column(table, path, rating, "rating", problems) if rating is not None else np.full(n, np.nan)
    stamps = timestamp_column(table, path, timestamp, problems) if timestamp is not None else np.full(n, np.nan)
    problems.check()
    return pd.DataFrame(
        {
            "user": pd.array(users, dtype="str"),
            "item": pd.array(items, dtype="str"),
            "rating": ratings,
            "timestamp": stamps,
            "row": np.arange(n, dtype=np.int64),
        }
    )


def check_unique_index(ids: pd.Index, problems: Problems) -> None:
    """Add every row whose user id an earlier row of the attributes file already has."""
    dup = ids.duplicated()
    problems.add(dup, lambda i: f"user {ids[i]!r} appears more than once")
