"""Transport of the unlearning phase: its queries to the nodes (``unlearn_*`` messages, :mod:`fedrec_flwr.app.queries`),
their replies summed, and the bytes and messages they cost.

Each function takes the running phase (``phase``, a :class:`~fedrec_flwr.strategies.unlearning.ClientUnlearning`)
and calls back through its methods, so a phase variant (or a test) can replace one query.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedrec_flwr.errors import reply_error_line
from fedrec_flwr.wire import (
    ARRAYS,
    CONFIG,
    METRICS,
    SUPPORT,
    UNLEARN_AFFECTED,
    UNLEARN_GRADIENT,
    VECTOR,
    ReplyError,
    pack_sparse,
    unpack_sparse,
)

log = logging.getLogger("fedrec_flwr.strategies.unlearning")  # the phase's logger: its lines keep their source


class UnlearningFailed(RuntimeError):
    """A node failed or sent an invalid reply during the unlearning phase (the phase cannot be exact without it)."""


def query(
    phase,
    grid: Grid,
    action: str,
    targets: Mapping[int, Mapping],
    arrays: ArrayRecord,
    *,
    vector: Mapping[str, np.ndarray] | None = None,
    support: np.ndarray | None = None,
) -> list[Message]:
    """Send ``action`` to each node of ``targets`` (node -> its config) and return the replies in canonical order.

    Raises:
        UnlearningFailed: a node failed or did not answer in time.
    """
    if not targets:
        return []
    vector_record = (
        None if vector is None else ArrayRecord({k: Array(v) for k, v in pack_sparse(vector, phase.layout).items()})
    )
    support_record = None if support is None else ArrayRecord({"rows": Array(np.asarray(support, dtype=np.int64))})
    messages = []
    for node, config in targets.items():
        # the run's message context (run name, durable round) and the round whose private state to use
        common = {**getattr(phase.strategy, "message_config", {}), "server-round": phase.server_round}
        content = RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({**common, **dict(config)})})
        if vector_record is not None:
            content[VECTOR] = vector_record
        if support_record is not None:
            content[SUPPORT] = support_record
        messages.append(Message(content=content, message_type=f"{MessageType.QUERY}.{action}", dst_node_id=node))
    phase.messages += len(messages)
    phase.bytes_sent += sum(payload_bytes(m.content) for m in messages)
    replies = list(grid.send_and_receive(messages, timeout=phase.timeout))
    phase.bytes_received += sum(payload_bytes(m.content) for m in replies if not m.has_error())
    failed = [m for m in replies if m.has_error()]
    if failed:
        raise UnlearningFailed(
            f"{action}: node {failed[0].metadata.src_node_id} failed: {reply_error_line(failed[0].error.reason)}"
        )
    if len(replies) != len(messages):
        raise UnlearningFailed(
            f"{action}: {len(replies)} of {len(messages)} nodes answered within {phase.timeout:.0f} s"
        )
    return phase.strategy._canonical_order(replies)


def sum_replies(phase, replies: list[Message]) -> dict[str, np.ndarray]:
    """The nodes' row-sparse vectors (:func:`fedrec_flwr.wire.unpack_sparse`) added up: full float64 arrays by key.

    Raises:
        UnlearningFailed: a node sent an invalid vector.
    """
    total = {k: np.zeros(s, dtype=np.float64) for k, s in phase.layout.shared_shapes.items()}
    for reply in replies:
        try:
            vector = unpack_sparse({k: a.numpy() for k, a in reply.content[ARRAYS].items()}, phase.layout)
        except ReplyError as err:
            raise UnlearningFailed(f"node {reply.metadata.src_node_id} sent an invalid vector: {err}") from err
        for key in total:
            total[key] += vector[key]
    return total


def forget_gradient(phase, grid: Grid, arrays: ArrayRecord, users: np.ndarray) -> tuple[dict, float]:
    """``g = sum_{u in users} ∇L_u`` at ``arrays`` (full float64 arrays by key) and the users' mean loss."""
    groups = phase.strategy._topology().group(np.asarray(users, dtype=np.int64))
    replies = phase._query(grid, UNLEARN_GRADIENT, {n: {"users": us} for n, us in groups.items()}, arrays)
    total = phase._sum(replies)
    loss = sum(float(r.content[METRICS]["loss-sum"]) for r in replies)
    return total, loss / max(len(users), 1)


def affected_users(phase, grid: Grid, arrays: ArrayRecord, support: np.ndarray, forget: np.ndarray) -> dict[int, int]:
    """Node -> how many of its remaining users share an influence-loss row with ``support`` (every node asked)."""
    nodes = sorted({int(n) for n in phase.strategy._topology().user_to_node.tolist()})
    exclude = [int(u) for u in forget]
    replies = phase._query(grid, UNLEARN_AFFECTED, {n: {"exclude": exclude} for n in nodes}, arrays, support=support)
    phase._remaining = {int(r.metadata.src_node_id): int(r.content[CONFIG].get("remaining-users", 0)) for r in replies}
    return {int(r.metadata.src_node_id): int(r.content[CONFIG]["affected-users"]) for r in replies}


def query_targets(phase, nodes, forget: np.ndarray, extra: Mapping | None = None) -> dict[int, dict]:
    """Node -> its query config: the forgotten users to leave out, causal weighting, and ``extra``."""
    return {
        int(n): {"exclude": [int(u) for u in forget], "causal": phase.settings.causal_weighting, **(extra or {})}
        for n in nodes
    }


def step_sums(replies: list[Message], action: str, key: str, steps: int) -> np.ndarray:
    """``(steps,)`` float64: the nodes' per-step sums under metric ``key`` added up.

    Raises:
        UnlearningFailed: a node sent another number of sums than steps asked.
    """
    totals = np.zeros(steps, dtype=np.float64)
    for reply in replies:
        sums = list(reply.content[METRICS].get(key, []))
        if len(sums) != steps:
            raise UnlearningFailed(
                f"{action}: node {reply.metadata.src_node_id} sent {len(sums)} sums for {steps} steps"
            )
        totals += np.asarray(sums, dtype=np.float64)
    return totals


def payload_bytes(content: RecordDict) -> int:
    """Bytes of the arrays a message carries (every query re-sends the model; config records are not counted)."""
    return sum(len(array.data) for record in content.array_records.values() for array in record.values())
