"""Client unlearning as a Flower phase: HF-KCU (Hessian-free Krylov causal unlearning) and its baselines.

HF-KCU: Mahdavi, Zamanifar, Farhadi, Kashefi, "Causal Unlearning in Collaborative Optimization: Exact and Approximate
Influence Reversal under Adversarial Contributions", arXiv:2605.20341 (2026). We had the abstract, not the full
text, so every choice the abstract does not fix is marked "ours" below.

**The step and its sign.** Let ``theta`` be the shared parameters (item embeddings, score function), every user's
private embedding held fixed, ``L(theta) = sum_u L_u(theta)`` with ``L_u`` user ``u``'s loss
(:meth:`fedrec_flwr.clients.fedrec.FedRecClient.influence_objective`), ``F`` the users to forget, ``R`` the others. At a minimiser
``theta*`` of ``L``, ``∇L_R(theta*) = -g_F`` with ``g_F = sum_{f in F} ∇L_f(theta*)``. One Newton step on the
remaining objective ``L_R`` from ``theta*`` gives the retrained optimum to second order (Koh & Liang 2017, influence
functions):

    theta_R ≈ theta* - H_R^{-1} ∇L_R(theta*) = theta* + H_R^{-1} g_F,    H_R = sum_{u in R} ∇² L_u(theta*).

So the unlearning step is ``delta = + s * x`` with ``x`` the CG solution of

    (H_R + damping I) x = g_F.

The model moves *along* the forgotten users' gradient (their loss rises), through the remaining users' inverse
curvature. For a quadratic ``L`` with ``s = 1`` and ``damping = 0`` the step lands exactly on the retrained optimum
(``tests/test_unlearning.py``). ``H_R`` is the Hessian of the *summed* loss: an item row's curvature is the sum over
the users whose loss uses that row (a popular item's row is stiff, a rare one's soft), so ``damping`` is compared
with per-row sums of user curvatures. (Normalising by the number of users, as influence functions do for a mean
loss, makes every row's curvature about ``1 / n_R`` of that and lets ``damping`` swamp it: we measured the full
step then equal to ``g_F / (n_R * damping)`` to 1e-4, a scaled gradient step.) ``s`` is ``unlearn-scale`` (eta).
With this summed-loss normalisation ``s = 1`` is the full influence step; the paper's default 0.01 is 1% of it, does
not transfer to our normalisation and measurably does nothing (relative update 1e-8 to 2e-4). With
``adaptive-scale`` (ours: the paper's rule is not in its abstract; the issue-6 arm) the step is also capped so that
it changes the parameters it touches by at most ``unlearn-max-step`` of their norm: ``s = min(eta, max_step *
||theta_S|| / ||x||)``.

**Curvature and solver (ours).** A 100-round federated model is not at a minimum, and there NCF's Hessian
is indefinite: plain CG met non-positive curvature after 2-4 iterations in every FedNCF setting and the step was
dropped. ``curvature = "gauss-newton"`` replaces ``H_R`` by the generalised Gauss-Newton matrix ``sum_u J_u^T H_z
J_u`` (positive semi-definite by construction; equal to the Hessian for MF; :func:`fedrec_flwr.unlearning.krylov.
gauss_newton_vector_product`); ``"hessian"`` keeps the exact Hessian. ``krylov-solver = "steihaug"`` solves the
trust-region subproblem ``min m(x) = -g_F^T x + 1/2 x^T (H_R + damping I) x, ||x|| <= Delta`` by Steihaug-Toint CG
(:func:`fedrec_flwr.unlearning.krylov.steihaug_cg`): inside the radius it is CG; when the next iterate would leave it, or a
direction of non-positive curvature appears, it steps to the boundary, so no solve is dropped. ``Delta =
trust-radius * ||theta_S||`` with ``theta_S`` the shared parameters ``g_F`` touches (its item rows and the dense
parameters), so the radius is a relative size (ours). ``"cg"`` is the issue-6 arm (plain CG, truncated at
non-positive curvature).

**Preconditioned trust region (ours).** ``krylov-preconditioner = "diagonal"`` (or ``"row"``) measures the
trust region in the norm ``||x||_M = sqrt(x^T M x)`` of a diagonal ``M`` built from the remaining users' Gauss-Newton
diagonal (:meth:`ClientUnlearning.preconditioner`; Steihaug 1983's preconditioned CG, :func:`fedrec_flwr.unlearning.krylov.
steihaug_cg`): rows on which few remaining users' losses curve (a promoted target item) may move further than rows
that many users pin (popular fillers). The diagonal costs one ``unlearn_diagonal`` query round in which each node
returns one row-sparse sum over its users (exact on item rows; Monte Carlo on NCF's MLP). Inside the radius the
answer is still the solve of the damped system. ``"none"`` (the default) is the Euclidean solve.

**How far to go: a line search on the remaining users' loss (ours).** With ``line-search =
"remaining-loss"`` the solver's step ``x`` (times ``unlearn-scale``) is only a direction: the phase moves ``a x``
with ``a`` chosen to minimise the remaining users' summed influence loss ``L_R(theta + a x)`` (the objective the
retrained model is trained on; each user's loss uses its fixed negative sample, so the values are deterministic for
a seed), by :func:`fedrec_flwr.unlearning.krylov.ladder_line_search`: ``f(0)`` and the geometric ladder ``a = 0.25, 0.5, ...,
8`` in one ``unlearn_loss`` query round, extended by factors of 2 (up to ``line-search-max-step``) or refined
downwards (unless ``L_R`` rises from 0) while the best value sits at an end, then one parabolic-interpolation point (Nocedal & Wright, *Numerical
Optimization*, 2nd ed., Sec. 3.5); at most ``line-search-rounds`` rounds. Each node answers one scalar sum per ``a``
over its remaining (with causal weighting: affected) users, never a per-user value; the rounds' messages, bytes and
time count in the phase. If no ``a > 0`` lowers ``L_R`` the step is 0. ``"none"`` (the default) keeps the fixed
radius. Measured (``experiments/hfkcu/README.md``): at the trained, non-stationary model ``L_R`` *rises* along the
step from ``a = 0`` (the forgotten and the remaining users' gradients agree on the shared popular rows), so on the
development setting the search takes no step; it is therefore an arm, not the default. Two further rules were
measured on four development settings and rejected before the benchmark (not keys): stopping where the forgotten
users' loss per example reaches a reference level, and a radius scaled by their share of the data
(``experiments/hfkcu/README.md``, ``results/poison-level.md``).

**How far to go: membership calibration (ours).** With ``line-search =
"membership-margin"`` the phase moves ``a x`` with ``a`` where the forgotten users' mean *membership margin* on the
items they dominate (their logit of such an item minus their mean logit of the same-popularity items they never
rated) reaches 0, the level of a model that never saw them (:mod:`fedrec_flwr.unlearning.margin`, with the derivation);
nodes reply with item counts and margin sums only (:meth:`ClientUnlearning.margin_step`). Measured
(``experiments/hfkcu/README.md``, ``results/poison-margin.md``): 2 of 5 development settings met (the fixed radius
1), 4 of 8 reported ones (the fixed radius 4; it fixes ML-100K's 20-fake overshoot, loses FilmTrust FedMF with 20
fakes and overshoots FilmTrust FedNCF), so it is an arm, not the default.

**Causal weighting.** Only users whose loss shares rows with ``g_F`` are *affected*: the server sends ``g_F``'s row
ids once to every node (``unlearn_affected``); each node answers how many of its users are affected (a node total,
never a per-user answer); nodes with none are not queried again, and inside a queried node users with no shared row
get weight 0. For MF this isolation is exact: with private embeddings
fixed, MF's Hessian is block-diagonal by item row (``∂²L_u / ∂q_i ∂q_j = 0`` for ``i != j``), so CG's iterates stay
on ``g_F``'s rows and users without them contribute nothing. NCF's shared MLP couples every user, so there the
restriction to affected users is an approximation (``causal-weighting = false`` queries everyone).

**Two ways to solve** (``krylov-mode``):

* ``distributed``: the server runs CG; each iteration sends the direction to the affected users' nodes
  (``unlearn_hvp``), which return ``sum_u H_u p``; the server sums them. This solves the federated system exactly up
  to CG's tolerance. With ``curvature-sample`` < 1 (ours; a cheaper product) only a seeded share of those
  nodes answers every product and the sum is scaled by all users over the drawn nodes' users
  (:func:`curvature_sample_nodes`; subsampled curvature as in Hessian-free optimisation, Martens 2010): a product
  costs that share of a full one, and the solve is of a noisy, unbiased estimate of the curvature.
* ``local`` (the paper's Algorithm 1 as the abstract and the issue describe it): each affected user ``u`` solves
  ``(H_u + damping I) x_u = g_F`` on its own Hessian (``unlearn_local_cg``) and the server takes ``x = sum_u w_u
  x_u`` with ``w_u = ||∇L_u|| / sum ||∇L_v||`` (causal weighting by gradient magnitude; uniform weights without it).
  A solve that meets non-positive curvature or ends worse than no step (relative residual > 1) is left out.

**Baselines** (``unlearning``): ``retrain`` (the forgotten users never train: the same seed samples the same other
users in every round, the gold standard), ``continue`` (drop them and train ``continue-rounds`` more rounds on the
rest), ``gradient-ascent`` (``ascent-steps`` steps ``theta += ascent-learning-rate * g_F(theta) / |F|``: ascent on
the forgotten users' mean loss, so the step does not grow with their number).

**Privacy.** The forgotten users' gradient is computed by their own clients on request (``unlearn_gradient``); the
server never sees their data, but ``g_F`` itself is revealing and HF-KCU must share it: the server receives it, and
every affected node receives its row ids and (as the right-hand side of local CG, or the first CG direction) its
values. For MF and BCE a single user's ``g_F`` gives away the user's rated items (the sign of each row's coefficient
separates positives from the sampled negatives) and the direction of its embedding. A node answers HVP and local-CG
queries only as sums over all its remaining users, as its training replies are; the server cannot pick a single
user. Nothing in this protocol lets a client verify that a forget request really came from the user: the operator
must only send ``unlearn_gradient`` for users who asked to leave (a probe of a user who did not is not prevented).

:class:`ClientUnlearning` runs the phase for a strategy (:class:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg` calls it
after ``unlearn-round``); experiments call it directly to compare variants on one trained model.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError, reply_error_line
from fedrec_flwr.seeding import numpy_rng
from fedrec_flwr.unlearning.krylov import (
    TERMINATIONS,
    CGResult,
    LineSearchResult,
    flatten,
    krylov_solve,
    ladder_line_search,
    unflatten,
)
from fedrec_flwr.unlearning.margin import bracket_root, dominated_items, popularity_bins
from fedrec_flwr.wire import (
    ARRAYS,
    CONFIG,
    METRICS,
    SUPPORT,
    UNLEARN_AFFECTED,
    UNLEARN_COUNTS,
    UNLEARN_DIAGONAL,
    UNLEARN_GRADIENT,
    UNLEARN_HVP,
    UNLEARN_LOCAL_CG,
    UNLEARN_LOSS,
    UNLEARN_MARGIN,
    VECTOR,
    ReplyError,
    nonzero_rows,
    pack_sparse,
    support_rows,
    unpack_sparse,
)

log = logging.getLogger(__name__)

TAG_FORGET = 15
"""Seed tag of the stream that draws ``forget-fraction`` of the users."""

TAG_CURVATURE_SAMPLE = 16
"""Seed tag of the stream that draws the nodes whose users' curvature ``curvature-sample`` queries."""

