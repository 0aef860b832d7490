"""What travels between ServerApp and ClientApp: the named-array key scheme, and the exact sum-and-count algebra.

Key scheme (one ``ArrayRecord`` under the key ``"arrays"`` in every message; arrays travel by name, never by position):

* **Server -> client** (train and evaluate): one array per shared parameter, keyed by the model's shared-state key,
  e.g. ``"item_embedding_gmf.weight"`` ``(num_items, d)``, ``"mlp.0.weight"``, ``"output.bias"``. Never a private key.
* **Client -> server** (train reply), for a node that trained users ``S`` this round:

  - dense shared parameters (the score function), key ``"<key>"``: the node's example-weighted mean
    ``sum_u n_u * theta_u / sum_u n_u``, with ``n = sum_u n_u`` sent as the ``"num-examples"`` metric. Flower's own
    :func:`flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords` over such replies therefore gives exactly the
    example-weighted mean over all users, however users are grouped into nodes (up to float32 rounding: a different
    grouping adds the same terms in another order).
  - item-embedding tables (row-sparse), three arrays per table ``"<key>"``:
    ``"<key>#rows"`` ``(T,)`` int64, the sorted item rows that at least one user of the node updated;
    ``"<key>#sum"`` ``(T, d)`` float32, the sum over those users of their updated row values;
    ``"<key>#count"`` ``(T,)`` float32, how many of the node's users updated each row.
    Sums and counts add across nodes, so the server's per-row mean ``sum / count`` is the same for any grouping (up
    to float32 rounding of the sums' order).

Values are updated parameters by default. A strategy that puts ``"upload" = "gradient"`` in the train config (e.g.
:class:`fedrec_flwr.strategies.server_optimizer.ServerOptimizerStrategy`) receives gradients of the shared parameters in the same
scheme instead. The weight ``n_u`` of a user is its example count for parameter uploads and 1 for gradient uploads
(``UserUpdate.aggregation_weight``); ``"num-examples"`` is the node's total weight and ``"num-users"`` its number of
trained users.

Private parameters (user embeddings) never appear in a reply; :func:`check_reply_keys` makes a reply that carries one
fail loudly with :class:`PrivacyViolation`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

# ------------------------------------------------------------------------------------------ message names
IDENTIFY = "identify"
"""Action of the ``query`` message by which the server learns which users each node serves."""

UNLEARN_GRADIENT = "unlearn_gradient"
"""Query: the summed influence-loss gradient of the named (forgotten) users at the sent shared parameters."""
UNLEARN_AFFECTED = "unlearn_affected"
"""Query: how many of the node's remaining users share a loss row with the sent support rows (node totals)."""
UNLEARN_HVP = "unlearn_hvp"
"""Query: the summed Hessian-vector product of the node's remaining users' losses with the sent direction."""
UNLEARN_LOCAL_CG = "unlearn_local_cg"
"""Query: the weighted sum of the node's remaining users' local CG solutions for the sent right-hand side."""
UNLEARN_LOSS = "unlearn_loss"
"""Query: the summed influence loss of the node's remaining users at points ``theta + a_k d`` along the sent direction
(one scalar sum per step; HF-KCU's line search)."""
UNLEARN_DIAGONAL = "unlearn_diagonal"
"""Query: the summed Gauss-Newton diagonal of the node's remaining users' losses (HF-KCU's preconditioner)."""
UNLEARN_COUNTS = "unlearn_counts"
"""Query: the node's training positives per item over its remaining and over its forgotten users (two count vectors;
HF-KCU's membership-margin step, :mod:`fedrec_flwr.unlearning.margin`)."""
UNLEARN_MARGIN = "unlearn_margin"
"""Query: the summed membership margins of the node's forgotten users at points ``theta + a_k d`` (one sum per step)."""
ADVERSARY_GRADIENT = "adversary_gradient"
"""Query (FedAU², ``adversary-server-steps`` > 1): the mean gradient of ``h_w`` over the named users at the sent
``h_w`` and their current private embeddings (:func:`adversary_gradient_query`)."""
SECURE_AGGREGATION = "secagg"
"""Query (``secure-aggregation = "secagg+"``): one SecAgg+ stage over the node's kept ``h_w`` vector
(:mod:`fedrec_flwr.privacy.secagg_records`, :mod:`fedrec_flwr.adversary.secure`)."""
VECTOR = "vector"
"""Content key of the row-sparse vector (direction, right-hand side) an unlearning query carries."""
SUPPORT = "support"
"""Content key of the support rows (``"rows"``, int64) of an ``unlearn_affected`` query."""


