"""The baselines of client unlearning that run a phase (``unlearning``): ``gradient-ascent`` on the forgotten users'
mean loss and ``continue`` (more training rounds without them; ``rollback``'s tuning rounds are the same rounds). ``retrain`` runs no phase: the forgotten users are
never sampled (:mod:`fedrec_flwr.strategies.sampling`).

Each function takes the running phase (``phase``, a :class:`~fedrec_flwr.strategies.unlearning.ClientUnlearning`).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp import Grid

from .unlearning_transport import payload_bytes


def gradient_ascent(phase, grid: Grid, theta: dict, g_forget: dict) -> dict:
    """``ascent-steps`` steps ``theta += ascent-learning-rate * g_F(theta) / |F|`` from ``theta`` (``g_forget`` is
    ``g_F`` there; later steps query it again); returns the total step (float64 arrays by key)."""
    s = phase.settings
    current = {k: v.copy() for k, v in theta.items()}
    gradient = g_forget
    for step in range(s.ascent_steps):
        if step:
            record = ArrayRecord({k: Array(v.astype(np.float32)) for k, v in current.items()})
            gradient, _ = phase.gradient(grid, record, np.asarray(s.forget, dtype=np.int64))
        for key in current:
            current[key] += s.ascent_learning_rate * gradient[key] / max(len(s.forget), 1)
    return {k: current[k] - theta[k] for k in theta}


def continue_training(
    phase, grid: Grid, arrays: ArrayRecord, rounds: int | None = None, after: int | None = None
) -> ArrayRecord:
    """``rounds`` (default ``continue-rounds``) training rounds of the strategy without the forgotten users, numbered
    from ``after + 1`` (default: the run's last round, so they never repeat a training round's sample)."""
    strategy = phase.strategy
    rounds = phase.settings.continue_rounds if rounds is None else int(rounds)
    after = strategy.num_rounds if after is None else int(after)
    saved = (strategy.removed_users, strategy.last_train)
    strategy.removed_users = frozenset(strategy.removed_users) | set(phase.settings.forget)
    try:
        for step in range(1, rounds + 1):
            server_round = after + step
            messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
            phase.messages += len(messages)
            phase.bytes_sent += sum(payload_bytes(m.content) for m in messages)
            replies = list(grid.send_and_receive(messages, timeout=phase.timeout))
            phase.bytes_received += sum(payload_bytes(m.content) for m in replies if not m.has_error())
            new, _ = strategy.aggregate_train(server_round, replies)
            if new is not None:
                arrays = new
    finally:
        strategy.removed_users, strategy.last_train = saved
    return arrays
