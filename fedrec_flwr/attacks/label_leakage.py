"""Gradient label leakage: an honest-but-curious server recovers a client's private label from its upload.

The target is the attribute adversary ``h_w`` of FedAU² (:mod:`fedrec_flwr.adversary`), trained by each client on a
single private example (its own user vector and attribute class ``a``) under cross-entropy. The server observes the
client's upload, from which it forms the update ``delta = w_sent - w_returned`` (proportional to the accumulated
gradient for SGD; of the same sign pattern for Adam's first steps).

* **iDLG** (Zhao, Mopuri, Bilen 2020, "iDLG: Improved Deep Leakage from Gradients", Sec. 3): for softmax
  cross-entropy the gradient of the last layer's bias is ``p - onehot(a)``, whose only negative entry is the label;
  so the label is ``argmin delta_bias`` (:func:`idlg_label`).
* **DLG** (Zhu, Liu, Han 2019, "Deep Leakage from Gradients", Alg. 1): optimise a dummy input and dummy soft label so
  that the gradient they induce matches the observed update; the recovered label is the dummy label's argmax
  (:func:`dlg_label`). Ours: the match is the cosine distance over all adversary parameters (Geiping et al. 2020,
  "Inverting Gradients", Eq. 4), because the update's scale (learning rate, Adam's normalisation, several local
  steps) is unknown to the attacker; the dummy model uses the adversary's deterministic forward (``predict_logits``:
  the attacker cannot know a DSVAE client's random draws).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def idlg_label(bias_update: np.ndarray) -> int:
    """iDLG's analytic label: ``argmin`` of the last layer's bias update ``w_sent - w_returned`` (``(C,)``).

    Raises:
        ValueError: not a finite 1-D array with >= 2 entries.
    """
    delta = np.asarray(bias_update, dtype=np.float64)
    if delta.ndim != 1 or delta.size < 2 or not np.isfinite(delta).all():
        raise ValueError(f"idlg_label: expected a finite (C,) bias update with C >= 2, got shape {delta.shape}")
    return int(np.argmin(delta))


def dlg_label(adversary: nn.Module, update: Mapping[str, np.ndarray], *, iterations: int = 100, lr: float = 0.1,
              seed: int = 0) -> int:
    """DLG's label: the argmax of a dummy soft label optimised so that its gradient matches ``update``.

    Args:
        adversary: the adversary as the server sent it (``w_sent`` loaded); it is not modified.
        update: parameter name (as in ``adversary.named_parameters()``) -> ``w_sent - w_returned``; names not given
            are left out of the match.
        iterations: Adam steps on the dummy input and label.
        lr: Adam's step size.
        seed: the dummy input's initialisation.

    Returns:
        The recovered class index.

    Raises:
        ValueError: ``update`` names no parameter of the adversary.
    """
    params = dict(adversary.named_parameters())
    names = [n for n in params if n in update]
    if not names:
        raise ValueError(f"dlg_label: the update names none of the adversary's parameters {sorted(params)}")
    target = torch.cat([torch.as_tensor(np.asarray(update[n]), dtype=torch.float32).reshape(-1) for n in names])
    weights = [params[n] for n in names]
    generator = torch.Generator().manual_seed(int(seed))
    dummy_x = torch.randn((1, adversary.in_dim), generator=generator).requires_grad_(True)
    dummy_y = torch.zeros((1, adversary.num_classes), requires_grad=True)
    optimizer = torch.optim.Adam([dummy_x, dummy_y], lr=lr)
    for _ in range(int(iterations)):
        optimizer.zero_grad()
        logits = adversary.predict_logits(dummy_x)
        loss = -(F.softmax(dummy_y, dim=-1) * F.log_softmax(logits, dim=-1)).sum()
        grads = torch.autograd.grad(loss, weights, create_graph=True)
        flat = torch.cat([g.reshape(-1) for g in grads])
        distance = 1.0 - F.cosine_similarity(flat, target, dim=0)
        distance.backward()
        optimizer.step()
    for p in weights:
        p.grad = None
    return int(dummy_y.detach().argmax(dim=-1)[0])
