"""The client-unlearning section of the run configuration: what to forget, when, and how (HF-KCU and its baselines).

:class:`UnlearningSection` declares the keys of the ``client unlearning`` group of ``[tool.flwr.app.config]`` (their
defaults and meanings are there); :class:`fedrec_flwr.config.RunConfig` inherits it, and the unlearning phase reads
its settings from it (:class:`fedrec_flwr.strategies.unlearning.UnlearningSettings`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.fields import INT_MAX, config_key

METHODS = ("auto", "none", "retrain", "continue", "hfkcu", "gradient-ascent", "rollback")
"""The values of ``unlearning`` (``"auto"`` is resolved by :func:`resolve_unlearning` before any check)."""

PHASE_METHODS = ("continue", "hfkcu", "gradient-ascent", "rollback")
"""Methods that run a phase after ``unlearn-round`` (``retrain`` only changes sampling)."""

APPROXIMATE_METHODS = ("hfkcu", "gradient-ascent")
"""Methods whose result ``unlearning-post-check`` checks (an approximate step that can be undone)."""

HISTORY_DTYPES = ("off", "float32", "float16", "float64")
"""The values of ``unlearning-history``: off, or the storage dtype of the stored deltas
(:data:`fedrec_flwr.unlearning.history.DTYPES`)."""


def resolve_unlearning(unlearning: str, forget_users: str, forget_fraction: float, history: str) -> str:
    """``unlearning`` with ``"auto"`` resolved to the default recipe: ``"none"`` when no user is to be forgotten
    (``forget-users`` empty and ``forget-fraction`` 0), else ``"rollback"`` when the run stores its contributions
    (``unlearning-history`` not ``"off"``: the replay of the stored rounds without the forgotten users), else
    ``"hfkcu"`` (one approximate influence step; :func:`resolve_post_check` checks it when the run holds out a
    validation item). Why this order, with its measured numbers: ``docs/how-to/forget-a-user.md`` and
    ``experiments/hfkcu/results/band/recipe.md``. Any other value is returned unchanged."""
    if unlearning != "auto":
        return unlearning
    if not str(forget_users).strip(", ") and not forget_fraction:
        return "none"
    return "rollback" if history != "off" else "hfkcu"


def resolve_post_check(post_check: str, unlearning: str, holdout_validation: bool) -> str:
    """``unlearning-post-check`` with ``"auto"`` resolved: ``"on"`` for an approximate method
    (:data:`APPROXIMATE_METHODS`, after :func:`resolve_unlearning`) in a run with ``holdout-validation`` (the check
    ranks the validation item, never the test item), else ``"off"``. Any other value is returned unchanged."""
    if post_check != "auto":
        return post_check
    return "on" if unlearning in APPROXIMATE_METHODS and holdout_validation else "off"


CHOICES: dict[str, tuple[str, ...]] = {
    "unlearning": METHODS,
    "krylov-mode": ("distributed", "local"),
    "krylov-solver": ("steihaug", "cg"),
    "krylov-preconditioner": ("none", "diagonal", "row"),
    "curvature": ("gauss-newton", "hessian"),
    "line-search": ("none", "remaining-loss", "membership-margin"),
    "unlearning-history": HISTORY_DTYPES,
    "krylov-radius-rule": ("touched", "dominated"),
    "unlearning-post-check": ("auto", "off", "on"),
}
"""The allowed values of the section's string keys that take one of a few."""


def _key(name: str, *, minimum: float | None = None, maximum: float | None = None, positive: bool = False) -> Any:
    return config_key(name, minimum=minimum, maximum=maximum, positive=positive, choices=CHOICES.get(name, ()))


