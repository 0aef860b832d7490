"""HF-KCU's Krylov solve in the unlearning phase (:mod:`fedrec_flwr.strategies.unlearning` has the method, its
sign and the choices marked "ours"): the step from the forgotten users' gradient, the distributed or local solve of
the remaining users' damped curvature system, the diagonal preconditioner of the trust region, and the curvature
sample of nodes.

Each function takes the running phase (``phase``, a :class:`~fedrec_flwr.strategies.unlearning.ClientUnlearning`)
and calls back through its methods (queries, sums), so a phase variant (or a test) can replace one of them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from fedrec_flwr.seeding import numpy_rng
from fedrec_flwr.unlearning.krylov import CGResult, flatten, krylov_solve, unflatten
from fedrec_flwr.unlearning.radius import dominated_rows, mask_step
from fedrec_flwr.wire import METRICS, UNLEARN_DIAGONAL, UNLEARN_HVP, UNLEARN_LOCAL_CG, nonzero_rows, support_rows

from .unlearning_search import positive_counts

log = logging.getLogger("fedrec_flwr.strategies.unlearning")  # the phase's logger: its lines keep their source

TAG_CURVATURE_SAMPLE = 16
"""Seed tag of the stream that draws the nodes whose users' curvature ``curvature-sample`` queries."""

PRECONDITIONER_FLOOR = 0.01
"""``krylov-preconditioner``: ``M``'s entries are at least this share of the mean curvature over the touched entries
(ours: rows without remaining curvature get at most 10x the mean reach instead of an unbounded one)."""

PRECONDITIONER_PROBES = 8
"""Sign draws of the Monte Carlo Gauss-Newton diagonal on the dense (non-item-row) parameters (``krylov-preconditioner``;
ours: the item rows are exact, and a preconditioner needs only the scale of the dense entries)."""


