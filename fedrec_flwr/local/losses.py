"""Training losses for implicit feedback: pointwise BCE and pairwise BPR, in numerically stable log-sigmoid form.

The trainer calls :func:`batch_loss`, which turns a mini-batch laid out as ``(logits, labels)`` into the right call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fedrec_flwr.errors import ConfigError


def bce_loss(logits_pos: torch.Tensor, logits_neg: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy with logits over positives (label 1) and negatives (label 0).

    ``L = -(sum_p log σ(s_p) + sum_n log(1 - σ(s_n))) / (P + N)`` — the pointwise log loss of He et al. (2017),
    "Neural Collaborative Filtering", Sec. 3.1.1 (log loss), used by FedNCF/FedMF-style training. Computed with ``logsigmoid``
    (``log(1-σ(x)) = logσ(-x)``), so large logits never give inf/NaN.

    Args:
        logits_pos: ``(P,)`` float logits of positive pairs.
        logits_neg: ``(N,)`` float logits of negative pairs.
    Returns:
        0-dim float tensor (differentiable).
    Raises:
        ValueError: both inputs are empty, or an input is not 1-D.
    """
    if logits_pos.dim() != 1 or logits_neg.dim() != 1:
        raise ValueError(
            f"bce_loss: expected 1-D logits, got shapes {tuple(logits_pos.shape)}, {tuple(logits_neg.shape)}"
        )
    total = logits_pos.numel() + logits_neg.numel()
    if total == 0:
        raise ValueError("bce_loss: no positives and no negatives")
    return -(F.logsigmoid(logits_pos).sum() + F.logsigmoid(-logits_neg).sum()) / total


def bpr_loss(logits_pos: torch.Tensor, logits_neg: torch.Tensor) -> torch.Tensor:
    """Mean Bayesian personalised ranking loss ``-log σ(s_pos - s_neg)`` over all (positive, negative) pairs.

    Rendle, Freudenthaler, Gantner, Schmidt-Thieme (2009), "BPR: Bayesian Personalized Ranking from Implicit
    Feedback", BPR-Opt (Sec. 4.1) without the regularisation term (apply weight decay separately).

    Args:
        logits_pos: ``(P,)`` float logits of positives.
        logits_neg: ``(P, k)`` float logits; row ``j`` holds the k negatives paired with positive ``j``.
    Returns:
        0-dim float tensor: mean over the P·k pairs.
    Raises:
        ValueError: shapes do not match ``(P,)`` / ``(P, k)`` or there are no pairs.
    """
    if logits_pos.dim() != 1 or logits_neg.dim() != 2 or logits_neg.shape[0] != logits_pos.shape[0]:
        raise ValueError(
            f"bpr_loss: expected shapes (P,) and (P, k), got {tuple(logits_pos.shape)} and {tuple(logits_neg.shape)}"
        )
    if logits_neg.numel() == 0:
        raise ValueError("bpr_loss: no (positive, negative) pairs")
    return -F.logsigmoid(logits_pos.unsqueeze(1) - logits_neg).mean()


#: Loss name -> function. Names are run-config values (``loss = "bce"``).
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"bce": bce_loss, "bpr": bpr_loss}


def batch_loss(name: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Loss of one mini-batch given its ``(B,)`` logits and ``(B,)`` float labels (1 = positive, 0 = negative).

    Layouts:
        * ``"bce"``: any order; positives are where ``labels == 1``.
        * ``"bpr"``: pairs, ``B = 2n``: entries ``0..n-1`` are positives (label 1) and entry ``n + j`` is the
          negative paired with positive ``j`` (label 0). This is what :class:`fedrec_flwr.local.training.LocalTrainer`
          builds for BPR.

    Raises:
        ConfigError: unknown loss name.
        ValueError: shapes differ, or the BPR layout is violated.
    """
    if name not in LOSSES:
        raise ConfigError(f"unknown loss {name!r}; valid losses: {sorted(LOSSES)}")
    if logits.shape != labels.shape or logits.dim() != 1:
        raise ValueError(f"batch_loss: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must be equal 1-D")
    if name == "bce":
        # Same value as bce_loss(logits[labels == 1], logits[labels == 0]), without boolean indexing.
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    n = logits.shape[0] // 2
    if logits.shape[0] != 2 * n or n == 0:
        raise ValueError(f"batch_loss('bpr'): batch size must be even and positive, got {logits.shape[0]}")
    expected = torch.cat([torch.ones(n, device=labels.device), torch.zeros(n, device=labels.device)])
    if not torch.equal(labels.to(expected.dtype), expected):
        raise ValueError("batch_loss('bpr'): labels must be n ones (positives) followed by n zeros (paired negatives)")
    return bpr_loss(logits[:n], logits[n:].unsqueeze(1))
