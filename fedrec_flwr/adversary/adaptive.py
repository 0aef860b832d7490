"""An adaptive GRL weight for FedAU²: ``eps`` set each round from statistics of ``h_w`` summed over the users.

Why. FedAU²'s GRL weight ``eps`` (``adversary-epsilon``) is fixed, and the value that protects depends on the dataset,
the model and the objective: on MovieLens-100K / FedNCF ``eps = 0.1`` barely moves the attacker's AUC (0.654 ->
0.645), while elsewhere ``eps = 1`` pushes the embeddings past ``h_w``'s boundary and writes the attribute in again
with its sign inverted (AUC 0.442). This module chooses ``eps`` from what the protocol can see.

**What the server sees.** Only sums over the round's sampled users of the fixed-length vector
:func:`adversary_statistics` gives per user (layout in :data:`STATISTICS`), delivered by a secure-aggregation phase:
the server learns per-class counts of users, of users ``h_w`` classifies correctly, and per-class sums of ``h_w``'s
probability of the true class and of its cross-entropy, never one user's vector (which names its label) and never a
test label. Every entry is a sum over users, so the statistics of a union of user sets are the sums of the sets'
statistics (tested): nodes holding several users add theirs before the phase, and the server adds the nodes'. The
phase is ``secure-aggregation = "secagg+"`` (:mod:`fedrec_flwr.adversary.secure`); with ``"off"`` each node's sum
travels in the clear in its train reply, so the server then sees per-node class counts (with one user per node, that
user's label).

**The constraint and the rule.** The target is prior-free: ``h_w``'s balanced accuracy (the mean over classes of the
per-class share it classifies correctly; chance ``1/C`` whatever the class shares) should be at most ``1/C + delta``.
``eps`` is the weight of the adversarial term in each user's loss, i.e. the Lagrange multiplier of that leakage
constraint in ``min L_rec  s.t.  bacc(h_w) <= 1/C + delta``; the controller takes an exponentiated (mirror-descent)
dual ascent step on it, projected onto ``[eps_min, eps_max]``:

    g_t       = (b_t - 1/C - delta) / (1/C)                           (normalised constraint violation)
    eps_{t+1} = clip(eps_t * exp(eta * g_t), eps_min, eps_max)         (:func:`epsilon_step`)

``b_t`` is the signal read from the (optionally discounted) summed statistics: balanced accuracy by default, or the
balanced mean probability of the true class (``"balanced-probability"``, smoother: it moves with the margin as well as
the sign; also ``1/C`` at chance). The multiplicative step is scale-free (the protecting ``eps`` spans decades, 0.1 to
10 in our runs; ``g_t`` lies in ``[-1 - C * delta, C - 1]``, so one step changes ``ln eps`` by a bounded amount),
and a positive ``eps_min`` keeps ``eps`` able to come back. Below chance (``b_t < 1/C``) ``g_t < 0`` and ``eps``
*decreases*: an ``h_w`` that is wrong more often than chance on the users it was just fitted on means the embeddings
were pushed past its boundary (the sign-flip case above), i.e. ``eps`` is too large. At the constraint's edge
``b_t = 1/C + delta`` it holds; a slack constraint lets it decay, returning utility. A round whose summed statistics
lack a class (no sampled user of it, so no balanced accuracy) keeps ``eps``. With the SUT (``adversary-trigger =
"sut"``) the controller sets the ``eps`` a triggered user gets; the ``correct`` block is the round's trigger count.

**Which ``h_w``, and the bias.** With ``adversary-training = "server"`` (:mod:`fedrec_flwr.strategies.adversary`) the
server steps ``h_w`` on the round's users' own gradients (the train replies' and ``adversary-server-steps - 1`` more
query steps on the same users at their frozen embeddings). Statistics taken with that stepped ``h_w`` on the same
users (e.g. alongside the last ``adversary_gradient`` query) are an in-sample estimate: ``h_w`` was fitted to exactly
these embeddings, so their balanced accuracy over-estimates what an attacker's classifier reaches on users it did not
fit. That bias is in the conservative direction for this controller: it reads more leakage than a fresh attacker
would find, so it raises ``eps`` earlier and lowers it later, erring toward protection at some cost in utility; were
over-fitting the only gap, the equilibrium ``b_t = 1/C + delta`` in-sample would bound the out-of-sample balanced
accuracy (in expectation) by the same ``1/C + delta``. The opposite
bias, which this estimate does not correct, is capacity and lag: ``h_w`` is one small model a few steps behind moving
embeddings, where a post-hoc attacker refits to convergence; ``delta`` should therefore stay small (``0.02`` here, two
points of balanced accuracy) and the attacker's AUC remains the measure a run reports. In the sign-flip case that lag
is what ``b_t < 1/C`` detects, and lowering ``eps`` is the fix: the attacker's refit reads the inverted attribute, so
a two-sided rule raising ``eps`` there would widen the flip.

**Measured** (``tests/test_adaptive_epsilon.py``, a synthetic federation of 400 users whose embeddings carry a binary
attribute along one direction, a utility anchor standing in for the recommendation loss, a server-trained linear
``h_w``, 150 rounds of 25% of the users, defaults above): from ``eps = 0.01`` the controller reaches ``eps`` 3.5-7.3
and the logistic-regression attacker's AUC falls from 0.905-0.962 to a mean of 0.531-0.576 over its last 5
evaluations (seeds 0-4); single evaluations still swing by about 0.05 around that (the GRL's chase between ``h_w``
and the embeddings: the same band as a fixed ``eps = 5``). On real data it has not been run.

**Run-config keys** (the ``attribute unlearning`` group of the run config). ``adversary-weight-rule = "fixed" |
"adaptive"`` (``"fixed"``, the default: ``eps = adversary-epsilon`` every round; ``"adaptive"``: this controller,
starting at ``adversary-epsilon``, held by the server's :class:`fedrec_flwr.strategies.adversary.AdversaryServerStep`,
which steps it after each round's ``h_w`` steps on the statistics the nodes computed with the round's global ``h_w``
at their users' trained embeddings and sends the new ``eps`` in the next round's train config),
``adaptive-target-delta`` (``delta``, balanced-accuracy points, default 0.02), ``adaptive-rate`` (``eta``, change of
``ln eps`` per unit of normalised violation per round, default 0.5), ``adaptive-epsilon-min`` / ``adaptive-epsilon-max``
(default 0.001 / 100), ``adaptive-signal = "balanced-accuracy" | "balanced-probability"``, ``adaptive-smoothing``
(``lambda`` in ``[0, 1)``: the summed statistics are discounted sums ``S_t = lambda S_{t-1} + s_t``, default 0).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

STATISTICS = ("users", "correct", "true-probability", "cross-entropy")
"""The blocks of :func:`adversary_statistics`'s vector, each ``C`` long (entry ``c`` of a block covers the users of
class ``c``): ``users`` (how many), ``correct`` (how many ``h_w``'s deterministic ``argmax`` classifies as ``c``: where
the binary SUT fires), ``true-probability`` (sum of ``softmax(h_w(e_u))[c]``), ``cross-entropy`` (sum of
``-log softmax(h_w(e_u) [+ log prior])[c]``, nats). Block ``k`` occupies ``[k * C, (k + 1) * C)``."""
SIGNALS = ("balanced-accuracy", "balanced-probability")
"""What the controller compares with chance ``1/C`` (``adaptive-signal``)."""


def statistics_length(num_classes: int) -> int:
    """``len(STATISTICS) * C``, the length of :func:`adversary_statistics`'s vector."""
    return len(STATISTICS) * int(num_classes)