def hfkcu_step(
    phase, grid: Grid, arrays: ArrayRecord, theta: dict, g_forget: dict, forget: np.ndarray, report: dict
) -> dict:
    """HF-KCU's step (full float64 arrays by key) from ``theta`` (the shared parameters) and ``g_forget`` (the
    forgotten users' summed gradient): the Krylov solve of ``krylov-mode``, scaled (``unlearn-scale``,
    ``adaptive-scale``) and, with ``line-search``, searched along; every figure goes into ``report``.

    Raises:
        ValueError: a preconditioner without the Steihaug solver.
        UnlearningFailed: a node failed or sent an invalid reply.
    """
    s = phase.settings
    support = support_rows(g_forget, phase.layout)
    affected = phase.affected(grid, arrays, support, forget)
    nodes = [n for n, count in affected.items() if count > 0] if s.causal_weighting else list(affected)
    # each queried node's users in the curvature sum (curvature-sample scales a sample of nodes by it)
    phase._curvature_users = {n: (affected[n] if s.causal_weighting else phase._remaining[n]) for n in nodes}
    report.update(
        {
            "krylov-mode": s.krylov_mode,
            "causal-weighting": s.causal_weighting,
            "support-rows": int(support.size),
            "affected-users": int(sum(affected.values())),
            "remaining-users": int(phase.strategy._topology().num_users - forget.size),
            "queried-nodes": len(nodes),
            "nodes": len(affected),
            "damping": s.damping,
            "cg-max-iterations": s.cg_iterations,
            "krylov-solver": s.krylov_solver,
            "krylov-preconditioner": s.preconditioner,
            "curvature": s.curvature,
        }
    )
    radius, mask = None, None
    if s.krylov_solver == "steihaug":
        radius, mask = trust_radius(phase, grid, theta, g_forget, forget, report)
    if not nodes:
        log.warning("unlearning: no remaining user shares a row with the forgotten users; the step is g / damping")
    if s.krylov_mode == "distributed":
        preconditioner = None
        if s.preconditioner != "none":
            if s.krylov_solver != "steihaug":
                raise ValueError(
                    f"preconditioner {s.preconditioner!r} needs krylov_solver 'steihaug', got {s.krylov_solver!r}"
                )
            preconditioner = phase.preconditioner(grid, arrays, nodes, forget, support, g_forget, report)
        result = phase.distributed_cg(
            grid, arrays, nodes, forget, support, g_forget, radius=radius, preconditioner=preconditioner
        )
        report.update(result.summary())
        report.update(
            {
                "curvature-sample": s.curvature_sample,
                "curvature-nodes": len(phase.curvature_nodes),
                "curvature-factor": phase.curvature_factor,
            }
        )
        if not result.converged and not result.boundary:
            # ours: a residual within 1e-3 of |g| is an accurate solve for a step scaled by unlearn-scale; only a
            # larger one (or a dropped step) is worth a warning
            level = logging.WARNING if result.residual > 1e-3 or result.negative_curvature else logging.INFO
            log.log(
                level,
                "unlearning: CG used all %d iterations (cg-iterations) and stopped at relative residual "
                "%.1e, above cg-tolerance %.0e: |H x - g| is %.1e of |g|%s",
                result.iterations,
                result.residual,
                s.cg_tolerance,
                result.residual,
                "; non-positive curvature: step dropped"
                if result.negative_curvature
                else " (raise cg-iterations, or cg-tolerance to accept it)",
            )
        x = unflatten(result.x, phase.layout.shared_shapes)
    else:
        x, stats = phase.local_cg(grid, arrays, nodes, forget, support, g_forget, radius=radius)
        report.update(stats)
    if mask is not None:  # krylov-masked-step: the solve's step on the dominated rows only
        x = mask_step(x, mask, phase.layout.item_keys)
    scale = s.scale
    if s.adaptive_scale:
        changed = norm(restrict(theta, x, phase.layout))
        size = norm(x)
        if size > 0:
            scale = min(s.scale, s.max_step * changed / size)
    report["scale"] = scale
    step = {k: scale * x[k] for k in phase.layout.shared_shapes}
    if s.line_search == "remaining-loss":
        search = phase.line_search(grid, arrays, nodes, forget, support, step)
        report.update(search.summary())
        report["scale"] = scale * search.step
        step = {k: search.step * v for k, v in step.items()}
    elif s.line_search == "membership-margin":
        multiple = phase.margin_step(grid, arrays, forget, step, report)
        report["scale"] = scale * multiple
        step = {k: multiple * v for k, v in step.items()}
    return step


def trust_radius(
    phase, grid: Grid, theta: dict, g_forget: dict, forget: np.ndarray, report: dict
) -> tuple[float, np.ndarray | None]:
    """The Steihaug solve's radius by ``krylov-radius-rule``, and the row mask of ``krylov-masked-step`` (``None``
    without it); both rules' figures go into ``report``.

    * ``"touched"``: ``trust-radius * ||theta_S||``, ``S`` every parameter ``g_F`` touches (its item rows, the
      forgotten users' negative sample included, and the dense keys);
    * ``"dominated"``: ``trust-radius * ||theta[D]||``, ``D`` the item rows whose training positives are at least
      ``krylov-radius-threshold`` forgotten (:func:`fedrec_flwr.unlearning.radius.dominated_rows`; one
      ``unlearn_counts`` round, :func:`.unlearning_search.positive_counts`). Without a dominated row the touched
      rule's radius is used and no mask (``radius-rule-fallback`` in the report).
    """
    s = phase.settings
    report["krylov-radius-rule"] = s.krylov_radius_rule
    mask = None
    if s.krylov_radius_rule == "dominated":
        counts = positive_counts(phase, grid, forget, "krylov-radius-rule = 'dominated'")
        dominated = dominated_rows(
            {k: theta[k] for k in phase.layout.item_keys},
            counts["remaining"],
            counts["forgotten"],
            factor=s.trust_radius,
            threshold=s.krylov_radius_threshold,
        )
        report.update({"dominated-rows": int(dominated.rows.size), "dominated-norm": dominated.norm})
        if dominated.radius > 0:
            report.update({"trust-radius": s.trust_radius, "trust-radius-absolute": dominated.radius})
            if s.krylov_masked_step:
                mask = dominated.mask
                report["krylov-masked-step"] = True
            return dominated.radius, mask
        log.warning("unlearning: the forgotten users dominate no item row; the touched rows set the trust radius")
        report["radius-rule-fallback"] = "touched"
    radius = s.trust_radius * norm(restrict(theta, g_forget, phase.layout))
    if radius <= 0:  # the forgotten users touch only all-zero parameters: any finite radius (ours)
        radius = s.trust_radius
    # the config key (relative to the norm of the touched parameters) under its own name; the norm bound the
    # solve used under another
    report["trust-radius"] = s.trust_radius
    report["trust-radius-absolute"] = radius
    return radius, mask


