"""The split's random streams (fedrec_flwr.data.split), each checked against its own named generator: test negatives
from ``[seed, TAG_TEST_NEG, user]``, validation negatives from ``[seed, TAG_VAL_NEG, user]`` (so the two sets are
independent draws: on the tiny data about a third of each user's validation negatives are also test negatives, not
all of them), training negatives from ``[seed, TAG_TRAIN_NEG, user, round]``; and the leave-one-out hold-out worked
by hand on a five-row file."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_tiny_dataset

from fedrec_flwr.data import GenericSource, load_interactions, preprocess, sample_train_negatives
from fedrec_flwr.data.split import TAG_TEST_NEG, TAG_TRAIN_NEG, TAG_VAL_NEG, complement_items

NEGATIVES = 20


@pytest.fixture(scope="module")
def interactions(tmp_path_factory):
    path = write_tiny_dataset(tmp_path_factory.mktemp("split"))
    return load_interactions(
        "generic", generic=GenericSource(str(path), user_col="user", item_col="item", timestamp_col="timestamp")
    )


def _all_interacted(split, user):
    return split.interacted(user)


def _expected(split, user, seed, tag):
    interacted = _all_interacted(split, user)
    ranks = np.random.default_rng([seed, tag, user]).choice(
        split.num_items - interacted.size, size=NEGATIVES, replace=False
    )
    return complement_items(interacted, ranks)


@pytest.mark.parametrize("seed", [0, 3])
def test_validation_and_test_negatives_come_from_their_own_streams(interactions, seed):
    split = preprocess(interactions, seed=seed, num_test_negatives=NEGATIVES, holdout_validation=True)
    assert split.val_negatives.shape == split.test_negatives.shape == (split.num_users, NEGATIVES)
    overlaps = []
    for user in range(split.num_users):
        np.testing.assert_array_equal(split.test_negatives[user], _expected(split, user, seed, TAG_TEST_NEG))
        np.testing.assert_array_equal(split.val_negatives[user], _expected(split, user, seed, TAG_VAL_NEG))
        assert not np.isin(split.val_negatives[user], _all_interacted(split, user)).any()
        overlaps.append(np.isin(split.val_negatives[user], split.test_negatives[user]).mean())
    assert 0.1 < float(np.mean(overlaps)) < 0.6  # independent draws of 20 of ~50 candidates: about 0.4


def test_without_validation_the_test_negatives_are_unchanged(interactions):
    """Holding out a validation item changes which items are candidates, so compare per stream: without
    validation the test negatives are the TAG_TEST_NEG draw over the user's items (training + test)."""
    split = preprocess(interactions, seed=0, num_test_negatives=NEGATIVES)
    assert split.val_items is None and split.val_negatives is None
    for user in range(split.num_users):
        np.testing.assert_array_equal(split.test_negatives[user], _expected(split, user, 0, TAG_TEST_NEG))


def test_training_negatives_come_from_the_user_and_round_stream(interactions):
    split = preprocess(interactions, seed=0, num_test_negatives=NEGATIVES)
    for user, round_ in ((0, 1), (5, 1), (5, 2)):
        got = sample_train_negatives(split, user, round_, 3, seed=4)
        positives = split.positives(user)
        ranks = np.random.default_rng([4, TAG_TRAIN_NEG, user, round_]).integers(
            0, split.num_items - positives.size, size=3 * positives.size, dtype=np.int64
        )
        np.testing.assert_array_equal(got, complement_items(positives, ranks))
        assert not np.isin(got, positives).any()
    assert not np.array_equal(sample_train_negatives(split, 5, 1, 3, 4), sample_train_negatives(split, 5, 2, 3, 4))


def test_complement_items_maps_ranks_to_the_items_left_out():
    # items 0..9 without {1, 2, 5}: 0, 3, 4, 6, 7, 8, 9
    np.testing.assert_array_equal(complement_items(np.array([1, 2, 5]), np.arange(7)), [0, 3, 4, 6, 7, 8, 9])
    np.testing.assert_array_equal(complement_items(np.array([0]), np.array([0, 2])), [1, 3])


def test_leave_one_out_holds_out_the_latest_and_second_latest(tmp_path):
    """User a's items by time: 4 (t=1), 1 (t=2), 3 (t=3), 2 (t=4): test item 2, validation item 3, training {1, 4}."""
    path = tmp_path / "d.csv"
    path.write_text(
        "user,item,ts\na,4,1\na,1,2\na,3,3\na,2,4\nb,1,1\nb,2,2\nb,3,3\nb,5,4\nb,4,9\nc,6,1\nc,7,2\nc,8,3\n"
    )
    inter = load_interactions(
        "generic", generic=GenericSource(str(path), user_col="user", item_col="item", timestamp_col="ts")
    )
    split = preprocess(inter, min_user_interactions=3, num_test_negatives=0, holdout_validation=True)
    ids = lambda idx: [split.item_ids[i] for i in np.atleast_1d(idx)]  # noqa: E731
    assert ids(split.test_items[0]) == ["2"] and ids(split.val_items[0]) == ["3"]
    assert sorted(ids(split.positives(0))) == ["1", "4"]
    assert ids(split.test_items[1]) == ["4"] and ids(split.val_items[1]) == ["5"]
    assert sorted(ids(split.positives(1))) == ["1", "2", "3"]
    assert ids(split.test_items[2]) == ["8"] and ids(split.val_items[2]) == ["7"] and ids(split.positives(2)) == ["6"]