def statistics_block(stats: np.ndarray, name: str, num_classes: int) -> np.ndarray:
    """Block ``name`` (one of :data:`STATISTICS`) of a statistics vector: ``(C,)``.

    Raises:
        ValueError: an unknown block or a vector of the wrong length.
    """
    stats = np.asarray(stats, dtype=np.float64)
    if stats.shape != (statistics_length(num_classes),):
        raise ValueError(
            f"adversary statistics for {num_classes} classes have shape ({statistics_length(num_classes)},),"
            f" got {stats.shape}"
        )
    k = STATISTICS.index(name)
    return stats[k * num_classes : (k + 1) * num_classes]


@torch.no_grad()
def adversary_statistics(
    adversary: nn.Module, vectors: torch.Tensor, labels, *, log_prior: torch.Tensor | None = None
) -> np.ndarray:
    """The controller's summable statistics of ``h_w`` on ``n`` users: the sum over the users of each one's vector.

    Per user ``u`` with class ``a`` and deterministic logits ``z = h_w.predict_logits(e_u)`` (for DSVAE the posterior
    mean, as the SUT reads), the vector is zero except in column ``a`` of each block of :data:`STATISTICS`: ``1``,
    ``[argmax z == a]``, ``softmax(z)[a]`` and ``-log softmax(z + log_prior)[a]`` (the loss ``h_w`` trains on,
    :func:`~fedrec_flwr.adversary.prior.adjusted_ce`). One user's vector names its label, so only sums over users may
    leave a secure-aggregation phase; the sum over a batch is what this returns, and sums over disjoint batches add
    up to the union's: the counts exactly, the other blocks up to float32 rounding (the logits are computed in
    ``h_w``'s float32, whose batched kernels round by batch size, then summed in float64).

    Args:
        adversary: ``h_w`` (:class:`~fedrec_flwr.adversary.models.AttributeAdversary` or ``DSVAEAdversary``; any
            module with ``num_classes`` and ``predict_logits``).
        vectors: ``(n, D)`` user vectors (:func:`~fedrec_flwr.adversary.models.user_vector` layout); ``n = 0`` gives
            zeros. labels: ``(n,)`` classes in ``[0, C)``.
        log_prior: ``(C,)`` log class prior (``adversary-class-prior``) for the cross-entropy block, or ``None``.

    Returns:
        ``(len(STATISTICS) * C,)`` float64.

    Raises:
        ValueError: shapes that disagree or a label outside ``[0, C)``.
    """
    num_classes = int(adversary.num_classes)
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
    if vectors.dim() != 2 or labels.shape != (len(vectors),):
        raise ValueError(
            f"adversary_statistics: vectors (n, D) and labels (n,), got {tuple(vectors.shape)} and {tuple(labels.shape)}"
        )
    out = np.zeros(statistics_length(num_classes), dtype=np.float64)
    if len(labels) == 0:
        return out
    if int(labels.min()) < 0 or int(labels.max()) >= num_classes:
        raise ValueError(f"adversary_statistics: labels outside [0, {num_classes})")
    logits = adversary.predict_logits(vectors.detach().to(adversary.head.weight.device)).cpu()
    labels = labels.cpu()
    rows = torch.arange(len(labels))
    adjusted = logits if log_prior is None else logits + log_prior.cpu()
    per_user = (
        torch.ones(len(labels), dtype=torch.float64),
        (logits.argmax(dim=-1) == labels).double(),
        F.softmax(logits, dim=-1)[rows, labels].double(),
        -F.log_softmax(adjusted, dim=-1)[rows, labels].double(),
    )
    index = labels.numpy()
    for k, values in enumerate(per_user):
        np.add.at(out, k * num_classes + index, values.numpy())
    return out


