"""Hessian-free Krylov tools: conjugate gradient on a damped operator, Hessian-vector products with ``torch.func``, and
the row-sparse vectors of shared parameters that unlearning messages carry.

Used by HF-KCU (Mahdavi, Zamanifar, Farhadi, Kashefi, "Causal Unlearning in Collaborative Optimization: Exact and
Approximate Influence Reversal under Adversarial Contributions", arXiv:2605.20341): the unlearning step solves
``(H + damping * I) x = g`` with conjugate gradient, touching the Hessian ``H`` only through products ``H v``
(Pearlmutter 1994; forward-over-reverse differentiation), so ``H`` is never formed. Pure numpy / PyTorch, no Flower.

Two solvers (``krylov-solver``): plain CG (:func:`conjugate_gradient`, stops on non-positive curvature) and the
trust-region CG of Steihaug (1983) and Toint (1981) (:func:`steihaug_cg`), which returns a step inside a radius and
follows a direction of negative curvature to the boundary instead of stopping. Two curvatures (``curvature``): the
exact Hessian (:func:`hessian_vector_product`) and the generalised Gauss-Newton matrix
(:func:`gauss_newton_vector_product`), positive semi-definite by construction. How far to go along a computed step
can be chosen by :func:`ladder_line_search`, a line search from batches of function values (``line-search``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

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


# ---------------------------------------------------------------------------------------------- line search
@dataclass
class LineSearchResult:
    """Outcome of :func:`ladder_line_search`.

    Attributes:
        step: the chosen multiple ``a`` of the direction (0 when no tried ``a > 0`` lowered the objective).
        value: ``f(step)``.
        steps: every ``a`` evaluated, in the order asked (``f(0)`` first).
        values: ``f`` at each of ``steps``.
        rounds: calls of ``evaluate`` (query rounds in the federated phase).
        termination: ``"bracketed"`` (a tried ``a`` lower than its neighbours on both sides, refined by parabolic
            interpolation), ``"max-step"`` (``f`` still decreasing at the largest allowed ``a``), ``"rounds"``
            (``f`` still decreasing when the round budget ran out), or ``"no-decrease"`` (no ``a > 0`` tried was
            below ``f(0)``; ``step`` = 0).
    """

    step: float
    value: float
    steps: list
    values: list
    rounds: int
    termination: str

    def summary(self) -> dict:
        """The scalar facts, for logs and ``unlearning.json``."""
        return {
            "line-search-step": self.step,
            "line-search-rounds": self.rounds,
            "line-search-termination": self.termination,
            "line-search-evaluations": len(self.steps),
            "line-search-steps": [float(a) for a in self.steps],
            "line-search-values": [float(v) for v in self.values],
        }


def ladder_line_search(
    evaluate: Callable[[list], list],
    *,
    ladder: tuple = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
    factor: float = 2.0,
    max_step: float = 64.0,
    max_rounds: int = 4,
    interpolate: bool = True,
) -> LineSearchResult:
    """Choose how far to go along a fixed direction: approximately minimise ``f(a)``, ``a >= 0``, from batches of
    function values only.

    ``evaluate(steps)`` returns ``f`` at every ``a`` of ``steps`` in one call (in the federated phase: one query
    round in which each node returns one scalar sum per ``a``). The first call evaluates ``f(0)`` and the geometric
    ``ladder``. While the smallest value sits at the largest ``a`` tried, the next call extends the ladder by
    ``len(ladder)`` more points, each ``factor`` times the previous, up to ``max_step`` (the bracketing phase of a
    line search, Nocedal & Wright, *Numerical Optimization* (2nd ed.), Sec. 3.5, with the step multiplied instead
    of chosen by the strong Wolfe conditions, which would need directional derivatives: ours, function values are
    what nodes can sum cheaply). When the smallest value sits at the smallest ``a > 0`` tried and above it ``f``
    rises, the next call tries ``len(ladder)`` smaller steps, each ``1 / factor`` of the previous, unless the slope
    at 0 extrapolated from the two smallest steps' secants is positive (then no smaller step can help). Once a tried
    ``a_i`` is lower than both neighbours, one more call evaluates the minimiser of the parabola through the three
    points (N&W Sec. 3.5, quadratic interpolation; exact for a quadratic ``f``) and the lower of the two is kept.
    If no ``a > 0`` lowers ``f`` below ``f(0)`` the step is 0 (nothing is moved rather than something made worse).

    Args:
        evaluate: ``list of a -> list of f(a)`` (same length, finite numbers).
        ladder: the first call's ``a > 0``, increasing.
        factor: ratio ``> 1`` of consecutive extension points.
        max_step: the largest ``a`` ever tried (``>= max(ladder)``).
        max_rounds: at most this many calls, the interpolation's included (``>= 1``).
        interpolate: whether to spend a call on the parabola's minimiser once bracketed.

    Returns:
        :class:`LineSearchResult`.

    Raises:
        ValueError: an empty, non-positive or non-increasing ``ladder``, ``factor <= 1``, ``max_step <
            max(ladder)``, ``max_rounds < 1``, or ``evaluate`` returning the wrong number of values or a non-finite
            one.
    """
    ladder = [float(a) for a in ladder]
    if not ladder or ladder[0] <= 0 or any(b <= a for a, b in zip(ladder, ladder[1:])):
        raise ValueError(f"ladder_line_search: ladder must be increasing numbers > 0, got {ladder!r}")
    if not (math.isfinite(factor) and factor > 1):
        raise ValueError(f"ladder_line_search: factor must be a finite number > 1, got {factor!r}")
    if not (max_step >= ladder[-1]):
        raise ValueError(f"ladder_line_search: max_step {max_step!r} is below the ladder's largest step {ladder[-1]}")
    if isinstance(max_rounds, bool) or int(max_rounds) != max_rounds or max_rounds < 1:
        raise ValueError(f"ladder_line_search: max_rounds must be an int >= 1, got {max_rounds!r}")
    tried: dict[float, float] = {}
    order: list[float] = []
    rounds = 0

    def ask(steps: list[float]) -> None:
        nonlocal rounds
        steps = [a for a in dict.fromkeys(steps) if a not in tried]
        if not steps:
            return
        values = [float(v) for v in evaluate(list(steps))]
        rounds += 1
        if len(values) != len(steps):
            raise ValueError(f"ladder_line_search: evaluate returned {len(values)} values for {len(steps)} steps")
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"ladder_line_search: evaluate returned a non-finite value: {values}")
        for a, v in zip(steps, values):
            tried[a] = v
            order.append(a)

    ask([0.0] + ladder)
    termination = "rounds"
    while True:
        points = sorted(tried)
        best = min(points, key=lambda a: (tried[a], a))
        index = points.index(best)
        if best == 0.0:
            positive = [a for a in points if a > 0]
            if (
                rounds >= max_rounds
                or positive[0] <= ladder[0] / factor ** (2 * len(ladder))
                or _slope_at_zero(tried, positive[0], positive[1]) > 0
            ):
                termination = "no-decrease"
                break
            ask([positive[0] / factor ** (j + 1) for j in range(len(ladder))])
            continue
        if index == len(points) - 1:
            if best >= max_step:
                termination = "max-step"
                break
            if rounds >= max_rounds:
                termination = "rounds"
                break
            ask([min(best * factor ** (j + 1), max_step) for j in range(len(ladder))])
            continue
        termination = "bracketed"
        if interpolate and rounds < max_rounds:
            left, right = points[index - 1], points[index + 1]
            vertex = _parabola_minimiser(left, tried[left], best, tried[best], right, tried[right])
            if vertex is not None and left < vertex < right:
                ask([vertex])
        break
    best = min(tried, key=lambda a: (tried[a], a))
    if tried[best] >= tried[0.0]:
        best, termination = 0.0, "no-decrease"
    return LineSearchResult(best, tried[best], order, [tried[a] for a in order], rounds, termination)


def _slope_at_zero(tried: dict, a1: float, a2: float) -> float:
    """``f'(0)`` estimated from the secant slopes ``s(a) = (f(a) - f(0)) / a`` at ``a1 < a2``, extrapolated linearly
    to ``a = 0`` (exact for a quadratic, whose secant slope is ``f'(0) + f'' a / 2``). Positive: ``f`` rises from
    0, so smaller steps would not help either and the search stops without refining downwards (ours)."""
    s1, s2 = (tried[a1] - tried[0.0]) / a1, (tried[a2] - tried[0.0]) / a2
    return s1 - (s2 - s1) * a1 / (a2 - a1)


def _parabola_minimiser(a0: float, f0: float, a1: float, f1: float, a2: float, f2: float) -> float | None:
    """The minimiser of the parabola through three points (``a0 < a1 < a2``), or ``None`` when it opens downwards or
    is flat (N&W Sec. 3.5)."""
    d01, d12 = (f1 - f0) / (a1 - a0), (f2 - f1) / (a2 - a1)
    curvature = (d12 - d01) / (a2 - a0)
    if not curvature > 0:
        return None
    # Newton's form p(a) = f0 + d01 (a - a0) + curvature (a - a0)(a - a1); p'(a) = 0 there
    return 0.5 * (a0 + a1) - d01 / (2.0 * curvature)


# ---------------------------------------------------------------------------------------------- products
Params = dict[str, torch.Tensor]


def gradient(loss_fn: Callable[[Params], torch.Tensor], params: Mapping[str, torch.Tensor]) -> Params:
    """``∇ loss_fn(params)`` as a dict shaped like ``params`` (``torch.func.grad``; no graph is kept)."""
    return {k: v.detach() for k, v in torch.func.grad(loss_fn)(dict(params)).items()}


def hessian_vector_product(
    loss_fn: Callable[[Params], torch.Tensor], params: Mapping[str, torch.Tensor], vector: Mapping[str, torch.Tensor]
) -> Params:
    """``H v`` where ``H = ∇² loss_fn(params)``, without forming ``H``.

    Forward-over-reverse: the directional derivative of the gradient, ``d/dt ∇L(params + t v)`` at ``t = 0``
    (``torch.func.jvp`` of ``torch.func.grad``; Pearlmutter 1994). Costs about two gradient evaluations and keeps no
    autograd graph afterwards, so memory stays flat over any number of products. Works through ``nn.Embedding``
    lookups (the rows not looked up get exactly 0).

    Args:
        loss_fn: ``params -> scalar`` (e.g. a ``torch.func.functional_call`` of the model and a loss).
        params: name -> tensor at which the Hessian is taken.
        vector: name -> tensor, same keys and shapes as ``params``.
    Returns:
        name -> ``(H v)[name]``.
    Raises:
        ValueError: ``vector``'s keys or shapes differ from ``params``'.
    """
    _check_vector("hessian_vector_product", params, vector)
    primals = dict(params)
    tangents = {k: vector[k].to(dtype=v.dtype, device=v.device) for k, v in primals.items()}
    _, product = torch.func.jvp(torch.func.grad(loss_fn), (primals,), (tangents,))
    return {k: v.detach() for k, v in product.items()}


CURVATURES = ("gauss-newton", "hessian")
"""Values of ``curvature``: the generalised Gauss-Newton matrix (:func:`gauss_newton_vector_product`) and the exact
Hessian (:func:`hessian_vector_product`)."""


@dataclass(frozen=True)
class CompositeLoss:
    """A loss written as ``output_loss(outputs(params)) + regulariser(params)``, so that its generalised Gauss-Newton
    matrix is defined (Schraudolph 2002; Martens 2010, "Deep learning via Hessian-free optimization").

    Attributes:
        outputs: ``params -> z``, the model's outputs (logits / scores), a tensor of any shape.
        output_loss: ``z -> scalar``, convex in ``z`` (then the Gauss-Newton matrix is positive semi-definite).
        regulariser: ``params -> scalar`` (e.g. L2 weight decay) whose exact Hessian is added, or ``None``.
    """

    outputs: Callable[[Params], torch.Tensor]
    output_loss: Callable[[torch.Tensor], torch.Tensor]
    regulariser: Callable[[Params], torch.Tensor] | None = None
    output_curvature: Callable[[torch.Tensor], torch.Tensor] | None = None
    """``z -> diag(H_z)`` (shaped like ``z``), the diagonal of ``output_loss``'s Hessian; needed by
    :func:`gauss_newton_diagonal` only."""
    row_keys: tuple = ()
    """Keys of row tables (item embeddings) from which each output reads exactly one row, ``example_rows[j]``."""
    example_rows: torch.Tensor | None = None
    """``(n_out,)`` int64: the row of the ``row_keys`` tables output ``j`` reads."""
    example_outputs: Callable[[Params], torch.Tensor] | None = None
    """``outputs`` with every ``row_keys`` table replaced by an ``(n_out, ...)`` table whose row ``j`` is the row output
    ``j`` reads: so ``∂z_j / ∂(row j)`` is the per-example Jacobian block, from one backward pass."""

    def __call__(self, params: Params) -> torch.Tensor:
        loss = self.output_loss(self.outputs(params))
        return loss if self.regulariser is None else loss + self.regulariser(params)


def gauss_newton_vector_product(
    loss: CompositeLoss, params: Mapping[str, torch.Tensor], vector: Mapping[str, torch.Tensor]
) -> Params:
    """``G v = J^T H_z J v + ∇²R v``: the generalised Gauss-Newton (GGN) matrix of ``loss`` times ``vector``.

    ``J = ∂z/∂params`` is the Jacobian of ``loss.outputs``, ``H_z = ∇²_z output_loss`` the loss Hessian with respect
    to the outputs and ``R`` the regulariser (Schraudolph 2002; Martens 2010, Sec. 4.2). It drops the Hessian's term
    ``sum_j (∂ℓ/∂z_j) ∇² z_j`` (the outputs' own curvature, what makes NCF's Hessian indefinite away from a minimum),
    so for a convex ``output_loss`` and a convex ``R`` the matrix is positive semi-definite whatever ``params`` are.
    For BCE on logits ``H_z`` is diagonal, ``w_j sigma(z_j) (1 - sigma(z_j))``; for BPR on pairs ``d = z_+ - z_-``
    it is ``w sigma(d) (1 - sigma(d)) [[1, -1], [-1, 1]]`` per pair (both computed here by differentiation, not by
    hand). For a model linear in ``params`` given the private embeddings (MF's score ``p_u . q_i`` in ``q_i``) the
    GGN equals the Hessian.

    Computed matrix-free with ``torch.func``: ``J v`` by ``jvp`` of ``outputs``, ``H_z (J v)`` by ``jvp`` of
    ``grad(output_loss)``, ``J^T (.)`` by ``vjp`` of ``outputs``; no graph is kept afterwards.

    Args:
        loss: the loss in its composite form.
        params: name -> tensor at which the matrix is taken.
        vector: name -> tensor, same keys and shapes as ``params``.
    Returns:
        name -> ``(G v)[name]``.
    Raises:
        ValueError: ``vector``'s keys or shapes differ from ``params'``.
    """
    _check_vector("gauss_newton_vector_product", params, vector)
    primals = dict(params)
    tangents = {k: vector[k].to(dtype=v.dtype, device=v.device) for k, v in primals.items()}
    z, jv = torch.func.jvp(loss.outputs, (primals,), (tangents,))
    z = z.detach()
    _, hjv = torch.func.jvp(torch.func.grad(loss.output_loss), (z,), (jv.detach(),))
    _, pullback = torch.func.vjp(loss.outputs, primals)
    (product,) = pullback(hjv.detach())
    product = {k: v.detach() for k, v in product.items()}
    if loss.regulariser is not None:
        extra = hessian_vector_product(loss.regulariser, params, vector)
        product = {k: product[k] + extra[k] for k in product}
    return product


def gauss_newton_diagonal(
    loss: CompositeLoss,
    params: Mapping[str, torch.Tensor],
    *,
    probes: int = 8,
    generator: torch.Generator | None = None,
) -> Params:
    """``diag(G)``: the diagonal of the generalised Gauss-Newton matrix ``G = J^T H_z J + ∇²R`` of
    :func:`gauss_newton_vector_product`, for a preconditioner (ours).

    ``diag(J^T H_z J)_k = sum_j H_z[j, j] (∂z_j / ∂theta_k)^2`` wherever at most one output's row of ``theta`` is
    touched per entry's cross term, which holds exactly on the ``row_keys`` tables: each output reads one row, so the
    cross terms ``H_z[j, l] J_jk J_lk`` (``j != l``) of ``diag(J^T H_z J)`` vanish there unless outputs ``j, l`` read
    the same row *and* ``H_z[j, l] != 0``; for BCE (diagonal ``H_z``) never; for BPR (``H_z`` couples a positive
    with its negative) only if a pair's two items were the same row, which the negative sampler excludes. One
    backward pass of ``sum_j eps_j z_j`` with respect to the per-example tables (``example_outputs``) gives
    ``eps_j ∂z_j / ∂(row j)`` for every ``j`` at once; squared with ``eps_j^2 = H_z[j, j]`` and summed into the rows
    read, it is the exact row diagonal. On the other (dense) keys, every output touches every entry, so the diagonal
    is estimated by Monte Carlo: ``E[(J^T eps)^2] = diag(J^T E[eps eps^T] J)`` with ``eps_j = s_j sqrt(H_z[j, j])``
    and Rademacher signs ``s`` (the MC Gauss-Newton diagonal, cf. Martens, Sutskever & Swersky 2012, "Estimating
    the Hessian by back-propagating curvature"), averaged over ``probes`` draws: unbiased when ``H_z`` is diagonal
    (BCE); for BPR it leaves out each pair's cross term ``2 H_z[+, -] J_+k J_-k`` (ours: a preconditioner only needs
    the scale). The regulariser's diagonal is ``∇²R 1`` (exact for an L2 term, whose Hessian is diagonal).

    Args:
        loss: a :class:`CompositeLoss` with ``output_curvature``, ``example_rows`` and ``example_outputs`` set.
        params: name -> tensor at which the matrix is taken (row tables ``(T, ...)``).
        probes: sign draws for the dense keys (>= 1; one draw suffices when every key is a row table).
        generator: the random stream of the signs (``None``: torch's global one).
    Returns:
        name -> ``diag(G)[name]`` (>= 0), shaped like ``params``.
    Raises:
        ValueError: ``loss`` lacks the per-example parts, or ``probes < 1``.
    """
    if loss.output_curvature is None or loss.example_outputs is None or loss.example_rows is None:
        raise ValueError("gauss_newton_diagonal: the loss needs output_curvature, example_rows and example_outputs")
    if isinstance(probes, bool) or int(probes) != probes or probes < 1:
        raise ValueError(f"gauss_newton_diagonal: probes must be an int >= 1, got {probes!r}")
    rows = loss.example_rows
    with torch.no_grad():
        z = loss.outputs(dict(params))
        scale = loss.output_curvature(z).clamp_min(0.0).sqrt()
    expanded = {k: (v.index_select(0, rows) if k in loss.row_keys else v) for k, v in params.items()}
    _, pullback = torch.func.vjp(loss.example_outputs, expanded)
    dense = [k for k in params if k not in loss.row_keys]
    draws = int(probes) if dense else 1
    out = {k: torch.zeros_like(v) for k, v in params.items()}
    for draw in range(draws):
        signs = torch.randint(0, 2, tuple(z.shape), generator=generator).to(z) * 2.0 - 1.0
        (grads,) = pullback((signs * scale).detach())
        for key, value in grads.items():
            if key in loss.row_keys:
                if draw == 0:  # exact: the same in every draw
                    out[key].index_add_(0, rows, value.detach() ** 2)
            else:
                out[key] += value.detach() ** 2 / draws
    if loss.regulariser is not None:
        extra = hessian_vector_product(loss.regulariser, params, {k: torch.ones_like(v) for k, v in params.items()})
        out = {k: out[k] + extra[k] for k in out}
    return out


def curvature_vector_product(
    loss_fn: Callable[[Params], torch.Tensor],
    params: Mapping[str, torch.Tensor],
    vector: Mapping[str, torch.Tensor],
    curvature: str,
) -> Params:
    """``C v`` for ``curvature`` in :data:`CURVATURES`: the GGN (``loss_fn`` must be a :class:`CompositeLoss`) or the
    exact Hessian.

    Raises:
        ValueError: an unknown curvature, or ``"gauss-newton"`` for a loss that is not a :class:`CompositeLoss`.
    """
    if curvature == "hessian":
        return hessian_vector_product(loss_fn, params, vector)
    if curvature == "gauss-newton":
        if not isinstance(loss_fn, CompositeLoss):
            raise ValueError("curvature 'gauss-newton' needs the loss as a CompositeLoss (outputs, output_loss)")
        return gauss_newton_vector_product(loss_fn, params, vector)
    raise ValueError(f"curvature must be one of {CURVATURES}, got {curvature!r}")


def _check_vector(name: str, params: Mapping[str, torch.Tensor], vector: Mapping[str, torch.Tensor]) -> None:
    if set(vector) != set(params):
        raise ValueError(f"{name}: vector keys {sorted(vector)} differ from params {sorted(params)}")
    for key, value in params.items():
        if tuple(vector[key].shape) != tuple(value.shape):
            raise ValueError(
                f"{name}: vector[{key!r}] has shape {tuple(vector[key].shape)}, expected {tuple(value.shape)}"
            )


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
