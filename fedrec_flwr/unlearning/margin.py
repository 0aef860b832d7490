"""How far HF-KCU steps, calibrated on membership (ours): move along the solver's step until
the forgotten users' own interactions with the items they dominate look like non-member data.

**Why.** Retraining without the forgotten users ``F`` turns their training interactions into non-member data. For
an item ``j`` whose training positives come mostly from ``F`` (a promoted target item; ``n_F(j) > n_R(j)``, the
*dominated* items), the retrained row of ``j`` is shaped by the remaining users ``R`` alone, so a forgotten user
``f`` who rated ``j`` should score it no higher than the items it never interacted with that ``R`` made about as
popular as ``j``. We measure that with the *membership margin*

    m_fj(theta) = s_f(j; theta) - mean_{k in B(j), k not in I_f} s_f(k; theta),

``s_f`` the model's logit with ``f``'s private embedding, ``I_f`` the items ``f`` interacted with, ``B(j)`` the
popularity bin of ``j``: :data:`MARGIN_BINS` equal-size bins of the items ranked by ``n_R`` (the remaining users'
training positives per item). Before unlearning ``m_fj > 0`` (``f`` trained ``j`` up: membership); a model that never
saw ``f`` gives ``m_fj ≈ 0`` on the dominated items, because nothing but ``f``'s data singled ``j`` out from its
popularity peers. (On the four FedMF development federations of ``experiments/hfkcu``, seed and target 100, the
mean margin over the dominated positives was 2.3 / 0.60 / 2.9 / 1.0 at the trained model and 0.11 / 0.02 / -0.18 /
-0.09 at the model retrained without the fakes; over *all* their positives it stayed 0.66 / 0.58 / 1.8 / 1.8 after
retraining, because the fakes' popular fillers keep their fit: a diagnostic that read the retrained model,
``experiments/hfkcu/results/runs/poison-dev/*/FedMF/*/seed-100/original/calibration-1.json``.)

**The rule.** With the solver's step ``x`` (Steihaug CG at the trust radius) as a direction, choose ``a >= 0`` with

    M(a) = mean_{f in F, j in P_f ∩ D} m_fj(theta + a x) = 0

(``P_f`` the training positives of ``f``, ``D`` the dominated items) by :func:`bracket_root`. For FedMF only item
rows move, so every logit and ``M`` are affine in ``a``; for FedNCF ``M`` is smooth, not affine. ``M(0) <= 0``:
nothing to forget by this measure, no step. No dominated item among the forgotten positives (e.g. a random forget
set, whose items all have many remaining raters): the rule has nothing to calibrate on and the phase keeps the
solver's step (``a = 1``), reported as ``margin-termination = "no-dominated-items"``.

**Measured** (``experiments/hfkcu/README.md``): it met 2 of 5 development poisoning settings (the fixed
radius 1) and 4 of 8 reported ones (the fixed radius 4, different ones): ML-100K FedMF closes 93-102% of the gap
with 20 or 100 fakes, FilmTrust FedMF 44-63%, and on FedNCF, whose step is mostly the shared MLP, the margin
reaches 0 after the genuine users' ranking has fallen past retrained (FilmTrust: overshoot 835%). An arm
(``line-search = "membership-margin"``), not the default.

**Protocol and privacy.** Two kinds of query round, each answered with sums only:
``unlearn_counts`` (every node: ``n_R`` over its remaining users and ``n_F`` over its forgotten users, two
``(I,)`` count vectors, node totals; no model is sent) and
``unlearn_margin`` (only the forgotten users' nodes: for each step ``a_k`` the sum of ``m_fj`` over their forgotten
users' dominated positives and the number of terms; never a per-user value). The forgotten users' nodes already
answer ``unlearn_gradient`` for them; their margins stay on the node.

**Privacy cost (a reason this stays an arm).** A node total of training positives is a per-user value when the node
serves one user: with ``users-per-node = 1`` the ``unlearn_counts`` reply *is* that user's set of training items,
which a training reply does not reveal by itself (its touched rows mix the positives with sampled negatives). With
k users per node it is the union of k users' counts. Secure aggregation or noisy (differentially private) counts
would remove this; neither is built. The phase logs a warning when it runs this query.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

MARGIN_BINS = 20
"""Popularity bins of the reference items (ours: about 84 items a bin on ML-100K, 103 on FilmTrust, enough to
average a user's scores over, few enough that a bin spans a narrow range of popularity)."""

MARGIN_LADDER = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
"""First query round of :func:`bracket_root` (multiples of the solver's step; ``a = 1`` is the fixed-radius step)."""


def popularity_bins(counts: np.ndarray, bins: int = MARGIN_BINS) -> np.ndarray:
    """``(I,)`` int64 bin of every item: ``bins`` equal-size bins of the items ranked by ``counts`` (ties by item
    index), bin 0 the least popular.

    Raises:
        ValueError: ``counts`` is not a 1-d array or ``bins`` < 1.
    """
    counts = np.asarray(counts)
    if counts.ndim != 1 or bins < 1:
        raise ValueError(f"popularity_bins: need 1-d counts and bins >= 1, got shape {counts.shape}, bins {bins}")
    order = np.lexsort((np.arange(counts.size), counts))
    out = np.empty(counts.size, np.int64)
    out[order] = np.arange(counts.size) * min(bins, max(counts.size, 1)) // max(counts.size, 1)
    return out


def dominated_items(remaining_counts: np.ndarray, forgotten_counts: np.ndarray) -> np.ndarray:
    """``(n,)`` sorted item ids whose training positives come mostly from the forgotten users (``n_F > n_R``)."""
    return np.flatnonzero(np.asarray(forgotten_counts) > np.asarray(remaining_counts)).astype(np.int64)


def user_margins(
    scores: np.ndarray, positives: np.ndarray, interacted: np.ndarray, bins: np.ndarray, dominated: np.ndarray
) -> np.ndarray:
    """One user's membership margins ``m_fj`` (module docstring) on its dominated positives.

    Args:
        scores: ``(I,)`` the user's logits of every item.
        positives: the user's training positives ``P_f`` (item ids).
        interacted: every item the user interacted with ``I_f`` (left out of the reference means).
        bins: ``(I,)`` popularity bin per item (:func:`popularity_bins`).
        dominated: item ids of ``D`` (:func:`dominated_items`).
    Returns:
        ``(len(P_f ∩ D),)`` float64 margins; a bin without a reference item gives no margin.
    """
    scores = np.asarray(scores, dtype=np.float64)
    wanted = np.intersect1d(np.asarray(positives, np.int64), np.asarray(dominated, np.int64))
    if wanted.size == 0:
        return np.zeros(0)
    free = np.ones(scores.size, bool)
    free[np.asarray(interacted, np.int64)] = False
    size = int(bins.max()) + 1
    sums = np.bincount(bins[free], weights=scores[free], minlength=size)
    counts = np.bincount(bins[free], minlength=size)
    usable = counts[bins[wanted]] > 0
    wanted = wanted[usable]
    return scores[wanted] - sums[bins[wanted]] / counts[bins[wanted]]


@dataclass
class RootResult:
    """What :func:`bracket_root` did: the chosen ``step``, every multiple tried with its value, the query
    ``rounds`` and the ``termination``: ``"root"`` (bracketed and interpolated), ``"nonpositive-at-zero"`` (``M(0) <=
    0``: no step), ``"unbracketed"`` (``M`` stayed positive up to ``max_step``: the largest step tried)."""

    step: float
    steps: list = field(default_factory=list)
    values: list = field(default_factory=list)
    rounds: int = 0
    termination: str = ""

    def summary(self) -> dict:
        return {
            "margin-step": self.step,
            "margin-steps": [float(a) for a in self.steps],
            "margin-values": [float(v) for v in self.values],
            "margin-rounds": self.rounds,
            "margin-termination": self.termination,
        }


def bracket_root(
    evaluate: Callable[[Sequence[float]], Sequence[float]],
    *,
    ladder: Sequence[float] = MARGIN_LADDER,
    max_step: float = 64.0,
    rounds: int = 4,
    points: int = 3,
) -> RootResult:
    """The smallest ``a >= 0`` where a decreasing-on-the-whole function ``M`` (given by ``evaluate``, a batch of
    multiples -> their values, one query round per call) first crosses 0 (ours; a bracketing search whose every
    round is one batch, so a round trip per round instead of per point):

    round 1 evaluates ``ladder`` (must contain 0); while ``M`` is positive at every multiple tried, the next round
    doubles the largest (up to ``max_step``); once ``M(a_lo) > 0 >= M(a_hi)`` for consecutive tried multiples,
    each further round evaluates ``points`` equally spaced interior multiples and keeps the first sign change; the
    answer is the root of the line through the last bracket's ends (regula falsi: exact when ``M`` is affine, as
    for FedMF). At most ``rounds`` rounds.

    Raises:
        ValueError: ``ladder`` lacks 0, ``rounds`` < 1, ``points`` < 1, or ``evaluate`` returns the wrong number
            of values or a non-finite one.
    """
    if 0.0 not in [float(a) for a in ladder] or rounds < 1 or points < 1:
        raise ValueError(
            f"bracket_root: ladder must contain 0, rounds and points >= 1 (got {list(ladder)}, {rounds}, {points})"
        )
    tried: dict[float, float] = {}

    def run(steps) -> None:
        steps = [float(a) for a in steps if float(a) not in tried]
        values = [float(v) for v in evaluate(steps)]
        if len(values) != len(steps) or not np.all(np.isfinite(values)):
            raise ValueError(f"bracket_root: evaluate returned {values} for steps {steps}")
        tried.update(zip(steps, values))

    def result(step: float, termination: str, used: int) -> RootResult:
        order = sorted(tried)
        return RootResult(
            step=float(step), steps=order, values=[tried[a] for a in order], rounds=used, termination=termination
        )

    run(sorted({float(a) for a in ladder if 0 <= float(a) <= max_step}))
    used = 1
    if tried[0.0] <= 0:
        return result(0.0, "nonpositive-at-zero", used)
    while all(v > 0 for v in tried.values()):
        top = max(tried)
        if used >= rounds or top >= max_step:
            return result(top, "unbracketed", used)
        run([min(2 * top, max_step)])
        used += 1

    def bracket() -> tuple[float, float]:
        order = sorted(tried)
        for lo, hi in zip(order, order[1:]):
            if tried[lo] > 0 >= tried[hi]:
                return lo, hi
        raise AssertionError("no sign change")  # unreachable: M(0) > 0 and some value <= 0

    lo, hi = bracket()
    while used < rounds:
        run([lo + (hi - lo) * (i + 1) / (points + 1) for i in range(points)])
        used += 1
        lo, hi = bracket()
    f_lo, f_hi = tried[lo], tried[hi]
    return result(lo + (hi - lo) * f_lo / (f_lo - f_hi), "root", used)


# ---------------------------------------------------------------------------------------------- node side
def positive_counts(runtime, users: Sequence[int]) -> np.ndarray:
    """``(I,)`` float64 number of training positives per item over ``users`` (a node total; ``unlearn_counts``)."""
    split = runtime.split
    counts = np.zeros(split.num_items, dtype=np.float64)
    for user in users:
        np.add.at(counts, split.positives(int(user)), 1.0)
    return counts


def margin_sums(
    runtime, clients: Sequence, shared, direction, steps: Sequence[float], bins: np.ndarray, dominated: np.ndarray
) -> tuple[np.ndarray, int]:
    """``unlearn_margin`` on one node: for each ``a_k`` in ``steps``, the sum of the membership margins
    (:func:`user_margins`) of ``clients`` (the node's forgotten users) at ``theta + a_k d``, and the number of margins
    per step (the same for every step). Scores every item once per user and step with the user's private embedding.

    Args:
        runtime: the process's :class:`~fedrec_flwr.app.runtime.Runtime`.
        clients: :class:`fedrec_flwr.clients.fedrec.FedRecClient` objects (their private state available).
        shared: shared key -> full array ``theta``; direction: the same keys -> full arrays ``d``.
        steps: ``(K,)`` multiples; bins: ``(I,)`` popularity bins; dominated: item ids of ``D``.
    Returns:
        ``((K,) float64 sums, count)``: node totals only.
    """
    from fedrec_flwr.local.training import score_candidates
    from fedrec_flwr.unlearning.influence import can_batch, node_users_model

    split = runtime.split
    bins = np.asarray(bins, dtype=np.int64)
    totals = np.zeros(len(steps), dtype=np.float64)
    if not clients:
        return totals, 0
    clients = list(clients)
    batched = len(clients) > 1 and can_batch(runtime.model)
    if batched:  # every user's private rows in one model: one scoring pass per step (as the HVP queries batch)
        model = node_users_model(runtime, clients)
    everything = np.broadcast_to(np.arange(split.num_items), (len(clients) if batched else 1, split.num_items))
    count = 0
    for index, step in enumerate(steps):
        moved = {
            k: (np.asarray(shared[k], np.float64) + float(step) * np.asarray(direction[k], np.float64)).astype(
                np.asarray(shared[k]).dtype
            )
            for k in shared
        }
        if batched:
            model.load_shared_state(moved)
            model._influence_shared = moved  # the cached node model no longer holds an earlier query's parameters
            got = score_candidates(model, np.arange(len(clients)), everything)
        for row, client in enumerate(clients):
            if batched:
                user_scores = got[row]
            else:
                client.load_shared(moved)
                client.load_private()
                user_scores = score_candidates(runtime.model, np.array([0]), everything)[0]
            margins = user_margins(
                user_scores, split.positives(client.user), split.interacted(client.user), bins, dominated
            )
            totals[index] += float(margins.sum())
            if index == 0:
                count += int(margins.size)
    return totals, count