def balanced_signal(stats: np.ndarray, num_classes: int, signal: str = "balanced-accuracy") -> float:
    """``mean_c correct_c / users_c`` (``"balanced-accuracy"``) or ``mean_c true-probability_c / users_c``
    (``"balanced-probability"``) of a (summed) statistics vector; both ``1/C`` for an ``h_w`` that ignores the
    embedding. NaN when a class has no user (the mean over classes is then undefined).

    Raises:
        ValueError: an unknown signal or a vector of the wrong length.
    """
    if signal not in SIGNALS:
        raise ValueError(f"adaptive signal must be one of {SIGNALS}, got {signal!r}")
    users = statistics_block(stats, "users", num_classes)
    if not np.all(users > 0):
        return float("nan")
    hits = statistics_block(stats, "correct" if signal == "balanced-accuracy" else "true-probability", num_classes)
    return float(np.mean(hits / users))


def epsilon_step(
    epsilon: float, signal: float, *, num_classes: int, delta: float, rate: float, lower: float, upper: float
) -> float:
    """One projected exponentiated dual step (module docstring):
    ``clip(epsilon * exp(rate * (signal - 1/C - delta) / (1/C)), lower, upper)``; ``epsilon`` itself when ``signal``
    is NaN (a class absent from the round). All quantities dimensionless; ``rate`` in ``ln eps`` per unit of
    normalised violation."""
    if math.isnan(signal):
        return float(epsilon)
    chance = 1.0 / num_classes
    violation = (signal - chance - delta) / chance
    return float(min(max(epsilon * math.exp(rate * violation), lower), upper))


