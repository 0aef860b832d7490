"""The reply's sum-and-count algebra: grouping users into nodes never changes the aggregate."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.wire import (
    COUNT,
    ROWS,
    SUM,
    Contribution,
    ModelLayout,
    PrivacyViolation,
    ReplyError,
    check_reply_keys,
    merge_rows,
)

LAYOUT = ModelLayout(
    shared_shapes={"item.weight": (6, 3), "out.weight": (1, 3)},
    item_keys=("item.weight",),
    private_keys=("user.weight",),
)


def _users(rng, count):
    users = []
    for _ in range(count):
        rows = np.sort(rng.choice(6, size=rng.integers(1, 6), replace=False))
        users.append(
            (
                {"out.weight": rng.normal(size=(1, 3))},
                {"item.weight": (rows, rng.normal(size=(len(rows), 3)))},
                int(rng.integers(1, 50)),
                float(rng.random()),
            )
        )
    return users


def _aggregate(groups, current):
    packs, weights = [], []
    for group in groups:
        contribution = Contribution(LAYOUT)
        for dense, rows, n, loss in group:
            contribution.add_user(dense, rows, n, loss)
        packs.append(contribution.pack())
        weights.append(contribution.num_examples)
    table, _ = merge_rows(
        current, [(p["item.weight" + ROWS], p["item.weight" + SUM], p["item.weight" + COUNT]) for p in packs]
    )
    dense = sum(w * p["out.weight"].astype(np.float64) for w, p in zip(weights, packs)) / sum(weights)
    return table, dense


def test_one_user_per_node_and_many_users_per_node_agree():
    rng = np.random.default_rng(0)
    users = _users(rng, 12)
    current = rng.normal(size=(6, 3)).astype(np.float32)
    singles = _aggregate([[u] for u in users], current)
    blocks = _aggregate([users[:5], users[5:10], users[10:]], current)
    np.testing.assert_allclose(singles[0], blocks[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(singles[1], blocks[1], rtol=1e-5, atol=1e-6)
    # and against the definition: per-row mean over the users that touched the row
    for row in range(6):
        touched = [vals[list(ids).index(row)] for _, r, _, _ in users for ids, vals in [r["item.weight"]] if row in ids]
        expected = np.mean(touched, axis=0) if touched else current[row]
        np.testing.assert_allclose(singles[0][row], expected, rtol=1e-5, atol=1e-6)


def test_check_reply_keys_flags_private_and_malformed_arrays():
    contribution = Contribution(LAYOUT)
    contribution.add_user({"out.weight": np.ones((1, 3))}, {"item.weight": (np.array([1, 4]), np.ones((2, 3)))}, 3, 0.1)
    packed = contribution.pack()
    check_reply_keys(packed, LAYOUT)
    with pytest.raises(PrivacyViolation):
        check_reply_keys({**packed, "user.weight": np.ones((1, 3))}, LAYOUT)
    with pytest.raises(PrivacyViolation):
        check_reply_keys({**packed, "user.weight#sum": np.ones((1, 3))}, LAYOUT)
    with pytest.raises(ReplyError, match="shape"):
        check_reply_keys({**packed, "out.weight": np.ones((2, 3), dtype=np.float32)}, LAYOUT)
    with pytest.raises(ReplyError, match="missing"):
        check_reply_keys({k: v for k, v in packed.items() if k != "out.weight"}, LAYOUT)


def test_zero_example_user_is_refused():
    with pytest.raises(ReplyError):
        Contribution(LAYOUT).add_user(
            {"out.weight": np.ones((1, 3))}, {"item.weight": (np.array([1]), np.ones((1, 3)))}, 0, 0.0
        )


def test_a_node_reply_is_the_example_weighted_mean_of_its_users_dense_parameters():
    """Hand computation: users with 1 and 3 examples; dense (1,1,1) and (5,5,5) -> (1*1 + 3*5) / 4 = 4; losses 0.2 and
    0.6 -> 0.5; row 2 touched by both (sum and count 2), rows 0 and 5 by one each."""
    contribution = Contribution(LAYOUT)
    contribution.add_user(
        {"out.weight": np.full((1, 3), 1.0)}, {"item.weight": (np.array([0, 2]), np.ones((2, 3)))}, 1, 0.2
    )
    contribution.add_user(
        {"out.weight": np.full((1, 3), 5.0)}, {"item.weight": (np.array([2, 5]), np.full((2, 3), 2.0))}, 3, 0.6
    )
    packed = contribution.pack()
    np.testing.assert_array_equal(packed["out.weight"], np.full((1, 3), 4.0, np.float32))
    np.testing.assert_array_equal(packed["item.weight" + ROWS], [0, 2, 5])
    np.testing.assert_array_equal(packed["item.weight" + SUM], [[1.0] * 3, [3.0] * 3, [2.0] * 3])
    np.testing.assert_array_equal(packed["item.weight" + COUNT], [1.0, 2.0, 1.0])
    assert contribution.mean_loss == pytest.approx((1 * 0.2 + 3 * 0.6) / 4, abs=1e-15)
    assert (contribution.num_examples, contribution.num_users) == (4, 2)


def test_selected_aggregation_is_the_plain_mean_of_the_users_full_tables():
    """'selected': each of the round's m = 4 users counts in every row; row 0 was updated to 3 and 5 by two users, the
    other two keep the current 1 -> (3 + 5 + 1 + 1) / 4 = 2.5; 'touched' averages over the two only -> 4."""
    current = np.ones((6, 3), np.float32)
    update = (np.array([0, 4]), np.array([[8.0] * 3, [-2.0] * 3]), np.array([2.0, 1.0]))  # sums and counts
    selected, count = merge_rows(current, [update], "selected", num_users=4)
    np.testing.assert_array_equal(selected[0], [2.5] * 3)
    np.testing.assert_array_equal(selected[4], [(-2.0 + 3 * 1.0) / 4] * 3)
    np.testing.assert_array_equal(selected[[1, 2, 3, 5]], current[[1, 2, 3, 5]])
    np.testing.assert_array_equal(count, [2, 0, 0, 0, 1, 0])
    touched, _ = merge_rows(current, [update], "touched")
    np.testing.assert_array_equal(touched[0], [4.0] * 3)
    np.testing.assert_array_equal(touched[4], [-2.0] * 3)
    with pytest.raises(ValueError, match="num_users >= every row count"):
        merge_rows(current, [update], "selected", num_users=1)