ARRAYS = "arrays"
"""Record key of the single ``ArrayRecord`` of every message."""
CONFIG = "config"
"""Record key of the ``ConfigRecord`` of server messages."""
METRICS = "metrics"
"""Record key of the ``MetricRecord`` of client replies."""
NUM_EXAMPLES = "num-examples"
"""Metric key of the example count used as aggregation weight (Flower's default ``weighted_by_key``)."""

GRADIENT_USERS = "gradient-users"
"""Metric key: how many of the reply's users uploaded gradients (the rest uploaded parameters); a strategy that
asked for gradients rejects a reply whose users did not all send them."""

ISOLATED_USERS = "isolated-users"
"""Metric key: how many of the requested users the node left out for non-finite private state
(:func:`fedrec_flwr.app.client_app.isolate_nonfinite_users`); present only when some were."""

ROWS, SUM, COUNT = "#rows", "#sum", "#count"
"""Suffixes of the three arrays that carry one item table's sparse update."""


class ReplyError(ValueError):
    """A client reply is malformed (unknown key, wrong shape, non-finite value, zero weight); it is rejected."""


class PrivacyViolation(RuntimeError):
    """A client reply carries a private parameter (a user embedding). The round fails."""


# ------------------------------------------------------------------------------------------ one user's result
@dataclass
class UserUpdate:
    """One user's train result, by name.

    Attributes:
        dense: dense shared key -> updated value (the score function).
        rows: item-table key -> ``(rows (T,) int64, values (T, d) float32)``: the rows this user updated.
        num_examples: examples trained on this round (positives + sampled negatives).
        loss: mean training loss.
        weight: the user's weight in the server's average of dense values (default: ``num_examples``, FedAvg's
            example weighting; a gradient-upload client uses 1, so that every user counts once).
        metrics: extra scalar metrics for the reply: key -> number (numpy scalars are converted); each key is sent as
            its mean over the node's users weighted by their aggregation weight, and ends up in ``metrics.csv`` as
            the weighted mean over the round's trained users (:class:`fedrec_flwr.app.client_app.UserMetrics`).
    """

    dense: dict[str, np.ndarray]
    rows: dict[str, tuple[np.ndarray, np.ndarray]]
    num_examples: int
    loss: float
    weight: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    is_gradient: bool = False
    """True when ``dense`` / ``rows`` hold gradients of the shared parameters rather than updated values."""

    @property
    def aggregation_weight(self) -> float:
        """``weight`` if set, else ``num_examples``."""
        return float(self.num_examples if self.weight is None else self.weight)


@dataclass(frozen=True)
class ModelLayout:
    """Which parameter keys exist, and which are item tables, dense shared or private.

    Attributes:
        shared_shapes: shared key -> shape, in the model's order (item tables and score function).
        item_keys: the shared keys that are item-embedding tables (row-sparse on the wire).
        private_keys: keys of private parameters (user embeddings); they must never leave a client.
    """

    shared_shapes: Mapping[str, tuple[int, ...]]
    item_keys: tuple[str, ...]
    private_keys: tuple[str, ...]

    @property
    def dense_keys(self) -> tuple[str, ...]:
        """Shared keys that are not item tables (the score function)."""
        return tuple(k for k in self.shared_shapes if k not in self.item_keys)

    def reply_keys(self) -> set[str]:
        """Every key a valid train reply carries."""
        keys = set(self.dense_keys)
        for key in self.item_keys:
            keys.update({key + ROWS, key + SUM, key + COUNT})
        return keys

    @classmethod
    def from_model(cls, model) -> ModelLayout:
        """Read the layout off a :class:`fedrec_flwr.models.RecModel`."""
        shared = model.shared_state()
        item_keys = []
        for name, module in model.item_embedding_modules().items():
            for pname, _ in module.named_parameters():
                item_keys.append(f"{name}.{pname}")
        return cls(
            shared_shapes={k: tuple(v.shape) for k, v in shared.items()},
            item_keys=tuple(item_keys),
            private_keys=tuple(model.private_state().keys()),
        )