@dataclass(frozen=True)
class UnlearningSection:
    """The run-config keys of client unlearning: the forget set, the phase's round, HF-KCU's solver, curvature, step
    and line search, and the baselines' own keys."""

    unlearning: str = _key("unlearning")
    forget_users: str = _key("forget-users")
    forget_fraction: float = _key("forget-fraction", minimum=0.0, maximum=1.0)
    unlearn_round: int = _key("unlearn-round", minimum=0)
    krylov_mode: str = _key("krylov-mode")
    krylov_solver: str = _key("krylov-solver")
    krylov_preconditioner: str = _key("krylov-preconditioner")
    curvature: str = _key("curvature")
    trust_radius: float = _key("trust-radius", positive=True)
    cg_iterations: int = _key("cg-iterations", minimum=1)
    cg_tolerance: float = _key("cg-tolerance", minimum=0.0)
    damping: float = _key("damping", minimum=0.0)
    unlearn_scale: float = _key("unlearn-scale", positive=True)
    adaptive_scale: bool = _key("adaptive-scale")
    unlearn_max_step: float = _key("unlearn-max-step", positive=True)
    line_search: str = _key("line-search")
    line_search_max_step: float = _key("line-search-max-step", minimum=8.0)
    line_search_rounds: int = _key("line-search-rounds", minimum=1, maximum=20)
    curvature_sample: float = _key("curvature-sample", positive=True, maximum=1.0)
    causal_weighting: bool = _key("causal-weighting")
    ascent_steps: int = _key("ascent-steps", minimum=1)
    ascent_learning_rate: float = _key("ascent-learning-rate", positive=True)
    continue_rounds: int = _key("continue-rounds", minimum=1)
    unlearning_history: str = _key("unlearning-history")
    rollback_calibration_every: int = _key("rollback-calibration-every", minimum=0)
    rollback_tuning_rounds: int = _key("rollback-tuning-rounds", minimum=0)
    krylov_radius_rule: str = _key("krylov-radius-rule")
    krylov_radius_threshold: float = _key("krylov-radius-threshold", positive=True, maximum=1.0)
    krylov_masked_step: bool = _key("krylov-masked-step")
    unlearning_post_check: str = _key("unlearning-post-check")
    post_check_max_hr_drop: float = _key("post-check-max-hr-drop", minimum=0.0)
    post_check_max_ndcg_drop: float = _key("post-check-max-ndcg-drop", minimum=0.0)
    post_check_min_loss_rise: float = _key("post-check-min-loss-rise", minimum=0.0)

    @classmethod
    def of(cls, config: UnlearningSection) -> UnlearningSection:
        """The section's values of ``config`` (a :class:`fedrec_flwr.config.RunConfig`, or a section) on their own."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def defaults(cls) -> UnlearningSection:
        """The section of the project's default run config (``pyproject.toml``,
        :func:`fedrec_flwr.config.default_run_config`)."""
        from fedrec_flwr.config import default_run_config

        return cls.of(default_run_config())

    @property
    def forget_user_ids(self) -> tuple[int, ...]:
        """The user indices of ``forget-users`` (sorted, unique), e.g. ``(3, 17)``; ``()`` when empty (the split's
        user order: with ``users-per-node`` 1 a user's index is its node's ``partition-id``).

        Raises:
            ConfigError: an entry is not an integer, is negative or exceeds :data:`~fedrec_flwr.sections.fields.
                INT_MAX`.
        """
        parts = [p.strip() for p in str(self.forget_users).split(",") if p.strip()]
        try:
            values = sorted({int(p) for p in parts})
        except ValueError:
            raise ConfigError(
                f"run-config key 'forget-users' = {self.forget_users!r}: expected comma-separated "
                'user indices in one string, e.g. forget-users="3,17" (--run-config) or '
                "forget-users=3,17 (the launcher); not a TOML array"
            ) from None
        if values and values[0] < 0:
            raise ConfigError(f"run-config key 'forget-users' = {self.forget_users!r}: user indices are >= 0")
        if values and values[-1] > INT_MAX:
            raise ConfigError(
                f"run-config key 'forget-users' = {self.forget_users!r}: user index {values[-1]} is "
                f"out of range (at most {INT_MAX})"
            )
        return tuple(values)

    def _check_unlearning(self) -> None:
        """The relations between the section's keys (and ``num-server-rounds``, in
        :class:`fedrec_flwr.config.RunConfig`); called by :meth:`fedrec_flwr.config.RunConfig.from_mapping`.

        Raises:
            ConfigError: a method without users to forget, a phase after the last round, local solves without
                damping, or a preconditioner without the distributed Steihaug solve (naming the keys).
        """
        forget = self.forget_user_ids  # validates the list
        if self.unlearning != "none" and not forget and self.forget_fraction == 0:
            raise ConfigError(
                f"run-config key 'unlearning' = {self.unlearning!r} needs users to forget: set "
                "'forget-users' (user indices) or 'forget-fraction'"
            )
        if self.unlearn_round > self.num_server_rounds:
            raise ConfigError(
                f"run-config key 'unlearn-round' = {self.unlearn_round} is after the last round "
                f"(num-server-rounds = {self.num_server_rounds})"
            )
        if self.unlearning == "hfkcu" and self.krylov_mode == "local" and self.damping == 0:
            raise ConfigError(
                "run-config key 'damping' = 0 with krylov-mode = 'local': one user's Hessian is singular "
                "(zero on every row it never touches); set damping > 0"
            )
        self._check_history_keys()
        if self.krylov_preconditioner != "none" and (
            self.krylov_solver != "steihaug" or self.krylov_mode != "distributed"
        ):
            raise ConfigError(
                f"run-config key 'krylov-preconditioner' = {self.krylov_preconditioner!r} needs "
                f"krylov-solver = 'steihaug' and krylov-mode = 'distributed', got {self.krylov_solver!r} "
                f"and {self.krylov_mode!r}; or set it to 'none'"
            )

    def _check_history_keys(self) -> None:
        """The relations of the history, rollback, radius-rule and post-check keys (with ``users-per-node``,
        ``holdout-validation`` and ``adversary`` of :class:`fedrec_flwr.config.RunConfig`).

        Raises:
            ConfigError: ``rollback`` without a history, the history with
                FedAU²'s adversary (its replies carry gradients), the masked step without the dominated rule, or the
                post-check without the validation item or an approximate method (naming the keys).
        """
        history = self.unlearning_history != "off"
        if self.unlearning == "rollback" and not history:
            raise ConfigError(
                "run-config key 'unlearning' = 'rollback' replays the stored contributions: set "
                "'unlearning-history' = 'float32' (or 'float16') to store them"
            )
        if history and getattr(self, "adversary", "none") != "none":
            raise ConfigError(
                f"run-config key 'unlearning-history' = {self.unlearning_history!r} stores parameter updates, but "
                f"adversary = {self.adversary!r} uploads gradients of h_w; set unlearning-history = 'off'"
            )
        if self.krylov_masked_step and self.krylov_radius_rule != "dominated":
            raise ConfigError(
                "run-config key 'krylov-masked-step' = true needs krylov-radius-rule = 'dominated' (the mask is "
                f"the dominated rows), got {self.krylov_radius_rule!r}"
            )
        if self.unlearning_post_check == "on":
            if self.unlearning not in APPROXIMATE_METHODS:
                raise ConfigError(
                    f"run-config key 'unlearning-post-check' = 'on' checks an approximate step "
                    f"(unlearning = {' or '.join(APPROXIMATE_METHODS)}), got unlearning = {self.unlearning!r}"
                )
            if not getattr(self, "holdout_validation", True):
                raise ConfigError(
                    "run-config key 'unlearning-post-check' = 'on' ranks the remaining users' validation item: "
                    "set 'holdout-validation' = true"
                )
