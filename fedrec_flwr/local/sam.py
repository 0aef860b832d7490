"""Sharpness-aware minimization (SAM) with FedRecGEL's decoupled parameter groups (pure PyTorch; no Flower).

Foret, Kleiner, Mobahi, Neyshabur (2021), "Sharpness-Aware Minimization for Efficiently Improving Generalization",
ICLR, Eq. 2-3: the first-order SAM perturbation of a parameter group ``w`` with gradient ``g`` is
``eps = rho * g / ||g||_2`` and the SAM gradient is ``∇L(w + eps)``.

FedRecGEL ("Sharpness-Aware Minimization for Generalized Embedding Learning in Federated Recommendation",
arXiv:2603.11503, Sec. 4.2) applies SAM separately to the shared group S (item embeddings and score function) and the
non-shared group P (the user's embeddings): from the gradient at the current point ``(w_S, w_P)``,

* ``g_S^SAM = ∇_S L(w_S + eps_S, w_P)``  with ``eps_S = rho_S g_S / ||g_S||`` (P unperturbed),
* ``g_P^SAM = ∇_P L(w_S, w_P + eps_P)``  with ``eps_P = rho_P g_P / ||g_P||`` (S unperturbed),

and each group is then updated with its own SAM gradient. Its public code does one such step per round over all of
the user's examples; :class:`SAMTrainer` follows it (``local-epochs`` such steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.losses import batch_loss
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer
from fedrec_flwr.models.base import RecModel


@torch.no_grad()
def sam_perturbation(grads: Sequence[torch.Tensor | None], rho: float) -> list[torch.Tensor | None]:
    """The SAM perturbation of one parameter group (Foret et al. 2021, Eq. 2): ``eps = rho * g / ||g||_2``.

    The norm is taken over the whole group (all its tensors together), so ``||eps||_2 = rho`` over the group.

    Args:
        grads: the group's gradients (a ``None`` entry = a parameter without gradient).
        rho: the radius (>= 0).
    Returns:
        One tensor per entry (same shape), or ``None`` where the gradient was ``None``. All zeros if ``rho == 0`` or
        the group's gradient norm is zero or not finite: the point is then left unperturbed, never NaN.
    Raises:
        ValueError: ``rho`` is negative or not finite.
    """
    if not math.isfinite(rho) or rho < 0:
        raise ValueError(f"SAM rho must be a finite number >= 0, got {rho!r}")
    present = [g for g in grads if g is not None]
    norm = (
        torch.sqrt(sum((g.double() ** 2).sum() for g in present)) if present else torch.zeros((), dtype=torch.float64)
    )
    if rho == 0 or not bool(torch.isfinite(norm)) or float(norm) == 0.0:
        return [None if g is None else torch.zeros_like(g) for g in grads]
    scale = rho / float(norm)
    return [None if g is None else g * scale for g in grads]


def sam_gradient(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    rho: float,
    loss_fn: Callable[[], torch.Tensor],
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """``∇ L(w + eps)`` of one group: perturb ``params`` by :func:`sam_perturbation`, take the gradient, restore.

    Parameters are restored by copying their saved values back, so they are bit-identical afterwards (subtracting
    ``eps`` is not exact in floating point). Other parameters are untouched; their ``.grad`` is left as the backward
    pass at the perturbed point wrote it, so callers zero gradients first.

    Args:
        params: the group's parameters ``w`` (leaf tensors with ``requires_grad``).
        grads: their gradients at the current point (``None`` allowed).
        rho: the group's radius; with ``rho == 0`` or a zero gradient the input gradients are returned as they are.
        loss_fn: recomputes the scalar loss at the current parameter values (same examples).
    Returns:
        ``(SAM gradients (one per param; None where the param got no gradient), loss at the perturbed point or None
        if no perturbation was made)``.
    """
    eps = sam_perturbation(grads, rho)
    if all(e is None or not bool(e.any()) for e in eps):
        return [None if g is None else g.clone() for g in grads], None
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, eps):
            if e is not None:
                p.add_(e)
    try:
        for p in params:
            p.grad = None
        loss = loss_fn()
        loss.backward()
        out = [None if p.grad is None else p.grad.detach().clone() for p in params]
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    return out, loss.detach()


class SAMTrainer(LocalTrainer):
    """FedRecGEL's local step: decoupled SAM on the shared and the non-shared group (see the module docstring).

    Each of the ``local-epochs`` steps is full-batch over the user's examples. The loss of a step is the sum over
    consecutive chunks of ``batch-size`` examples of each chunk's mean loss (FedRecGEL's public code sums the mean BCE
    of 128-example chunks: use ``batch-size = 128`` to match it); examples are shuffled with the client's generator.

    The private group is updated by :attr:`optimizer` (``cfg.optimizer`` over the private parameters; the client
    keeps its state across rounds). The shared group is updated locally only when ``update_shared`` is true (a fresh
    ``cfg.optimizer`` each call: the FedAvg-of-updates mode); otherwise only its SAM gradient is kept, in
    :attr:`shared_grads`, to be uploaded (the faithful mode: the server applies it).

    Args:
        model: the one-user model. cfg: local training hyper-parameters (``loss`` must be ``"bce"`` and
            ``weight_decay`` 0, else :class:`~fedrec_flwr.errors.ConfigError`).
        rho_shared / rho_private: SAM radii (0 switches that part off: "w/o shared" / "w/o non-shared" ablations;
            both 0 = plain gradient steps, i.e. FedNCF).
        update_shared: step the shared parameters locally (True) or only record their SAM gradient (False).

    Attributes:
        shared_grads: shared state key -> the mean over steps of the shared SAM gradient (same shape as the
            parameter; zero rows for items the user never saw).
    """

    def __init__(
        self, model: RecModel, cfg: LocalTrainConfig, *, rho_shared: float, rho_private: float, update_shared: bool
    ) -> None:
        if cfg.loss != "bce":
            raise ConfigError(
                f"FedRecGEL's SAM trainer supports loss = 'bce' only (its paper's loss), got {cfg.loss!r}"
            )
        if cfg.weight_decay:
            raise ConfigError(
                f"FedRecGEL's SAM trainer has no weight decay (its public code has none), got {cfg.weight_decay!r}"
            )
        super().__init__(model, cfg)
        for name, value in (("rho_shared", rho_shared), ("rho_private", rho_private)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"SAMTrainer: {name} must be a finite number >= 0, got {value!r}")
        self.rho_shared = float(rho_shared)
        self.rho_private = float(rho_private)
        self.update_shared = bool(update_shared)
        self.shared_grads: dict[str, torch.Tensor] = {}

    def make_optimizer(self) -> torch.optim.Optimizer:
        """``cfg.optimizer`` (SGD or Adam, ``cfg.learning_rate``) over the private parameters only."""
        return self._optimizer_for(self.model.private_parameters())

    def _optimizer_for(self, params) -> torch.optim.Optimizer:
        if self.cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.cfg.learning_rate)
        return torch.optim.SGD(params, lr=self.cfg.learning_rate)

    def chunked_loss(self, users: torch.Tensor, items: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum over chunks of ``cfg.batch_size`` examples of the chunk's mean loss (BCE layout), each chunk with the
        trainer's extra :attr:`loss_terms` (e.g. FedAU²'s adversarial term, once per chunk)."""
        total = None
        for start in range(0, users.numel(), self.cfg.batch_size):
            sl = slice(start, start + self.cfg.batch_size)
            part = self.add_loss_terms(batch_loss(self.cfg.loss, self.model(users[sl], items[sl]), labels[sl]))
            total = part if total is None else total + part
        return total

    def sam_step(
        self,
        users: torch.Tensor,
        items: torch.Tensor,
        labels: torch.Tensor,
        shared_optimizer: torch.optim.Optimizer | None,
    ) -> tuple[float, list[torch.Tensor | None]]:
        """One decoupled SAM step over the given examples; returns ``(loss at the current point, shared SAM grads)``."""
        private, shared = self.model.private_parameters(), self.model.shared_parameters()
        everything = private + shared

        def loss_fn() -> torch.Tensor:
            return self.chunked_loss(users, items, labels)

        for p in everything:
            p.grad = None
        loss = loss_fn()
        value = float(loss.detach())
        if not math.isfinite(value):
            return value, []
        loss.backward()
        base_private = [None if p.grad is None else p.grad.detach().clone() for p in private]
        base_shared = [None if p.grad is None else p.grad.detach().clone() for p in shared]
        sam_shared, _ = sam_gradient(shared, base_shared, self.rho_shared, loss_fn)
        for p in everything:
            p.grad = None
        sam_private, _ = sam_gradient(private, base_private, self.rho_private, loss_fn)
        for p, g in zip(everything, sam_private + sam_shared):
            p.grad = g
        self.optimizer.step()
        if shared_optimizer is not None:
            shared_optimizer.step()
        for p in everything:
            p.grad = None
        return value, sam_shared

    def fit_examples(
        self,
        users: np.ndarray,
        items: np.ndarray,
        labels: np.ndarray,
        generator: torch.Generator,
        epochs: int | None = None,
    ) -> tuple[float, int]:
        """``local-epochs`` full-batch SAM steps over the ``(n,)`` examples (shuffled once per step).

        Returns ``(loss at the start of the last step divided by the number of chunks (the mean of the chunk means),
        n)``. Raises ``FloatingPointError`` (parameters restored) on a non-finite loss, shared SAM gradient or
        parameters, as :meth:`LocalTrainer.train`.
        """
        n = len(users)
        if n == 0:
            raise ValueError("no training examples")
        u = torch.as_tensor(np.asarray(users, np.int64), device=self.device)
        i = torch.as_tensor(np.asarray(items, np.int64), device=self.device)
        y = torch.as_tensor(np.asarray(labels, np.float32), device=self.device)
        epochs = self.cfg.local_epochs if epochs is None else int(epochs)
        shared_keys = list(self.model.shared_state())
        shared_optimizer = self._optimizer_for(self.model.shared_parameters()) if self.update_shared else None
        snapshot = self._take_snapshot()
        sums: list[torch.Tensor | None] = [None] * len(shared_keys)
        value = float("nan")
        self.model.train()
        for epoch in range(epochs):
            order = torch.randperm(n, generator=generator).to(self.device)
            value, grads = self.sam_step(u[order], i[order], y[order], shared_optimizer)
            if not math.isfinite(value):
                self._restore(snapshot, f"loss {value} at SAM step {epoch + 1}")
            if not all(g is None or bool(torch.isfinite(g).all()) for g in grads):
                self._restore(snapshot, f"shared SAM gradient at SAM step {epoch + 1}")
            sums = [g if s is None else (s if g is None else s + g) for s, g in zip(sums, grads)]
            if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
                self._restore(snapshot, f"parameters after SAM step {epoch + 1}")
        params = dict(zip(shared_keys, self.model.shared_parameters()))
        self.shared_grads = {
            k: (torch.zeros_like(params[k]) if s is None else s / epochs).detach() for k, s in zip(shared_keys, sums)
        }
        chunks = math.ceil(n / self.cfg.batch_size)
        return value / chunks, n