@dataclass(frozen=True)
class Topology:
    """Which node serves each user: ``user_to_node[u]`` is the node id of user ``u``'s SuperNode."""

    user_to_node: np.ndarray
    fingerprint: str = ""
    """The dataset fingerprint the nodes reported (a node that joins later must report the same)."""

    @property
    def num_users(self) -> int:
        return len(self.user_to_node)

    def group(self, users: Iterable[int]) -> dict[int, list[int]]:
        """Node id -> the given users it serves, in ascending user order."""
        out: dict[int, list[int]] = {}
        for user in sorted(int(u) for u in users):
            out.setdefault(int(self.user_to_node[user]), []).append(user)
        return out


@dataclass
class Contribution:
    """One node's train contribution: the sum-and-count form of the reply, before packing.

    ``dense_sum[k]`` is ``sum_u n_u * theta_u[k]``; ``row_updates[k]`` keeps each user's ``(row ids (T_u,), values
    (T_u, d) float64)`` of item table ``k`` in the order they were added, summed over the touched rows only when the
    reply is packed (:meth:`pack`): a node whose users touch a few hundred of the table's rows never builds the full
    ``(num_items, d)`` table (about 1 ms per one-user message before; the float64 sums are added in the same order, so
    the packed reply is bit for bit the one a full table gives).
    """

    layout: ModelLayout
    num_examples: float = 0.0
    num_users: int = 0
    loss_sum: float = 0.0
    dense_sum: dict[str, np.ndarray] = field(default_factory=dict)
    row_updates: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)

    def add_user(
        self,
        dense: Mapping[str, np.ndarray],
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
        num_examples: int,
        loss: float,
    ) -> None:
        """Add one user's update (its values are copied: the caller may reuse its arrays).

        Args:
            dense: dense key -> the user's updated value (shape as in the layout).
            rows: item key -> ``(row_ids (T,) int unique, values (T, d))``: the rows this user updated.
            num_examples: the user's example count ``n_u`` (> 0): the weight of its dense update.
            loss: the user's mean training loss (averaged over users with weight ``n_u``).

        Raises:
            ReplyError: ``num_examples`` <= 0, repeated row ids, row ids outside the table, or values whose shape does
                not match the ids and the table's row width.
        """
        if num_examples <= 0:
            raise ReplyError(f"a user's num_examples must be > 0, got {num_examples}")
        for key in self.layout.dense_keys:
            value = np.asarray(dense[key], dtype=np.float64) * num_examples
            self.dense_sum[key] = self.dense_sum[key] + value if key in self.dense_sum else value
        for key in self.layout.item_keys:
            ids, values = rows[key]
            shape = self.layout.shared_shapes[key]
            ids = np.asarray(ids)
            # strictly increasing rows (what the clients send: np.union1d's output) are unique without a sort
            if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()) and len(np.unique(ids)) != len(ids):
                raise ReplyError(f"rows of '{key}' must be unique")
            if len(ids) and (ids.min() < 0 or ids.max() >= shape[0]):
                raise ReplyError(f"rows of '{key}' must be in [0, {shape[0]})")
            values = np.array(values, dtype=np.float64)  # a copy; float32 -> float64 is exact
            if values.shape != (len(ids), *shape[1:]):
                raise ReplyError(f"values of '{key}' have shape {values.shape}, expected {(len(ids), *shape[1:])}")
            self.row_updates.setdefault(key, []).append((ids.astype(np.int64, copy=False), values))
        self.num_examples += num_examples
        self.num_users += 1
        self.loss_sum += loss * num_examples

    def pack(self) -> dict[str, np.ndarray]:
        """The reply's arrays under the documented key scheme (float32 values, int64 rows): per item table the sorted
        rows some user touched, the float64 sum of the users' values there (added user by user, in order) and the
        number of users per row, each cast to float32."""
        if self.num_users == 0:
            raise ReplyError("no user contributed: nothing to pack")
        out: dict[str, np.ndarray] = {}
        for key in self.layout.dense_keys:
            out[key] = (self.dense_sum[key] / self.num_examples).astype(np.float32)
        for key in self.layout.item_keys:
            updates = self.row_updates[key]
            touched = np.unique(np.concatenate([ids for ids, _ in updates])).astype(np.int64)
            sums = np.zeros((len(touched), *self.layout.shared_shapes[key][1:]), dtype=np.float64)
            counts = np.zeros(len(touched), dtype=np.float64)
            for ids, values in updates:
                where = np.searchsorted(touched, ids)
                sums[where] += values
                counts[where] += 1.0
            out[key + ROWS] = touched
            out[key + SUM] = sums.astype(np.float32)
            out[key + COUNT] = counts.astype(np.float32)
        return out

    @property
    def mean_loss(self) -> float:
        """Example-weighted mean training loss over the node's users."""
        return self.loss_sum / self.num_examples if self.num_examples else float("nan")


