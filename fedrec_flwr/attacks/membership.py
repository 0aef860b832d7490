"""Membership inference on a recommender: can an attacker tell a user's training items from items the user never
interacted with, by the model's scores? The measure of whether an unlearned user's interactions are still detectable
(HF-KCU, arXiv:2605.20341, Sec. "membership inference": success is the unlearned model's attack at the level of the
retrained model's).

The attacker here is a threshold on the score (the loss-based attack of Yeom et al., "Privacy Risk in Machine
Learning", CSF 2018, in its threshold-free form): its success over all thresholds is the ROC AUC of scores of
members (label 1) against non-members (label 0), computed with scikit-learn. 0.5 means the model's scores do not
reveal membership at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.metrics import roc_auc_score

from fedrec_flwr.data import Split
from fedrec_flwr.errors import DataError


def nonmember_items(split: Split, user: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` distinct items ``user`` never interacted with (not training, validation or test items), uniform.

    Raises:
        DataError: the user has fewer than ``size`` non-interacted items.
    """
    candidates = np.setdiff1d(np.arange(split.num_items), split.interacted(user))
    if candidates.size < size:
        raise DataError(f"user {user}: only {candidates.size} non-interacted items, {size} needed")
    return np.sort(rng.choice(candidates, size=size, replace=False)).astype(np.int64)


def membership_auc(member_scores: Sequence[np.ndarray], nonmember_scores: Sequence[np.ndarray]) -> dict[str, float]:
    """Attack success per user and pooled.

    Args:
        member_scores: per attacked user, ``(m_u,)`` scores (logits) of its training items.
        nonmember_scores: per attacked user, ``(n_u,)`` scores of items it never interacted with.
    Returns:
        ``{"auc": mean over users of the per-user AUC, "auc-std": their std, "auc-pooled": AUC over all pairs pooled,
        "users": number of users}``.
    Raises:
        ValueError: the two lists differ in length or are empty, a user has no member or no non-member, or a score
            is NaN or infinite (a diverged model).
    """
    if len(member_scores) != len(nonmember_scores) or not member_scores:
        raise ValueError(f"membership_auc: {len(member_scores)} member lists, {len(nonmember_scores)} non-member lists")
    per_user = []
    for members, others in zip(member_scores, nonmember_scores):
        members, others = np.asarray(members, dtype=np.float64), np.asarray(others, dtype=np.float64)
        if members.size == 0 or others.size == 0:
            raise ValueError("membership_auc: every user needs at least one member and one non-member score")
        if not (np.isfinite(members).all() and np.isfinite(others).all()):
            raise ValueError("membership_auc: a score is NaN or infinite (the model diverged)")
        labels = np.concatenate([np.ones(members.size), np.zeros(others.size)])
        per_user.append(roc_auc_score(labels, np.concatenate([members, others])))
    members = np.concatenate([np.asarray(m, dtype=np.float64) for m in member_scores])
    others = np.concatenate([np.asarray(o, dtype=np.float64) for o in nonmember_scores])
    pooled = roc_auc_score(
        np.concatenate([np.ones(members.size), np.zeros(others.size)]), np.concatenate([members, others])
    )
    return {
        "auc": float(np.mean(per_user)),
        "auc-std": float(np.std(per_user)),
        "auc-pooled": float(pooled),
        "users": len(per_user),
    }
