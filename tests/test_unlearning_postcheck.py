"""The post-check on a tiny matrix-factorisation model poisoned to promote one item: a step that destroys utility
fails, a no-op step fails the influence check, a step that restores the target's row passes."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.unlearning.postcheck import (
    Expectations,
    loss_margin,
    post_check,
    target_exposure,
    validation_utility,
)

USERS, ITEMS, DIM, TARGET = 40, 60, 4, 7


def _world():
    rng = np.random.default_rng(3)
    p = rng.normal(size=(USERS, DIM))
    q = rng.normal(size=(ITEMS, DIM))
    q[TARGET] = -p.mean(axis=0)  # an item genuine users dislike
    interacted = np.zeros((USERS, ITEMS), dtype=bool)
    for u in range(USERS):
        interacted[u, rng.choice(np.setdiff1d(np.arange(ITEMS), [TARGET]), size=8, replace=False)] = True
    scores = p @ q.T
    val, negatives = [], []
    for u in range(USERS):
        free = np.flatnonzero(~interacted[u])
        best = free[np.argmax(scores[u, free])]  # the user's validation item: its favourite unseen item
        val.append(best)
        negatives.append(rng.choice(np.setdiff1d(free, [best]), size=20, replace=False))
    return p, q, interacted, np.array(val), np.array(negatives)


def _measure(p, q, interacted, val, negatives):
    scores = p @ q.T
    candidates = np.concatenate([val[:, None], negatives], axis=1)
    utility = validation_utility(np.take_along_axis(scores, candidates, axis=1))
    return utility, target_exposure(scores, interacted, TARGET)


def _poisoned(q):
    out = q.copy()
    out[TARGET] = 3.0 * np.abs(q).max() * np.sign(_world()[0].mean(axis=0))
    return out


def test_steps_are_judged_by_utility_and_influence():
    p, q, interacted, val, negatives = _world()
    _, clean_exposure = _measure(p, q, interacted, val, negatives)
    poisoned = _poisoned(q)
    before, poisoned_exposure = _measure(p, poisoned, interacted, val, negatives)
    assert clean_exposure == 0.0 and poisoned_exposure > 0.5
    expect = Expectations(max_hr_drop=0.05, max_ndcg_drop=0.05, max_exposure=clean_exposure + 0.1)

    destroyed_q = np.random.default_rng(9).normal(scale=10.0, size=q.shape)
    destroyed_q[TARGET] = q[TARGET]
    after, exposure = _measure(p, destroyed_q, interacted, val, negatives)
    destroyed = post_check(before, after, expect, exposure=exposure)
    assert not destroyed.passed
    assert any(r.startswith("utility: validation HR@10") for r in destroyed.reasons)

    after, exposure = _measure(p, poisoned, interacted, val, negatives)
    noop = post_check(before, after, expect, exposure=exposure)
    assert not noop.passed
    assert [r for r in noop.reasons] == [f"influence: exposure {exposure:.4f} above the expected {0.1:g}"]

    good_q = poisoned.copy()
    good_q[TARGET] = q[TARGET]
    after, exposure = _measure(p, good_q, interacted, val, negatives)
    good = post_check(before, after, expect, exposure=exposure)
    assert good.passed, good.reasons
    assert good.as_dict() == {"passed": True, "reasons": [], "measured": good.measured}
    assert good.measured["exposure"] == 0.0 and good.measured["HR@10-after"] >= good.measured["HR@10-before"] - 0.05


def test_margin_expectation_and_missing_measures():
    same = {"HR@10": 0.5, "NDCG@10": 0.3}
    members, nonmembers = np.array([0.1, 0.2]), np.array([0.7, 0.9])
    assert loss_margin(members, nonmembers) == pytest.approx(0.65)
    remembered = post_check(same, same, Expectations(max_margin=0.1), margin=loss_margin(members, nonmembers))
    assert not remembered.passed and remembered.reasons[0].startswith("influence: margin 0.6500")
    forgotten = post_check(same, same, Expectations(max_margin=0.1), margin=loss_margin(nonmembers, nonmembers))
    assert forgotten.passed
    unmeasured = post_check(same, same, Expectations(max_margin=0.1))
    assert unmeasured.reasons == ["influence: margin expected at most 0.1 but not measured"]
    nothing = post_check(same, same, Expectations(), exposure=0.0)
    assert not nothing.passed and "no expectation set" in nothing.reasons[0]


def test_only_the_validation_item_is_ranked_and_exposure_edges():
    with pytest.raises(ValueError, match="validation item only"):
        validation_utility(np.zeros((2, 5)), split="test")
    scores = np.array([[3.0, 1.0, 2.0], [0.0, 5.0, 1.0]])
    interacted = np.array([[False, False, False], [False, True, False]])
    # user 0: target 2 is second of 3 candidates; user 1: first of its 2 unseen items (item 1, above it, is seen)
    assert target_exposure(scores, interacted, 2, k=1) == 0.5
    assert target_exposure(scores, interacted, 2, k=2) == 1.0
    assert np.isnan(target_exposure(scores, np.ones((2, 3), dtype=bool), 2))