def check_reply_keys(arrays: Mapping[str, np.ndarray], layout: ModelLayout) -> None:
    """Validate one train reply's arrays against the key scheme.

    Raises:
        PrivacyViolation: a key names a private parameter (a user embedding), bare or with any suffix.
        ReplyError: a key is missing or unknown, a shape or dtype is wrong, or a value is NaN or Inf.
    """
    private = set(layout.private_keys)
    for key in arrays:
        if key.split("#", 1)[0] in private:
            raise PrivacyViolation(f"a client reply carries the private parameter '{key}' (a user embedding)")
    expected = layout.reply_keys()
    missing, unknown = expected - set(arrays), set(arrays) - expected
    if missing or unknown:
        raise ReplyError(f"reply keys do not match the scheme: missing {sorted(missing)}, unknown {sorted(unknown)}")
    for key in layout.dense_keys:
        if tuple(arrays[key].shape) != tuple(layout.shared_shapes[key]):
            raise ReplyError(f"'{key}' has shape {arrays[key].shape}, expected {layout.shared_shapes[key]}")
    for key in layout.item_keys:
        num_rows, dim = layout.shared_shapes[key][0], layout.shared_shapes[key][1:]
        rows, sums, counts = arrays[key + ROWS], arrays[key + SUM], arrays[key + COUNT]
        if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
            raise ReplyError(f"'{key}{ROWS}' must be a 1-d integer array, got {rows.dtype} {rows.shape}")
        if tuple(sums.shape) != (len(rows), *dim) or tuple(counts.shape) != (len(rows),):
            raise ReplyError(
                f"'{key}' sparse arrays disagree: rows {rows.shape}, sum {sums.shape}, count {counts.shape}"
            )
        if len(rows):
            # strictly increasing rows (what our nodes send) are unique, and their first and last are the extremes
            increasing = len(rows) == 1 or bool((rows[1:] > rows[:-1]).all())
            low, high = (rows[0], rows[-1]) if increasing else (rows.min(), rows.max())
            if low < 0 or high >= num_rows or (not increasing and len(np.unique(rows)) != len(rows)):
                raise ReplyError(f"'{key}{ROWS}' must be unique row ids in [0, {num_rows})")
        if len(counts) and counts.min() <= 0:
            raise ReplyError(f"'{key}{COUNT}' has a zero or negative row weight")
    for key, value in arrays.items():
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise ReplyError(f"'{key}' contains NaN or Inf")


ITEM_AGGREGATIONS = ("touched", "selected")
"""How an item row is averaged: over the users that updated it, or over every user that took part in the round."""


