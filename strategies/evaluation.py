"""Federated evaluation of the item-embedding strategies: the mean metrics over the evaluated users, with the
failure accounting of a round's evaluation replies."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedrec_flwr.wire import ISOLATED_USERS, METRICS, NUM_EXAMPLES

from .aggregation import take_isolated
from .replies import attribute_replies, count_evaluation_failure

log = logging.getLogger("fedrec_flwr.strategies.item_fedavg")  # the strategy's logger: its lines keep their source


def evaluation_metrics(
    server_round: int,
    replies: list[Message],
    *,
    sent: Mapping[int, list[int]],
    known: set[int],
    round_timeout: float,
    failures: dict[int, int],
    isolated: dict[str, dict[str, int]],
) -> tuple[MetricRecord | None, dict[str, float]]:
    """Mean metrics over the evaluated users of a round's evaluation ``replies`` (in canonical order), each reply
    weighted by its number of users (``num-examples``).

    A node of ``sent`` (node id -> its users) that answers with an error, or not at all within ``round_timeout``, is
    logged by node id with the users it left out and counted in ``failures``; an error the SuperLink sends for an
    unavailable node is put on a sent-to node that did not answer (``known``: the nodes serving users). Users the
    nodes left out for non-finite private state are counted in ``isolated["evaluate"]``.

    Returns:
        ``(metrics, row)``: the aggregated ``MetricRecord`` (``None`` without a successful reply) and the round's
        evaluation row (``eval-users``; ``eval-failures`` when > 0; ``eval-isolated-users`` when > 0).
    """
    ok: list[RecordDict] = [m.content for m in replies if not m.has_error()]
    answered, missing, unattributed = attribute_replies(replies, sent, known, round_timeout)
    failed = 0
    for message in answered:
        if message.has_error():
            failed += 1
            node = int(message.metadata.src_node_id)
            count_evaluation_failure(failures, sent.get(node, []), server_round, node, message.error.reason)
    for node, reason in missing:
        failed += 1
        count_evaluation_failure(failures, sent.get(node, []), server_round, node, reason)
    for reason in unattributed:  # not matched to a node we sent to (no record of the sent nodes)
        failed += 1
        log.warning("round %d: evaluation failed on a node the SuperLink reports unavailable: %s", server_round, reason)
    if not ok:
        return None, ({"eval-failures": float(failed)} if failed else {})
    metrics = aggregate_metricrecords(ok, NUM_EXAMPLES)
    left_out = take_isolated(server_round, ok, metrics, "evaluate", isolated)
    row = {k: float(v) for k, v in metrics.items()}
    if left_out:
        row[f"eval-{ISOLATED_USERS}"] = float(left_out)
    row["eval-users"] = float(sum(float(r[METRICS][NUM_EXAMPLES]) for r in ok))
    if failed:  # the column appears in metrics.csv from the first evaluation a node failed
        row["eval-failures"] = float(failed)
    return metrics, row


def evaluate_now(strategy, grid: Grid, arrays: ArrayRecord, server_round: int, users=None) -> dict[str, float]:
    """Federated evaluation of ``arrays`` by ``strategy`` (an :class:`~fedrec_flwr.strategies.item_fedavg.
    ItemEmbeddingFedAvg`) now, on ``users`` (default: its evaluation users of ``server_round``); returns the mean
    metrics (``{}`` when the run evaluates no one) and leaves its ``last_evaluate`` as it was."""
    if strategy.fraction_evaluate <= 0 and users is None:
        return {}
    users = strategy.evaluation_users(server_round) if users is None else np.asarray(users, dtype=np.int64)
    config = ConfigRecord({"split": strategy.evaluate_split})
    strategy._evaluated_nodes = strategy._topology().group(users)
    messages = strategy._messages(server_round, arrays, config, strategy._evaluated_nodes, MessageType.EVALUATE)
    saved = strategy.last_evaluate
    try:
        strategy.aggregate_evaluate(server_round, grid.send_and_receive(messages, timeout=strategy.round_timeout))
        return dict(strategy.last_evaluate)
    finally:
        strategy.last_evaluate = saved


def aggregate_evaluation(strategy, server_round: int, replies) -> MetricRecord | None:
    """``strategy.aggregate_evaluate`` of an :class:`~fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg`
    (:func:`evaluation_metrics` over the nodes it sent to): sets its ``last_evaluate`` (left as it was when no node
    answered and none failed) and returns the aggregated metrics. A node that answers with an error, or not at all
    within ``round-timeout``, is logged by node id with the users it left out and counted in its
    ``evaluation_failures`` (``eval-failures`` in the round's metrics when > 0), as training failures are."""
    metrics, row = evaluation_metrics(
        server_round,
        strategy._canonical_order(replies),
        sent=strategy._evaluated_nodes,
        known=set(strategy._topology().user_to_node.tolist()),
        round_timeout=strategy.round_timeout,
        failures=strategy.evaluation_failures,
        isolated=strategy.isolated_users,
    )
    strategy._evaluated_nodes = {}
    if row:
        strategy.last_evaluate = row
    return metrics