def curvature_targets(phase, nodes, forget: np.ndarray, extra: Mapping) -> tuple[dict, float]:
    """The nodes that answer curvature queries (with ``curvature-sample`` < 1 a seeded share of ``nodes``,
    :func:`curvature_sample_nodes`) with their configs, and the factor their sums are scaled by."""
    s = phase.settings
    counts = getattr(phase, "_curvature_users", None) or {int(n): 1 for n in nodes}
    sampled, factor = curvature_sample_nodes({int(n): counts.get(int(n), 1) for n in nodes}, s.curvature_sample, s.seed)
    phase.curvature_nodes, phase.curvature_factor = sampled, factor
    return phase._targets(sampled, forget, dict(extra)), factor


def preconditioner(
    phase, grid: Grid, arrays: ArrayRecord, nodes, forget: np.ndarray, support: np.ndarray, rhs: dict, report: dict
) -> np.ndarray:
    """``krylov-preconditioner``: the diagonal of ``M`` for the trust-region solve (flattened in the layout's key
    order), from one ``unlearn_diagonal`` query round (ours).

    Each queried node returns the diagonal of its remaining (affected) users' summed Gauss-Newton matrix, one
    row-sparse sum over its users as an HVP reply (:func:`fedrec_flwr.unlearning.influence.influence_gn_diagonal`: exact on
    item rows, a :data:`PRECONDITIONER_PROBES`-draw Monte Carlo estimate on dense parameters); the server adds
    them (scaled as the products are, :meth:`_curvature_targets`): ``d = diag(sum_u G_u)``. ``"row"`` replaces
    ``d`` by its mean over each item row's entries (and over each dense key), a block-diagonal ``M`` of scaled
    identities. Then ``M = (d + floor) / mean_S(d + floor)`` with ``floor = PRECONDITIONER_FLOOR * mean_S(d)``,
    ``S`` the entries the forgotten users' gradient touches (its item rows and the dense keys, the entries whose
    norm sets the radius): so a step spread evenly over ``S`` has the same ``M``-norm as Euclidean norm and the
    radius keeps its meaning on average, while rows with little remaining curvature (e.g. a target item that few
    genuine users rate) get a longer reach and stiff rows (popular fillers) a shorter one: the scaled trust region
    of Nocedal & Wright Sec. 4.5 with the curvature's diagonal. ``damping`` is left out of ``M`` (ours): on the development
    setting the per-entry Gauss-Newton curvature of these per-user mean losses averaged 3e-4 against damping 0.01,
    and ``d + damping`` lay within 0.97-1.15 of its mean (no change of shape). With no curvature on ``S``
    (``mean_S(d) = 0``) ``M = I``. The round's bytes are also reported as ``preconditioner-bytes-sent`` /
    ``-received``; they count in the phase's.
    """
    s = phase.settings
    shapes = phase.layout.shared_shapes
    targets, factor = phase._curvature_targets(nodes, forget, {"probes": PRECONDITIONER_PROBES, "seed": s.seed})
    sent, received = phase.bytes_sent, phase.bytes_received
    replies = phase._query(grid, UNLEARN_DIAGONAL, targets, arrays, support=support)
    report["preconditioner-bytes-sent"] = phase.bytes_sent - sent
    report["preconditioner-bytes-received"] = phase.bytes_received - received
    diagonal = {k: factor * v for k, v in phase._sum(replies).items()}
    if s.preconditioner == "row":
        diagonal = {
            k: (
                np.broadcast_to(v.mean(axis=tuple(range(1, v.ndim)), keepdims=True), v.shape).copy()
                if k in phase.layout.item_keys and v.ndim > 1
                else np.full_like(v, v.mean())
            )
            for k, v in diagonal.items()
        }
    touched = restrict(diagonal, rhs, phase.layout)
    count = sum(v.size for v in touched.values())
    mean = sum(float(v.sum()) for v in touched.values()) / count if count else 0.0
    if mean <= 0:
        log.warning("unlearning: the remaining users have no curvature on the forgotten users' rows; M = I")
        report.update({"krylov-preconditioner": s.preconditioner, "preconditioner-mean": 0.0})
        return np.ones(sum(int(np.prod(v)) for v in shapes.values()))
    floor = PRECONDITIONER_FLOOR * mean
    m = (flatten(diagonal, shapes) + floor) / (mean + floor)
    on_support = (np.concatenate([v.reshape(-1) for v in touched.values()]) + floor) / (mean + floor)
    report.update(
        {
            "krylov-preconditioner": s.preconditioner,
            "preconditioner-mean": mean,
            "preconditioner-min": float(on_support.min()),
            "preconditioner-max": float(on_support.max()),
        }
    )
    return m


