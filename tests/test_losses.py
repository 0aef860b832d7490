"""BCE and BPR losses against hand-computed values, and their numerical stability."""

import math

import pytest
import torch

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.losses import LOSSES, batch_loss, bce_loss, bpr_loss


def test_bce_hand_numbers():
    pos = torch.tensor([0.0, 2.0])
    neg = torch.tensor([-1.0])
    expected = (math.log(2) + math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-1))) / 3
    assert bce_loss(pos, neg).item() == pytest.approx(expected, rel=1e-6)


def test_bpr_hand_numbers():
    pos = torch.tensor([1.0, 0.0])
    neg = torch.tensor([[0.0, 1.0], [2.0, -3.0]])
    diffs = [1.0, 0.0, -2.0, 3.0]
    expected = sum(math.log(1 + math.exp(-d)) for d in diffs) / 4
    assert bpr_loss(pos, neg).item() == pytest.approx(expected, rel=1e-6)


def test_losses_are_stable_for_huge_logits():
    big = torch.tensor([1e4, -1e4])
    assert torch.isfinite(bce_loss(big, -big))
    assert bce_loss(big[:1], -big[:1]).item() == pytest.approx(0.0, abs=1e-6)
    assert bce_loss(-big[:1], big[:1]).item() == pytest.approx(1e4, rel=1e-6)
    assert torch.isfinite(bpr_loss(-big[:1], big[:1].reshape(1, 1)))


def test_batch_loss_matches_direct_calls():
    logits = torch.tensor([0.3, -0.2, 1.5, -0.7])
    labels = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert batch_loss("bce", logits, labels).item() == pytest.approx(bce_loss(logits[:2], logits[2:]).item(), rel=1e-6)
    assert batch_loss("bpr", logits, labels).item() == pytest.approx(
        bpr_loss(logits[:2], logits[2:].reshape(2, 1)).item(), rel=1e-6
    )
    assert set(LOSSES) == {"bce", "bpr"}


def test_batch_loss_errors():
    with pytest.raises(ConfigError, match="unknown loss"):
        batch_loss("mse", torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="ones"):
        batch_loss("bpr", torch.zeros(4), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="shapes"):
        bpr_loss(torch.zeros(2), torch.zeros(3, 1))
