"""Small contracts of the attack and adversary helpers, checked by hand: each of attribute inference's ``splits``
train/test halves is its own draw from ``np.random.default_rng([seed, split])`` (so the reported std is over
different halves), and ``adversary-class-prior`` parses to normalised log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedrec_flwr.adversary import parse_class_prior
from fedrec_flwr.attacks.attribute_inference import stratified_halves

LABELS = np.array([0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0])


def test_each_split_is_its_own_seeded_draw_of_stratified_halves():
    halves = list(stratified_halves(LABELS, 4, 0.5, seed=3))
    assert len(halves) == 4
    for split, (train, test) in enumerate(halves):
        rng = np.random.default_rng([3, split])
        expected_train = []
        for c in (0, 1):
            members = np.flatnonzero(LABELS == c)
            expected_train.append(rng.permutation(members)[: int(round(0.5 * members.size))])
        np.testing.assert_array_equal(train, np.sort(np.concatenate(expected_train)))
        np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(LABELS.size))
        for c in (0, 1):  # every class in both halves
            assert (LABELS[train] == c).any() and (LABELS[test] == c).any()
    assert len({tuple(train) for train, _ in halves}) > 1  # the splits differ


@pytest.mark.parametrize(("text", "shares"), [("0.71,0.29", (0.71, 0.29)), ("2,1,1", (0.5, 0.25, 0.25))])
def test_class_prior_is_normalised_log_probabilities(text, shares):
    prior = parse_class_prior(text, len(shares))
    torch.testing.assert_close(prior, torch.log(torch.tensor(shares)), rtol=1e-6, atol=1e-6)
    assert float(prior.exp().sum()) == pytest.approx(1.0, rel=1e-6)
    assert parse_class_prior("", len(shares)) is None
