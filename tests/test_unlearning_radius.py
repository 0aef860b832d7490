"""HF-KCU's dominated-row trust radius: independent of the forgotten users' negative sample, and a popular row held by
many remaining users stays outside the mask."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.unlearning.radius import dominated_rows, forgotten_share, mask_step, positive_counts

NUM_ITEMS, TARGET, POPULAR = 40, 33, 0
THETA = {"item.weight": np.random.default_rng(0).normal(size=(NUM_ITEMS, 4))}


def _federation():
    """20 genuine users rating among items 0-19 (item 0 by all); 6 fake users rating the target 33 and fillers 0-2."""
    rng = np.random.default_rng(5)
    genuine = [np.union1d([POPULAR], rng.choice(np.arange(1, 20), size=6, replace=False)) for _ in range(20)]
    fakes = [np.array([0, 1, 2, TARGET]) for _ in range(6)]
    return genuine, fakes


def _negatives(positives: list[np.ndarray], seed: int, per_positive: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.choice(np.setdiff1d(np.arange(NUM_ITEMS), p), size=per_positive * len(p)) for p in positives]


def _touched_radius(fakes, negatives, factor=0.015) -> float:
    """The radius the strategy uses now: the norm of every row the fakes' influence loss touches."""
    rows = np.unique(np.concatenate([np.union1d(p, n) for p, n in zip(fakes, negatives, strict=True)]))
    return factor * float(np.linalg.norm(THETA["item.weight"][rows]))


def test_radius_does_not_change_with_the_negative_sample():
    genuine, fakes = _federation()
    n_r, n_f = positive_counts(genuine, NUM_ITEMS), positive_counts(fakes, NUM_ITEMS)
    first = dominated_rows(THETA, n_r, n_f)
    again = dominated_rows(THETA, n_r, n_f)
    assert first.radius == again.radius and np.array_equal(first.rows, again.rows)
    # the touched-row radius moves with the sample; the dominated rows never include a negative-only row
    a, b = _touched_radius(fakes, _negatives(fakes, 1)), _touched_radius(fakes, _negatives(fakes, 2))
    assert a != b
    assert first.radius < min(a, b)
    negatives = np.unique(np.concatenate(_negatives(fakes, 1)))
    assert not np.isin(np.setdiff1d(negatives, [0, 1, 2, TARGET]), first.rows).any()


def test_popular_row_is_outside_the_mask_and_the_target_inside():
    genuine, fakes = _federation()
    result = dominated_rows(THETA, positive_counts(genuine, NUM_ITEMS), positive_counts(fakes, NUM_ITEMS))
    assert result.share[POPULAR] == pytest.approx(6 / 26)
    assert not result.mask[POPULAR]
    assert result.mask[TARGET] and result.share[TARGET] == 1.0
    np.testing.assert_array_equal(result.rows, np.flatnonzero(result.mask))
    expected = 0.015 * np.linalg.norm(THETA["item.weight"][result.rows])
    assert result.radius == pytest.approx(expected, rel=1e-14)
    step = {"item.weight": np.ones((NUM_ITEMS, 4)), "mlp.weight": np.ones(3)}
    masked = mask_step(step, result.mask, ["item.weight"])
    np.testing.assert_array_equal(masked["item.weight"][POPULAR], 0.0)
    np.testing.assert_array_equal(masked["item.weight"][TARGET], 1.0)
    np.testing.assert_array_equal(masked["mlp.weight"], 1.0)
    assert step["item.weight"][POPULAR].sum() == 4  # the input is not changed


def test_threshold_boundary_and_no_dominated_row():
    n_r, n_f = np.array([3.0, 2.0, 0.0, 0.0]), np.array([3.0, 1.0, 0.0, 2.0])
    np.testing.assert_array_equal(forgotten_share(n_r, n_f), [0.5, 1 / 3, 0.0, 1.0])
    theta = {"t": np.arange(8, dtype=np.float64).reshape(4, 2)}
    assert dominated_rows(theta, n_r, n_f, threshold=0.5).rows.tolist() == [0, 3]
    assert dominated_rows(theta, n_r, n_f, threshold=0.6).rows.tolist() == [3]
    assert dominated_rows(theta, n_r, n_f, factor=2.0, threshold=0.6).radius == pytest.approx(2 * np.hypot(6, 7))
    none = dominated_rows(theta, n_r, np.zeros(4))
    assert none.radius == 0.0 and none.rows.size == 0 and not none.mask.any()
    with pytest.raises(ValueError, match="threshold"):
        dominated_rows(theta, n_r, n_f, threshold=0.0)
    with pytest.raises(ValueError, match="rows"):
        dominated_rows({"t": np.zeros((3, 2))}, n_r, n_f)