PRECONDITIONER_FLOOR = 0.01
"""``krylov-preconditioner``: ``M``'s entries are at least this share of the mean curvature over the touched entries
(ours: rows without remaining curvature get at most 10x the mean reach instead of an unbounded one)."""

PRECONDITIONER_PROBES = 8
"""Sign draws of the Monte Carlo Gauss-Newton diagonal on the dense (non-item-row) parameters (``krylov-preconditioner``;
ours: the item rows are exact, and a preconditioner needs only the scale of the dense entries)."""

METHODS = ("none", "retrain", "continue", "hfkcu", "gradient-ascent")
PHASE_METHODS = ("continue", "hfkcu", "gradient-ascent")
"""Methods that run a phase after ``unlearn-round`` (``retrain`` only changes sampling)."""


class UnlearningFailed(RuntimeError):
    """A node failed or sent an invalid reply during the unlearning phase (the phase cannot be exact without it)."""


def forget_set(config: RunConfig, num_users: int) -> np.ndarray:
    """The users to forget: ``forget-users`` plus ``round(forget-fraction * num_users)`` (at least one when the
    fraction is > 0) drawn without replacement from the stream ``(seed, TAG_FORGET)``; ``(n,)`` int64 sorted.

    Raises:
        ConfigError: a user index of ``forget-users`` is out of range, or every user would be forgotten.
    """
    explicit = np.asarray(config.forget_user_ids, dtype=np.int64)
    if explicit.size and explicit.max() >= num_users:
        raise ConfigError(
            f"run-config key 'forget-users' = {config.forget_users!r}: user index "
            f"{int(explicit.max())} is out of range (the dataset has {num_users} users)"
        )
    drawn = np.zeros(0, dtype=np.int64)
    if config.forget_fraction > 0:
        size = max(1, int(round(config.forget_fraction * num_users)))
        drawn = numpy_rng(config.seed, TAG_FORGET).choice(num_users, size=min(size, num_users), replace=False)
    users = np.union1d(explicit, drawn).astype(np.int64)
    if users.size >= num_users:
        raise ConfigError(f"forget-users / forget-fraction would forget all {num_users} users")
    return users