def distributed_cg(
    phase,
    grid: Grid,
    arrays: ArrayRecord,
    nodes,
    forget: np.ndarray,
    support: np.ndarray,
    rhs: dict,
    radius: float | None = None,
    preconditioner: np.ndarray | None = None,
) -> CGResult:
    """CG (``krylov-solver``: plain, or trust-region within ``radius``, in the ``M``-norm of ``preconditioner``
    when given, :meth:`preconditioner`) on ``(sum_u C_u + damping I) x = rhs``
    over the remaining (with causal weighting: affected) users of ``nodes``, ``C_u`` the curvature of
    ``curvature`` (Hessian or Gauss-Newton), one ``unlearn_hvp`` query round per product; with ``curvature-sample``
    < 1 over the drawn nodes only, scaled up (:func:`curvature_sample_nodes`)."""
    shapes = phase.layout.shared_shapes
    s = phase.settings
    targets, factor = phase._curvature_targets(nodes, forget, {"curvature": s.curvature})

    def matvec(flat: np.ndarray) -> np.ndarray:
        if not targets:
            return np.zeros_like(flat)
        replies = phase._query(grid, UNLEARN_HVP, targets, arrays, vector=unflatten(flat, shapes), support=support)
        return factor * flatten(phase._sum(replies), shapes)

    return krylov_solve(
        matvec,
        flatten(rhs, shapes),
        solver=s.krylov_solver,
        iterations=s.cg_iterations,
        damping=s.damping,
        tolerance=s.cg_tolerance,
        radius=radius,
        preconditioner=preconditioner,
    )


