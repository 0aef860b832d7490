"""Leave-one-out splits with sampled evaluation negatives, as the federated-recommendation papers build them.

Protocol (NCF, He et al., WWW 2017, Sec. 4.1; used by FedNCF, PFedRec, FedRAP, FedRecGEL): every observed
interaction is a positive; each user's latest interaction is held out for testing and ranked against
``num_test_negatives`` (99) items the user never interacted with; metrics are HR@K and NDCG@K over those 100.

All randomness comes from ``np.random.default_rng([seed, TAG_..., user, round])`` sequence seeds, so a user's split
and negatives do not depend on call order, process or scheduling.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import zlib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

# pandas is imported inside the functions that parse data: the ClientApp reads a cached split and never needs it, and
# importing it costs ~1 s of every ClientApp cold start (a SuperNode starts one process per message)
if TYPE_CHECKING:  # annotations only
    import pandas as pd

from fedrec_flwr.data.datasets import DATASET_SPECS
from fedrec_flwr.data.loaders import Interactions
from fedrec_flwr.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

#: Version of the processed-split layout and procedure; part of every cache key. 2: timestamps are exact int64 order
#: keys (1 read them as float64, which merged timestamps above 2**53), and ``meta`` records ``held_out_order``.
#: 3: user and item ids are checked as integers while parsing (a cache hit skips parsing, so a split cached by 2 from
#: a file with an id such as ``abc`` would otherwise still be used).
FORMAT_VERSION = 3

TIE_RULES = ("random", "fedrecgel", "smallest-item", "largest-item")


def _tag(purpose: str) -> int:
    return zlib.crc32(f"fedrec-flwr/data/{purpose}".encode())


#: Purpose tags of the sequence seeds ``[seed, TAG, ...]``.
TAG_ORDER = _tag("order")  # synthetic order of interactions without timestamps
TAG_TIE = _tag("tie")  # random tie-break key among equal latest timestamps
TAG_TEST_NEG = _tag("test-negatives")
TAG_VAL_NEG = _tag("val-negatives")
TAG_TRAIN_NEG = _tag("train-negatives")


@dataclass(frozen=True, eq=False)
class Split:
    """A processed leave-one-out split.

    Users and items are contiguous indices ``0..num_users-1`` / ``0..num_items-1``; ``user_ids`` / ``item_ids``
    map them back to raw ids (sorted by raw id: numerically when all ids are integers).

    Attributes:
        train_indptr: (num_users+1,) int64 CSR row pointer into ``train_items``.
        train_items: (nnz,) int64 training positives, ascending within each user.
        test_items: (num_users,) int64 each user's held-out latest item.
        test_negatives: (num_users, num_test_negatives) int64 distinct items the user never interacted with.
        val_items, val_negatives: the same for the second-latest item when ``holdout_validation``, else None.
        user_ids, item_ids: (num_users,) / (num_items,) str raw ids.
        attributes: name -> (num_users,) array (str, int64 or float64); ``{}`` if the dataset has none.
        meta: JSON-able provenance (parameters, source sha256, cleaning counts, ``format_version``, ...).
    """

    dataset: str
    num_users: int
    num_items: int
    train_indptr: np.ndarray
    train_items: np.ndarray
    test_items: np.ndarray
    test_negatives: np.ndarray
    val_items: np.ndarray | None
    val_negatives: np.ndarray | None
    user_ids: np.ndarray
    item_ids: np.ndarray
    attributes: dict[str, np.ndarray]
    meta: dict

    def positives(self, user: int) -> np.ndarray:
        """(n_u,) int64 view of ``user``'s training positives, ascending."""
        return self.train_items[self.train_indptr[user] : self.train_indptr[user + 1]]

    def interacted(self, user: int) -> np.ndarray:
        """Sorted (n_u + 1, or n_u + 2 with validation,) int64: every item ``user`` interacted with."""
        extra = [self.test_items[user]] if self.val_items is None else [self.test_items[user], self.val_items[user]]
        return np.sort(np.concatenate([self.positives(user), np.asarray(extra, dtype=np.int64)]))

    def train_counts(self) -> np.ndarray:
        """(num_items,) int64 number of users with each item among their training positives (popularity)."""
        return np.bincount(self.train_items, minlength=self.num_items).astype(np.int64)

    def stats(self) -> dict:
        """Statistics after cleaning: users, items, interactions (train+val+test), density, per-user/item means."""
        per_user = np.diff(self.train_indptr) + 1 + (self.val_items is not None)
        interactions = int(per_user.sum())
        return {
            "users": self.num_users,
            "items": self.num_items,
            "interactions": interactions,
            "train_interactions": int(len(self.train_items)),
            "density": interactions / (self.num_users * self.num_items),
            "avg_interactions_per_user": interactions / self.num_users,
            "min_interactions_per_user": int(per_user.min()),
            "max_interactions_per_user": int(per_user.max()),
            "avg_interactions_per_item": interactions / self.num_items,
        }

    def equals(self, other: Split) -> bool:
        """True when every field (arrays element-wise, dtypes included) is equal."""
        if not isinstance(other, Split):
            return False
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "attributes":
                if a.keys() != b.keys() or not all(_array_equal(a[k], b[k]) for k in a):
                    return False
            elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not _array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True


