"""Rollback and FedEraser calibration on a tiny float64 federation whose remaining users' updates do not depend on
the forgotten user, so that retraining without it is known exactly."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.unlearning.aggregate import UserDelta
from fedrec_flwr.unlearning.history import ContributionHistory
from fedrec_flwr.unlearning.rollback import calibrate_delta, rollback, rollback_correction

ITEM, DENSE = "item.weight", "mlp.weight"
SHAPES = {ITEM: (6, 3)}, {DENSE: (2, 2)}
FORGET = 2
ROUNDS = 4
# the users each round trains, and the rows each touches; user 2 (forgotten) alone touches row 5 (rounds 2 and 3),
# which user 0 touched in round 1 before it
PLAN = {
    1: {0: [0, 1, 5], 1: [1, 2], 2: [1, 3]},
    2: {0: [0, 3], 2: [3, 4, 5], 3: [2, 4]},
    3: {1: [0, 1, 2], 2: [1, 5], 3: [3]},
    4: {0: [4], 1: [0, 1], 3: [1, 2, 3]},
}


def _theta0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {ITEM: rng.normal(size=SHAPES[0][ITEM]), DENSE: rng.normal(size=SHAPES[1][DENSE])}


def _upload(t: int, user: int, rows: list[int]) -> tuple[np.ndarray, np.ndarray, float]:
    """A fixed (model-independent) delta of ``user`` in round ``t``: its row deltas, dense delta and weight."""
    rng = np.random.default_rng([t, user])
    return rng.normal(size=(len(rows), 3)), rng.normal(size=(2, 2)), float(1 + user)


def _history(mode: str) -> ContributionHistory:
    history = ContributionHistory(*SHAPES, dtype="float64", mode=mode)
    for t, users in PLAN.items():
        for user, rows in users.items():
            row_delta, dense_delta, weight = _upload(t, user, rows)
            history.record(t, user, np.array(rows), row_delta, {DENSE: dense_delta}, weight)
    return history


def _train(forget: set[int], mode: str) -> dict[str, np.ndarray]:
    """Train without ``forget`` by the strategy's value form: a row is the mean of its touching users' uploads
    (theta + delta), or for "selected" theta + (sum of uploads - count * theta) / m; dense the weighted mean."""
    theta = _theta0()
    for t, users in PLAN.items():
        users = {u: r for u, r in users.items() if u not in forget}
        uploads = {u: _upload(t, u, r) for u, r in users.items()}
        total, count = np.zeros(SHAPES[0][ITEM]), np.zeros(6)
        dense_sum, weight_sum = np.zeros((2, 2)), 0.0
        for u, rows in users.items():
            row_delta, dense_delta, weight = uploads[u]
            total[rows] += theta[ITEM][rows] + row_delta
            count[rows] += 1
            dense_sum += weight * (theta[DENSE] + dense_delta)
            weight_sum += weight
        new = theta[ITEM].copy()
        hit = count > 0
        if mode == "touched":
            new[hit] = total[hit] / count[hit, None]
        else:
            new[hit] = theta[ITEM][hit] + (total[hit] - count[hit, None] * theta[ITEM][hit]) / len(users)
        theta = {ITEM: new, DENSE: dense_sum / weight_sum if users else theta[DENSE]}
    return theta


@pytest.mark.parametrize("mode", ["touched", "selected"])
def test_rollback_equals_retraining_without_the_user(mode):
    history = _history(mode)
    retrained = _train({FORGET}, mode)
    unlearned = rollback(_theta0(), history, [FORGET])
    for key in retrained:
        np.testing.assert_allclose(unlearned[key], retrained[key], rtol=0, atol=1e-12)
    # the forgotten user mattered: the full model is elsewhere, and rollback without forgetting reproduces it
    full = _train(set(), mode)
    assert np.abs(full[ITEM] - retrained[ITEM]).max() > 0.1
    kept = rollback(_theta0(), history, [])
    for key in full:
        np.testing.assert_allclose(kept[key], full[key], rtol=0, atol=1e-12)
    # the same change, added to the trained model
    correction = rollback_correction(history, [FORGET])
    for key in full:
        np.testing.assert_allclose(full[key] + correction[key], retrained[key], rtol=0, atol=1e-12)


def test_a_row_only_the_forgotten_user_touched_returns_to_its_value_before():
    theta0 = _theta0()
    unlearned = rollback(theta0, _history("touched"), [FORGET])
    before = theta0[ITEM][5] + _upload(1, 0, PLAN[1][0])[0][2]  # after round 1, user 0's update of row 5
    np.testing.assert_allclose(unlearned[ITEM][5], before, rtol=0, atol=1e-15)
    full = rollback(theta0, _history("touched"), [])
    assert np.abs(full[ITEM][5] - before).max() > 0.1


def test_calibration_with_fresh_equal_to_stored_changes_nothing():
    history = _history("touched")
    seen = []

    def same(t, theta, users):
        seen.append((t, users.tolist()))
        return history.contributions(t, exclude={FORGET})

    plain = rollback(_theta0(), history, [FORGET])
    calibrated = rollback(_theta0(), history, [FORGET], calibrate=same)
    for key in plain:
        np.testing.assert_array_equal(calibrated[key], plain[key])
    assert seen == [(t, sorted(u for u in PLAN[t] if u != FORGET)) for t in range(1, ROUNDS + 1)]


def test_calibration_rescales_each_block_to_the_fresh_length():
    history = _history("touched")
    stored = history.contribution(2, 0)
    fresh = UserDelta(
        rows=np.array([1, 3, 4]),  # other rows (a new negative sample): its block norm counts
        items={ITEM: np.full((3, 3), 2.0)},
        dense={DENSE: np.full((2, 2), 0.5)},
        weight=9.0,
    )
    out = calibrate_delta(stored, fresh)
    np.testing.assert_array_equal(out.rows, stored.rows)
    assert out.weight == stored.weight
    np.testing.assert_allclose(np.linalg.norm(out.items[ITEM]), np.linalg.norm(fresh.items[ITEM]), rtol=1e-14)
    np.testing.assert_allclose(np.linalg.norm(out.dense[DENSE]), 1.0, rtol=1e-14)
    scale = np.linalg.norm(fresh.items[ITEM]) / np.linalg.norm(stored.items[ITEM])
    np.testing.assert_allclose(out.items[ITEM], scale * stored.items[ITEM], rtol=1e-14)
    # a calibrated rollback moves the result (the calibration is used)
    doubled = rollback(
        _theta0(),
        history,
        [FORGET],
        calibrate=lambda t, theta, users: {
            u: UserDelta(d.rows, {ITEM: 2 * d.items[ITEM]}, {DENSE: 2 * d.dense[DENSE]}, d.weight)
            for u, d in history.contributions(t, exclude={FORGET}).items()
        },
    )
    plain = rollback(_theta0(), history, [FORGET])
    theta0 = _theta0()
    np.testing.assert_allclose(doubled[DENSE] - theta0[DENSE], 2 * (plain[DENSE] - theta0[DENSE]), atol=1e-12)
