"""Per-round diagnostics of the global adversary ``h_w`` in an in-process simulation (evaluation only: it reads the
true labels, which never leave a client in a deployment)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedrec_flwr.adversary.models import ADVERSARY_MODULE, build_adversary, user_vector_dim

DIAGNOSTICS_FILE = "adversary-diagnostics.csv"


@torch.no_grad()
def adversary_diagnostics(adversary: nn.Module, embeddings: torch.Tensor, labels) -> dict[str, float]:
    """How the (global) adversary ``h_w`` sees every user, for the per-round diagnostics (evaluation only: it needs
    the true labels, which never leave a client; :class:`DiagnosticsHook`).

    Args:
        adversary: ``h_w`` (deterministic prediction, ``predict_logits``).
        embeddings: ``(N, D)`` user vectors (:func:`user_vector` layout). labels: ``(N,)`` class indices.

    Returns:
        ``users``; per class ``c``: ``predicted-share-c`` (share of all users ``h_w`` assigns to ``c``) and
        ``trigger-rate-c`` (share of class-``c`` users it predicts correctly: where the binary SUT fires);
        ``balanced-accuracy`` (mean of the per-class trigger rates over classes present); ``auc`` (``h_w``'s own
        ROC AUC, one-vs-rest macro for more than two classes; NaN with one class present).
    """
    from sklearn.metrics import roc_auc_score

    labels = torch.as_tensor(labels, dtype=torch.long)
    logits = adversary.predict_logits(torch.as_tensor(embeddings, dtype=torch.float32))
    predicted = logits.argmax(dim=-1)
    num_classes = logits.shape[1]
    out: dict[str, float] = {"users": float(len(labels))}
    rates = []
    for c in range(num_classes):
        out[f"predicted-share-{c}"] = float((predicted == c).float().mean()) if len(labels) else float("nan")
        members = labels == c
        rate = float((predicted[members] == c).float().mean()) if members.any() else float("nan")
        out[f"trigger-rate-{c}"] = rate
        if members.any():
            rates.append(rate)
    out["balanced-accuracy"] = float(np.mean(rates)) if rates else float("nan")
    present = np.unique(labels.numpy())
    if len(present) < 2:
        out["auc"] = float("nan")
    elif num_classes == 2:
        out["auc"] = float(roc_auc_score(labels.numpy(), logits[:, 1].numpy() - logits[:, 0].numpy()))
    else:
        probs = torch.softmax(logits, dim=-1).numpy()
        out["auc"] = (
            float(
                roc_auc_score(
                    labels.numpy(),
                    probs[:, present] / probs[:, present].sum(1, keepdims=True),
                    multi_class="ovr",
                    labels=present,
                )
            )
            if len(present) > 2
            else float("nan")
        )
    return out


def adaptive_columns(strategy) -> dict[str, float]:
    """Under ``adversary-weight-rule = "adaptive"``, the server controller's state after the round: ``epsilon``
    (the GRL weight the next round's train messages carry) and ``adaptive-signal`` (``b_t``, the balanced signal the
    step read from the round's summed statistics; NaN when a class was absent); ``{}`` otherwise."""
    adaptive = getattr(getattr(strategy, "adversary_step", None), "adaptive", None)
    if adaptive is None:
        return {}
    return {"epsilon": float(adaptive.epsilon), "adaptive-signal": float(adaptive.last_signal)}


class DiagnosticsHook:
    """An ``on_round`` hook of an in-process simulation (:func:`fedrec_flwr.serial.run_serial`) that appends
    :func:`adversary_diagnostics` of the round's global ``h_w`` over every user trained so far to
    ``adversary-diagnostics.csv`` in the results folder (column ``round`` first; with the adaptive rule also
    :func:`adaptive_columns`), then calls ``then``.

    Evaluation only: the users' embeddings are read from the simulated nodes' private state and their labels from
    the split (as :func:`fedrec_flwr.attacks.collect_user_embeddings`); nothing travels in a message, and a
    deployment has no such hook.
    """

    def __init__(self, runtime, then=None) -> None:
        self.runtime, self.then = runtime, then
        cfg = runtime.config
        self.adversary = build_adversary(
            cfg.adversary,
            user_vector_dim(runtime.model),
            runtime.protected.num_classes,
            hidden=cfg.adversary_hidden,
            latent=cfg.dsvae_latent_dim,
            gradient_noise=0.0,
            generator=torch.Generator().manual_seed(0),
        )
        self.rows: list[dict] = []

    def __call__(self, view) -> None:
        import pandas as pd

        from fedrec_flwr.attacks import collect_user_embeddings
        from fedrec_flwr.io import atomic_write_text

        prefix = ADVERSARY_MODULE + "."
        with torch.no_grad():
            for name, param in self.adversary.named_parameters():
                param.copy_(torch.as_tensor(view.arrays[prefix + name].numpy()))
        runtime = self.runtime
        states = [context.state for context in view.grid.contexts.values()]
        x, present = collect_user_embeddings(states, runtime.layout.private_keys, runtime.split.num_users)
        if present.any():
            row = {
                "round": view.server_round,
                **adversary_diagnostics(self.adversary, torch.as_tensor(x[present]), runtime.protected.labels[present]),
                **adaptive_columns(view.strategy),
            }
            self.rows.append(row)
            atomic_write_text(
                Path(view.folder) / DIAGNOSTICS_FILE, pd.DataFrame(self.rows).to_csv(index=False, float_format="%.5f")
            )
        if self.then is not None:
            self.then(view)
