"""MovieLens-100K (GroupLens; Harper and Konstan, ACM TiiS 2015): 100,000 ratings of 1,682 movies by 943 users, with
each user's age, gender and occupation.

``u.data``: tab-separated ``user item rating timestamp`` rows, no header; ``u.user``: ``|``-separated
``id|age|gender|occupation|zip``; ``u.item``: ``|``-separated ``movie_id|title|...`` in ISO-8859-1 (read only for
titles, :func:`read_item_titles`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedrec_flwr.data.datasets.spec import DatasetSpec, Parsed
from fedrec_flwr.data.parsing import (
    Problems,
    Table,
    build_frame,
    check_unique_index,
    id_column,
    numeric_column,
    read_table,
)
from fedrec_flwr.errors import DataError

if TYPE_CHECKING:  # annotations only
    import pandas as pd


def read(paths: Mapping[str, Path]) -> Parsed:
    """The ratings of ``u.data`` with the user attributes of ``u.user`` (ages as integers)."""
    table = read_table(paths["u.data"], sep="\t", header=False)
    frame = build_frame(table, paths["u.data"], user=0, item=1, rating=2, timestamp=3, expect_cols=4)
    users = read_table(paths["u.user"], sep="|", header=False)
    return Parsed(frame, table.lines, _attributes(users, paths["u.user"]))


def _attributes(table: Table, path: Path) -> pd.DataFrame:
    import pandas as pd

    if table.df.shape[1] != 5:
        raise DataError(
            f"{path}: expected 5 '|'-separated fields (id|age|gender|occupation|zip), found {table.df.shape[1]}"
        )
    problems = Problems(table, path)
    ids = id_column(table, path, 0, "user id", problems=problems)
    age = numeric_column(table, path, 1, "age", problems)
    problems.add(np.isfinite(age) & (age != np.round(age)), lambda i: f"age {age[i]:g} is not an integer")
    gender = id_column(table, path, 2, "gender", "label", problems)
    occupation = id_column(table, path, 3, "occupation", "label", problems)
    check_unique_index(pd.Index(ids), problems)
    problems.check()
    return pd.DataFrame(
        {"gender": gender, "age": age.astype(np.int64), "occupation": occupation}, index=pd.Index(ids, name="user")
    )


def read_item_titles(path: Path) -> pd.Series:
    """The movie titles of ``u.item`` (ISO-8859-1 text, read with ``encoding="latin-1"``).

    Returns: str Series named ``title``, indexed by raw item id (str), in file order.
    Raises: DataError if ``u.item`` is malformed.
    """
    import pandas as pd

    table = read_table(path, sep="|", header=False, encoding="latin-1")
    if table.df.shape[1] < 2:
        raise DataError(f"{path}: expected '|'-separated 'movie_id|title|...' rows, found {table.df.shape[1]} column")
    ids = id_column(table, path, 0, "movie_id")
    return pd.Series(table.df[1].to_numpy(dtype=str), index=pd.Index(ids, name="item"), name="title")


SPEC = DatasetSpec(
    name="ml-100k",
    title="MovieLens-100K",
    url="https://files.grouplens.org/datasets/movielens/ml-100k.zip",
    sha256={
        "u.data": "06416e597f82b7342361e41163890c81036900f418ad91315590814211dca490",
        "u.user": "f120e114da2e8cf314fd28f99417c94ae9ddf1cb6db8ce0e4b5995d40e90e62c",
        "u.item": "553841ebc7de3a0fd0d6b62a204ea30c1e651aacfb2814c7a6584ac52f2c5701",
    },
    files=("u.data", "u.user"),
    read=read,
    attributes=("age", "gender", "occupation"),
    # the 943 users of GroupLens' u.user, counted once from the official file (ages bucketed by
    # fedrec_flwr.attributes.AGE_BUCKETS): the dataset's public statistics, the same for every user of every run
    published_class_counts={
        "gender": {"F": 273, "M": 670},
        "age": {"<18": 36, "18-24": 198, "25-34": 310, "35-44": 194, "45-49": 80, "50-55": 73, "56+": 52},
        "occupation": {
            "administrator": 79,
            "artist": 28,
            "doctor": 7,
            "educator": 95,
            "engineer": 67,
            "entertainment": 18,
            "executive": 32,
            "healthcare": 16,
            "homemaker": 7,
            "lawyer": 12,
            "librarian": 51,
            "marketing": 26,
            "none": 9,
            "other": 105,
            "programmer": 66,
            "retired": 14,
            "salesman": 12,
            "scientist": 31,
            "student": 196,
            "technician": 27,
            "writer": 45,
        },
    },
)
