"""Raw interactions of a dataset: locate (or download) its files, parse them, and drop duplicate (user, item) rows.

Every reader returns an :class:`Interactions` whose ``frame`` has one row per (user, item) pair. A built-in dataset is
parsed by the reader of its :class:`~fedrec_flwr.data.datasets.DatasetSpec` (:mod:`fedrec_flwr.data.datasets`), the
user's own CSV/TSV by :mod:`fedrec_flwr.data.generic`; both report a bad value with its file, 1-based line number,
column and value (:mod:`fedrec_flwr.data.parsing`) instead of a pandas traceback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

# pandas is imported inside the functions that parse data: the ClientApp reads a cached split and never needs it, and
# importing it costs ~1 s of every ClientApp cold start (a SuperNode starts one process per message)
if TYPE_CHECKING:  # annotations only
    import pandas as pd

from fedrec_flwr.data.datasets import DATASET_SPECS, DATASETS, movielens
from fedrec_flwr.data.download import SourceFiles, combine_sha256, locate_files, sha256_file
from fedrec_flwr.data.generic import GenericSource, read_generic
from fedrec_flwr.data.parsing import TIMESTAMP_FORMATS
from fedrec_flwr.errors import ConfigError, DataError

__all__ = [
    "DATASETS",
    "FRAME_COLUMNS",
    "TIMESTAMP_FORMATS",
    "GenericSource",
    "Interactions",
    "check_dataset_args",
    "default_cache_dir",
    "load_interactions",
    "load_item_titles",
    "locate_source",
    "read_interactions",
]

logger = logging.getLogger(__name__)

FRAME_COLUMNS = ("user", "item", "rating", "timestamp", "row")


def _empty_pairs() -> np.ndarray:
    return np.zeros((0, 2), dtype=np.int64)


@dataclass(frozen=True)
class Interactions:
    """Raw interactions of one dataset, before preprocessing.

    Attributes:
        frame: one row per (user, item) after deduplication, in file order, with columns ``user`` (str raw id),
            ``item`` (str raw id), ``rating`` (float64, NaN if the file has none), ``timestamp`` (int64 exact order
            key when the file has timestamps, see :func:`~fedrec_flwr.data.parsing.timestamp_column`; float64 NaN when it has none) and
            ``row`` (int64, 0-based index of the data row in the file, header excluded).
        attributes: user attributes indexed by raw user id (str), or None.
        source_sha256: sha256 over the files read, in read order (for generic data it also covers the parse
            options, so two column choices on one file never share a cache entry).
        name: dataset name.
        duplicate_rows: (d, 2) int64 ``[dropped_row, kept_row]`` file-row pairs of removed duplicate
            (user, item) rows; ``len(duplicate_rows)`` is the number of duplicates removed. Kept so that
            preprocessing can reproduce procedures defined on the raw rows (FedRecGEL's synthetic timestamps).
    """

    frame: pd.DataFrame
    attributes: pd.DataFrame | None
    source_sha256: str
    name: str
    duplicate_rows: np.ndarray = field(default_factory=_empty_pairs)

    @property
    def duplicates_removed(self) -> int:
        """Number of duplicate (user, item) rows dropped when loading."""
        return int(len(self.duplicate_rows))


def default_cache_dir() -> Path:
    """Cache folder: ``$FEDREC_FLWR_CACHE`` if set, else ``~/.cache/fedrec-flwr``."""
    env = os.environ.get("FEDREC_FLWR_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedrec-flwr"


def check_dataset_args(dataset: str, generic: GenericSource | None) -> None:
    """Raise :class:`ConfigError` for an unknown dataset or a ``generic`` mismatch."""
    if dataset not in DATASETS:
        raise ConfigError(f"unknown dataset {dataset!r}; choose one of {list(DATASETS)}")
    if dataset == "generic" and generic is None:
        raise ConfigError("dataset 'generic' needs generic=GenericSource(path=..., user_col=..., item_col=...)")
    if dataset != "generic" and generic is not None:
        raise ConfigError(f"generic= is only used with dataset 'generic', not {dataset!r}")


def locate_source(
    dataset: str,
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    generic: GenericSource | None = None,
    download: bool = True,
) -> SourceFiles:
    """Find (downloading if needed) and hash the files :func:`load_interactions` would read.

    Raises: ConfigError (bad arguments), DataError (missing file, failed or mismatching download).
    """
    check_dataset_args(dataset, generic)
    if dataset == "generic":
        assert generic is not None
        paths = {"interactions": Path(generic.path)}
        if generic.attributes_path is not None:
            paths["attributes"] = Path(generic.attributes_path)
        for path in paths.values():
            if not path.is_file():
                raise DataError(f"generic dataset: file {str(path)!r} not found")
        digests = {k: sha256_file(p) for k, p in paths.items()}
        options = {k: repr(v) for k, v in vars(generic).items() if k not in ("path", "attributes_path")}
        return SourceFiles(dataset, paths, digests, combine_sha256({**digests, **options}))
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return locate_files(dataset, list(DATASET_SPECS[dataset].files), data_dir, cache, download=download)


def load_interactions(
    dataset: str,
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    generic: GenericSource | None = None,
    download: bool = True,
) -> Interactions:
    """Read the raw interactions of ``dataset`` (one of :data:`DATASETS`).

    Files are taken from ``data_dir`` (the dataset folder or its parent), else from ``cache_dir/raw/<name>/``
    (downloaded and sha256-verified on first use when ``download``); ``generic`` describes a ``"generic"`` file.
    Formats: see each dataset's SOURCE.md. Duplicate (user, item) rows keep the row with the latest timestamp,
    else the first; their number is logged and kept in :attr:`Interactions.duplicates_removed`.

    Raises:
        ConfigError: unknown dataset, or ``generic`` given/missing wrongly.
        DataError: missing/empty file, missing column, non-numeric rating, a timestamp that is neither a number
            nor an ISO 8601 date (or a column mixing both, see :data:`~fedrec_flwr.data.parsing.TIMESTAMP_FORMATS`), empty or malformed user or
            item id (file, line, column, value): ids must be non-negative integers (MovieLens-100K, FilmTrust,
            Lastfm-2K), Amazon reviewer ids and ASINs (Amazon-Video), or, in a generic file, integers when at least
            half of that column's ids are (else any non-empty text; see :func:`~fedrec_flwr.data.parsing.id_column`).
    """
    source = locate_source(dataset, data_dir, cache_dir=cache_dir, generic=generic, download=download)
    return read_interactions(source, generic)


def read_interactions(source: SourceFiles, generic: GenericSource | None = None) -> Interactions:
    """Parse the files of an already located source (see :func:`locate_source`)."""
    name, paths = source.name, source.paths
    if name == "generic":
        if generic is None:
            raise ConfigError("dataset 'generic' needs generic=GenericSource(...)")
        parsed = read_generic(paths, generic)
    elif name in DATASET_SPECS:
        parsed = DATASET_SPECS[name].read(paths)
    else:  # pragma: no cover - check_dataset_args guards this
        raise ConfigError(f"unknown dataset {name!r}")
    first_file = next(iter(paths.values()))
    frame, duplicate_rows = _deduplicate(parsed.frame, first_file, parsed.lines)
    return Interactions(frame, parsed.attributes, source.combined_sha256, name, duplicate_rows)


def load_item_titles(
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    download: bool = True,
) -> pd.Series:
    """MovieLens-100K movie titles from ``u.item`` (ISO-8859-1 text, read with ``encoding="latin-1"``).

    Returns: str Series named ``title``, indexed by raw item id (str), in file order.
    Raises: DataError if ``u.item`` is missing or malformed.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source = locate_files(movielens.SPEC.name, ["u.item"], data_dir, cache, download=download)
    return movielens.read_item_titles(source.paths["u.item"])


def _deduplicate(frame: pd.DataFrame, path: Path, lines: np.ndarray | None = None) -> tuple[pd.DataFrame, np.ndarray]:
    """Keep one row per (user, item): the latest timestamp, else the first; return (frame, [dropped, kept]).

    When rows are dropped, one warning says how many, which row of each pair was kept and the first few
    (dropped line, kept line) pairs; ``lines``: (n,) 1-based file line of each row (default: row + 1)."""
    order = frame.sort_values(["timestamp", "row"], ascending=[False, True], kind="stable", na_position="last")
    dup = order.duplicated(["user", "item"], keep="first")
    if not dup.any():
        return frame, _empty_pairs()
    kept_row = order.groupby(["user", "item"], sort=False)["row"].transform("first")
    pairs = np.stack([order.loc[dup, "row"].to_numpy(np.int64), kept_row[dup].to_numpy(np.int64)], axis=1)
    pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
    line_of = (lambda row: int(lines[row])) if lines is not None else (lambda row: int(row) + 1)
    timed = (
        bool(np.isfinite(frame["timestamp"].to_numpy(dtype=np.float64, na_value=np.nan)).any())
        if frame["timestamp"].dtype.kind == "f"
        else True
    )
    rule = (
        "its row with the latest timestamp (the first of equal ones)"
        if timed
        else "its first row (the file has no timestamps)"
    )
    users, items = frame["user"].to_numpy(dtype=object), frame["item"].to_numpy(dtype=object)
    shown = "; ".join(
        f"line {line_of(d)} dropped, line {line_of(k)} kept (user {str(users[k])!r}, item {str(items[k])!r})"
        for d, k in pairs[:3]
    )
    more = f"; {len(pairs) - 3} more" if len(pairs) > 3 else ""
    logger.warning(
        "%s: dropped %d duplicate (user, item) row%s, keeping for each pair %s: %s%s",
        path,
        len(pairs),
        "s" if len(pairs) != 1 else "",
        rule,
        shown,
        more,
    )
    kept = frame.loc[~dup.reindex(frame.index).to_numpy()].reset_index(drop=True)
    return kept, pairs
