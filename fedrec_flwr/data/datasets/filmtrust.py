"""FilmTrust (LibRec's release, Guo et al., IJCAI 2013): the film ratings of the FilmTrust site's users.

``ratings.txt``: whitespace-separated ``user item rating`` rows, no header and no timestamps. FedRecGEL synthesises
timestamps for it (:func:`fedrecgel_timestamps`), which ``tie-rule = "fedrecgel"`` reproduces.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from fedrec_flwr.data.datasets.spec import DatasetSpec, Parsed
from fedrec_flwr.data.parsing import build_frame, read_table

FEDRECGEL_TIMESTAMP_SEED = 42
"""FedRecGEL hard-codes this seed for the synthetic FilmTrust timestamps (data_process.ipynb)."""


def read(paths: Mapping[str, Path]) -> Parsed:
    """Every (user, item) row of ``ratings.txt`` with its rating."""
    table = read_table(paths["ratings.txt"], sep=r"\s+", header=False)
    frame = build_frame(table, paths["ratings.txt"], user=0, item=1, rating=2, timestamp=None, expect_cols=3)
    return Parsed(frame, table.lines, None)


def fedrecgel_timestamps(users_raw: np.ndarray, rows: np.ndarray, dup_rows: np.ndarray) -> np.ndarray:
    """FedRecGEL's synthetic FilmTrust timestamps over all raw rows; a kept pair takes its copies' maximum.

    ``base = default_rng(42).integers(0, 10**9, n_raw)`` and ``timestamp = base * 10**6 + (the user's running row
    count)`` over the raw rows in file order, as FedRecGEL's data_process.ipynb builds them.

    Args:
        users_raw: ``(n,)`` raw user ids of the kept rows.
        rows: ``(n,)`` int64 file row of each kept row.
        dup_rows: ``(d, 2)`` int64 ``[dropped_row, kept_row]`` of the removed duplicates.

    Returns: ``(n,)`` int64 exact timestamps of the kept rows.
    """
    import pandas as pd

    n_raw = len(rows) + len(dup_rows)
    user_of_row = np.empty(n_raw, dtype=object)
    user_of_row[rows] = users_raw
    if len(dup_rows):
        kept_pos = pd.Index(rows).get_indexer(dup_rows[:, 1])
        user_of_row[dup_rows[:, 0]] = users_raw[kept_pos]
    base = np.random.default_rng(FEDRECGEL_TIMESTAMP_SEED).integers(0, 10**9, size=n_raw, dtype=np.int64)
    cumcount = pd.Series(user_of_row).groupby(user_of_row, sort=False).cumcount().to_numpy(np.int64)
    raw_ts = base * np.int64(10**6) + cumcount
    ts = raw_ts[rows].copy()
    if len(dup_rows):
        np.maximum.at(ts, kept_pos, raw_ts[dup_rows[:, 0]])
    return ts  # int64, exact


SPEC = DatasetSpec(
    name="filmtrust",
    title="FilmTrust",
    url="https://guoguibing.github.io/librec/datasets/filmtrust.zip",
    sha256={"ratings.txt": "241167424e24d588e8871d68641e94ead98d5b3a4f0db01ef3181a74ad35e7a1"},
    files=("ratings.txt",),
    read=read,
    fedrecgel_timestamps=fedrecgel_timestamps,
)
