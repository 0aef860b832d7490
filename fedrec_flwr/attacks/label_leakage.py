"""Gradient label leakage: an honest-but-curious server recovers a client's private label from its upload.

The target is the attribute adversary ``h_w`` of FedAU² (:mod:`fedrec_flwr.adversary`), trained by each client on a
single private example (its own user vector and attribute class ``a``) under cross-entropy. The server observes the
client's upload, from which it forms the update ``delta = w_sent - w_returned`` (proportional to the accumulated
gradient for SGD; of the same sign pattern for Adam's first steps).

* **iDLG** (Zhao, Mopuri, Bilen 2020, "iDLG: Improved Deep Leakage from Gradients", Sec. 3): for softmax
  cross-entropy the gradient of the last layer's bias is ``p - onehot(a)``, whose only negative entry is the label;
  so the label is ``argmin delta_bias`` (:func:`idlg_label`).
* **DLG** (Zhu, Liu, Han 2019, "Deep Leakage from Gradients", Alg. 1): optimise a dummy input (and label) so that the
  gradient they induce matches the observed update (:func:`dlg_label`). Ours:

  - the label is found by enumeration: for each class, the dummy input is optimised with that one-hot label, and the
    class with the best final match wins. DLG's joint optimisation of a soft dummy label stalls with two classes:
    the whole gradient is then ``(p0 - q0)`` times a label-free vector, so a scale-free match depends on the label
    only through a sign and has no gradient with respect to it (measured: 13 of 20 binary labels with the joint
    optimisation, 20 of 20 with four classes);
  - the match is the cosine distance (Geiping et al. 2020, "Inverting Gradients", Eq. 4), because the update's scale
    (learning rate, Adam's normalisation, several local steps) is unknown, summed over the parameter tensors: one
    cosine over all parameters is dominated by the first layer, whose sign the dummy input can flip;
  - the dummy model uses the adversary's deterministic forward (``predict_logits``: the attacker cannot know a DSVAE
    client's random draws).
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


def dlg_label(
    adversary: nn.Module, update: Mapping[str, np.ndarray], *, iterations: int = 100, lr: float = 0.1, seed: int = 0
) -> int:
    """DLG's label by enumeration: for each class ``c``, optimise a dummy input so that the gradient of
    ``CE(h_w(x), c)`` matches ``update``; return the class with the best match (module docstring).

    Args:
        adversary: the adversary as the server sent it (``w_sent`` loaded); it is not modified.
        update: parameter name (as in ``adversary.named_parameters()``) -> ``w_sent - w_returned``; names not given
            are left out of the match.
        iterations: Adam steps on the dummy input, per class.
        lr: Adam's step size.
        seed: the dummy input's initialisation (the same start for every class).

    Returns:
        The recovered class index.

    Raises:
        ValueError: ``update`` names no parameter of the adversary.
    """
    params = dict(adversary.named_parameters())
    names = [n for n in params if n in update]
    if not names:
        raise ValueError(f"dlg_label: the update names none of the adversary's parameters {sorted(params)}")
    targets = [torch.as_tensor(np.asarray(update[n]), dtype=torch.float32).reshape(-1) for n in names]
    weights = [params[n] for n in names]
    start = torch.randn((1, adversary.in_dim), generator=torch.Generator().manual_seed(int(seed)))

    def distance(x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(adversary.predict_logits(x), label)
        grads = torch.autograd.grad(loss, weights, create_graph=True)
        return sum(1.0 - F.cosine_similarity(g.reshape(-1), t, dim=0, eps=1e-12) for g, t in zip(grads, targets))

    best, best_distance = 0, float("inf")
    for label in range(adversary.num_classes):
        target_label = torch.tensor([label])
        dummy_x = start.clone().requires_grad_(True)
        optimizer = torch.optim.Adam([dummy_x], lr=lr)
        for _ in range(int(iterations)):
            optimizer.zero_grad()
            distance(dummy_x, target_label).backward()
            optimizer.step()
        final = float(distance(dummy_x, target_label).detach())
        if final < best_distance:
            best, best_distance = label, final
    for p in weights:
        p.grad = None
    return best
