"""Reply checks of the item-embedding strategies: what a train reply must hold before it touches the model, which
node each reply (or missing reply) belongs to, and the failure accounting of a round."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping

from flwr.app import Message, RecordDict

from fedrec_flwr.arrays import decode_record
from fedrec_flwr.errors import reply_error_line
from fedrec_flwr.wire import ARRAYS, METRICS, NUM_EXAMPLES, ModelLayout, ReplyError, check_reply_keys

log = logging.getLogger("fedrec_flwr.strategies.item_fedavg")  # the strategy's logger: its lines keep their source


def check_reply(
    content: RecordDict, layout: ModelLayout, max_update_norm: float, update_norm: Callable[[RecordDict], float]
) -> RecordDict:
    """Check one train reply's content against ``layout``; returns it.

    The reply must hold the ``arrays`` and ``metrics`` records, the key scheme of :func:`fedrec_flwr.wire.
    check_reply_keys` (no private parameter, known keys, shapes, finite values), a positive finite ``num-examples``
    and a finite ``train-loss``; with ``max_update_norm`` > 0 its ``update_norm(content)`` must not exceed it.

    Raises:
        ReplyError: naming what is wrong.
        PrivacyViolation: the reply carries a private parameter.
    """
    if ARRAYS not in content.array_records or METRICS not in content.metric_records:
        raise ReplyError(f"reply must hold '{ARRAYS}' and '{METRICS}' records, got {list(content.keys())}")
    arrays = decode_record(content[ARRAYS], copy=False)
    check_reply_keys(arrays, layout)
    weight = content[METRICS].get(NUM_EXAMPLES, 0)
    if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ReplyError(f"'{NUM_EXAMPLES}' must be a positive number, got {weight!r}")
    loss = content[METRICS].get("train-loss", 0.0)
    if not math.isfinite(float(loss)):
        raise ReplyError(f"'train-loss' is not finite: {loss!r}")
    if max_update_norm > 0:
        norm = update_norm(content)
        if not norm <= max_update_norm:
            raise ReplyError(f"update norm {norm:.4g} exceeds max-update-norm {max_update_norm:g}")
    return content


def attribute_replies(
    replies: Iterable[Message], sent: Mapping[int, list[int]], known: set[int], round_timeout: float
) -> tuple[list[Message], list[tuple[int, str]], list[str]]:
    """Match a round's replies to the nodes they were sent to (``sent``: node id -> its users).

    An error reply from a node neither in ``sent`` nor in ``known`` is the SuperLink answering for a node that stopped
    sending heartbeats (its source is the SuperLink itself): its reason is given, in order, to a node of ``sent``
    that did not answer; such a node without one failed by ``round-timeout``.

    Returns:
        ``(answered, missing, unattributed)``: the replies of nodes (errors included) in the given order; ``(node,
        reason)`` for each node of ``sent`` that did not answer, by node id; the SuperLink's reasons left over.
    """
    answered: list[Message] = []
    unattributed: list[str] = []
    for message in replies:
        node = int(message.metadata.src_node_id)
        if message.has_error() and node not in known and node not in sent:
            unattributed.append(message.error.reason)
            continue
        answered.append(message)
    nodes = {int(m.metadata.src_node_id) for m in answered}
    missing = []
    for node in sorted(set(sent) - nodes):
        reason = unattributed.pop(0) if unattributed else f"no reply within round-timeout ({round_timeout:g} s)"
        missing.append((node, reason))
    return answered, missing, unattributed


def count_failure(failures: dict[int, int], server_round: int, node: int, reason: str, reasons: list[str]) -> None:
    """Count a failed training reply of ``node`` in ``failures``, log it (the whole reason at debug level, its first
    line as a warning) and add a line to ``reasons``."""
    failures[node] = failures.get(node, 0) + 1
    log.debug("round %d: node %d failed, whole reason: %s", server_round, node, reason)
    reason = reply_error_line(reason)
    log.warning("round %d: node %d failed: %s", server_round, node, reason)
    reasons.append(f"node {node} failed: {reason}")


def count_evaluation_failure(
    failures: dict[int, int], users: list[int], server_round: int, node: int, reason: str
) -> None:
    """Count a failed evaluation reply of ``node`` (which was to evaluate ``users``) in ``failures`` and log it."""
    failures[node] = failures.get(node, 0) + 1
    left_out = f" ({len(users)} users not evaluated: {users[0]}..{users[-1]})" if users else ""
    log.debug("round %d: evaluation failed on node %d, whole reason: %s", server_round, node, reason)
    log.warning("round %d: evaluation failed on node %d%s: %s", server_round, node, left_out, reply_error_line(reason))


def sort_train_replies(
    server_round: int,
    answered: list[Message],
    missing: list[tuple[int, str]],
    validate: Callable[[RecordDict], RecordDict],
    on_failure: Callable[[int, int, str, list[str]], None],
) -> tuple[list[RecordDict], list[int], list[str]]:
    """Split a round's attributed train replies (:func:`attribute_replies`) into accepted and failed ones.

    An error reply and a node that did not answer (``missing``) go to ``on_failure(round, node, reason, reasons)``; a
    reply that ``validate`` rejects with :class:`~fedrec_flwr.wire.ReplyError` is logged; a privacy violation
    propagates.

    Returns:
        ``(accepted contents, their node ids, reasons)``: ``reasons`` has one line per failed or rejected node.
    """
    accepted: list[RecordDict] = []
    accepted_nodes: list[int] = []
    reasons: list[str] = []
    for message in answered:
        node = int(message.metadata.src_node_id)
        if message.has_error():
            on_failure(server_round, node, message.error.reason, reasons)
            continue
        try:
            accepted.append(validate(message.content))
            accepted_nodes.append(node)
        except ReplyError as err:
            log.warning("round %d: rejected the reply of node %d: %s", server_round, node, err)
            reasons.append(f"node {node}'s reply rejected: {err}")
    for node, reason in missing:
        on_failure(server_round, node, reason, reasons)
    return accepted, accepted_nodes, reasons


def max_update_norm(value: float) -> float:
    """The bound ``max-update-norm`` on a reply's :func:`~fedrec_flwr.strategies.aggregation.update_norm` (0: none).

    Raises:
        ValueError: ``value`` is negative or NaN.
    """
    if not value >= 0:
        raise ValueError(f"max_update_norm must be >= 0, got {value!r}")
    return float(value)
