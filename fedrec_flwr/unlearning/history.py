"""A compact per-round store of every user's contribution, for history-based unlearning (rollback).

What is stored, per round ``t`` and user ``u`` (:meth:`ContributionHistory.record`):

* the item rows the user updated, ``(T,)`` int32 (sorted; one row set for all item tables, which a user trains on
  the same items);
* per item table, the row deltas ``(T, d)``: the user's upload minus the global it downloaded, on those rows;
* per dense key (the score function), the user's delta, whole;
* the user's aggregation weight (float64; its example count for parameter uploads).

Deltas are kept in ``dtype``: float32 (default) or float16, or float64 for exact tests. float16 halves the deltas'
bytes at a relative error of at most ``2**-11`` (4.9e-4) per entry for ``6.1e-5 <= |x| <= 65504`` and an absolute
error of at most ``2**-25`` (3.0e-8) below that range (round to nearest, subnormals); a delta outside float16's range
is refused (:meth:`ContributionHistory.record` raises). The errors add up over the rounds a rollback sums.

This is the storage of FRU (Yuan et al., "Federated Unlearning for On-Device Recommendation", WSDM 2023), which keeps
each user's updates to the item rows it touched, and of FedEraser's stored client updates (Liu et al., IWQoS 2021).

**Per user, not per node.** A train reply (:mod:`fedrec_flwr.wire`) carries per node the sum and count of its users'
updated rows and the example-weighted mean of their dense values: with one user per node (``users-per-node = 1``,
the simulation's default) that *is* the user's contribution (:func:`delta_from_reply` reads it); with several users
per node only the node's aggregate arrives, and the per-user contributions this store needs would have to be added
to the reply by the client (the store's API takes them per user either way).

``round_aggregate(t, exclude)`` forms round ``t``'s update without the excluded users exactly as the strategy's
aggregation rule does (:func:`fedrec_flwr.unlearning.aggregate.aggregate_deltas`). ``to_arrays`` / ``from_arrays``
give a flat ``{name: np.ndarray}`` form for server checkpoints: per round a handful of concatenated arrays, not one
array per user.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from fedrec_flwr.unlearning.aggregate import RoundUpdate, UserDelta, aggregate_deltas
from fedrec_flwr.wire import COUNT, ITEM_AGGREGATIONS, ROWS, SUM, Contribution, ModelLayout

__all__ = [
    "CONTRIBUTIONS",
    "DTYPES",
    "ContributionHistory",
    "delta_from_reply",
    "pack_user_contributions",
    "unpack_user_contributions",
]

CONTRIBUTIONS = "user-contributions"
"""Name of the train reply's array record that carries each user's own contribution, added by a node that trains
more than one user when ``unlearning-history`` is on (:func:`pack_user_contributions`)."""

DTYPES = ("float64", "float32", "float16")
"""The storage dtypes of the deltas."""

_USER_OVERHEAD = 8 + 8 + 8
"""Bytes per stored user beside its arrays: its id (int64), weight (float64) and row offset (int64)."""


@dataclass(frozen=True)
class _Stored:
    rows: np.ndarray  # (T,) int32
    items: dict[str, np.ndarray]  # key -> (T, *row) dtype
    dense: dict[str, np.ndarray]  # key -> shape, dtype
    weight: float

    @property
    def nbytes(self) -> int:
        return (
            self.rows.nbytes
            + sum(v.nbytes for v in self.items.values())
            + sum(v.nbytes for v in self.dense.values())
            + _USER_OVERHEAD
        )


class ContributionHistory:
    """Every recorded user's contribution to every recorded round (see the module docstring).

    Args:
        item_shapes: item-table key -> ``(num_items, *row_shape)``.
        dense_shapes: dense key -> shape (empty for FedMF).
        dtype: storage dtype of the deltas (:data:`DTYPES`).
        mode: the strategy's ``item-aggregation`` (``"touched"`` or ``"selected"``).

    Raises:
        ValueError: unknown ``dtype`` or ``mode``, no item table, or a table of 2**31 rows or more (rows are int32).
    """

    def __init__(
        self,
        item_shapes: Mapping[str, tuple[int, ...]],
        dense_shapes: Mapping[str, tuple[int, ...]] | None = None,
        *,
        dtype: str = "float32",
        mode: str = "touched",
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if mode not in ITEM_AGGREGATIONS:
            raise ValueError(f"mode must be one of {ITEM_AGGREGATIONS}, got {mode!r}")
        if not item_shapes:
            raise ValueError("a contribution history needs at least one item table")
        for key, shape in item_shapes.items():
            if shape[0] >= 2**31:
                raise ValueError(f"item table '{key}' has {shape[0]} rows: more than int32 row ids hold")
        self.item_shapes = {k: tuple(int(n) for n in s) for k, s in item_shapes.items()}
        self.dense_shapes = {k: tuple(int(n) for n in s) for k, s in (dense_shapes or {}).items()}
        self.dtype = np.dtype(dtype)
        self.mode = mode
        self._rounds: dict[int, dict[int, _Stored]] = {}

    @classmethod
    def from_layout(cls, layout: ModelLayout, **kwargs) -> ContributionHistory:
        """A store for the shared parameters of ``layout`` (its item tables and dense keys)."""
        return cls(
            {k: layout.shared_shapes[k] for k in layout.item_keys},
            {k: layout.shared_shapes[k] for k in layout.dense_keys},
            **kwargs,
        )

    # ------------------------------------------------------------------------------------------------ record / read
    def record(
        self,
        server_round: int,
        user: int,
        rows: np.ndarray,
        row_delta: Mapping[str, np.ndarray] | np.ndarray,
        dense_delta: Mapping[str, np.ndarray] | None = None,
        weight: float = 1.0,
    ) -> None:
        """Store user ``user``'s contribution to round ``server_round``.

        Args:
            server_round: the round (an int; rounds need not be contiguous).
            user: the user (partition id).
            rows: ``(T,)`` unique item rows the user updated (any order; stored sorted).
            row_delta: item key -> ``(T, *row_shape)`` upload minus downloaded global on ``rows`` (in ``rows``'
                order), or one array when the model has one item table.
            dense_delta: dense key -> upload minus downloaded global (every dense key; ``None`` when there is none).
            weight: the user's aggregation weight (> 0).

        Raises:
            ValueError: the user is already recorded in that round, a shape or key does not match, rows are out of
                range or repeated, the weight is not positive, or a value is not finite in the storage dtype.
        """
        server_round, user = int(server_round), int(user)
        if user in self._rounds.get(server_round, {}):
            raise ValueError(f"user {user} is already recorded in round {server_round}")
        if not isinstance(row_delta, Mapping):
            if len(self.item_shapes) != 1:
                raise ValueError(f"row_delta must name its tables: this model has {sorted(self.item_shapes)}")
            row_delta = {next(iter(self.item_shapes)): row_delta}
        if set(row_delta) != set(self.item_shapes):
            raise ValueError(
                f"row_delta keys {sorted(row_delta)} do not match the item tables {sorted(self.item_shapes)}"
            )
        dense_delta = dict(dense_delta or {})
        if set(dense_delta) != set(self.dense_shapes):
            raise ValueError(f"dense_delta keys {sorted(dense_delta)} do not match {sorted(self.dense_shapes)}")
        rows = np.asarray(rows)
        for key, values in row_delta.items():
            if np.shape(values)[:1] != rows.shape:
                raise ValueError(f"delta of '{key}' has shape {np.shape(values)}, expected {rows.size} rows")
        order = np.argsort(rows, kind="stable")
        delta = UserDelta(
            rows=rows[order].astype(np.int64),
            items={k: np.asarray(v)[order] for k, v in row_delta.items()},
            dense=dense_delta,
            weight=float(weight),
        )
        aggregate_deltas([delta], self.item_shapes, self.dense_shapes, self.mode)  # validates shapes, rows, weight
        stored = _Stored(
            rows=delta.rows.astype(np.int32),
            items={k: self._cast(k, delta.items[k]) for k in self.item_shapes},
            dense={k: self._cast(k, delta.dense[k]) for k in self.dense_shapes},
            weight=float(weight),
        )
        self._rounds.setdefault(server_round, {})[user] = stored

    def _cast(self, key: str, values: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # an overflow is reported below
            out = np.array(values, dtype=self.dtype)
        if not np.isfinite(out).all():
            raise ValueError(f"the delta of '{key}' is not finite in {self.dtype} (NaN, Inf or out of its range)")
        return out

    def rounds(self) -> list[int]:
        """The recorded rounds, ascending."""
        return sorted(self._rounds)

    def users(self, server_round: int) -> np.ndarray:
        """``(n,)`` int64 sorted users recorded in ``server_round`` (empty for an unrecorded round)."""
        return np.array(sorted(self._rounds.get(int(server_round), {})), dtype=np.int64)

    def contribution(self, server_round: int, user: int) -> UserDelta:
        """The stored contribution of ``user`` to ``server_round`` (float64 copies; raises ``KeyError`` if absent)."""
        stored = self._rounds[int(server_round)][int(user)]
        return UserDelta(
            rows=stored.rows.astype(np.int64),
            items={k: v.astype(np.float64) for k, v in stored.items.items()},
            dense={k: v.astype(np.float64) for k, v in stored.dense.items()},
            weight=stored.weight,
        )

    def contributions(self, server_round: int, exclude: Iterable[int] = ()) -> dict[int, UserDelta]:
        """User -> stored contribution to ``server_round``, ascending by user, without the ``exclude`` users."""
        excluded = {int(u) for u in exclude}
        return {int(u): self.contribution(server_round, int(u)) for u in self.users(server_round) if u not in excluded}

    def round_aggregate(self, server_round: int, exclude: Iterable[int] = ()) -> RoundUpdate:
        """Round ``server_round``'s aggregate update without the ``exclude`` users, by the strategy's rule
        (:func:`~fedrec_flwr.unlearning.aggregate.aggregate_deltas`, users in ascending order)."""
        deltas = list(self.contributions(server_round, exclude).values())
        return aggregate_deltas(deltas, self.item_shapes, self.dense_shapes, self.mode)

    # ------------------------------------------------------------------------------------------------ storage cost
    def nbytes(self) -> int:
        """Bytes of the checkpoint form (:meth:`to_arrays`): every stored array, metadata included."""
        return int(sum(v.nbytes for v in self.to_arrays().values()))

    def nbytes_per_round(self) -> dict[int, int]:
        """Round -> bytes of its stored contributions (users' arrays, ids, weights and row offsets)."""
        return {t: int(sum(s.nbytes for s in users.values())) + 8 for t, users in sorted(self._rounds.items())}

    def drop_users(self, users: Iterable[int]) -> int:
        """Delete every stored contribution of ``users`` (a forgotten user's updates are not kept after its
        rollback); rounds left without users are removed. Returns the number of contributions deleted."""
        users = {int(u) for u in users}
        deleted = 0
        for t in list(self._rounds):
            for user in users & set(self._rounds[t]):
                del self._rounds[t][user]
                deleted += 1
            if not self._rounds[t]:
                del self._rounds[t]
        return deleted

    def nbytes_per_user(self) -> dict[int, int]:
        """User -> bytes of its stored contributions over all rounds."""
        out: dict[int, int] = {}
        for users in self._rounds.values():
            for user, stored in users.items():
                out[user] = out.get(user, 0) + stored.nbytes
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------------------------------------ checkpoints
    def to_arrays(self, prefix: str = "history/") -> dict[str, np.ndarray]:
        """The store as a flat ``{name: array}`` dict (for a server checkpoint's arrays).

        Names: ``<prefix>mode`` (int8: index in ``ITEM_AGGREGATIONS``), ``<prefix>rounds`` (int64),
        ``<prefix>item-shape/<key>`` and ``<prefix>dense-shape/<key>`` (int64), and per round ``t``:
        ``<prefix><t>/users`` ``(n,)`` int64, ``<prefix><t>/weights`` ``(n,)`` float64, ``<prefix><t>/offsets``
        ``(n+1,)`` int64 (user ``k``'s rows are ``rows[offsets[k]:offsets[k+1]]``), ``<prefix><t>/rows``
        ``(sum T,)`` int32, ``<prefix><t>/item/<key>`` ``(sum T, *row)`` and ``<prefix><t>/dense/<key>``
        ``(n, *shape)`` in the storage dtype (a ``(0, ...)`` array in that dtype when no dense key exists).
        """
        out: dict[str, np.ndarray] = {
            f"{prefix}mode": np.array([ITEM_AGGREGATIONS.index(self.mode)], dtype=np.int8),
            f"{prefix}rounds": np.array(self.rounds(), dtype=np.int64),
            f"{prefix}dtype": np.zeros(0, dtype=self.dtype),
        }
        for key, shape in self.item_shapes.items():
            out[f"{prefix}item-shape/{key}"] = np.array(shape, dtype=np.int64)
        for key, shape in self.dense_shapes.items():
            out[f"{prefix}dense-shape/{key}"] = np.array(shape, dtype=np.int64)
        for t in self.rounds():
            users = self.users(t)
            stored = [self._rounds[t][int(u)] for u in users]
            lengths = np.array([len(s.rows) for s in stored], dtype=np.int64)
            out[f"{prefix}{t}/users"] = users
            out[f"{prefix}{t}/weights"] = np.array([s.weight for s in stored], dtype=np.float64)
            out[f"{prefix}{t}/offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            out[f"{prefix}{t}/rows"] = np.concatenate([s.rows for s in stored]).astype(np.int32)
            for key, shape in self.item_shapes.items():
                out[f"{prefix}{t}/item/{key}"] = np.concatenate([s.items[key] for s in stored]).reshape(-1, *shape[1:])
            for key, shape in self.dense_shapes.items():
                out[f"{prefix}{t}/dense/{key}"] = np.stack([s.dense[key] for s in stored]).reshape(-1, *shape)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], prefix: str = "history/") -> ContributionHistory:
        """Inverse of :meth:`to_arrays` (names outside ``prefix`` are ignored).

        Raises:
            KeyError: a name the format needs is missing.
            ValueError: the arrays disagree with each other (offsets, lengths).
        """
        mode = ITEM_AGGREGATIONS[int(np.asarray(arrays[f"{prefix}mode"])[0])]
        dtype = np.asarray(arrays[f"{prefix}dtype"]).dtype.name
        item_shapes, dense_shapes = {}, {}
        for name, value in arrays.items():
            if name.startswith(f"{prefix}item-shape/"):
                item_shapes[name[len(f"{prefix}item-shape/") :]] = tuple(int(n) for n in value)
            elif name.startswith(f"{prefix}dense-shape/"):
                dense_shapes[name[len(f"{prefix}dense-shape/") :]] = tuple(int(n) for n in value)
        history = cls(item_shapes, dense_shapes, dtype=dtype, mode=mode)
        for t in np.asarray(arrays[f"{prefix}rounds"]).tolist():
            users = np.asarray(arrays[f"{prefix}{t}/users"])
            weights = np.asarray(arrays[f"{prefix}{t}/weights"])
            offsets = np.asarray(arrays[f"{prefix}{t}/offsets"])
            rows = np.asarray(arrays[f"{prefix}{t}/rows"])
            if len(offsets) != len(users) + 1 or len(weights) != len(users) or offsets[-1] != len(rows):
                raise ValueError(f"round {t}: users, weights, offsets and rows of the history disagree")
            items = {k: np.asarray(arrays[f"{prefix}{t}/item/{k}"]) for k in item_shapes}
            dense = {k: np.asarray(arrays[f"{prefix}{t}/dense/{k}"]) for k in dense_shapes}
            history._rounds[int(t)] = {
                int(u): _Stored(
                    rows=rows[offsets[i] : offsets[i + 1]].astype(np.int32),
                    items={k: v[offsets[i] : offsets[i + 1]].astype(history.dtype) for k, v in items.items()},
                    dense={k: v[i].astype(history.dtype) for k, v in dense.items()},
                    weight=float(weights[i]),
                )
                for i, u in enumerate(users.tolist())
            }
        return history


