"""Which users a round trains and evaluates: seeded draws by ``(seed, round)`` (:func:`fedrec_flwr.wire.sample_users`),
less the users the run no longer trains or scores.

Users, not nodes, are sampled, so the same seed trains the same users whatever the number of nodes, ``users-per-node``
or Ray workers. The functions return ``(m,)`` int64 user indices, sorted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from fedrec_flwr.unlearning.settings import PHASE_METHODS
from fedrec_flwr.wire import sample_users

TRAIN_TAG = 0
"""Seed tag of the stream that draws each round's trained users."""

EVALUATE_TAG = 1
"""Seed tag of the stream that draws each round's evaluated users."""


def without(users: np.ndarray, excluded: Iterable[int]) -> np.ndarray:
    """``users`` (``(m,)`` int64) less ``excluded`` (any iterable of user indices; nothing removed when empty)."""
    excluded = np.fromiter((int(u) for u in excluded), dtype=np.int64)
    return users[~np.isin(users, excluded)] if excluded.size else users


def train_users(seed: int, server_round: int, num_users: int, fraction: float, removed: Iterable[int]) -> np.ndarray:
    """The users trained in ``server_round``: ``fraction`` of ``num_users`` drawn from ``(seed, round)``, less
    ``removed`` (so a run without some users trains every other user in exactly the same rounds)."""
    return without(sample_users(seed, server_round, num_users, fraction, tag=TRAIN_TAG), removed)


def removed_from_start(unlearning) -> frozenset[int]:
    """The users never trained: the forget set of a ``retrain`` run (``unlearning``: an
    :class:`fedrec_flwr.strategies.unlearning.UnlearningSettings` or ``None``), else none."""
    return frozenset(unlearning.forget if unlearning is not None and unlearning.method == "retrain" else ())


def evaluation_users(seed: int, server_round: int, num_users: int, fraction: float, unlearning) -> np.ndarray:
    """The users evaluated in ``server_round``: the seeded draw, less the forget set of ``unlearning`` (an
    :class:`fedrec_flwr.strategies.unlearning.UnlearningSettings` or ``None``) when one is configured, so every
    method is scored on the same remaining users."""
    users = sample_users(seed, server_round, num_users, fraction, tag=EVALUATE_TAG)
    return without(users, unlearning.forget) if unlearning is not None and unlearning.forget else users


def planned_train_rounds(num_rounds: int, unlearning) -> list[int]:
    """Every round whose train replies the strategy aggregates as the run is configured: ``1 .. num_rounds``, and
    with ``unlearning = "continue"`` its phase's ``continue-rounds`` rounds, numbered after the last (``rollback``:
    its ``rollback-tuning-rounds``, numbered after its calibration rounds, :func:`calibration_rounds`)."""
    rounds = list(range(1, num_rounds + 1))
    if unlearning is not None and unlearning.method == "continue":
        rounds += range(num_rounds + 1, num_rounds + unlearning.continue_rounds + 1)
    if unlearning is not None and unlearning.method == "rollback" and unlearning.rollback_tuning_rounds:
        first = num_rounds + calibration_rounds(unlearning.round, unlearning.rollback_calibration_every) + 1
        rounds += range(first, first + unlearning.rollback_tuning_rounds)
    return rounds


def calibration_rounds(stored_rounds: int, every: int) -> int:
    """How many of ``stored_rounds`` stored rounds FedEraser's calibration trains at: every ``every``-th, the first
    included (``ceil(stored_rounds / every)``; 0 when ``every`` is 0). The tuning rounds are numbered after the run's
    last round plus this count for ``stored_rounds = unlearn-round`` (every round before the phase is stored)."""
    return math.ceil(int(stored_rounds) / int(every)) if every else 0


def forgotten_after_phase(unlearning, server_round: int) -> bool:
    """Whether ``server_round`` trains without the forget set because an unlearning phase (``continue``, ``hfkcu``,
    ``gradient-ascent``) ran after an earlier round (``unlearn-round``) and removed it."""
    u = unlearning
    return u is not None and u.method in PHASE_METHODS and bool(u.forget) and server_round > u.round


def is_evaluation_round(
    server_round: int, fraction_evaluate: float, eval_every: int, num_rounds: int, unlearning
) -> bool:
    """Evaluate every ``eval-every`` rounds, after the last round and in the round of an unlearning phase."""
    phase = unlearning is not None and unlearning.method != "none" and server_round == unlearning.round
    return fraction_evaluate > 0 and (server_round % eval_every == 0 or server_round == num_rounds or phase)


def planned_train_users(users: np.ndarray, unlearning, server_round: int) -> np.ndarray:
    """A round's sampled ``users`` less the forget set when an earlier unlearning phase removed it
    (:func:`forgotten_after_phase`)."""
    return without(users, unlearning.forget) if forgotten_after_phase(unlearning, server_round) else users
