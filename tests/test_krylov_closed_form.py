"""Steihaug trust-region CG (fedrec_flwr.unlearning.krylov.steihaug_cg) on a diagonal SPD system worked out by hand.

``A = diag(1, 10, 100)``, ``b = (1, 1, 1)``: three distinct eigenvalues, so CG reaches the solution ``x* = (1, 0.1,
0.01)`` (``||x*|| = 1.00504``) on its third product, and its iterates grow in norm (``||x_1|| = 0.0468``, ``||x_2|| =
0.2781``; Steihaug 1983, Thm 2.1). With a radius between ``||x_2||`` and ``||x*||`` only the *third* iterate leaves the
radius, while that step's own length ``||alpha_3 p_3|| = ||x* - x_2||`` is below it: so the boundary test must measure
the iterate ``x + alpha p``, not the step ``alpha p``.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.unlearning.krylov import _to_boundary, conjugate_gradient, krylov_solve, steihaug_cg

A = np.array([1.0, 10.0, 100.0])
B = np.ones(3)
SOLUTION = B / A  # (1, 0.1, 0.01)


def _iterate(k: int) -> np.ndarray:
    """CG's ``k``-th iterate (plain CG, no radius): the points Steihaug's path passes through."""
    return conjugate_gradient(lambda v: A * v, B, iterations=k, tolerance=0.0).x


def test_the_hand_computed_cg_path_of_the_diagonal_system():
    x1, x2 = _iterate(1), _iterate(2)
    np.testing.assert_allclose(x1, (3.0 / 111.0) * B, rtol=1e-12)  # alpha_1 = b.b / b.Ab = 3 / 111, along b
    np.testing.assert_allclose(_iterate(3), SOLUTION, rtol=1e-10)
    assert np.linalg.norm(x1) < np.linalg.norm(x2) < 0.905 < np.linalg.norm(SOLUTION)
    # the last step alone is shorter than the radius: only its end point leaves it
    assert np.linalg.norm(SOLUTION - x2) < 0.905


@pytest.mark.parametrize("radius", [0.905, 0.5, 0.3])
def test_steihaug_stops_where_the_third_iterate_would_leave_the_radius(radius):
    """The returned step is on the boundary, ``||x|| = radius``, on the segment from ``x_2`` to ``x*`` (the third CG
    step), reported as ``"boundary"``, with the true residual of that point."""
    x2 = _iterate(2)
    result = steihaug_cg(lambda v: A * v, B, radius=radius, iterations=10, tolerance=1e-12)
    assert result.termination == "boundary" and result.boundary and not result.negative_curvature
    assert result.iterations == 3
    assert np.linalg.norm(result.x) == pytest.approx(radius, rel=1e-12)
    # on the segment x2 + t (x* - x2), 0 < t < 1: the point of that segment at distance radius from 0
    d = SOLUTION - x2
    t = (-(x2 @ d) + np.sqrt((x2 @ d) ** 2 - (d @ d) * (x2 @ x2 - radius**2))) / (d @ d)
    assert 0.0 < t < 1.0
    np.testing.assert_allclose(result.x, x2 + t * d, rtol=1e-10)
    assert result.residual == pytest.approx(np.linalg.norm(B - A * result.x) / np.linalg.norm(B), rel=1e-10)
    assert not result.converged


@pytest.mark.parametrize("radius", [0.01, 0.1, 0.905, 1.0, 1.004])
def test_steihaug_never_returns_a_step_longer_than_the_radius(radius):
    for iterations in range(1, 6):
        result = steihaug_cg(lambda v: A * v, B, radius=radius, iterations=iterations, tolerance=1e-12)
        assert np.linalg.norm(result.x) <= radius * (1 + 1e-12), (radius, iterations, result.termination)
        dispatched = krylov_solve(
            lambda v: A * v, B, solver="steihaug", iterations=iterations, damping=0.0, tolerance=1e-12, radius=radius
        )
        np.testing.assert_array_equal(dispatched.x, result.x)


def test_steihaug_with_a_radius_beyond_the_solution_returns_it():
    result = steihaug_cg(lambda v: A * v, B, radius=1.006, iterations=10, tolerance=1e-12)
    assert result.termination == "tolerance" and result.converged and not result.boundary
    np.testing.assert_allclose(result.x, SOLUTION, rtol=1e-10)


def test_steihaug_first_step_leaves_a_small_radius_along_b():
    """The first iterate ``(3/111) b`` is outside a radius of 0.01: the step is ``0.01 b / ||b||``."""
    result = steihaug_cg(lambda v: A * v, B, radius=0.01, iterations=10, tolerance=1e-12)
    assert result.termination == "boundary" and result.iterations == 1
    np.testing.assert_allclose(result.x, 0.01 * B / np.sqrt(3.0), rtol=1e-12)


def test_to_boundary_is_the_positive_root_in_both_norms():
    # from x = (0.6, 0) along p = (0, 1): ||x + tau p|| = 1 at tau = 0.8
    assert _to_boundary(np.array([0.6, 0.0]), np.array([0.0, 1.0]), 1.0) == pytest.approx(0.8, rel=1e-14)
    # in the M-norm with M = diag(4, 1): ||(0.3, tau)||_M^2 = 0.36 + tau^2 = 1 at tau = 0.8
    assert _to_boundary(np.array([0.3, 0.0]), np.array([0.0, 1.0]), 1.0, np.array([4.0, 1.0])) == pytest.approx(
        0.8, rel=1e-14
    )
    # backwards along p: x = (0.6, 0), p = (-1, 0): 0.6 - tau = -1 at tau = 1.6
    assert _to_boundary(np.array([0.6, 0.0]), np.array([-1.0, 0.0]), 1.0) == pytest.approx(1.6, rel=1e-14)


def test_damping_shifts_the_diagonal_in_the_solve():
    """``(A + 2 I) x = b`` on the diagonal system: ``x = b / (a + 2)``, from both solvers."""
    for result in (
        conjugate_gradient(lambda v: A * v, B, iterations=10, damping=2.0, tolerance=1e-13),
        steihaug_cg(lambda v: A * v, B, radius=10.0, iterations=10, damping=2.0, tolerance=1e-13),
    ):
        assert result.converged and result.iterations == 3
        np.testing.assert_allclose(result.x, B / (A + 2.0), rtol=1e-10)