def delta_from_reply(
    arrays: Mapping[str, np.ndarray],
    current: Mapping[str, np.ndarray],
    layout: ModelLayout,
    num_users: int,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One user's ``(rows, row_delta, dense_delta)`` read off a train reply of a node that trained that user alone.

    The reply (:mod:`fedrec_flwr.wire`) carries ``<key>#rows`` / ``#sum`` / ``#count`` per item table and each dense
    key's value; with one user, ``sum`` is the user's upload on ``rows`` and the dense values are its upload, so the
    deltas are those minus the ``current`` global the node was sent (computed in float64).

    Raises:
        ValueError: ``num_users`` (the reply's ``num-users`` metric) is not 1: a node's aggregate does not give its
            users' contributions; a row count is not 1; or the item tables' row sets differ.
    """
    if int(num_users) != 1:
        raise ValueError(
            f"the reply aggregates {num_users} users: per-user contributions need one user per node "
            "(or the client must add them to its reply)"
        )
    rows = None
    row_delta: dict[str, np.ndarray] = {}
    for key in layout.item_keys:
        key_rows = np.asarray(arrays[key + ROWS], dtype=np.int64)
        if rows is not None and not np.array_equal(rows, key_rows):
            raise ValueError(f"item tables of one user touch different rows ('{key}')")
        rows = key_rows
        if not np.all(np.asarray(arrays[key + COUNT]) == 1):
            raise ValueError(f"'{key}{COUNT}' is not 1 on every row: the reply holds more than one user")
        values = np.asarray(arrays[key + SUM], dtype=np.float64)
        row_delta[key] = values - np.asarray(current[key], dtype=np.float64)[key_rows]
    dense_delta = {
        k: np.asarray(arrays[k], dtype=np.float64) - np.asarray(current[k], dtype=np.float64) for k in layout.dense_keys
    }
    assert rows is not None
    return rows, row_delta, dense_delta


def pack_user_contributions(
    layout: ModelLayout, updates: Iterable[tuple[int, Mapping[str, np.ndarray], Mapping, float]]
) -> dict[str, np.ndarray]:
    """The :data:`CONTRIBUTIONS` record's arrays of a node's users: per user ``u`` its own one-user reply arrays
    (:meth:`fedrec_flwr.wire.Contribution.pack`) under ``u<u>:<name>`` and its weight as ``u<u>:weight`` ``(1,)``
    float64.

    Args:
        layout: the model's keys.
        updates: ``(user, dense, rows, weight)`` per user, as :meth:`fedrec_flwr.wire.Contribution.add_user` takes
            them (``weight``: the user's aggregation weight).

    Raises:
        ReplyError: as :meth:`fedrec_flwr.wire.Contribution.add_user`.
    """
    out: dict[str, np.ndarray] = {}
    for user, dense, rows, weight in updates:
        single = Contribution(layout)
        single.add_user(dense, rows, weight, 0.0)
        out.update({f"u{int(user)}:{name}": value for name, value in single.pack().items()})
        out[f"u{int(user)}:weight"] = np.array([float(weight)], dtype=np.float64)
    return out


def unpack_user_contributions(arrays: Mapping[str, np.ndarray]) -> dict[int, tuple[dict[str, np.ndarray], float]]:
    """Inverse of :func:`pack_user_contributions`: user -> (its one-user reply arrays, its weight), ascending.

    Raises:
        ValueError: a name that is not ``u<int>:<name>``, or a user without its weight.
    """
    users: dict[int, dict[str, np.ndarray]] = {}
    for name, value in arrays.items():
        head, sep, rest = name.partition(":")
        if not sep or not head.startswith("u") or not head[1:].isdigit():
            raise ValueError(f"'{CONTRIBUTIONS}' holds an unexpected array '{name}'")
        users.setdefault(int(head[1:]), {})[rest] = np.asarray(value)
    out = {}
    for user in sorted(users):
        parts = users[user]
        if "weight" not in parts:
            raise ValueError(f"'{CONTRIBUTIONS}' has no weight for user {user}")
        weight = float(parts.pop("weight")[0])
        out[user] = (parts, weight)
    return out
