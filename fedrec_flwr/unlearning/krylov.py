"""Hessian-free Krylov solvers: conjugate gradient on a damped operator, trust-region CG, and the flat vectors of
shared parameters they run on.

Used by HF-KCU (Mahdavi, Zamanifar, Farhadi, Kashefi, "Causal Unlearning in Collaborative Optimization: Exact and
Approximate Influence Reversal under Adversarial Contributions", arXiv:2605.20341): the unlearning step solves
``(H + damping * I) x = g`` with conjugate gradient, touching the Hessian ``H`` only through products ``H v``
(Pearlmutter 1994; forward-over-reverse differentiation), so ``H`` is never formed. Pure numpy / PyTorch, no Flower.

Two solvers (``krylov-solver``): plain CG (:func:`conjugate_gradient`, stops on non-positive curvature) and the
trust-region CG of Steihaug (1983) and Toint (1981) (:func:`steihaug_cg`), which returns a step inside a radius and
follows a direction of negative curvature to the boundary instead of stopping.

The operators they are run on live in :mod:`fedrec_flwr.unlearning.curvature` (``curvature``: the exact Hessian,
:func:`~fedrec_flwr.unlearning.curvature.hessian_vector_product`, and the generalised Gauss-Newton matrix,
:func:`~fedrec_flwr.unlearning.curvature.gauss_newton_vector_product`, positive semi-definite by construction; the
Gauss-Newton diagonal that preconditions :func:`steihaug_cg`), and how far to go along a computed step in
:mod:`fedrec_flwr.unlearning.line_search` (``line-search``). Their names are re-exported here, where the clients,
strategies and tests import them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from fedrec_flwr.unlearning.curvature import (
    CURVATURES,
    CompositeLoss,
    Params,
    curvature_vector_product,
    gauss_newton_diagonal,
    gauss_newton_vector_product,
    gradient,
    hessian_vector_product,
)
from fedrec_flwr.unlearning.line_search import LineSearchResult, ladder_line_search

__all__ = [
    "CURVATURES",
    "CURVATURE_EPS",
    "SOLVERS",
    "TERMINATIONS",
    "CGResult",
    "CompositeLoss",
    "LineSearchResult",
    "Params",
    "conjugate_gradient",
    "curvature_vector_product",
    "flatten",
    "gauss_newton_diagonal",
    "gauss_newton_vector_product",
    "gradient",
    "hessian_vector_product",
    "krylov_solve",
    "ladder_line_search",
    "steihaug_cg",
    "unflatten",
]

log = logging.getLogger(__name__)


CURVATURE_EPS = 1e-10
"""A direction's curvature counts as non-positive below this fraction of the largest seen (``p^T A p / p^T p``), so
the null directions of a singular operator, whose curvature is 0 up to rounding, stop CG instead of blowing it up."""


@dataclass
class CGResult:
    """Outcome of :func:`conjugate_gradient`.

    Attributes:
        x: the last iterate, shaped like ``b``.
        iterations: operator products done (0 when ``b`` = 0).
        residual: relative residual ``||b - (A + damping I) x|| / ||b||`` of the last iterate (CG's recursive
            residual; 0 when ``b`` = 0).
        converged: ``residual <= tolerance``.
        negative_curvature: CG met a direction ``p`` with ``p^T (A + damping I) p <= 0``, or 0 up to rounding
            (:data:`CURVATURE_EPS`): the damped operator is not positive definite. It stopped there; ``x`` is the
            iterate before that direction.
    """

    x: np.ndarray
    iterations: int
    residual: float
    converged: bool
    negative_curvature: bool
    boundary: bool = False
    """(Steihaug only) the step ends on the trust-region boundary ``||x|| = radius``."""
    termination: str = ""
    """What ended the solve: ``"tolerance"`` (converged), ``"boundary"`` (Steihaug: the next iterate would leave the
    radius), ``"negative-curvature"`` (plain CG: stopped, ``x`` the iterate before; Steihaug: stepped to the
    boundary along that direction), ``"iterations"`` (the budget ran out), or ``"zero-rhs"`` (``b`` = 0)."""

    def summary(self) -> dict:
        """The scalar facts, for logs and ``unlearning.json``."""
        return {
            "cg-iterations": self.iterations,
            "cg-residual": self.residual,
            "cg-converged": self.converged,
            "cg-negative-curvature": self.negative_curvature,
            "cg-boundary": self.boundary,
            "cg-termination": self.termination,
        }


TERMINATIONS = {
    "tolerance": "the relative residual reached cg-tolerance",
    "iterations": "cg-iterations used up",
    "negative-curvature": "a direction of non-positive curvature",
    "boundary": "the step reached the trust region's edge, trust-radius",
    "zero-rhs": "the forgotten users' gradient is zero",
}
"""What each :attr:`CGResult.termination` means, in words (the unlearning phase's console line)."""

SOLVERS = ("cg", "steihaug")
"""Values of ``krylov-solver``: plain CG (:func:`conjugate_gradient`) and trust-region CG (:func:`steihaug_cg`)."""


def _check_solver_args(name: str, iterations, damping: float, tolerance: float, b) -> np.ndarray:
    if isinstance(iterations, bool) or int(iterations) != iterations or iterations < 1:
        raise ValueError(f"{name}: iterations must be an int >= 1, got {iterations!r}")
    for key, value in (("damping", damping), ("tolerance", tolerance)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: {key} must be a finite number >= 0, got {value!r}")
    b = np.asarray(b, dtype=np.float64)
    if not np.isfinite(b).all():
        raise ValueError(f"{name}: the right-hand side b contains NaN or Inf")
    return b


def _curvature(p: np.ndarray, ap: np.ndarray, largest: float) -> tuple[float, float, bool]:
    """``(p^T A p, the largest Rayleigh quotient seen so far, whether the curvature is non-positive)``: <= 0, or 0 up
    to rounding relative to the operator's scale (:data:`CURVATURE_EPS`; a singular operator's null directions)."""
    p_norm2 = float(np.vdot(p, p))
    curvature = float(np.vdot(p, ap))
    largest = max(largest, curvature / p_norm2)
    return curvature, largest, curvature <= CURVATURE_EPS * largest * p_norm2


def _apply(name: str, matvec, p: np.ndarray, damping: float) -> np.ndarray:
    ap = np.asarray(matvec(p), dtype=np.float64)
    if ap.shape != p.shape:
        raise ValueError(f"{name}: matvec returned shape {ap.shape}, expected {p.shape}")
    if not np.isfinite(ap).all():
        raise ValueError(f"{name}: matvec returned NaN or Inf")
    return ap + damping * p


def conjugate_gradient(
    matvec: Callable[[np.ndarray], np.ndarray],
    b: np.ndarray,
    *,
    iterations: int = 10,
    damping: float = 0.0,
    tolerance: float = 1e-6,
) -> CGResult:
    """Solve ``(A + damping * I) x = b`` for a symmetric operator ``A`` given only as ``matvec(v) = A v``.

    Hestenes & Stiefel (1952); Nocedal & Wright, *Numerical Optimization* (2nd ed.), Algorithm 5.2, started at
    ``x0 = 0``. In exact arithmetic it solves an ``n``-dimensional positive definite system in at most ``n``
    iterations (at most the number of distinct eigenvalues). It stops early, with a flag, on non-positive curvature
    (Nocedal & Wright, Algorithm 7.1's test), which is how an indefinite Hessian without enough damping shows.

    Args:
        matvec: ``v -> A v`` on float64 arrays shaped like ``b``.
        b: the right-hand side (any shape; float64 is used inside).
        iterations: at most this many products (CG's ``k``; >= 1).
        damping: ``lambda >= 0`` added to the diagonal.
        tolerance: stop when the relative residual ``||r|| / ||b||`` is at most this.

    Returns:
        :class:`CGResult`. A non-converged result is returned (and logged by the caller), never hidden.

    Raises:
        ValueError: ``iterations < 1``, a negative or non-finite ``damping`` / ``tolerance``, a non-finite ``b``, or
            ``matvec`` returning a wrong shape or a non-finite value.
    """
    b = _check_solver_args("conjugate_gradient", iterations, damping, tolerance, b)
    x = np.zeros_like(b)
    b_norm = float(np.linalg.norm(b))
    if b_norm == 0.0:
        return CGResult(x, 0, 0.0, True, False, termination="zero-rhs")
    r = b.copy()
    p = r.copy()
    rs = float(np.vdot(r, r))
    done = 0
    negative = False
    largest = 0.0  # the largest Rayleigh quotient p^T A p / p^T p seen: the operator's scale
    for _ in range(int(iterations)):
        ap = _apply("conjugate_gradient", matvec, p, damping)
        done += 1
        curvature, largest, non_positive = _curvature(p, ap, largest)
        if non_positive:
            negative = True
            break
        alpha = rs / curvature
        x += alpha * p
        r -= alpha * ap
        rs_new = float(np.vdot(r, r))
        if math.sqrt(rs_new) <= tolerance * b_norm:
            rs = rs_new
            break
        p = r + (rs_new / rs) * p
        rs = rs_new
    residual = math.sqrt(rs) / b_norm
    converged = residual <= tolerance
    termination = "negative-curvature" if negative else "tolerance" if converged else "iterations"
    return CGResult(x, done, residual, converged, negative, termination=termination)


def steihaug_cg(
    matvec: Callable[[np.ndarray], np.ndarray],
    b: np.ndarray,
    *,
    radius: float,
    iterations: int = 10,
    damping: float = 0.0,
    tolerance: float = 1e-6,
    preconditioner: np.ndarray | None = None,
) -> CGResult:
    """Approximately minimise the quadratic model ``m(x) = -b^T x + 1/2 x^T (A + damping I) x`` subject to
    ``||x||_M <= radius``, for a symmetric (possibly indefinite) operator ``A`` given only as ``matvec``.

    Steihaug (1983) / Toint (1981) truncated CG; Nocedal & Wright, *Numerical Optimization* (2nd ed.), Algorithm 7.2,
    started at ``x0 = 0``. While the curvature of each direction is positive and the iterates stay inside the radius
    it is plain CG (so on a positive definite system whose solution lies inside the radius it returns CG's answer).
    When a direction ``p`` has ``p^T (A + damping I) p <= 0`` (tested as in :func:`conjugate_gradient`), or the next
    iterate would leave the radius, it returns ``x + tau p`` with ``tau >= 0`` such that ``||x + tau p||_M = radius``:
    along a descent direction of ``m``, so ``m`` decreases monotonically over the iterates (N&W Theorem 7.3) and the
    step is never dropped.

    With a ``preconditioner`` (a positive diagonal ``M``, given as its diagonal) this is Steihaug's preconditioned
    algorithm (Steihaug 1983, Sec. 2; N&W Sec. 7.2, "Preconditioning"): CG on ``M^{-1/2} (A + damping I) M^{-1/2}``
    in the variables ``M^{1/2} x``, written in ``x``: each new direction is built from ``y = M^{-1} r``, ``alpha =
    r^T y / p^T A p``, and the trust region is measured in the norm ``||x||_M = sqrt(x^T M x)`` (an ellipsoid that is
    long where ``M`` is small). Every iterate stays in the Krylov space of ``M^{-1} (A + damping I)`` and ``M^{-1}
    b``, so inside the radius the answer is still the solve of ``(A + damping I) x = b``. ``M = I`` (or ``None``)
    is the Euclidean algorithm, operation for operation.

    Args:
        matvec: ``v -> A v`` on float64 arrays shaped like ``b``.
        b: the right-hand side (any shape; float64 inside).
        radius: the trust-region radius ``> 0`` (the ``M``-norm of the step; Euclidean without a preconditioner, in
            ``b``'s units divided by ``A``'s).
        iterations: at most this many products (>= 1).
        damping: ``lambda >= 0`` added to the diagonal.
        tolerance: stop when the relative residual ``||b - (A + damping I) x|| / ||b||`` (Euclidean) is at most this.
        preconditioner: ``M``'s diagonal, shaped like ``b``, finite and > 0; ``None`` for ``M = I``.

    Returns:
        :class:`CGResult` with ``boundary`` set when the step ends on the radius and ``negative_curvature`` when a
        direction of non-positive curvature was met (then ``boundary`` is also set). ``residual`` is the relative
        residual of the returned ``x``, computed from the recursion (exact in exact arithmetic, also for a boundary
        step: ``r - tau A p``).

    Raises:
        ValueError: ``radius`` not finite and > 0, a ``preconditioner`` of the wrong shape or not finite and > 0, or
            as :func:`conjugate_gradient`.
    """
    if not (isinstance(radius, (int, float)) and math.isfinite(radius) and radius > 0):
        raise ValueError(f"steihaug_cg: radius must be a finite number > 0, got {radius!r}")
    b = _check_solver_args("steihaug_cg", iterations, damping, tolerance, b)
    m = None
    if preconditioner is not None:
        m = np.asarray(preconditioner, dtype=np.float64)
        if m.shape != b.shape:
            raise ValueError(f"steihaug_cg: preconditioner has shape {m.shape}, expected {b.shape} (its diagonal)")
        if not (np.isfinite(m).all() and (m > 0).all()):
            raise ValueError("steihaug_cg: the preconditioner's diagonal must be finite and > 0")
    x = np.zeros_like(b)
    b_norm = float(np.linalg.norm(b))
    if b_norm == 0.0:
        return CGResult(x, 0, 0.0, True, False, termination="zero-rhs")
    r = b.copy()  # residual b - A x (the negative gradient of m)
    y = r if m is None else r / m  # the preconditioned residual M^{-1} r
    p = y.copy()
    rs = float(np.vdot(r, y))
    largest, done = 0.0, 0
    for _ in range(int(iterations)):
        ap = _apply("steihaug_cg", matvec, p, damping)
        done += 1
        curvature, largest, non_positive = _curvature(p, ap, largest)
        if non_positive:
            tau = _to_boundary(x, p, radius, m)
            x, r = x + tau * p, r - tau * ap
            return CGResult(x, done, float(np.linalg.norm(r)) / b_norm, False, True, True, "negative-curvature")
        alpha = rs / curvature
        if _m_norm(x + alpha * p, m) >= radius:
            tau = _to_boundary(x, p, radius, m)
            x, r = x + tau * p, r - tau * ap
            residual = float(np.linalg.norm(r)) / b_norm
            return CGResult(x, done, residual, residual <= tolerance, False, True, "boundary")
        x = x + alpha * p
        r = r - alpha * ap
        y = r if m is None else r / m
        rs_new = float(np.vdot(r, y))
        r_norm = math.sqrt(rs_new) if m is None else float(np.linalg.norm(r))
        if r_norm <= tolerance * b_norm:
            return CGResult(x, done, r_norm / b_norm, True, False, False, "tolerance")
        p = y + (rs_new / rs) * p
        rs = rs_new
    residual = (math.sqrt(rs) if m is None else float(np.linalg.norm(r))) / b_norm
    return CGResult(x, done, residual, residual <= tolerance, False, False, "iterations")


def _m_norm(v: np.ndarray, m: np.ndarray | None) -> float:
    """``||v||_M = sqrt(v^T M v)`` for a diagonal ``M`` (its diagonal ``m``); Euclidean for ``m = None``."""
    return float(np.linalg.norm(v)) if m is None else math.sqrt(float(np.vdot(v, m * v)))


def _to_boundary(x: np.ndarray, p: np.ndarray, radius: float, m: np.ndarray | None = None) -> float:
    """The ``tau >= 0`` with ``||x + tau p||_M = radius`` (``||x||_M <= radius``; ``M`` diagonal, Euclidean for
    ``m = None``): the positive root of ``p^T M p tau^2 + 2 x^T M p tau + x^T M x - radius^2 = 0``."""
    mp = p if m is None else m * p
    a, half_b = float(np.vdot(p, mp)), float(np.vdot(x, mp))
    c = (float(np.vdot(x, x)) if m is None else float(np.vdot(x, m * x))) - radius * radius
    disc = max(half_b * half_b - a * c, 0.0)
    return (-half_b + math.sqrt(disc)) / a if a > 0 else 0.0


def krylov_solve(
    matvec: Callable[[np.ndarray], np.ndarray],
    b: np.ndarray,
    *,
    solver: str,
    iterations: int,
    damping: float,
    tolerance: float,
    radius: float | None = None,
    preconditioner: np.ndarray | None = None,
) -> CGResult:
    """Dispatch to :func:`conjugate_gradient` (``solver = "cg"``; ``radius`` ignored) or :func:`steihaug_cg`
    (``"steihaug"``; needs ``radius``; ``preconditioner``: the diagonal of ``M``, or ``None``).

    Raises:
        ValueError: an unknown solver, a ``preconditioner`` with ``"cg"`` (not built), or as the solver does.
    """
    if solver == "cg":
        if preconditioner is not None:
            raise ValueError("krylov_solve: a preconditioner is only built for solver 'steihaug'")
        return conjugate_gradient(matvec, b, iterations=iterations, damping=damping, tolerance=tolerance)
    if solver == "steihaug":
        return steihaug_cg(
            matvec,
            b,
            radius=radius,
            iterations=iterations,
            damping=damping,
            tolerance=tolerance,
            preconditioner=preconditioner,
        )
    raise ValueError(f"krylov_solve: solver must be one of {SOLVERS}, got {solver!r}")


# ---------------------------------------------------------------------------------------------- vectors
def flatten(vector: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]) -> np.ndarray:
    """Concatenate ``vector``'s arrays in ``shapes``' key order into one float64 array."""
    return (
        np.concatenate([np.asarray(vector[k], dtype=np.float64).reshape(-1) for k in shapes]) if shapes else np.zeros(0)
    )


def unflatten(flat: np.ndarray, shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """Inverse of :func:`flatten`.

    Raises:
        ValueError: ``flat`` has the wrong length.
    """
    sizes = [int(np.prod(s)) for s in shapes.values()]
    if flat.size != sum(sizes):
        raise ValueError(f"unflatten: got {flat.size} values, the shapes need {sum(sizes)}")
    out, start = {}, 0
    for (key, shape), size in zip(shapes.items(), sizes):
        out[key] = flat[start : start + size].reshape(shape)
        start += size
    return out
