"""History-based client unlearning: replay the stored rounds without the forgotten users, with or without
FedEraser's calibration.

**Rollback** (FRU, Yuan et al., WSDM 2023, and FedEraser without calibration): from the state ``theta_0`` before the
first stored round, re-add every stored round's aggregate with the forgotten users ``F`` left out,

    theta_T' = theta_0 + sum_{t=1..T} Delta_t(U_t \\ F),

``Delta_t`` the strategy's aggregation rule over round ``t``'s stored deltas
(:func:`fedrec_flwr.unlearning.aggregate.aggregate_deltas`). This equals retraining without ``F`` exactly when the
remaining users' updates would not have changed without ``F`` (a row only ``F`` touched returns to its value before
``F`` first touched it); in general later rounds' updates were computed at a model ``F`` had moved, which the
calibration corrects for in part.

**Calibration** (FedEraser, Liu et al., "FedEraser: Enabling Efficient Client-Level Data Removal from Federated
Learning Models", IWQoS 2021, Sec. III, the update-calibration step): at a calibration round ``t`` the remaining
clients train briefly from the unlearned model ``theta_t'`` and report fresh updates ``U^_t``; each stored update
``U_t`` keeps its direction and takes the fresh update's length, per client and per layer:

    U~_t = ||U^_t|| * U_t / ||U_t||.

Here a "layer" is one item table's block of the user's touched rows (``(T, d)``, norms over the block) and one dense
key. The calibrated updates are aggregated by the same rule. A user with no fresh update keeps its stored one; a
stored block of zero length stays zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from fedrec_flwr.unlearning.aggregate import UserDelta, aggregate_deltas, apply_update
from fedrec_flwr.unlearning.history import ContributionHistory

__all__ = ["Calibrate", "calibrate_delta", "calibrate_round", "rollback", "rollback_correction"]

Calibrate = Callable[[int, Mapping[str, np.ndarray], np.ndarray], Mapping[int, UserDelta] | None]
"""``calibrate(round, theta_t', remaining_users) -> {user: fresh delta}`` (or ``None``: no calibration this round):
the fresh updates of the remaining users at the unlearned model before round ``round``."""


def calibrate_delta(stored: UserDelta, fresh: UserDelta) -> UserDelta:
    """FedEraser's ``U~ = ||U^|| U / ||U||`` (module docstring) for one user: each item table's block and each dense
    key of ``stored`` rescaled to the length of the same block or key of ``fresh``.

    The fresh update may touch other rows than the stored one (a new negative sample); its block norm is over its own
    rows. Float64 throughout. Returns a new :class:`UserDelta` on ``stored``'s rows with ``stored``'s weight.
    """

    def scaled(old: np.ndarray, new: np.ndarray) -> np.ndarray:
        old = np.asarray(old, dtype=np.float64)
        length = float(np.linalg.norm(old))
        return old * (float(np.linalg.norm(np.asarray(new, dtype=np.float64))) / length) if length > 0 else old.copy()

    return UserDelta(
        rows=np.asarray(stored.rows, dtype=np.int64),
        items={k: scaled(v, fresh.items[k]) for k, v in stored.items.items()},
        dense={k: scaled(v, fresh.dense[k]) for k, v in stored.dense.items()},
        weight=stored.weight,
    )


def calibrate_round(stored: Mapping[int, UserDelta], fresh: Mapping[int, UserDelta]) -> dict[int, UserDelta]:
    """User -> :func:`calibrate_delta` of its stored and fresh updates; users without a fresh update keep theirs."""
    return {u: calibrate_delta(d, fresh[u]) if u in fresh else d for u, d in stored.items()}


def rollback(
    theta0: Mapping[str, np.ndarray],
    history: ContributionHistory,
    forget: Iterable[int],
    *,
    calibrate: Calibrate | None = None,
) -> dict[str, np.ndarray]:
    """``theta_T'`` (module docstring): replay every stored round, in ascending order, without ``forget``.

    Args:
        theta0: the shared parameters before the first stored round (by shared key; float64 copies are made).
        history: the stored contributions.
        forget: the users to leave out.
        calibrate: optional :data:`Calibrate` callback; when it returns fresh updates for a round, the remaining
            users' stored updates of that round are calibrated with them (:func:`calibrate_round`) before aggregation.

    Returns:
        Shared key -> float64 array, the unlearned parameters.
    """
    forgotten = {int(u) for u in forget}
    theta = {k: np.array(v, dtype=np.float64) for k, v in theta0.items()}
    for t in history.rounds():
        stored = history.contributions(t, exclude=forgotten)
        if calibrate is not None:
            fresh = calibrate(t, theta, np.array(sorted(stored), dtype=np.int64))
            if fresh is not None:
                stored = calibrate_round(stored, fresh)
        update = aggregate_deltas(list(stored.values()), history.item_shapes, history.dense_shapes, history.mode)
        theta = apply_update(theta, update)
    return theta


def rollback_correction(history: ContributionHistory, forget: Iterable[int]) -> dict[str, np.ndarray]:
    """``sum_t (Delta_t(U_t \\ F) - Delta_t(U_t))``: what rollback changes, as full float64 arrays by shared key.

    Added to the trained ``theta_T`` it gives :func:`rollback`'s result when ``theta_T = theta_0 + sum_t Delta_t(U_t)``
    (a parameter-averaging strategy, up to the float32 rounding of the served models), without ``theta_0``.
    """
    forgotten = {int(u) for u in forget}
    zeros = {
        **{k: np.zeros(s, dtype=np.float64) for k, s in history.item_shapes.items()},
        **{k: np.zeros(s, dtype=np.float64) for k, s in history.dense_shapes.items()},
    }
    without, full = dict(zeros), {k: v.copy() for k, v in zeros.items()}
    for t in history.rounds():
        without = apply_update(without, history.round_aggregate(t, exclude=forgotten))
        full = apply_update(full, history.round_aggregate(t))
    return {k: without[k] - full[k] for k in zeros}
