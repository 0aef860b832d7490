"""Membership inference's success measure (fedrec_flwr.attacks.membership.membership_auc) on cases worked by hand:
the per-user AUC's mean differs from the pooled AUC when users' scores live on shifted scales."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.attacks.membership import membership_auc


def test_per_user_mean_and_pooled_auc_differ_on_shifted_scales():
    """Each user ranks its members above its non-members (per-user AUC 1, mean 1), but user 2's scores are all 10
    higher: pooled, user 1's members (1, 2) lose to user 2's non-members (10, 9), so 12 of the 16 member/non-member
    pairs are ordered right (AUC 0.75)."""
    members = [np.array([1.0, 2.0]), np.array([11.0, 12.0])]
    others = [np.array([0.0, -1.0]), np.array([10.0, 9.0])]
    result = membership_auc(members, others)
    assert result["auc"] == 1.0 and result["auc-std"] == 0.0 and result["users"] == 2
    pooled_members, pooled_others = np.concatenate(members), np.concatenate(others)
    wins = sum(float(m > o) + 0.5 * float(m == o) for m in pooled_members for o in pooled_others)
    assert wins / 16 == 0.75  # 12 of the 16 pairs: user 1's members lose to user 2's non-members
    assert result["auc-pooled"] == pytest.approx(0.75)


def test_per_user_auc_counts_ties_as_half_and_std_is_over_users():
    # user 1: members (1, 3) vs others (2, 0): pairs 1>2 no, 1>0 yes, 3>2 yes, 3>0 yes -> 0.75
    # user 2: member 5 vs others (5, 4): tie 0.5, win 1 -> 0.75; user 3: member 0 vs other 1 -> 0
    result = membership_auc([[1.0, 3.0], [5.0], [0.0]], [[2.0, 0.0], [5.0, 4.0], [1.0]])
    assert result["auc"] == pytest.approx(0.5)
    assert result["auc-std"] == pytest.approx(np.std([0.75, 0.75, 0.0]))


@pytest.mark.parametrize(
    ("members", "others"), [([], []), ([[1.0]], []), ([[]], [[1.0]]), ([[np.nan]], [[0.0]]), ([[1.0]], [[np.inf]])]
)
def test_bad_scores_are_refused(members, others):
    with pytest.raises(ValueError, match="membership_auc"):
        membership_auc(members, others)