@dataclasses.dataclass(frozen=True)
class AdaptiveEpsilonConfig:
    """The controller's settings (module docstring; run-config keys in brackets).

    Args:
        num_classes: ``C`` >= 2, the protected attribute's classes.
        target_delta: ``delta`` [``adaptive-target-delta``], the tolerated signal above chance, in ``[0, 1 - 1/C)``.
        rate: ``eta`` > 0 [``adaptive-rate``]. epsilon_min / epsilon_max: the projection interval, ``0 < min <= max``
            [``adaptive-epsilon-min`` / ``-max``]. signal: one of :data:`SIGNALS` [``adaptive-signal``].
        smoothing: ``lambda`` in ``[0, 1)`` [``adaptive-smoothing``]: the step reads the discounted sum
            ``S_t = lambda * S_{t-1} + s_t`` of the rounds' summed statistics (0: this round's alone).

    Raises:
        ValueError: any setting outside its range.
    """

    num_classes: int
    target_delta: float = 0.02
    rate: float = 0.5
    epsilon_min: float = 1e-3
    epsilon_max: float = 100.0
    signal: str = "balanced-accuracy"
    smoothing: float = 0.0

    def __post_init__(self) -> None:
        if int(self.num_classes) != self.num_classes or self.num_classes < 2:
            raise ValueError(f"AdaptiveEpsilonConfig: num_classes must be an integer >= 2, got {self.num_classes!r}")
        if not 0.0 <= self.target_delta < 1.0 - 1.0 / self.num_classes:
            raise ValueError(
                f"adaptive-target-delta must be in [0, {1.0 - 1.0 / self.num_classes:g}), got {self.target_delta!r}"
            )
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"adaptive-rate must be a finite number > 0, got {self.rate!r}")
        if not (math.isfinite(self.epsilon_max) and 0 < self.epsilon_min <= self.epsilon_max):
            raise ValueError(
                f"adaptive epsilon bounds need 0 < min <= max < inf, got {self.epsilon_min!r}, {self.epsilon_max!r}"
            )
        if self.signal not in SIGNALS:
            raise ValueError(f"adaptive-signal must be one of {SIGNALS}, got {self.signal!r}")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"adaptive-smoothing must be in [0, 1), got {self.smoothing!r}")


@dataclasses.dataclass
class AdaptiveEpsilon:
    """The controller's state: the current ``eps``, the steps taken, the discounted statistics and the last signal.

    ``step(summed)`` takes one round's summed :func:`adversary_statistics` and returns the next round's ``eps``;
    :meth:`state_dict` / :meth:`from_state` round-trip the state as plain numbers (a checkpoint's JSON).

    Raises:
        ValueError: an ``epsilon`` outside the config's bounds.
    """

    config: AdaptiveEpsilonConfig
    epsilon: float
    steps: int = 0
    discounted: tuple[float, ...] = ()
    last_signal: float = float("nan")

    def __post_init__(self) -> None:
        cfg = self.config
        if not cfg.epsilon_min <= self.epsilon <= cfg.epsilon_max:
            raise ValueError(
                f"AdaptiveEpsilon: epsilon {self.epsilon!r} outside [{cfg.epsilon_min!r}, {cfg.epsilon_max!r}]"
            )
        if self.discounted and len(self.discounted) != statistics_length(cfg.num_classes):
            raise ValueError(
                f"AdaptiveEpsilon: {len(self.discounted)} discounted statistics for {cfg.num_classes} classes"
            )

    def step(self, summed: Sequence[float] | np.ndarray) -> float:
        """Fold one round's summed statistics into the discounted sum, read the signal and take
        :func:`epsilon_step`; returns (and stores) the new ``eps``.

        Raises:
            ValueError: a vector of the wrong length or with a negative or non-finite entry.
        """
        cfg = self.config
        summed = np.asarray(summed, dtype=np.float64)
        statistics_block(summed, "users", cfg.num_classes)  # checks the length
        if not np.all(np.isfinite(summed)) or np.any(summed < 0):
            raise ValueError("AdaptiveEpsilon.step: summed statistics must be finite and >= 0")
        previous = np.asarray(self.discounted, dtype=np.float64) if self.discounted else np.zeros_like(summed)
        current = cfg.smoothing * previous + summed
        self.discounted = tuple(float(v) for v in current)
        self.last_signal = balanced_signal(current, cfg.num_classes, cfg.signal)
        self.epsilon = epsilon_step(
            self.epsilon,
            self.last_signal,
            num_classes=cfg.num_classes,
            delta=cfg.target_delta,
            rate=cfg.rate,
            lower=cfg.epsilon_min,
            upper=cfg.epsilon_max,
        )
        self.steps += 1
        return self.epsilon

    def state_dict(self) -> dict[str, float | int | list[float]]:
        """``{"epsilon", "steps", "discounted", "last-signal"}`` as plain Python numbers (NaN for no signal yet)."""
        return {
            "epsilon": float(self.epsilon),
            "steps": int(self.steps),
            "discounted": [float(v) for v in self.discounted],
            "last-signal": float(self.last_signal),
        }

    @classmethod
    def from_state(cls, config: AdaptiveEpsilonConfig, state: Mapping) -> AdaptiveEpsilon:
        """The controller :meth:`state_dict` wrote, under ``config``."""
        return cls(
            config,
            float(state["epsilon"]),
            steps=int(state["steps"]),
            discounted=tuple(float(v) for v in state["discounted"]),
            last_signal=float(state["last-signal"]),
        )
