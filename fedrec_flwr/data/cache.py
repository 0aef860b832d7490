"""Processed-split cache: ``cache_dir/processed/<dataset>-<key>.npz``, written atomically, verified on load.

The key covers the dataset, every preprocessing parameter, the sha256 of the source files and
:data:`~fedrec_flwr.data.split.FORMAT_VERSION`. Files are read with ``allow_pickle=False``: ``meta`` is stored as
a one-element JSON string array and attributes as ``attr__<name>`` str/int64/float64 arrays. A file that cannot be
read or fails the shape/dtype/key checks is logged, deleted and rebuilt, never used.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np

from fedrec_flwr.data.loaders import GenericSource, default_cache_dir, locate_source, read_interactions
from fedrec_flwr.data.split import FORMAT_VERSION, Split, check_params, preprocess, split_cache_key
from fedrec_flwr.errors import DataError
from fedrec_flwr.io import atomic_save_npz, load_npz

logger = logging.getLogger(__name__)

_ATTR_PREFIX = "attr__"


def load_split(
    dataset: str,
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    generic: GenericSource | None = None,
    min_user_interactions: int = 5,
    tie_rule: str = "random",
    seed: int = 0,
    num_test_negatives: int = 99,
    holdout_validation: bool = False,
    download: bool = True,
) -> Split:
    """Load the leave-one-out :class:`Split` of ``dataset``, from the processed cache when possible.

    Locates and hashes the source files (see :func:`~fedrec_flwr.data.load_interactions`), then returns the
    cached split for (dataset, parameters, source sha256, format version) if a valid one exists (logged at INFO
    as ``"loaded cached split"``); otherwise parses, runs :func:`~fedrec_flwr.data.preprocess` and saves it.
    ``cache_dir`` defaults to :func:`default_cache_dir`.

    Raises: ConfigError (bad parameter or dataset), DataError (missing/malformed data, failed download).
    """
    check_params(min_user_interactions, tie_rule, seed, num_test_negatives, holdout_validation)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source = locate_source(dataset, data_dir, cache_dir=cache, generic=generic, download=download)
    params = dict(
        min_user_interactions=min_user_interactions,
        tie_rule=tie_rule,
        seed=seed,
        num_test_negatives=num_test_negatives,
        holdout_validation=holdout_validation,
    )
    key = split_cache_key(dataset, source.combined_sha256, **params)
    path = cache / "processed" / f"{dataset}-{key}.npz"
    if path.exists():
        try:
            split = read_split(path, expected_key=key)
        except DataError as exc:
            logger.warning("discarding unusable cached split %s (%s); rebuilding it", path, exc)
            path.unlink(missing_ok=True)
        else:
            logger.info("loaded cached split %s", path)
            return split
    split = preprocess(read_interactions(source, generic), **params)
    try:
        save_split(path, split)
    except OSError as exc:  # a read-only or full cache must not stop the run
        logger.warning("could not write the split cache %s: %s", path, exc)
    else:
        logger.info("saved split to %s", path)
    return split


def save_split(path: str | os.PathLike, split: Split) -> Path:
    """Write ``split`` to ``path`` as an ``.npz`` atomically (loadable with ``allow_pickle=False``)."""
    arrays = {
        "meta": np.asarray([json.dumps(split.meta, sort_keys=True)]),
        "train_indptr": split.train_indptr,
        "train_items": split.train_items,
        "test_items": split.test_items,
        "test_negatives": split.test_negatives,
        "user_ids": np.asarray(split.user_ids, dtype=str),
        "item_ids": np.asarray(split.item_ids, dtype=str),
    }
    if split.val_items is not None:
        arrays["val_items"] = split.val_items
        arrays["val_negatives"] = split.val_negatives
    for name, values in split.attributes.items():
        arrays[_ATTR_PREFIX + name] = values
    return atomic_save_npz(path, **arrays)


def read_split(path: str | os.PathLike, *, expected_key: str | None = None) -> Split:
    """Read and verify a split written by :func:`save_split`.

    Raises: DataError if the file is unreadable, its key/format version differ, or any array has the wrong
    shape, dtype or range.
    """
    try:
        with load_npz(path) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: cannot read cached split: {type(exc).__name__}: {exc}") from None
    try:
        meta = json.loads(str(arrays["meta"][0]))
        if meta.get("format_version") != FORMAT_VERSION:
            raise DataError(f"format_version {meta.get('format_version')} != {FORMAT_VERSION}")
        if expected_key is not None and meta.get("cache_key") != expected_key:
            raise DataError(f"cache key {meta.get('cache_key')!r} != expected {expected_key!r}")
        user_ids, item_ids = arrays["user_ids"], arrays["item_ids"]
        num_users, num_items = len(user_ids), len(item_ids)
        k = int(meta["num_test_negatives"])
        holdout = bool(meta["holdout_validation"])
        _check(arrays, "user_ids", (num_users,), "U")
        _check(arrays, "item_ids", (num_items,), "U")
        indptr = _check(arrays, "train_indptr", (num_users + 1,), "i")
        items = _check(arrays, "train_items", (int(indptr[-1]) if len(indptr) else -1,), "i")
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0):
            raise DataError("train_indptr is not a valid CSR row pointer")
        _check(arrays, "test_items", (num_users,), "i")
        _check(arrays, "test_negatives", (num_users, k), "i")
        checked = ("train_items", "test_items", "test_negatives") + (("val_items", "val_negatives") if holdout else ())
        for name in checked:
            _check(arrays, name, None, "i")
            values = arrays[name]
            if values.size and (values.min() < 0 or values.max() >= num_items):
                raise DataError(f"{name} has item indices outside [0, {num_items})")
        if holdout:
            _check(arrays, "val_items", (num_users,), "i")
            _check(arrays, "val_negatives", (num_users, k), "i")
        attributes = {}
        for name in arrays:
            if name.startswith(_ATTR_PREFIX):
                attributes[name[len(_ATTR_PREFIX) :]] = _check(arrays, name, (num_users,), "Uif")
        if meta.get("num_interactions") != len(items) + num_users * (1 + holdout):
            raise DataError("num_interactions does not match the arrays")
    except DataError as exc:
        raise DataError(f"{path}: invalid cached split: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: invalid cached split: {type(exc).__name__}: {exc}") from None
    return Split(
        dataset=meta["dataset"],
        num_users=num_users,
        num_items=num_items,
        train_indptr=indptr,
        train_items=items,
        test_items=arrays["test_items"],
        test_negatives=arrays["test_negatives"],
        val_items=arrays.get("val_items") if holdout else None,
        val_negatives=arrays.get("val_negatives") if holdout else None,
        user_ids=user_ids,
        item_ids=item_ids,
        attributes=attributes,
        meta=meta,
    )


def _check(arrays: dict, name: str, shape: tuple | None, kinds: str) -> np.ndarray:
    if name not in arrays:
        raise DataError(f"array {name!r} missing")
    value = arrays[name]
    if (
        value.dtype.kind not in kinds
        or (value.dtype.kind == "i" and value.dtype != np.int64)
        or (value.dtype.kind == "f" and value.dtype != np.float64)
    ):
        raise DataError(f"array {name!r} has dtype {value.dtype}")
    if shape is not None and value.shape != shape:
        raise DataError(f"array {name!r} has shape {value.shape}, expected {shape}")
    return value
