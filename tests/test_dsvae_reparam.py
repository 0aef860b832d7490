"""DSVAE's reparameterised latent (fedrec_flwr.adversary.DSVAEAdversary) worked by hand: with a linear encoder whose
output is fixed (weights 0, bias ``(mu, log sigma^2)``) and an identity head, the training logits are the latent
itself, ``z = mu + sigma * xi`` with ``sigma = exp(log sigma^2 / 2)`` (Kingma & Welling 2014, Eq. 10), and the KL
term is ``1/2 sum(mu^2 + sigma^2 - 1 - log sigma^2)``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedrec_flwr.adversary import DSVAEAdversary

MU = (0.5, -1.0)
LOGVAR = (-2.0, 1.5)


def _fixed() -> DSVAEAdversary:
    adversary = DSVAEAdversary(3, 2, 0, 2, gradient_noise=0.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adversary.encoder.weight.zero_()
        adversary.encoder.bias.copy_(torch.tensor(MU + LOGVAR))
        adversary.head.weight.copy_(torch.eye(2))
        adversary.head.bias.zero_()
    return adversary


def test_the_latent_is_the_mean_plus_the_standard_deviation_times_the_draw():
    adversary = _fixed()
    xi = torch.tensor([[1.0, 1.0], [-2.0, 0.5], [0.0, 0.0]])
    logits = adversary(torch.randn(3, 3), (xi, None, None))
    sigma = torch.tensor([math.exp(v / 2) for v in LOGVAR])
    expected = torch.tensor(MU) + sigma * xi  # sigma = (0.368, 2.117), not the variance (0.135, 4.482)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    kl = 0.5 * sum(m * m + math.exp(v) - 1.0 - v for m, v in zip(MU, LOGVAR))
    assert float(adversary.regulariser()) == pytest.approx(kl, rel=1e-6)
    torch.testing.assert_close(adversary.predict_logits(torch.randn(2, 3)), torch.tensor([MU, MU]))


def test_drawn_latents_have_the_posterior_standard_deviation():
    """From the client's generator: over 20,000 draws the latent's std is sigma per coordinate (within 3%)."""
    adversary = _fixed()
    adversary.generator = torch.Generator().manual_seed(1)
    z = adversary(torch.zeros(20_000, 3)).detach().double().numpy()
    np.testing.assert_allclose(z.mean(axis=0), MU, atol=0.05)
    np.testing.assert_allclose(z.std(axis=0), [math.exp(v / 2) for v in LOGVAR], rtol=0.03)
