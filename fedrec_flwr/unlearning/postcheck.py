"""The check after an approximate unlearning step (HF-KCU, gradient ascent, a rollback with calibration): did the step
keep the remaining users' utility and remove the forgotten users' influence?

Two measurements, each against an expectation set before the step:

* **utility** on the remaining users' *validation* item (never the test item, which must stay unseen by every choice
  the run makes): HR@10 and NDCG@10 with the validation item ranked among its sampled negatives, after the step
  against before it; the step fails when either falls by more than its tolerance (absolute).
* **influence** of the forgotten users, by one or both of

  - the target item's exposure@10 among genuine users (:func:`target_exposure`: the share of the genuine users who
    never interacted with the target that have it in their top 10 over the items they never interacted with; the
    measure of a promotion attack), expected at most ``max_exposure`` (e.g. the exposure of a model trained without
    the forgotten users, or the target's popularity-rank level, plus a tolerance);
  - the forgotten users' training-loss margin against non-members (:func:`loss_margin`: mean loss of non-member
    examples minus mean loss of the forgotten users' training examples; > 0 when the model still fits the forgotten
    data better than unseen data), expected at most ``max_margin``.

:func:`post_check` returns a :class:`PostCheck` record ``{passed, reasons, measured}``; every failed expectation adds
a reason, and a check with no influence measure fails (an unmeasured influence is not a removed one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedrec_flwr.metrics import mean_metrics, ranking_metrics_batch

__all__ = ["Expectations", "PostCheck", "loss_margin", "post_check", "target_exposure", "validation_utility"]


@dataclass(frozen=True)
class Expectations:
    """What a good step keeps and removes (see the module docstring).

    Attributes:
        max_hr_drop: largest allowed fall of the remaining users' validation HR@10 (absolute; 0.01 = 1 point).
        max_ndcg_drop: the same for NDCG@10.
        max_exposure: the target's exposure@10 among genuine users must be at most this (``None``: not checked).
        max_margin: the forgotten users' loss margin against non-members must be at most this (``None``: not checked).
    """

    max_hr_drop: float = 0.01
    max_ndcg_drop: float = 0.01
    max_exposure: float | None = None
    max_margin: float | None = None


@dataclass(frozen=True)
class PostCheck:
    """The result: whether every expectation held, why not, and what was measured."""

    passed: bool
    reasons: list[str] = field(default_factory=list)
    measured: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """``{"passed": bool, "reasons": [...], "measured": {...}}`` (JSON-able)."""
        return {"passed": self.passed, "reasons": list(self.reasons), "measured": dict(self.measured)}


def validation_utility(scores: np.ndarray, split: str = "val", k: int = 10) -> dict[str, float]:
    """Mean HR@k and NDCG@k of ``(U, 1 + N)`` scores whose column 0 is each user's held-out item and the rest its
    sampled negatives (:func:`fedrec_flwr.metrics.ranking_metrics_batch`).

    Raises:
        ValueError: ``split`` is not ``"val"`` (the post-check never reads the test item), or as
            :func:`~fedrec_flwr.metrics.ranks_batch`.
    """
    if split != "val":
        raise ValueError(f"the post-check ranks the validation item only, got split {split!r}")
    metrics = mean_metrics(ranking_metrics_batch(scores, 0, ks=(k,)))
    return {f"HR@{k}": metrics[f"HR@{k}"], f"NDCG@{k}": metrics[f"NDCG@{k}"]}


def target_exposure(scores: np.ndarray, interacted: np.ndarray, target: int, k: int = 10) -> float:
    """Share of users with ``target`` in their top ``k`` among the items they never interacted with.

    Users who interacted with ``target`` are left out. Ties count against the target (its rank is the number of
    other candidates scoring at least as high), as :func:`fedrec_flwr.metrics.ranks_batch` ranks.

    Args:
        scores: ``(U, I)`` every user's score of every item.
        interacted: ``(U, I)`` bool, the items each user interacted with (training, validation and test).
        target: the item.
        k: the cut-off.

    Returns:
        The exposure in [0, 1]; NaN when every user interacted with the target.
    """
    scores = np.asarray(scores, dtype=np.float64)
    interacted = np.asarray(interacted, dtype=bool)
    if scores.shape != interacted.shape or scores.ndim != 2:
        raise ValueError(f"scores and interacted must be (U, I) alike, got {scores.shape} and {interacted.shape}")
    users = ~interacted[:, target]
    if not users.any():
        return float("nan")
    candidate = np.where(interacted[users], -np.inf, scores[users])
    rank = (candidate >= candidate[:, [target]]).sum(axis=1) - 1
    return float(np.mean(rank < k))


def loss_margin(member_losses: np.ndarray, nonmember_losses: np.ndarray) -> float:
    """Mean non-member loss minus mean member loss (per-example losses; > 0: members are fit better).

    Raises:
        ValueError: either set is empty.
    """
    member, nonmember = np.asarray(member_losses, np.float64), np.asarray(nonmember_losses, np.float64)
    if member.size == 0 or nonmember.size == 0:
        raise ValueError("loss_margin needs member and non-member losses")
    return float(nonmember.mean() - member.mean())


def post_check(
    before: Mapping[str, float],
    after: Mapping[str, float],
    expectations: Expectations,
    *,
    exposure: float | None = None,
    margin: float | None = None,
    k: int = 10,
) -> PostCheck:
    """Compare a step's measurements with the expectations (module docstring).

    Args:
        before / after: :func:`validation_utility` of the remaining users before / after the step.
        expectations: the tolerances and influence levels.
        exposure: the target's exposure@k among genuine users after the step (:func:`target_exposure`).
        margin: the forgotten users' loss margin after the step (:func:`loss_margin`).
        k: the cut-off of the utility metrics.
    """
    hr, ndcg = f"HR@{k}", f"NDCG@{k}"
    measured = {
        f"{hr}-before": float(before[hr]),
        f"{hr}-after": float(after[hr]),
        f"{ndcg}-before": float(before[ndcg]),
        f"{ndcg}-after": float(after[ndcg]),
    }
    reasons = []
    for name, tolerance in ((hr, expectations.max_hr_drop), (ndcg, expectations.max_ndcg_drop)):
        drop = float(before[name]) - float(after[name])
        if not drop <= tolerance:
            reasons.append(f"utility: validation {name} fell by {drop:.4f} (tolerance {tolerance:g})")
    checked = 0
    for label, value, limit in (
        ("exposure", exposure, expectations.max_exposure),
        ("margin", margin, expectations.max_margin),
    ):
        if value is not None:
            measured[label] = float(value)
        if limit is None:
            continue
        checked += 1
        if value is None:
            reasons.append(f"influence: {label} expected at most {limit:g} but not measured")
        elif not float(value) <= limit:
            reasons.append(f"influence: {label} {float(value):.4f} above the expected {limit:g}")
    if checked == 0:
        reasons.append("influence: no expectation set (max_exposure or max_margin)")
    return PostCheck(passed=not reasons, reasons=reasons, measured=measured)