def merge_rows(
    current: np.ndarray,
    updates: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]],
    mode: str = "touched",
    num_users: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise average of item-table values (updated parameters, or gradients with ``current`` = zeros).

    * ``"touched"``: ``new[i] = sum_c sum_c[i] / sum_c count_c[i]`` for rows some user updated; ``new[i] =
      current[i]`` otherwise (per-row FedAvg, e.g. FedNCF).
    * ``"selected"``: every one of the round's ``m = num_users`` users counts in every row, a user that did not
      touch row ``i`` contributing ``current[i]``: ``new[i] = current[i] + (sum[i] - count[i] * current[i]) / m``.
      This is the plain average of the users' full tables (PFedRec's and FedRecGEL's public code), which shrinks
      rare items' updates by the fraction of users that touched them.

    Args:
        current: ``(num_items, d)`` the table before the round.
        updates: per reply ``(rows (T,), sums (T, d), counts (T,))``.
        mode: ``"touched"`` or ``"selected"``.
        num_users: ``m``, the number of users whose replies are merged (needed by ``"selected"``; >= every count).

    Returns:
        ``(new_table (num_items, d) float32, count (num_items,) float64)``: the count is the number of users that
        updated each row this round.

    Raises:
        ValueError: unknown mode, or ``"selected"`` without a valid ``num_users``.
    """
    if mode not in ITEM_AGGREGATIONS:
        raise ValueError(f"item aggregation must be one of {ITEM_AGGREGATIONS}, got {mode!r}")
    total = np.zeros(current.shape, dtype=np.float64)
    count = np.zeros(current.shape[0], dtype=np.float64)
    for rows, sums, counts in updates:
        total[rows] += sums
        count[rows] += counts
    new = current.astype(np.float32, copy=True)
    touched = count > 0
    shape = (-1, *([1] * (current.ndim - 1)))
    if mode == "touched":
        new[touched] = (total[touched] / count[touched].reshape(shape)).astype(np.float32)
    else:
        if num_users is None or not num_users > 0 or (touched.any() and count.max() > num_users):
            raise ValueError(f"'selected' aggregation needs num_users >= every row count, got {num_users!r}")
        base = current[touched].astype(np.float64)
        new[touched] = (base + (total[touched] - count[touched].reshape(shape) * base) / num_users).astype(np.float32)
    return new, count


def sample_users(seed: int, server_round: int, num_users: int, fraction: float, tag: int = 0) -> np.ndarray:
    """The users (partition ids) that take part in one round, fixed by ``(seed, round, tag)``.

    The same seed samples the same users every run, whatever the number of nodes or Ray workers.

    Args:
        seed: the run's seed.
        server_round: 1-based round.
        num_users: population size ``U``.
        fraction: in (0, 1]; ``max(1, round(fraction * U))`` users are drawn without replacement.
        tag: separates independent streams (0 = train, 1 = evaluate).

    Returns:
        ``(m,)`` int64 sorted user indices.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    size = max(1, int(round(fraction * num_users)))
    if size >= num_users:
        return np.arange(num_users, dtype=np.int64)
    rng = np.random.default_rng([seed, 0x5A3B, tag, server_round])
    return np.sort(rng.choice(num_users, size=size, replace=False)).astype(np.int64)


# ---------------------------------------------------------------------------------------------- unlearning vectors
def nonzero_rows(table: np.ndarray) -> np.ndarray:
    """``(T,)`` int64 sorted indices of the rows of ``table`` (``(n, ...)``) with any non-zero entry."""
    table = np.asarray(table)
    return np.flatnonzero(np.any(table.reshape(table.shape[0], -1) != 0, axis=1)).astype(np.int64)


def support_rows(vector: Mapping[str, np.ndarray], layout: ModelLayout) -> np.ndarray:
    """Sorted item rows where any item table of ``vector`` (full arrays by shared key) is non-zero."""
    rows = [nonzero_rows(vector[k]) for k in layout.item_keys if k in vector]
    return np.unique(np.concatenate(rows)).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)