def _array_equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def check_params(min_user_interactions, tie_rule, seed, num_test_negatives, holdout_validation) -> None:
    """Raise :class:`ConfigError` naming the first invalid preprocessing parameter."""
    if tie_rule not in TIE_RULES:
        raise ConfigError(f"tie_rule {tie_rule!r} is not one of {list(TIE_RULES)}")
    for key, value in (
        ("seed", seed),
        ("num_test_negatives", num_test_negatives),
        ("min_user_interactions", min_user_interactions),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"{key} must be a non-negative integer, got {value!r}")
    if not isinstance(holdout_validation, (bool, np.bool_)):
        raise ConfigError(f"holdout_validation must be a bool, got {holdout_validation!r}")
    need = 3 if holdout_validation else 2
    if min_user_interactions < need:
        raise ConfigError(
            f"min_user_interactions must be >= {need} (held-out item(s) plus at least one training positive), "
            f"got {min_user_interactions}"
        )


def split_cache_key(
    dataset: str,
    source_sha256: str,
    *,
    min_user_interactions: int,
    tie_rule: str,
    seed: int,
    num_test_negatives: int,
    holdout_validation: bool,
) -> str:
    """Hex key (24 chars) over the dataset, every preprocessing parameter, the source sha256 and FORMAT_VERSION."""
    blob = json.dumps(
        {
            "dataset": dataset,
            "source_sha256": source_sha256,
            "format_version": FORMAT_VERSION,
            "min_user_interactions": int(min_user_interactions),
            "tie_rule": tie_rule,
            "seed": int(seed),
            "num_test_negatives": int(num_test_negatives),
            "holdout_validation": bool(holdout_validation),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def sorted_ids(ids: np.ndarray) -> np.ndarray:
    """Unique raw ids (str) sorted numerically when every id is an integer, else as strings."""
    import pandas as pd

    unique = pd.unique(pd.Series(ids, dtype=object)).astype(str)
    if len(unique) and pd.Series(unique).str.fullmatch(r"[+-]?\d+").all():
        return np.asarray(sorted(unique, key=lambda s: (int(s), s)), dtype=str)
    return np.sort(unique)


def preprocess(
    interactions: Interactions,
    *,
    min_user_interactions: int = 5,
    tie_rule: str = "random",
    seed: int = 0,
    num_test_negatives: int = 99,
    holdout_validation: bool = False,
) -> Split:
    """Build a leave-one-out :class:`Split` from raw interactions (pure: no I/O).

    Steps (implicit feedback, as in NCF/FedNCF/PFedRec/FedRecGEL):

    1. Every row is a positive.
    2. Users with fewer than ``min_user_interactions`` interactions are dropped, then items left with none.
    3. Ids are remapped to contiguous indices in sorted raw-id order (numeric when all ids are integers). In
       ``tie_rule="fedrecgel"`` non-integer ids are instead numbered in order of first appearance in the file,
       as FedRecGEL's ``pd.factorize`` does (this changes the smallest-item tie-break on Amazon-Video).
    4. Without timestamps, each row gets a random order value (a permutation from ``rng([seed, TAG_ORDER])``
       over rows in file order). In ``tie_rule="fedrecgel"`` a dataset whose
       :class:`~fedrec_flwr.data.datasets.DatasetSpec` has ``fedrecgel_timestamps`` (FilmTrust) gets FedRecGEL's
       synthetic timestamps instead (:func:`fedrec_flwr.data.datasets.filmtrust.fedrecgel_timestamps`; its seed 42
       is hard-coded there, so ``seed`` does not change it).
    5. Each user's latest interaction is the test item (the second latest the validation item when
       ``holdout_validation``). Ties on the latest timestamp are broken by ``tie_rule``: ``"random"`` (a key from
       ``rng([seed, TAG_TIE])`` per (user, item)), ``"fedrecgel"`` / ``"smallest-item"`` (smallest item index
       wins, which is FedRecGEL's ``rank(method="first", ascending=False)`` over rows sorted by (user, item)),
       ``"largest-item"``.
    6. ``num_test_negatives`` distinct never-interacted items per user from ``rng([seed, TAG_TEST_NEG, user])``
       (validation: ``TAG_VAL_NEG``). In ``"fedrecgel"`` the test negatives follow FedRecGEL exactly, with
       Python's ``random.Random(seed)`` (their files: ``seed=42``): for users in ascending order,
       ``cand = set(sample(range(num_items), K + |x|)) - x``, ``negs = sample(list(cand), K)``.

    Args:
        interactions: output of :func:`~fedrec_flwr.data.load_interactions` (or an equivalent frame).

    Returns: the split; ``meta`` records every parameter and the counts of dropped users/items, duplicates
        removed, users whose latest timestamp was tied, density and ``format_version``.

    Raises:
        ConfigError: invalid parameter.
        DataError: no interactions left, missing user attributes, a user who interacted with every item, or too
            few never-interacted items for ``num_test_negatives`` (message names the user and counts).
    """
    import pandas as pd

    check_params(min_user_interactions, tie_rule, seed, num_test_negatives, holdout_validation)
    frame = interactions.frame
    name = interactions.name
    for col in ("user", "item", "rating", "timestamp"):
        if col not in frame.columns:
            raise DataError(f"dataset {name!r}: interactions frame lacks column {col!r}")
    if len(frame) == 0:
        raise DataError(f"dataset {name!r}: no interactions")
    users_raw = frame["user"].to_numpy(dtype=object).astype(str)
    items_raw = frame["item"].to_numpy(dtype=object).astype(str)
    rows = frame["row"].to_numpy(np.int64) if "row" in frame.columns else np.arange(len(frame), dtype=np.int64)
    if pd.DataFrame({"u": users_raw, "i": items_raw}).duplicated().any():
        raise DataError(f"dataset {name!r}: interactions frame has duplicate (user, item) rows; deduplicate first")
    ts, has_ts = _order_keys(name, frame["timestamp"], users_raw, items_raw)
    dup_rows = np.asarray(interactions.duplicate_rows, dtype=np.int64).reshape(-1, 2)

    # Step 4 (before filtering, so the order does not depend on min_user_interactions).
    synthesise = DATASET_SPECS[name].fedrecgel_timestamps if name in DATASET_SPECS else None
    if has_ts:
        timestamp_source = "file"
        held_out_order = "timestamps from the file"
    elif tie_rule == "fedrecgel" and synthesise is not None:
        ts = synthesise(users_raw, rows, dup_rows)
        timestamp_source = "fedrecgel-synthetic (default_rng(42) base * 10**6 + cumcount)"
        held_out_order = "FedRecGEL's synthetic timestamps (the file has none)"
    else:
        ts = np.empty(len(frame), dtype=np.int64)
        ts[np.argsort(rows, kind="stable")] = np.random.default_rng([seed, TAG_ORDER]).permutation(len(frame))
        timestamp_source = "random order (rng([seed, TAG_ORDER]))"
        held_out_order = f"seeded random order (the file has no timestamps; seed {int(seed)})"
        logger.warning(
            "%s: the interactions have no timestamps, so each user's held-out item is chosen by a seeded "
            "random order (seed %d), not as the latest; tie-rule does not apply",
            name,
            int(seed),
        )

    # Step 2: filter users, then items.
    user_counts = pd.Series(users_raw).value_counts()
    keep_users = user_counts.index[user_counts >= min_user_interactions]
    keep = np.isin(users_raw, keep_users.to_numpy(dtype=object).astype(str))
    n_users_before, n_items_before = len(user_counts), len(pd.unique(items_raw))
    users_raw, items_raw, ts, rows = users_raw[keep], items_raw[keep], ts[keep], rows[keep]
    if len(users_raw) == 0:
        raise DataError(
            f"dataset {name!r}: no user has >= {min_user_interactions} interactions "
            f"(largest count {int(user_counts.max())})"
        )

    # Step 3: contiguous indices.
    if tie_rule == "fedrecgel":
        first_row = _first_rows(rows, dup_rows)
        user_ids = _ids_in_order(users_raw, first_row)
        item_ids = _ids_in_order(items_raw, first_row)
    else:
        user_ids, item_ids = sorted_ids(users_raw), sorted_ids(items_raw)
    uidx = pd.Index(user_ids).get_indexer(users_raw).astype(np.int64)
    iidx = pd.Index(item_ids).get_indexer(items_raw).astype(np.int64)
    num_users, num_items = len(user_ids), len(item_ids)

    # Step 5: order within each user by (timestamp, tie key); the last is the test item.
    by_pair = np.lexsort((iidx, uidx))
    if tie_rule == "random":
        tie_key = np.empty(len(uidx), dtype=np.float64)
        tie_key[by_pair] = np.random.default_rng([seed, TAG_TIE]).random(len(uidx))
    elif tie_rule == "largest-item":
        tie_key = iidx.astype(np.float64)
    else:  # smallest-item, fedrecgel
        tie_key = -iidx.astype(np.float64)
    order = np.lexsort((tie_key, ts, uidx))
    counts = np.bincount(uidx, minlength=num_users)
    ends = np.cumsum(counts)
    last = order[ends - 1]
    test_items = iidx[last]
    held_out = [last]
    val_items = None
    if holdout_validation:
        second = order[ends - 2]
        val_items = iidx[second]
        held_out.append(second)
    latest_ts = ts[last]
    users_with_tied_latest = int(np.count_nonzero(np.bincount(uidx[ts == latest_ts[uidx]], minlength=num_users) > 1))
    n_dropped_rows = int(np.count_nonzero(~keep))

    train_mask = np.ones(len(uidx), dtype=bool)
    train_mask[np.concatenate(held_out)] = False
    train_order = by_pair[train_mask[by_pair]]
    train_items = iidx[train_order]
    train_indptr = np.zeros(num_users + 1, dtype=np.int64)
    train_indptr[1:] = np.cumsum(np.bincount(uidx[train_order], minlength=num_users))

    # Step 6: evaluation negatives.
    all_items = iidx[by_pair]
    all_indptr = np.zeros(num_users + 1, dtype=np.int64)
    all_indptr[1:] = ends
    _check_room(name, user_ids, counts, num_items, num_test_negatives)
    if tie_rule == "fedrecgel":
        test_negatives = _fedrecgel_negatives(all_items, all_indptr, num_items, num_test_negatives, seed)
        negatives_source = "fedrecgel (random.Random(seed).sample)"
    else:
        test_negatives = _negatives(all_items, all_indptr, num_items, num_test_negatives, seed, TAG_TEST_NEG)
        negatives_source = "rng([seed, TAG_TEST_NEG, user])"
    val_negatives = (
        _negatives(all_items, all_indptr, num_items, num_test_negatives, seed, TAG_VAL_NEG)
        if holdout_validation
        else None
    )

    attributes = _attributes(interactions, user_ids)
    num_interactions = int(len(uidx))
    meta = {
        "dataset": name,
        "tie_rule": tie_rule,
        "seed": int(seed),
        "min_user_interactions": int(min_user_interactions),
        "num_test_negatives": int(num_test_negatives),
        "holdout_validation": bool(holdout_validation),
        "source_sha256": interactions.source_sha256,
        "num_interactions": num_interactions,
        "dropped_users": int(n_users_before - num_users),
        "dropped_items": int(n_items_before - num_items),
        "duplicates_removed": int(len(dup_rows)),
        "users_with_tied_latest": users_with_tied_latest,
        "density": num_interactions / (num_users * num_items),
        "format_version": FORMAT_VERSION,
        "timestamps": timestamp_source,
        "held_out_order": held_out_order,
        "tie_rule_applied": bool(has_ts or timestamp_source.startswith("fedrecgel")),
        "interactions_in_file": int(len(frame) + len(dup_rows)),
        "interactions_of_dropped_users": n_dropped_rows,
        "test_negatives_procedure": negatives_source,
        "id_order": "first appearance" if tie_rule == "fedrecgel" else "sorted raw id",
        "cache_key": split_cache_key(
            name,
            interactions.source_sha256,
            min_user_interactions=min_user_interactions,
            tie_rule=tie_rule,
            seed=seed,
            num_test_negatives=num_test_negatives,
            holdout_validation=holdout_validation,
        ),
    }
    logger.info(
        "%s: %d users, %d items, %d interactions after cleaning (%d users, %d items dropped); "
        "%d users had a tied latest timestamp (tie_rule=%s)",
        name,
        num_users,
        num_items,
        num_interactions,
        meta["dropped_users"],
        meta["dropped_items"],
        users_with_tied_latest,
        tie_rule,
    )
    return Split(
        dataset=name,
        num_users=num_users,
        num_items=num_items,
        train_indptr=train_indptr,
        train_items=train_items.astype(np.int64),
        test_items=test_items.astype(np.int64),
        test_negatives=test_negatives,
        val_items=None if val_items is None else val_items.astype(np.int64),
        val_negatives=val_negatives,
        user_ids=np.asarray(user_ids, dtype=str),
        item_ids=np.asarray(item_ids, dtype=str),
        attributes=attributes,
        meta=meta,
    )


def _order_keys(name: str, column: pd.Series, users_raw: np.ndarray, items_raw: np.ndarray) -> tuple[np.ndarray, bool]:
    """``((n,) int64 exact order keys, has timestamps)`` of the frame's ``timestamp`` column.

    Integer columns are used as they are (any unit: seconds, nanoseconds, ...). A float column is either all NaN (no
    timestamps) or all finite; its values are replaced by their dense rank, which keeps their order and ties exactly
    as given (a float64 above 2**53 has already lost precision in the caller's frame: read files with
    :func:`~fedrec_flwr.data.load_interactions`, which keeps integers exact). A datetime column (``datetime64``, with or
    without a zone) is ordered by its exact count of its unit since the epoch (zoned values: the instant, in UTC).

    Raises:
        DataError: some rows have a timestamp and others none, or the column is neither numeric nor datetime.
    """
    import pandas as pd

    if pd.api.types.is_datetime64_any_dtype(column.dtype):
        missing = column.isna().to_numpy()
        if missing.all():
            return np.zeros(len(column), dtype=np.int64), False
        if missing.any():
            i = int(np.flatnonzero(missing)[0])
            raise DataError(
                f"dataset {name!r}: timestamp missing for user {str(users_raw[i])!r} "
                f"item {str(items_raw[i])!r} (either every row has a timestamp or none)"
            )
        return column.astype("int64").to_numpy(dtype=np.int64), True
    values = column.to_numpy()
    if values.dtype.kind in "iu":
        return values.astype(np.int64), True
    if values.dtype.kind == "b" or values.dtype.kind not in "f":
        try:
            values = values.astype(np.float64)
        except (TypeError, ValueError):
            raise DataError(f"dataset {name!r}: the timestamp column is not numeric (dtype {column.dtype})") from None
    finite = np.isfinite(values)
    if not finite.any():
        return np.zeros(len(values), dtype=np.int64), False
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise DataError(
            f"dataset {name!r}: timestamp missing for user {str(users_raw[i])!r} "
            f"item {str(items_raw[i])!r} (either every row has a timestamp or none)"
        )
    return np.unique(values, return_inverse=True)[1].astype(np.int64).reshape(-1), True


def complement_items(excluded: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Map ranks ``j`` in ``[0, num_items - len(excluded))`` to the j-th item NOT in ``excluded``.

    ``excluded`` must be sorted and distinct (int64). Exact and loop-free: item = j + #{k : excluded[k] - k <= j}.
    Returns an int64 array shaped like ``ranks``.
    """
    excluded = np.asarray(excluded, dtype=np.int64)
    shifted = excluded - np.arange(len(excluded), dtype=np.int64)
    return (ranks + np.searchsorted(shifted, ranks, side="right")).astype(np.int64)


def sample_train_negatives(split: Split, user: int, round: int, num_per_positive: int, seed: int) -> np.ndarray:
    """Uniform training negatives for ``user`` in federated round ``round``.

    Draws ``n_u * num_per_positive`` items with replacement, uniformly among the items that are NOT training
    positives of ``user`` (the held-out test/validation item may be drawn: the client does not know it, so this
    leaks nothing). Sampling is exact and loop-free: ranks are drawn in the complement and mapped back with
    :func:`complement_items`, so a dense user costs the same as a sparse one.
    The generator is ``np.random.default_rng([seed, TAG_TRAIN_NEG, user, round])``: the result does not depend
    on call order or scheduling.

    Returns: (n_u * num_per_positive,) int64 item indices.

    Raises:
        ConfigError: ``user`` out of range or a negative ``round``/``num_per_positive``/``seed``.
        DataError: the user's training positives cover every item (message names the user).
    """
    if not 0 <= int(user) < split.num_users:
        raise ConfigError(f"user {user} out of range [0, {split.num_users})")
    for key, value in (("round", round), ("num_per_positive", num_per_positive), ("seed", seed)):
        if int(value) < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    positives = split.positives(int(user))
    room = split.num_items - len(positives)
    if room <= 0:
        raise DataError(
            f"dataset {split.dataset!r}: user {user} ({str(split.user_ids[user])!r}) has all "
            f"{split.num_items} items as training positives; no negative exists"
        )
    rng = np.random.default_rng([int(seed), TAG_TRAIN_NEG, int(user), int(round)])
    ranks = rng.integers(0, room, size=len(positives) * int(num_per_positive), dtype=np.int64)
    return complement_items(positives, ranks)


# ------------------------------------------------------------------------------------------------- helpers


def _check_room(name: str, user_ids: np.ndarray, counts: np.ndarray, num_items: int, k: int) -> None:
    full = np.flatnonzero(counts >= num_items)
    if len(full):
        u = int(full[0])
        raise DataError(
            f"dataset {name!r}: user {str(user_ids[u])!r} (index {u}) interacted with every one of the "
            f"{num_items} items, so no negative item exists ({len(full)} such users)"
        )
    short = np.flatnonzero(num_items - counts < k)
    if len(short):
        u = int(short[0])
        raise DataError(
            f"dataset {name!r}: user {str(user_ids[u])!r} (index {u}) has only {num_items - counts[u]} "
            f"never-interacted items ({counts[u]} interacted of {num_items}), fewer than the "
            f"{k} test negatives requested ({len(short)} such users)"
        )


def _negatives(all_items, all_indptr, num_items, k, seed, tag) -> np.ndarray:
    num_users = len(all_indptr) - 1
    out = np.empty((num_users, k), dtype=np.int64)
    for u in range(num_users):
        interacted = all_items[all_indptr[u] : all_indptr[u + 1]]
        rng = np.random.default_rng([int(seed), tag, u])
        ranks = rng.choice(num_items - len(interacted), size=k, replace=False)
        out[u] = complement_items(interacted, ranks)
    return out


def _fedrecgel_negatives(all_items, all_indptr, num_items, k, seed) -> np.ndarray:
    """FedRecGEL's test negatives (data_process.ipynb), with a private ``random.Random(seed)``."""
    rnd = random.Random(int(seed))
    pool = list(range(num_items))  # list(set(0..n-1)) iterates in ascending order in CPython
    num_users = len(all_indptr) - 1
    out = np.empty((num_users, k), dtype=np.int64)
    for u in range(num_users):
        x = set(all_items[all_indptr[u] : all_indptr[u + 1]].tolist())
        candidates = set(rnd.sample(pool, k + len(x))) - x
        out[u] = rnd.sample(list(candidates), k)
    return out


def _first_rows(rows: np.ndarray, dup_rows: np.ndarray) -> np.ndarray:
    """For each kept row, the first file row holding its (user, item) pair (a dropped copy may come first)."""
    import pandas as pd

    first = rows.copy()
    if len(dup_rows):
        pos = pd.Index(rows).get_indexer(dup_rows[:, 1])
        valid = pos >= 0
        np.minimum.at(first, pos[valid], dup_rows[valid, 0])
    return first


def _ids_in_order(ids: np.ndarray, first_row: np.ndarray) -> np.ndarray:
    """Unique ids ordered by first appearance (integer ids: numerically, which FedRecGEL's sort gives)."""
    import pandas as pd

    if pd.Series(ids, dtype=object).str.fullmatch(r"[+-]?\d+").all():
        return sorted_ids(ids)
    firsts = pd.Series(first_row).groupby(ids).min().sort_values(kind="stable")
    return np.asarray(firsts.index.to_numpy(dtype=object), dtype=str)


def _attributes(interactions: Interactions, user_ids: np.ndarray) -> dict[str, np.ndarray]:
    import pandas as pd

    table = interactions.attributes
    if table is None or table.shape[1] == 0:
        return {}
    index = pd.Index(table.index.astype(str))
    pos = index.get_indexer(user_ids)
    if (pos < 0).any():
        missing = user_ids[pos < 0]
        raise DataError(
            f"dataset {interactions.name!r}: user attributes lack {len(missing)} users, e.g. user {str(missing[0])!r}"
        )
    out = {}
    for col in table.columns:
        values = table[col].to_numpy()[pos]
        if values.dtype.kind in "iu":
            out[str(col)] = values.astype(np.int64)
        elif values.dtype.kind == "f":
            out[str(col)] = values.astype(np.float64)
        else:
            out[str(col)] = np.asarray(values, dtype=object).astype(str)
    return out