@dataclass(frozen=True)
class UnlearningSettings:
    """The unlearning keys of the run config, with the forget set resolved (see ``pyproject.toml``)."""

    method: str
    forget: tuple[int, ...]
    round: int
    krylov_mode: str = "distributed"
    krylov_solver: str = "steihaug"
    preconditioner: str = "none"
    curvature: str = "gauss-newton"
    trust_radius: float = 0.015
    cg_iterations: int = 10
    cg_tolerance: float = 1e-6
    damping: float = 0.01
    scale: float = 1.0
    adaptive_scale: bool = False
    max_step: float = 0.1
    line_search: str = "none"
    line_search_max_step: float = 64.0
    line_search_rounds: int = 4
    curvature_sample: float = 1.0
    seed: int = 0
    causal_weighting: bool = True
    ascent_steps: int = 5
    ascent_learning_rate: float = 0.1
    continue_rounds: int = 5

    @classmethod
    def from_config(cls, config: RunConfig, num_users: int) -> UnlearningSettings:
        """Settings of a validated config for a federation of ``num_users`` users (raises as :func:`forget_set`)."""
        return cls(
            method=config.unlearning,
            forget=tuple(int(u) for u in forget_set(config, num_users)),
            round=config.effective_unlearn_round,
            krylov_mode=config.krylov_mode,
            krylov_solver=config.krylov_solver,
            preconditioner=config.krylov_preconditioner,
            curvature=config.curvature,
            trust_radius=config.trust_radius,
            cg_iterations=config.cg_iterations,
            cg_tolerance=config.cg_tolerance,
            damping=config.damping,
            scale=config.unlearn_scale,
            adaptive_scale=config.adaptive_scale,
            max_step=config.unlearn_max_step,
            line_search=config.line_search,
            line_search_max_step=config.line_search_max_step,
            line_search_rounds=config.line_search_rounds,
            curvature_sample=config.curvature_sample,
            seed=config.seed,
            causal_weighting=config.causal_weighting,
            ascent_steps=config.ascent_steps,
            ascent_learning_rate=config.ascent_learning_rate,
            continue_rounds=config.continue_rounds,
        )

    def replace(self, **changes) -> UnlearningSettings:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


