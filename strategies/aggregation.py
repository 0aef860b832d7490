"""Aggregation of the item-embedding strategies: example-weighted FedAvg of the dense parameters, the per-row mean
of each item table over the users that touched the row, and the size of one reply's update.

* Dense shared parameters (the score function) are averaged weighted by ``num-examples`` with Flower's own
  ``aggregate_arrayrecords`` (McMahan et al. 2017, FedAvg): replies carry the node's example-weighted mean, so the
  result is exact however users are grouped into nodes (:mod:`fedrec_flwr.wire`).
* Item-embedding rows go through :func:`fedrec_flwr.wire.merge_rows` (``item-aggregation``: ``"touched"`` averages a
  row over the users that updated it, ``"selected"`` over the round's users).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords, aggregate_metricrecords

from fedrec_flwr.arrays import decode_array
from fedrec_flwr.wire import (
    ARRAYS,
    COUNT,
    GRADIENT_USERS,
    ISOLATED_USERS,
    ITEM_AGGREGATIONS,
    METRICS,
    NUM_EXAMPLES,
    ROWS,
    SUM,
    ModelLayout,
    merge_rows,
)

log = logging.getLogger("fedrec_flwr.strategies.item_fedavg")  # the strategy's logger: its lines keep their source


def update_norm(
    content: RecordDict, layout: ModelLayout, current: ArrayRecord, carries_gradient: Callable[[str], bool]
) -> float:
    """L2 norm of a (validated) reply's update against the sent arrays ``current``: the node's example-weighted mean
    of its dense parameters minus the sent ones, and each returned item row's mean over its users (``sum / count``)
    minus the sent row; for a key where ``carries_gradient(key)`` (the reply holds a gradient there), the norm of that
    mean gradient itself. With one user per node this is that user's update; with more, the node's mean."""
    arrays, total = content[ARRAYS], 0.0
    for key in layout.shared_shapes:
        if key in layout.item_keys:
            rows = decode_array(arrays[key + ROWS], copy=False)
            sums = decode_array(arrays[key + SUM], copy=False).astype(np.float64)
            counts = decode_array(arrays[key + COUNT], copy=False).astype(np.float64)
            value = sums / counts.reshape(-1, *[1] * (sums.ndim - 1))
            reference = decode_array(current[key], copy=False)[rows]
        else:
            value = decode_array(arrays[key], copy=False).astype(np.float64)
            reference = decode_array(current[key], copy=False)
        delta = value if carries_gradient(key) else value - reference
        total += float(np.sum(delta**2))
    return math.sqrt(total)


def aggregate_arrays(
    accepted: list[RecordDict], layout: ModelLayout, current: ArrayRecord, item_aggregation: str
) -> ArrayRecord:
    """The new shared arrays from accepted replies: dense keys by example-weighted FedAvg, item tables by
    :func:`fedrec_flwr.wire.merge_rows` over ``current`` (float32, the model's keys)."""
    dense_keys = layout.dense_keys
    dense_records = [
        RecordDict({ARRAYS: ArrayRecord({k: r[ARRAYS][k] for k in dense_keys}), METRICS: r[METRICS]}) for r in accepted
    ]
    dense = aggregate_arrayrecords(dense_records, NUM_EXAMPLES) if dense_keys else ArrayRecord()
    num_users = replied_users(accepted)
    out: dict[str, np.ndarray] = {}
    for key in layout.shared_shapes:
        if key in layout.item_keys:
            out[key], _ = merge_rows(current[key].numpy(), row_updates(accepted, key), item_aggregation, num_users)
        else:
            out[key] = dense[key].numpy().astype(np.float32)
    return ArrayRecord({k: Array(v) for k, v in out.items()})


def row_updates(accepted: list[RecordDict], key: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The ``(rows, sums, counts)`` of item table ``key`` in each accepted reply."""
    return [tuple(decode_array(r[ARRAYS][key + suffix], copy=False) for suffix in (ROWS, SUM, COUNT)) for r in accepted]


def replied_users(accepted: list[RecordDict]) -> float:
    """How many users the accepted replies cover (their ``num-users`` metrics)."""
    return float(sum(float(r[METRICS].get("num-users", 0)) for r in accepted))


def take_isolated(
    server_round: int, replies: list[RecordDict], metrics: MetricRecord, phase: str, counts: dict[str, dict[str, int]]
) -> int:
    """The users the ``replies``' nodes left out for non-finite private state (their ``isolated-users``), taken out
    of the averaged ``metrics`` (a mean of counts means nothing), counted in ``counts[phase][round]`` (``phase``:
    ``"train"`` or ``"evaluate"``) and logged; returns their number."""
    isolated = int(sum(float(r[METRICS].get(ISOLATED_USERS, 0)) for r in replies))
    if ISOLATED_USERS in metrics:
        del metrics[ISOLATED_USERS]
    if isolated:
        counts[phase][str(server_round)] = isolated
        log.warning(
            "round %d: %d user(s) left out of %s for non-finite private state (their nodes' logs name "
            "them; the other users went on)",
            server_round,
            isolated,
            "training" if phase == "train" else "evaluation",
        )
    return isolated


STANDARD_TRAIN_METRICS = frozenset({NUM_EXAMPLES, "num-users", "train-users", "train-loss", GRADIENT_USERS})
"""Train-reply metrics that are not a client's own (the row of :func:`train_metrics` has them under its names)."""


def train_metrics(
    server_round: int, accepted: list[RecordDict], expected: int, seconds: float, isolated: dict[str, dict[str, int]]
) -> tuple[MetricRecord, dict[str, float]]:
    """The aggregated metrics of a round's accepted train replies (example-weighted means; ``train-users`` their
    total) and the round's train row: ``train-loss``, ``train-users``, ``num-replies``, ``num-failures`` (of the
    ``expected`` sampled nodes), ``train-seconds``, ``isolated-users`` when > 0 (counted in ``isolated["train"]``) and
    the clients' own metrics (weighted means over the round's users, as the nodes sent them)."""
    metrics = aggregate_metricrecords(accepted, NUM_EXAMPLES)
    left_out = take_isolated(server_round, accepted, metrics, "train", isolated)
    train_users = replied_users(accepted)
    if "num-users" in metrics:
        del metrics["num-users"]  # a weighted mean of counts means nothing; the total is below
    metrics["train-users"] = train_users
    row = {
        "train-loss": float(metrics.get("train-loss", float("nan"))),
        "train-users": train_users,
        "num-replies": float(len(accepted)),
        "num-failures": float(expected - len(accepted)),
        "train-seconds": seconds,
    }
    if left_out:  # the column appears in metrics.csv from the first round a node left users out
        row[ISOLATED_USERS] = float(left_out)
    row.update(
        {k: float(v) for k, v in metrics.items() if k not in STANDARD_TRAIN_METRICS and isinstance(v, (int, float))}
    )
    return metrics, row


def item_aggregation(value: str, default: str) -> str:
    """The item-table rule ``item-aggregation`` names: ``value``, or ``default`` (the strategy's) for ``"auto"``.

    Raises:
        ValueError: not one of :data:`fedrec_flwr.wire.ITEM_AGGREGATIONS` (after ``"auto"``).
    """
    value = default if value == "auto" else value
    if value not in ITEM_AGGREGATIONS:
        raise ValueError(f"item_aggregation must be one of {ITEM_AGGREGATIONS}, got {value!r}")
    return value
