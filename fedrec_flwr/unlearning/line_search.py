"""A line search from batches of function values: how far to go along a step HF-KCU's Krylov solvers computed
(:mod:`fedrec_flwr.unlearning.krylov`; run-config key ``line-search``).

:func:`ladder_line_search` asks for ``f`` at a geometric ladder of step multiples per call (in the federated phase one
query round, each node returning one scalar sum per multiple), extends or shrinks the ladder until a tried multiple is
lower than its neighbours, and refines that bracket by parabolic interpolation (Nocedal & Wright, Sec. 3.5). Pure
Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


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