def pack_sparse(vector: Mapping[str, np.ndarray], layout: ModelLayout) -> dict[str, np.ndarray]:
    """A vector over the shared parameters (e.g. a gradient, a CG direction or a Hessian-vector product; full arrays
    by shared key) in the row-sparse form the unlearning messages carry.

    Dense keys travel whole, as ``"<key>"``; each item table ``"<key>"`` as ``"<key>#rows"`` ``(T,)`` int64 (the rows
    with a non-zero entry, sorted) and ``"<key>#sum"`` ``(T, d)`` float32 (their values). Missing keys count as zero.
    """
    out: dict[str, np.ndarray] = {}
    for key, shape in layout.shared_shapes.items():
        value = np.asarray(vector[key]) if key in vector else None
        if key in layout.item_keys:
            rows = nonzero_rows(value) if value is not None else np.zeros(0, dtype=np.int64)
            out[key + ROWS] = rows
            out[key + SUM] = (value[rows] if value is not None else np.zeros((0, *shape[1:]))).astype(np.float32)
        else:
            out[key] = (value if value is not None else np.zeros(shape)).astype(np.float32)
    return out


def unpack_sparse(arrays: Mapping[str, np.ndarray], layout: ModelLayout) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_sparse`: full float64 arrays by shared key.

    Raises:
        PrivacyViolation: a key names a private parameter.
        ReplyError: a key is missing or unknown, a shape is wrong, a row id is out of range or repeated, or a value
            is NaN or Inf.
    """
    private = set(layout.private_keys)
    for key in arrays:
        if key.split("#", 1)[0] in private:
            raise PrivacyViolation(f"an unlearning message carries the private parameter '{key}' (a user embedding)")
    expected = {k for k in layout.dense_keys} | {k + s for k in layout.item_keys for s in (ROWS, SUM)}
    missing, unknown = expected - set(arrays), set(arrays) - expected
    if missing or unknown:
        raise ReplyError(
            f"sparse vector keys do not match the scheme: missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    out: dict[str, np.ndarray] = {}
    for key, shape in layout.shared_shapes.items():
        if key in layout.item_keys:
            rows, values = np.asarray(arrays[key + ROWS]), np.asarray(arrays[key + SUM])
            if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
                raise ReplyError(f"'{key}{ROWS}' must be a 1-d integer array, got {rows.dtype} {rows.shape}")
            if tuple(values.shape) != (rows.size, *shape[1:]):
                raise ReplyError(f"'{key}{SUM}' has shape {values.shape}, expected {(rows.size, *shape[1:])}")
            if rows.size and (rows.min() < 0 or rows.max() >= shape[0] or np.unique(rows).size != rows.size):
                raise ReplyError(f"'{key}{ROWS}' must be unique row ids in [0, {shape[0]})")
            full = np.zeros(shape, dtype=np.float64)
            full[rows.astype(np.int64)] = values
        else:
            full = np.asarray(arrays[key], dtype=np.float64)
            if tuple(full.shape) != tuple(shape):
                raise ReplyError(f"'{key}' has shape {full.shape}, expected {tuple(shape)}")
        if not np.isfinite(full).all():
            raise ReplyError(f"'{key}' contains NaN or Inf")
        out[key] = full
    return out


class SparseSum:
    """A node's sum of per-user vectors over the shared parameters (gradients, Hessian-vector products, local CG
    solutions), packed with :func:`pack_sparse` for the reply.

    Args:
        layout: the model's keys.
    """

    def __init__(self, layout: ModelLayout) -> None:
        self.layout = layout
        self.total = {k: np.zeros(s, dtype=np.float64) for k, s in layout.shared_shapes.items()}
        self.count = 0

    def add(
        self, dense: Mapping[str, np.ndarray], rows: Mapping[str, tuple[np.ndarray, np.ndarray]], weight: float = 1.0
    ) -> None:
        """Add ``weight`` times one user's vector (dense key -> array; item key -> ``(row ids, values)``)."""
        for key in self.layout.dense_keys:
            self.total[key] += weight * np.asarray(dense[key], dtype=np.float64)
        for key in self.layout.item_keys:
            ids, values = rows[key]
            np.add.at(self.total[key], np.asarray(ids, dtype=np.int64), weight * np.asarray(values, np.float64))
        self.count += 1

    def pack(self) -> dict[str, np.ndarray]:
        """The sum in the row-sparse message form."""
        return pack_sparse(self.total, self.layout)
