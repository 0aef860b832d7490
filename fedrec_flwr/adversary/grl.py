"""Gradient reversal and fixed gradient noise: two identity-forward autograd functions that change only the backward.

:func:`grad_reverse` is FedAU²'s gradient reversal layer (Ganin & Lempitsky 2015, "Unsupervised Domain Adaptation by
Backpropagation", Sec. 3.2): the adversary ``h_w`` after it gets its ordinary gradient while the user embedding before
it gets the gradient times ``-eps``. :func:`noisy_gradient` adds a fixed perturbation to a parameter's gradient (DSVAE's
second randomness, :class:`fedrec_flwr.adversary.models.DSVAEAdversary`).
"""

from __future__ import annotations

import torch


class _GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, strength: torch.Tensor) -> torch.Tensor:  # noqa: D401
        ctx.save_for_backward(strength)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (strength,) = ctx.saved_tensors
        return -strength * grad, None


def grad_reverse(x: torch.Tensor, strength: float | torch.Tensor) -> torch.Tensor:
    """Gradient reversal layer: returns ``x`` unchanged; backward multiplies the incoming gradient by ``-strength``.

    Ganin & Lempitsky (2015), Eq. 11-12. ``strength`` is a float or a tensor broadcastable to ``x`` (e.g. ``(B, 1)``
    per-example strengths, as the SUT gives); no gradient flows into ``strength``. Parameters *after* the layer
    (the adversary's) get their ordinary gradient; only what flows back into ``x`` is reversed.
    """
    strength = torch.as_tensor(strength, dtype=x.dtype, device=x.device)
    return _GradientReversal.apply(x, strength)


class _NoisyGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:  # noqa: D401
        ctx.save_for_backward(noise)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (noise,) = ctx.saved_tensors
        return grad + noise, None


def noisy_gradient(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward adds the fixed tensor ``noise`` (shape of ``x``) to the gradient of ``x``."""
    return _NoisyGradient.apply(x, noise)