def local_cg(
    phase,
    grid: Grid,
    arrays: ArrayRecord,
    nodes,
    forget: np.ndarray,
    support: np.ndarray,
    rhs: dict,
    radius: float | None = None,
) -> tuple[dict, dict]:
    """``sum_u w_u x_u / sum_u w_u`` over the remaining (affected) users of ``nodes``, each ``x_u`` solved on its
    own node (``w_u`` = gradient norm with causal weighting, else 1), and the solves' statistics."""
    s = phase.settings
    if not nodes:
        return {k: v / s.damping for k, v in rhs.items()}, {"local-cg-users": 0}
    targets = phase._targets(
        nodes,
        forget,
        {
            "iterations": s.cg_iterations,
            "damping": s.damping,
            "tolerance": s.cg_tolerance,
            "curvature": s.curvature,
            "solver": s.krylov_solver,
            **({"radius": float(radius)} if radius is not None else {}),
        },
    )
    replies = phase._query(grid, UNLEARN_LOCAL_CG, targets, arrays, vector=rhs, support=support)
    metrics = [r.content[METRICS] for r in replies]
    weight_sum = sum(float(m["weight-sum"]) for m in metrics)
    stats = {
        "local-cg-users": int(sum(float(m["solved"]) for m in metrics)),
        "local-cg-dropped": int(sum(float(m["dropped"]) for m in metrics)),
        "cg-iterations": int(max(float(m["max-iterations"]) for m in metrics)),
        "cg-residual": float(max(float(m["max-residual"]) for m in metrics)),
        "local-cg-not-converged": int(sum(float(m["not-converged"]) for m in metrics)),
        "local-cg-negative-curvature": int(sum(float(m["negative-curvature"]) for m in metrics)),
        "local-cg-boundary": int(sum(float(m.get("boundary", 0.0)) for m in metrics)),
    }
    if stats["local-cg-not-converged"] or stats["local-cg-dropped"]:
        log.warning(
            "unlearning: %d local CG solves did not converge, %d were left out (non-positive curvature "
            "or residual > 1); %d used",
            stats["local-cg-not-converged"],
            stats["local-cg-dropped"],
            stats["local-cg-users"],
        )
    total = phase._sum(replies)
    if weight_sum <= 0:
        log.warning("unlearning: no local CG solve was usable; the step is 0")
        return {k: np.zeros_like(v) for k, v in total.items()}, stats
    return {k: v / weight_sum for k, v in total.items()}, stats


def curvature_sample_nodes(users: Mapping[int, int], fraction: float, seed: int) -> tuple[list[int], float]:
    """The nodes whose users' curvature the distributed solve queries, and the factor its summed products are scaled
    by (``curvature-sample``; ours).

    A subsampled curvature, as Hessian-free optimisation computes its curvature-vector products on a part of the data
    (Martens 2010, "Deep learning via Hessian-free optimization", Sec. 4.3; Byrd, Chin, Neveitt & Nocedal 2011,
    "On the use of stochastic Hessian information in optimization methods for machine learning"): ``max(1,
    round(fraction * n))`` of the ``n`` nodes are drawn without replacement from the stream ``(seed,
    TAG_CURVATURE_SAMPLE)``, the same nodes for every product of the solve (so CG sees one fixed symmetric
    operator), and each product is scaled by ``sum_all users / sum_drawn users`` (a ratio estimator of the full sum).
    Nodes still answer only sums over all their (affected) users, so nothing per user is revealed.

    Args:
        users: node id -> its users in the curvature sum (affected users with causal weighting, else remaining).
        fraction: the share of nodes to query, in ``(0, 1]``; 1 queries every node (factor 1).
        seed: the run's seed.
    Returns:
        ``(sorted node ids, factor)``; ``([], 1.0)`` for no nodes.
    Raises:
        ValueError: ``fraction`` outside ``(0, 1]``.
    """
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"curvature-sample must be in (0, 1], got {fraction!r}")
    nodes = sorted(int(n) for n in users)
    if not nodes or fraction >= 1.0:
        return nodes, 1.0
    size = max(1, int(round(fraction * len(nodes))))
    drawn = sorted(int(n) for n in numpy_rng(seed, TAG_CURVATURE_SAMPLE).choice(nodes, size=size, replace=False))
    total, sampled = sum(users[n] for n in nodes), sum(users[n] for n in drawn)
    return drawn, (total / sampled) if sampled > 0 else 1.0


def norm(vector: Mapping[str, np.ndarray]) -> float:
    """The Euclidean norm of a vector given as arrays by key (float64)."""
    return float(np.sqrt(sum(float(np.sum(np.asarray(v, dtype=np.float64) ** 2)) for v in vector.values())))


def restrict(theta: Mapping[str, np.ndarray], x: Mapping[str, np.ndarray], layout) -> dict[str, np.ndarray]:
    """The entries of ``theta`` that ``x`` changes: item rows where ``x`` is non-zero, dense keys where ``x`` is."""
    out = {}
    for key in layout.shared_shapes:
        if key in layout.item_keys:
            out[key] = theta[key][nonzero_rows(x[key])]
        elif np.any(x[key] != 0):
            out[key] = theta[key]
    return out
