"""One round's aggregation rule in update form, as a pure float64 function over per-user contributions.

The item-aware strategy (``strategies/item_fedavg.py``) forms a round's new shared parameters from the nodes' replies:

* each item-table row ``i`` is averaged over the users that updated it (``item-aggregation = "touched"``, the
  default): ``theta'[i] = sum_{u in S_i} theta_u[i] / |S_i|``, rows nobody touched keep their value; or over all the
  round's ``m`` users, an untouched user counting with ``theta[i]`` (``"selected"``, PFedRec's server):
  ``theta'[i] = theta[i] + sum_{u in S_i} (theta_u[i] - theta[i]) / m`` (:func:`fedrec_flwr.wire.merge_rows`);
* each dense (score-function) key is the example-weighted mean ``sum_u n_u theta_u / sum_u n_u`` (FedAvg, McMahan et
  al. 2017; Flower's ``aggregate_arrayrecords``).

Written with the user's delta ``d_u = theta_u - theta`` (upload minus the downloaded global), both rules are linear in
the deltas and need no ``theta``:

    Delta[i] = sum_{u in S_i} d_u[i] / c_i,   c_i = |S_i| ("touched") or m ("selected"),
    Delta_dense = sum_u n_u d_u / sum_u n_u,

so ``theta' = theta + Delta`` in exact arithmetic. :func:`aggregate_deltas` computes ``Delta`` for any subset of a
round's users (the history store's ``round_aggregate`` and the rollback call it with the forgotten users left out).
The strategy sums float32 uploads where this sums float64 deltas, so the two agree to float32 rounding, not bit for
bit (``tests/test_unlearning_history.py`` compares them on replies the strategy aggregates).

A strategy that steps a server optimizer with the mean gradient (Adam) is not linear in the uploads: its history
would store gradients, and replaying them needs the optimizer's state; this module covers the parameter-averaging
strategies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedrec_flwr.wire import ITEM_AGGREGATIONS

__all__ = ["RoundUpdate", "UserDelta", "aggregate_deltas", "apply_update"]


@dataclass(frozen=True)
class UserDelta:
    """One user's contribution to one round, in update form.

    Attributes:
        rows: ``(T,)`` int64 sorted unique item rows the user updated (shared by every item table: a user trains the
            same items in each of them).
        items: item-table key -> ``(T, *row_shape)`` the user's upload minus the downloaded global on ``rows``.
        dense: dense key -> the user's upload minus the downloaded global (the score function; empty for FedMF).
        weight: the user's weight ``n_u`` (> 0) in the dense mean (its example count for parameter uploads).
    """

    rows: np.ndarray
    items: Mapping[str, np.ndarray]
    dense: Mapping[str, np.ndarray] = field(default_factory=dict)
    weight: float = 1.0


@dataclass(frozen=True)
class RoundUpdate:
    """The aggregate update ``Delta`` of one round (float64), row-sparse on the item tables.

    Attributes:
        rows: ``(R,)`` int64 sorted rows some included user touched.
        items: item key -> ``(R, *row_shape)`` ``Delta`` on ``rows`` (zero elsewhere).
        count: ``(R,)`` float64 number of included users that touched each row.
        dense: dense key -> ``Delta`` (zeros when no user is included).
        num_users: the number of users aggregated.
    """

    rows: np.ndarray
    items: dict[str, np.ndarray]
    count: np.ndarray
    dense: dict[str, np.ndarray]
    num_users: int


def aggregate_deltas(
    deltas: Sequence[UserDelta],
    item_shapes: Mapping[str, tuple[int, ...]],
    dense_shapes: Mapping[str, tuple[int, ...]],
    mode: str = "touched",
) -> RoundUpdate:
    """The round's aggregate update from its users' deltas (module docstring: ``Delta`` for ``mode``).

    Users are added in the order given (float64 sums: the same order gives the same bits). ``"selected"`` divides by
    ``m = len(deltas)``, the users aggregated. No user: a zero update (the round leaves the model as it was).

    Args:
        deltas: the users to aggregate.
        item_shapes: item key -> table shape ``(num_items, *row_shape)``.
        dense_shapes: dense key -> shape.
        mode: ``"touched"`` or ``"selected"`` (:data:`fedrec_flwr.wire.ITEM_AGGREGATIONS`).

    Raises:
        ValueError: unknown ``mode``, a non-positive weight, rows out of range or not unique, or a delta whose shape
            does not match its rows and table.
    """
    if mode not in ITEM_AGGREGATIONS:
        raise ValueError(f"item aggregation must be one of {ITEM_AGGREGATIONS}, got {mode!r}")
    for delta in deltas:
        _check_delta(delta, item_shapes, dense_shapes)
    rows = (
        np.unique(np.concatenate([np.asarray(d.rows, dtype=np.int64) for d in deltas]))
        if deltas
        else np.zeros(0, dtype=np.int64)
    )
    count = np.zeros(len(rows), dtype=np.float64)
    sums = {k: np.zeros((len(rows), *s[1:]), dtype=np.float64) for k, s in item_shapes.items()}
    where_by_user = [np.searchsorted(rows, np.asarray(d.rows, dtype=np.int64)) for d in deltas]
    for delta, where in zip(deltas, where_by_user, strict=True):
        count[where] += 1.0
        for key in item_shapes:
            sums[key][where] += np.asarray(delta.items[key], dtype=np.float64)
    divisor = count if mode == "touched" else np.full(len(rows), float(max(len(deltas), 1)))
    items = {k: v / divisor.reshape(-1, *[1] * (v.ndim - 1)) for k, v in sums.items()}
    dense = {k: np.zeros(s, dtype=np.float64) for k, s in dense_shapes.items()}
    total_weight = float(sum(float(d.weight) for d in deltas))
    for delta in deltas:
        for key in dense_shapes:
            dense[key] += float(delta.weight) * np.asarray(delta.dense[key], dtype=np.float64)
    if total_weight > 0:
        dense = {k: v / total_weight for k, v in dense.items()}
    return RoundUpdate(rows=rows, items=items, count=count, dense=dense, num_users=len(deltas))


def apply_update(theta: Mapping[str, np.ndarray], update: RoundUpdate) -> dict[str, np.ndarray]:
    """``theta + Delta`` as new float64 arrays by shared key (``theta``'s keys; item rows outside ``update.rows`` and
    keys the update does not name are copied unchanged)."""
    out = {k: np.array(v, dtype=np.float64) for k, v in theta.items()}
    for key, values in update.items.items():
        out[key][update.rows] += values
    for key, values in update.dense.items():
        out[key] += values
    return out


def _check_delta(
    delta: UserDelta, item_shapes: Mapping[str, tuple[int, ...]], dense_shapes: Mapping[str, tuple[int, ...]]
) -> None:
    if not float(delta.weight) > 0:
        raise ValueError(f"a user's weight must be > 0, got {delta.weight!r}")
    rows = np.asarray(delta.rows)
    if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
        raise ValueError(f"rows must be a 1-d integer array, got {rows.dtype} {rows.shape}")
    for key, shape in item_shapes.items():
        if rows.size and (rows.min() < 0 or rows.max() >= shape[0]):
            raise ValueError(f"rows of '{key}' must be in [0, {shape[0]})")
        values = np.asarray(delta.items[key])
        if values.shape != (rows.size, *shape[1:]):
            raise ValueError(f"delta of '{key}' has shape {values.shape}, expected {(rows.size, *shape[1:])}")
    if rows.size > 1 and not bool((rows[1:] > rows[:-1]).all()):
        raise ValueError("rows must be sorted and unique")
    for key, shape in dense_shapes.items():
        if np.shape(delta.dense[key]) != tuple(shape):
            raise ValueError(f"delta of '{key}' has shape {np.shape(delta.dense[key])}, expected {tuple(shape)}")
