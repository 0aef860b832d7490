"""One training round of an item-embedding strategy after its replies arrive: attribute and check the replies, require
``min-train-fraction`` of the sampled nodes, aggregate, store each user's contribution (``unlearning-history``), step
the attribute adversary, collect the round's metrics and run the unlearning phase when it is due."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from flwr.app import ArrayRecord, Message, MetricRecord

from .aggregation import train_metrics
from .replies import attribute_replies, sort_train_replies


class RoundFailed(RuntimeError):
    """Too few valid replies arrived for a round to count."""


def enough_replies(
    server_round: int, accepted: int, expected: int, min_train_fraction: float, answered: int, reasons: list[str]
) -> None:
    """Require ``accepted`` replies of at least ``max(1, ceil(min_train_fraction * expected))`` (``expected``: the
    round's sampled nodes; ``answered``: how many nodes answered; ``reasons``: the failed or rejected ones').

    Raises:
        RoundFailed: naming the counts and the first problem.
    """
    needed = max(1, math.ceil(min_train_fraction * expected))
    if accepted < needed:
        raise RoundFailed(
            f"round {server_round}: {accepted} valid replies of {expected} sampled nodes "
            f"(min-train-fraction {min_train_fraction} needs {needed}); "
            f"{answered} nodes answered, {len(reasons)} failed or were rejected"
            + (f"; first problem: {reasons[0]}" if reasons else "")
        )


def aggregate_round(
    strategy, server_round: int, replies: Iterable[Message]
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """``strategy.aggregate_train`` of an :class:`~fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg`: its
    hooks (``validate_reply``, ``aggregate_arrays``, ``adopt_arrays``, ``run_unlearning``) do the work, in this order.

    Raises:
        PrivacyViolation: a reply carries a private parameter.
        RoundFailed: fewer accepted replies than ``min-train-fraction`` of the sampled nodes.
    """
    sent = strategy._sampled_nodes
    answered, missing, _ = attribute_replies(strategy._canonical_order(replies), sent, set(), strategy.round_timeout)
    accepted, accepted_nodes, reasons = sort_train_replies(
        server_round, answered, missing, strategy.validate_reply, strategy._count_failure
    )
    expected = len(sent)
    nodes = len({int(m.metadata.src_node_id) for m in answered})
    enough_replies(server_round, len(accepted), expected, strategy.min_train_fraction, nodes, reasons)
    strategy._record_trained(accepted_nodes)
    arrays = strategy.aggregate_arrays(accepted)
    if strategy.contribution_log is not None:  # unlearning-history: each user's own update
        strategy.contribution_log.record(server_round, strategy._current, accepted, accepted_nodes, sent)
    step = strategy.adversary_step
    if step is not None:  # h_w's keys carry gradients: its server steps (strategies/adversary.py)
        arrays = step.round_steps(strategy, server_round, arrays, accepted, accepted_nodes)
        strategy.adopt_arrays(arrays)
    seconds = time.perf_counter() - strategy._train_started
    metrics, strategy.last_train = train_metrics(server_round, accepted, expected, seconds, strategy.isolated_users)
    if strategy.contribution_log is not None:  # the round's stored bytes (metrics.csv)
        strategy.last_train["history-round-bytes"] = float(
            strategy.contribution_log.history.nbytes_per_round().get(server_round, 0)
        )
    if strategy._phase_due(server_round):
        arrays = strategy.run_unlearning(server_round, arrays)
    return arrays, metrics
