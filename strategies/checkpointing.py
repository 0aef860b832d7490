"""The item-embedding strategy's own state in server checkpoints (:mod:`fedrec_flwr.state.checkpoint`): failure
counts per node, users no longer trained, the unlearning report, isolated users, the trained-users mask, the server
step of the attribute adversary and the users' stored contributions (``unlearning-history``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord

from fedrec_flwr.state.checkpoint import TRAINED_KEY

log = logging.getLogger("fedrec_flwr.strategies.item_fedavg")  # the strategy's logger: its lines keep their source

ADVERSARY_PREFIX = "adversary-step/"
"""Prefix of the adversary server step's arrays among the checkpoint's strategy arrays."""


def strategy_state(strategy) -> tuple[dict, dict[str, np.ndarray]]:
    """``(JSON-able facts, arrays)`` of an :class:`~fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg`'s state."""
    state = {
        "failures": {str(k): v for k, v in strategy.failures.items()},
        "evaluation-failures": {str(k): v for k, v in strategy.evaluation_failures.items()},
        "removed-users": sorted(int(u) for u in strategy.removed_users),
        "unlearning-report": strategy.unlearning_report,
        "isolated-users": strategy.isolated_users,
    }
    step = strategy.adversary_step
    arrays = {} if step is None else {f"{ADVERSARY_PREFIX}{k}": v for k, v in step.state_arrays().items()}
    if strategy.trained is not None:
        arrays[TRAINED_KEY] = strategy.trained.copy()
    if strategy.contribution_log is not None:  # unlearning-history (.history_recording)
        arrays.update(strategy.contribution_log.state_arrays())
    return state, arrays


def restore_strategy_state(strategy, state: Mapping, arrays: Mapping[str, np.ndarray], shared: ArrayRecord) -> None:
    """Inverse of :func:`strategy_state` on ``strategy``; ``shared`` holds the checkpoint's shared parameters (given
    to the adversary step). Failure counts of node ids not connected now are kept under those ids (logged)."""
    strategy.failures = {int(k): int(v) for k, v in state.get("failures", {}).items()}
    strategy.evaluation_failures = {int(k): int(v) for k, v in state.get("evaluation-failures", {}).items()}
    if strategy.topology is not None:
        current = {int(n) for n in np.unique(strategy.topology.user_to_node)}
        gone = sorted((set(strategy.failures) | set(strategy.evaluation_failures)) - current)
        if gone:
            log.warning(
                "resumed failure counts name node ids %s that are not connected now (a restarted "
                "SuperNode gets a new id): their counts stay under the old ids, and the new nodes' "
                "counts start at 0",
                gone,
            )
    strategy.removed_users = frozenset(int(u) for u in state.get("removed-users", []))
    strategy.unlearning_report = state.get("unlearning-report")
    strategy.isolated_users = {
        phase: {str(k): int(v) for k, v in state.get("isolated-users", {}).get(phase, {}).items()}
        for phase in ("train", "evaluate")
    }
    strategy.trained = np.asarray(arrays[TRAINED_KEY], dtype=bool).copy() if TRAINED_KEY in arrays else None
    if strategy.contribution_log is not None:
        strategy.contribution_log.load_state_arrays(arrays)
    if strategy.adversary_step is not None:
        strategy.adversary_step.load_state_arrays(
            shared,
            {k[len(ADVERSARY_PREFIX) :]: v for k, v in arrays.items() if k.startswith(ADVERSARY_PREFIX)},
        )
