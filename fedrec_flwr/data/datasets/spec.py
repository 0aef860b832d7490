"""What the package knows about one built-in dataset, in one frozen :class:`DatasetSpec`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # annotations only: pandas is imported where a file is parsed
    import pandas as pd


class Parsed(NamedTuple):
    """What a dataset's reader returns, before duplicate (user, item) rows are removed.

    Attributes:
        frame: one row per interaction row of the file, columns ``user``, ``item``, ``rating``, ``timestamp``,
            ``row`` (see :class:`fedrec_flwr.data.Interactions`).
        lines: ``(len(frame),)`` int64, the 1-based file line of each row (for the duplicate warning).
        attributes: user attributes indexed by raw user id (str), or ``None``.
    """

    frame: pd.DataFrame
    lines: np.ndarray
    attributes: pd.DataFrame | None


@dataclass(frozen=True)
class DatasetSpec:
    """One built-in dataset: where it comes from, what is read, how, and the facts about it that the package uses.

    Attributes:
        name: the run-config value of ``dataset`` (``"ml-100k"``).
        title: the dataset's name in prose (``"MovieLens-100K"``).
        url: the official download; a ``.zip`` URL is an archive holding the files of ``sha256`` (found by base name
            anywhere in it), any other URL the single file itself.
        sha256: the pinned sha256 of every file any reader of the dataset reads (``shared/data/<name>/SOURCE.md``);
            the first is the file whose presence marks the dataset folder.
        files: the files :attr:`read` parses, in read order (the order of ``Interactions.source_sha256``).
        read: the reader, ``read(paths) -> Parsed`` with ``paths`` mapping each of :attr:`files` to its path.
        attributes: the user attributes the reader returns (known without the data, so a ``protected-attribute``
            the dataset lacks is refused with the run config).
        published_class_counts: attribute -> {class: users} in the dataset's published user file, classes in
            :func:`fedrec_flwr.attributes.encode_attribute`'s order (``adversary-class-prior = "published"``).
        fedrecgel_timestamps: for a dataset without timestamps, FedRecGEL's procedure that synthesises them
            (``fedrecgel_timestamps(users_raw, rows, dup_rows) -> (n,) int64``), which ``tie-rule = "fedrecgel"``
            reproduces (:func:`fedrec_flwr.data.preprocess`, step 4); ``None``: a seeded random order is used.
    """

    name: str
    title: str
    url: str
    sha256: Mapping[str, str]
    files: tuple[str, ...]
    read: Callable[[Mapping[str, Path]], Parsed]
    attributes: tuple[str, ...] = ()
    published_class_counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    fedrecgel_timestamps: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None
