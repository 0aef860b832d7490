"""The user's own interactions file (CSV/TSV/...) and optional user-attributes file, for dataset ``"generic"``.

:class:`GenericSource` says which file and columns; :func:`read_generic` parses them with the checks of
:mod:`fedrec_flwr.data.parsing` (ids are integers when at least half of a column's are, else any non-empty text).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedrec_flwr.data.datasets.spec import Parsed
from fedrec_flwr.data.parsing import (
    Problems,
    Table,
    build_frame,
    check_unique_index,
    id_column,
    read_table,
    sniff_separator,
)
from fedrec_flwr.errors import DataError

if TYPE_CHECKING:  # annotations only
    import pandas as pd

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenericSource:
    """The user's own interactions file (CSV/TSV/...), for dataset ``"generic"``.

    Attributes:
        path: interactions file.
        user_col, item_col: column name (``header=True``) or 0-based column index (``header=False``).
        rating_col, timestamp_col: optional columns; ratings are numbers, timestamps numbers in any monotone unit
            (unix seconds, milliseconds, nanoseconds, ...) or ISO 8601 dates and times with or without a zone
            (:data:`TIMESTAMP_FORMATS`), ordered exactly (:func:`timestamp_column`).
        sep: field separator; ``None`` sniffs ``,`` ``\\t`` ``;`` ``|`` from the first lines, else whitespace.
        header: whether the first line holds column names.
        attributes_path: optional user-attributes file, with a header line; one row per user.
        attributes_user_col: the column of ``attributes_path`` holding the raw user id; ``None`` (default): the
            interactions file's user column name (``user_col``) when the attributes file has it, else ``"user"``.
    """

    path: str
    user_col: str | int
    item_col: str | int
    rating_col: str | int | None = None
    timestamp_col: str | int | None = None
    sep: str | None = None
    header: bool = True
    attributes_path: str | None = None
    attributes_user_col: str | None = None


UNIX_TIME_LIKE = 1e8
"""A generic file's rating column whose every value is at least this (1973-03-03 in unix seconds) is announced as
probably holding timestamps (no rating scale reaches it)."""


def read_generic(paths: Mapping[str, Path], generic: GenericSource) -> Parsed:
    """The rows of ``paths["interactions"]`` with the columns ``generic`` names, and the user attributes of
    ``paths["attributes"]`` when given (one row per user, with a header line).

    A rating column whose every value is at least :data:`UNIX_TIME_LIKE` is announced (a logged warning) as probably
    holding timestamps.

    Raises:
        DataError: a missing column or a bad value (file, line, column, value), or the attributes file's user column
            is not found.
    """
    path = paths["interactions"]
    sep = generic.sep if generic.sep is not None else sniff_separator(path)
    table = read_table(path, sep=sep, header=generic.header)
    frame = build_frame(
        table,
        path,
        user=generic.user_col,
        item=generic.item_col,
        rating=generic.rating_col,
        timestamp=generic.timestamp_col,
        id_kinds=("auto", "auto"),
    )
    if (
        generic.rating_col is not None
        and generic.timestamp_col is None
        and float(frame["rating"].min()) >= UNIX_TIME_LIKE
    ):
        logger.warning(
            "%s: the rating column %r holds values from %g to %g, which look like unix times; ratings "
            "are not used for training (every row is a positive), while timestamps choose each user's "
            "held-out item: if it holds timestamps, name it in the timestamp position of "
            "'generic-columns' (e.g. \"user,item,,%s\")",
            path,
            generic.rating_col,
            float(frame["rating"].min()),
            float(frame["rating"].max()),
            generic.rating_col,
        )
    attributes = None
    if "attributes" in paths:
        apath = paths["attributes"]
        atable = read_table(apath, sep=sniff_separator(apath), header=True)
        attributes = _generic_attributes(atable, apath, _attributes_user_col(atable, apath, generic))
    return Parsed(frame, table.lines, attributes)


def _attributes_user_col(table: Table, path: Path, generic: GenericSource) -> str:
    """The attributes file's user-id column: ``attributes_user_col`` if given, else the interactions file's user
    column name when the attributes file has it, else ``"user"``.

    Raises:
        DataError: no such column (the message lists the file's columns and the names tried).
    """
    columns = [str(c) for c in table.df.columns]
    if generic.attributes_user_col is not None:
        if generic.attributes_user_col in columns:
            return generic.attributes_user_col
        raise DataError(
            f"{path}: attributes user column {generic.attributes_user_col!r} (run-config key "
            f"'generic-attributes-user-column') not found; the file's columns are {columns}"
        )
    tried = ([generic.user_col] if isinstance(generic.user_col, str) else []) + ["user"]
    for name in tried:
        if name in columns:
            return name
    raise DataError(
        f"{path}: attributes user column not found: tried {tried} (the user column of the interactions "
        f"file, named in 'generic-columns', then 'user'); the file's columns are {columns}: name its user "
        "column in 'generic-attributes-user-column'"
    )


def _generic_attributes(table: Table, path: Path, user_col: str) -> pd.DataFrame:
    import pandas as pd

    problems = Problems(table, path)
    ids = id_column(table, path, user_col, "attributes user", "auto", problems)
    columns = {}
    for col in table.df.columns:
        if col == user_col:
            continue
        raw = table.df[col].str.strip()
        empty = (raw == "").to_numpy()
        problems.add(empty, lambda i, col=col: f"attribute column {col!r} is empty")
        numeric = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        if np.isfinite(numeric).all():
            columns[str(col)] = numeric.astype(np.int64) if np.all(numeric == np.round(numeric)) else numeric
        else:
            columns[str(col)] = raw.to_numpy(dtype=object).astype(str)
    check_unique_index(pd.Index(ids), problems)
    problems.check()
    return pd.DataFrame(columns, index=pd.Index(ids, name="user"))