class ClientUnlearning:
    """Run one unlearning phase for ``strategy`` (an :class:`~fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg`): see the
    module docstring.

    Args:
        strategy: supplies the layout, the topology (which node serves which user), message building and, for
            ``continue``, its training round.
        settings: what to forget and how.
        timeout: seconds to wait for each query's replies.
    """

    def __init__(self, strategy, settings: UnlearningSettings, timeout: float = 600.0) -> None:
        if settings.method not in PHASE_METHODS:
            raise ValueError(f"method {settings.method!r} has no unlearning phase (phase methods: {PHASE_METHODS})")
        self.strategy = strategy
        self.settings = settings
        self.timeout = timeout
        self.layout = strategy.layout
        self.messages = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.server_round = 0
        """The round after which the phase runs (sent with every query: clients use that round's private state)."""

    # ------------------------------------------------------------------------------------------------ phase
    def run(self, grid: Grid, arrays: ArrayRecord, server_round: int) -> tuple[ArrayRecord, dict]:
        """Unlearn ``settings.forget`` from ``arrays`` (the shared parameters after ``server_round``).

        Returns:
            ``(new arrays, report)``; the report holds the method, the users, the affected users and nodes queried,
            messages sent, CG's iterations / residual / flags, the scale and the update's norm, and ``seconds`` (wall
            time of the whole phase, server side).
        Raises:
            UnlearningFailed: a node failed or sent an invalid reply.
        """
        s = self.settings
        started = time.perf_counter()
        self.messages = 0
        self.bytes_sent = self.bytes_received = 0
        self.server_round = int(server_round)
        forget = np.asarray(s.forget, dtype=np.int64)
        report: dict = {"method": s.method, "round": int(server_round), "forget-users": [int(u) for u in forget]}
        if s.method == "continue":
            new = self._continue(grid, arrays)
            report["continue-rounds"] = s.continue_rounds
        else:
            theta = {k: v.numpy().astype(np.float64) for k, v in arrays.items()}
            g_forget, loss = self.gradient(grid, arrays, forget)
            report["forget-loss"] = loss
            report["forget-gradient-norm"] = _norm(g_forget)
            if s.method == "gradient-ascent":
                step = self._gradient_ascent(grid, theta, g_forget)
                report.update({"ascent-steps": s.ascent_steps, "ascent-learning-rate": s.ascent_learning_rate})
            else:
                step = self._hfkcu(grid, arrays, theta, g_forget, forget, report)
            report["update-norm"] = _norm(step)
            report["relative-update"] = _norm(step) / max(_norm(theta), 1e-30)
            new = ArrayRecord({k: Array((theta[k] + step[k]).astype(np.float32)) for k in self.layout.shared_shapes})
        for key, value in new.items():
            if not np.isfinite(value.numpy()).all():
                raise UnlearningFailed(f"unlearning produced NaN or Inf in '{key}'; the model is left unchanged")
        report["messages"] = self.messages
        report["bytes-sent"] = self.bytes_sent
        report["bytes-received"] = self.bytes_received
        report["seconds"] = time.perf_counter() - started
        log.info("%s", describe_unlearning(report))
        return new, report

    # ------------------------------------------------------------------------------------------------ methods
    def _hfkcu(
        self, grid: Grid, arrays: ArrayRecord, theta: dict, g_forget: dict, forget: np.ndarray, report: dict
    ) -> dict:
        s = self.settings
        support = support_rows(g_forget, self.layout)
        affected = self.affected(grid, arrays, support, forget)
        nodes = [n for n, count in affected.items() if count > 0] if s.causal_weighting else list(affected)
        # each queried node's users in the curvature sum (curvature-sample scales a sample of nodes by it)
        self._curvature_users = {n: (affected[n] if s.causal_weighting else self._remaining[n]) for n in nodes}
        report.update(
            {
                "krylov-mode": s.krylov_mode,
                "causal-weighting": s.causal_weighting,
                "support-rows": int(support.size),
                "affected-users": int(sum(affected.values())),
                "remaining-users": int(self.strategy._topology().num_users - forget.size),
                "queried-nodes": len(nodes),
                "nodes": len(affected),
                "damping": s.damping,
                "cg-max-iterations": s.cg_iterations,
                "krylov-solver": s.krylov_solver,
                "krylov-preconditioner": s.preconditioner,
                "curvature": s.curvature,
            }
        )
        radius = None
        if s.krylov_solver == "steihaug":
            radius = s.trust_radius * _norm(_restrict(theta, g_forget, self.layout))
            if radius <= 0:  # the forgotten users touch only all-zero parameters: any finite radius (ours)
                radius = s.trust_radius
            # the config key (relative to the norm of the touched parameters) under its own name; the norm bound the
            # solve used under another
            report["trust-radius"] = s.trust_radius
            report["trust-radius-absolute"] = radius
        if not nodes:
            log.warning("unlearning: no remaining user shares a row with the forgotten users; the step is g / damping")
        if s.krylov_mode == "distributed":
            preconditioner = None
            if s.preconditioner != "none":
                if s.krylov_solver != "steihaug":
                    raise ValueError(
                        f"preconditioner {s.preconditioner!r} needs krylov_solver 'steihaug', got {s.krylov_solver!r}"
                    )
                preconditioner = self.preconditioner(grid, arrays, nodes, forget, support, g_forget, report)
            result = self.distributed_cg(
                grid, arrays, nodes, forget, support, g_forget, radius=radius, preconditioner=preconditioner
            )
            report.update(result.summary())
            report.update(
                {
                    "curvature-sample": s.curvature_sample,
                    "curvature-nodes": len(self.curvature_nodes),
                    "curvature-factor": self.curvature_factor,
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
            x = unflatten(result.x, self.layout.shared_shapes)
        else:
            x, stats = self.local_cg(grid, arrays, nodes, forget, support, g_forget, radius=radius)
            report.update(stats)
        scale = s.scale
        if s.adaptive_scale:
            changed = _norm(_restrict(theta, x, self.layout))
            size = _norm(x)
            if size > 0:
                scale = min(s.scale, s.max_step * changed / size)
        report["scale"] = scale
        step = {k: scale * x[k] for k in self.layout.shared_shapes}
        if s.line_search == "remaining-loss":
            search = self.line_search(grid, arrays, nodes, forget, support, step)
            report.update(search.summary())
            report["scale"] = scale * search.step
            step = {k: search.step * v for k, v in step.items()}
        elif s.line_search == "membership-margin":
            multiple = self.margin_step(grid, arrays, forget, step, report)
            report["scale"] = scale * multiple
            step = {k: multiple * v for k, v in step.items()}
        return step

    def _gradient_ascent(self, grid: Grid, theta: dict, g_forget: dict) -> dict:
        s = self.settings
        current = {k: v.copy() for k, v in theta.items()}
        gradient = g_forget
        for step in range(s.ascent_steps):
            if step:
                record = ArrayRecord({k: Array(v.astype(np.float32)) for k, v in current.items()})
                gradient, _ = self.gradient(grid, record, np.asarray(s.forget, dtype=np.int64))
            for key in current:
                current[key] += s.ascent_learning_rate * gradient[key] / max(len(s.forget), 1)
        return {k: current[k] - theta[k] for k in theta}

    def _continue(self, grid: Grid, arrays: ArrayRecord) -> ArrayRecord:
        """``continue-rounds`` training rounds of the strategy without the forgotten users (round numbers after the
        run's last, so they never repeat a training round's sample)."""
        strategy = self.strategy
        saved = (strategy.removed_users, strategy.last_train)
        strategy.removed_users = frozenset(strategy.removed_users) | set(self.settings.forget)
        try:
            for step in range(1, self.settings.continue_rounds + 1):
                server_round = strategy.num_rounds + step
                messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
                self.messages += len(messages)
                self.bytes_sent += sum(_payload_bytes(m.content) for m in messages)
                replies = list(grid.send_and_receive(messages, timeout=self.timeout))
                self.bytes_received += sum(_payload_bytes(m.content) for m in replies if not m.has_error())
                new, _ = strategy.aggregate_train(server_round, replies)
                if new is not None:
                    arrays = new
        finally:
            strategy.removed_users, strategy.last_train = saved
        return arrays

    # ------------------------------------------------------------------------------------------------ queries
    def gradient(self, grid: Grid, arrays: ArrayRecord, users: np.ndarray) -> tuple[dict, float]:
        """``g = sum_{u in users} ∇L_u`` at ``arrays`` (full float64 arrays by key) and the users' mean loss."""
        groups = self.strategy._topology().group(np.asarray(users, dtype=np.int64))
        replies = self._query(grid, UNLEARN_GRADIENT, {n: {"users": us} for n, us in groups.items()}, arrays)
        total = self._sum(replies)
        loss = sum(float(r.content[METRICS]["loss-sum"]) for r in replies)
        return total, loss / max(len(users), 1)

    def affected(self, grid: Grid, arrays: ArrayRecord, support: np.ndarray, forget: np.ndarray) -> dict[int, int]:
        """Node -> how many of its remaining users share an influence-loss row with ``support`` (every node asked)."""
        nodes = sorted({int(n) for n in self.strategy._topology().user_to_node.tolist()})
        exclude = [int(u) for u in forget]
        replies = self._query(grid, UNLEARN_AFFECTED, {n: {"exclude": exclude} for n in nodes}, arrays, support=support)
        self._remaining = {
            int(r.metadata.src_node_id): int(r.content[CONFIG].get("remaining-users", 0)) for r in replies
        }
        return {int(r.metadata.src_node_id): int(r.content[CONFIG]["affected-users"]) for r in replies}

    def _targets(self, nodes, forget: np.ndarray, extra: Mapping | None = None) -> dict[int, dict]:
        return {
            int(n): {"exclude": [int(u) for u in forget], "causal": self.settings.causal_weighting, **(extra or {})}
            for n in nodes
        }

    def _curvature_targets(self, nodes, forget: np.ndarray, extra: Mapping) -> tuple[dict, float]:
        """The nodes that answer curvature queries (with ``curvature-sample`` < 1 a seeded share of ``nodes``,
        :func:`curvature_sample_nodes`) with their configs, and the factor their sums are scaled by."""
        s = self.settings
        counts = getattr(self, "_curvature_users", None) or {int(n): 1 for n in nodes}
        sampled, factor = curvature_sample_nodes(
            {int(n): counts.get(int(n), 1) for n in nodes}, s.curvature_sample, s.seed
        )
        self.curvature_nodes, self.curvature_factor = sampled, factor
        return self._targets(sampled, forget, dict(extra)), factor

    def preconditioner(
        self, grid: Grid, arrays: ArrayRecord, nodes, forget: np.ndarray, support: np.ndarray, rhs: dict, report: dict
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
        s = self.settings
        shapes = self.layout.shared_shapes
        targets, factor = self._curvature_targets(nodes, forget, {"probes": PRECONDITIONER_PROBES, "seed": s.seed})
        sent, received = self.bytes_sent, self.bytes_received
        replies = self._query(grid, UNLEARN_DIAGONAL, targets, arrays, support=support)
        report["preconditioner-bytes-sent"] = self.bytes_sent - sent
        report["preconditioner-bytes-received"] = self.bytes_received - received
        diagonal = {k: factor * v for k, v in self._sum(replies).items()}
        if s.preconditioner == "row":
            diagonal = {
                k: (
                    np.broadcast_to(v.mean(axis=tuple(range(1, v.ndim)), keepdims=True), v.shape).copy()
                    if k in self.layout.item_keys and v.ndim > 1
                    else np.full_like(v, v.mean())
                )
                for k, v in diagonal.items()
            }
        touched = _restrict(diagonal, rhs, self.layout)
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
        self,
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
        shapes = self.layout.shared_shapes
        s = self.settings
        targets, factor = self._curvature_targets(nodes, forget, {"curvature": s.curvature})

        def matvec(flat: np.ndarray) -> np.ndarray:
            if not targets:
                return np.zeros_like(flat)
            replies = self._query(grid, UNLEARN_HVP, targets, arrays, vector=unflatten(flat, shapes), support=support)
            return factor * flatten(self._sum(replies), shapes)

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

    def remaining_loss(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        nodes,
        forget: np.ndarray,
        support: np.ndarray,
        direction: dict,
        steps: list,
    ) -> list[float]:
        """``[L_R(theta + a d) for a in steps]``: the remaining (with causal weighting: affected) users' summed
        influence loss along ``direction``, from one ``unlearn_loss`` query round (each node returns one scalar sum
        per step)."""
        replies = self._query(
            grid,
            UNLEARN_LOSS,
            self._targets(nodes, forget, {"steps": [float(a) for a in steps]}),
            arrays,
            vector=direction,
            support=support,
        )
        return _step_sums(replies, UNLEARN_LOSS, "loss-sums", len(steps)).tolist()

    def line_search(
        self, grid: Grid, arrays: ArrayRecord, nodes, forget: np.ndarray, support: np.ndarray, step: dict
    ) -> LineSearchResult:
        """``line-search = "remaining-loss"``: the multiple ``a`` of the solver's step that minimises the remaining
        users' summed training loss ``L_R(theta + a step)`` (:func:`fedrec_flwr.unlearning.krylov.ladder_line_search`; every
        round one :meth:`remaining_loss` query)."""
        s = self.settings
        return ladder_line_search(
            lambda steps: self.remaining_loss(grid, arrays, nodes, forget, support, step, steps),
            max_step=s.line_search_max_step,
            max_rounds=s.line_search_rounds,
        )

    def margin_step(self, grid: Grid, arrays: ArrayRecord, forget: np.ndarray, step: dict, report: dict) -> float:
        """``line-search = "membership-margin"``: the multiple ``a`` of the solver's step at which the forgotten
        users' mean membership margin on the items they dominate reaches 0 (:mod:`fedrec_flwr.unlearning.margin`). One
        ``unlearn_counts`` round (every node; no model sent), then :func:`fedrec_flwr.unlearning.margin.bracket_root`'s
        ``unlearn_margin`` rounds (the forgotten users' nodes), at most ``line-search-rounds`` of them, up to
        ``line-search-max-step``. Returns ``a`` (1 when no forgotten positive is a dominated item)."""
        s = self.settings
        topology = self.strategy._topology()
        nodes = sorted({int(n) for n in topology.user_to_node.tolist()})
        exclude = [int(u) for u in forget]
        smallest = int(np.unique(topology.user_to_node, return_counts=True)[1].min())
        log.warning(
            "line-search = 'membership-margin': every node sends its users' training-positive counts per item "
            "(unlearn_counts); a node serving %d user%s reveals %s (fedrec_flwr/unlearning/margin.py, 'Privacy "
            "cost')",
            smallest,
            "" if smallest == 1 else "s",
            "that user's training items" if smallest == 1 else "the sum of its users' training items",
        )
        replies = self._query(grid, UNLEARN_COUNTS, {n: {"exclude": exclude} for n in nodes}, ArrayRecord())
        counts = {"remaining": 0.0, "forgotten": 0.0}
        for reply in replies:
            for key in counts:
                counts[key] = counts[key] + reply.content[ARRAYS][key].numpy().astype(np.float64)
        bins = popularity_bins(counts["remaining"])
        dominated = dominated_items(counts["remaining"], counts["forgotten"])
        groups = topology.group(np.asarray(forget, dtype=np.int64))
        common = {"bins": [int(b) for b in bins], "dominated": [int(i) for i in dominated]}
        found: dict = {}

        def evaluate(steps) -> list[float]:
            if not steps:
                return []
            got = self._query(
                grid,
                UNLEARN_MARGIN,
                {n: {"users": us, "steps": [float(a) for a in steps], **common} for n, us in groups.items()},
                arrays,
                vector=step,
            )
            sums = _step_sums(got, UNLEARN_MARGIN, "margin-sums", len(steps))
            count = found["count"] = sum(int(reply.content[METRICS]["margin-count"]) for reply in got)
            return (sums / count).tolist() if count else [0.0] * len(steps)

        report["margin-dominated-items"] = int(dominated.size)
        if not np.intersect1d(dominated, np.flatnonzero(counts["forgotten"])).size:
            report.update({"margin-step": 1.0, "margin-termination": "no-dominated-items", "margin-rounds": 0})
            return 1.0
        result = bracket_root(evaluate, max_step=s.line_search_max_step, rounds=s.line_search_rounds)
        report.update(result.summary())
        report["margin-terms"] = int(found.get("count", 0))
        return result.step

    def local_cg(
        self,
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
        s = self.settings
        if not nodes:
            return {k: v / s.damping for k, v in rhs.items()}, {"local-cg-users": 0}
        targets = self._targets(
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
        replies = self._query(grid, UNLEARN_LOCAL_CG, targets, arrays, vector=rhs, support=support)
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
        total = self._sum(replies)
        if weight_sum <= 0:
            log.warning("unlearning: no local CG solve was usable; the step is 0")
            return {k: np.zeros_like(v) for k, v in total.items()}, stats
        return {k: v / weight_sum for k, v in total.items()}, stats

    # ------------------------------------------------------------------------------------------------ transport
    def _query(
        self,
        grid: Grid,
        action: str,
        targets: Mapping[int, Mapping],
        arrays: ArrayRecord,
        *,
        vector: Mapping[str, np.ndarray] | None = None,
        support: np.ndarray | None = None,
    ) -> list[Message]:
        """Send ``action`` to each node of ``targets`` (node -> its config) and return the replies in canonical order.

        Raises:
            UnlearningFailed: a node failed or did not answer in time.
        """
        if not targets:
            return []
        vector_record = (
            None if vector is None else ArrayRecord({k: Array(v) for k, v in pack_sparse(vector, self.layout).items()})
        )
        support_record = None if support is None else ArrayRecord({"rows": Array(np.asarray(support, dtype=np.int64))})
        messages = []
        for node, config in targets.items():
            # the run's message context (run name, durable round) and the round whose private state to use
            common = {**getattr(self.strategy, "message_config", {}), "server-round": self.server_round}
            content = RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({**common, **dict(config)})})
            if vector_record is not None:
                content[VECTOR] = vector_record
            if support_record is not None:
                content[SUPPORT] = support_record
            messages.append(Message(content=content, message_type=f"{MessageType.QUERY}.{action}", dst_node_id=node))
        self.messages += len(messages)
        self.bytes_sent += sum(_payload_bytes(m.content) for m in messages)
        replies = list(grid.send_and_receive(messages, timeout=self.timeout))
        self.bytes_received += sum(_payload_bytes(m.content) for m in replies if not m.has_error())
        failed = [m for m in replies if m.has_error()]
        if failed:
            raise UnlearningFailed(
                f"{action}: node {failed[0].metadata.src_node_id} failed: {reply_error_line(failed[0].error.reason)}"
            )
        if len(replies) != len(messages):
            raise UnlearningFailed(
                f"{action}: {len(replies)} of {len(messages)} nodes answered within {self.timeout:.0f} s"
            )
        return self.strategy._canonical_order(replies)

    def _sum(self, replies: list[Message]) -> dict[str, np.ndarray]:
        total = {k: np.zeros(s, dtype=np.float64) for k, s in self.layout.shared_shapes.items()}
        for reply in replies:
            try:
                vector = unpack_sparse({k: a.numpy() for k, a in reply.content[ARRAYS].items()}, self.layout)
            except ReplyError as err:
                raise UnlearningFailed(f"node {reply.metadata.src_node_id} sent an invalid vector: {err}") from err
            for key in total:
                total[key] += vector[key]
        return total


# ---------------------------------------------------------------------------------------------- helpers
def describe_unlearning(report: Mapping) -> str:
    """One console line for an unlearning phase's ``report`` (the dict written to ``unlearning.json``): the method,
    the users, the cost, why the Krylov solve stopped (``cg-termination``: ``"tolerance"``, ``"iterations"``,
    ``"negative-curvature"``, ``"boundary"``, ``"zero-rhs"``; :class:`fedrec_flwr.unlearning.krylov.CGResult`), the line search's
    step and why it stopped, and the size of the change (``relative-update``: ``||step|| / ||theta||``). Keys a method
    does not produce are left out, so this serves ``continue``, ``gradient-ascent`` and ``hfkcu``."""
    parts = [
        f"unlearning ({report.get('method')}) of {len(report.get('forget-users', ()))} users after round "
        f"{report.get('round')}: {float(report.get('seconds', 0.0)):.2f} s, {report.get('messages', 0)} messages"
    ]
    if "cg-iterations" in report:
        solve = f"CG {report['cg-iterations']} it, relative residual {float(report['cg-residual']):.2e}"
        if report.get("cg-termination"):
            solve += f", stopped on {report['cg-termination']}"
            if report["cg-termination"] in TERMINATIONS:
                solve += f" ({TERMINATIONS[report['cg-termination']]})"
        parts.append(solve)
    if "line-search-step" in report:
        parts.append(
            f"line search step {float(report['line-search-step']):.3g} ({report.get('line-search-termination', '')})"
        )
    if "relative-update" in report:
        parts.append(f"update {100 * float(report['relative-update']):.3g}% of the model's norm")
    return "; ".join(parts)


def describe_before(before: Mapping, server_round: int) -> str:
    """The console line of the ranking metrics measured just before the unlearning phase after ``server_round``
    (``before``: metric name -> value, e.g. ``{"HR@10": 0.41}``), saying that the metrics logged from that round's
    evaluation on (that round's included) are those of the unlearned model; ``""`` when ``before`` has no ranking
    metric."""
    shown = {k: float(v) for k, v in before.items() if "@" in k and isinstance(v, (int, float))}
    if not shown:
        return ""
    order = sorted(shown, key=lambda k: (k.split("@")[0], int(k.split("@")[1]) if k.split("@")[1].isdigit() else 0))
    return (
        "before unlearning: "
        + ", ".join(f"{k} {shown[k]:.4f}" for k in order)
        + f"; every evaluation from round {server_round} on is of the unlearned model"
    )


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


def _step_sums(replies: list[Message], action: str, key: str, steps: int) -> np.ndarray:
    """``(steps,)`` float64: the nodes' per-step sums under metric ``key`` added up.

    Raises:
        UnlearningFailed: a node sent another number of sums than steps asked.
    """
    totals = np.zeros(steps, dtype=np.float64)
    for reply in replies:
        sums = list(reply.content[METRICS].get(key, []))
        if len(sums) != steps:
            raise UnlearningFailed(
                f"{action}: node {reply.metadata.src_node_id} sent {len(sums)} sums for {steps} steps"
            )
        totals += np.asarray(sums, dtype=np.float64)
    return totals


def _payload_bytes(content: RecordDict) -> int:
    """Bytes of the arrays a message carries (every query re-sends the model; config records are not counted)."""
    return sum(len(array.data) for record in content.array_records.values() for array in record.values())


def _norm(vector: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.asarray(v, dtype=np.float64) ** 2)) for v in vector.values())))


def _restrict(theta: Mapping[str, np.ndarray], x: Mapping[str, np.ndarray], layout) -> dict[str, np.ndarray]:
    """The entries of ``theta`` that ``x`` changes: item rows where ``x`` is non-zero, dense keys where ``x`` is."""
    out = {}
    for key in layout.shared_shapes:
        if key in layout.item_keys:
            out[key] = theta[key][nonzero_rows(x[key])]
        elif np.any(x[key] != 0):
            out[key] = theta[key]
    return out
