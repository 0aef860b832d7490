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

The step is written once, over a batch of users: every tensor is stacked along a leading user dimension ``(k, ...)``
and each user's perturbation uses that user's own norm (:func:`sam_perturbations`, :func:`decoupled_sam_gradients`).
The engine that calls it only says how to take a gradient at a point (``gradient_at``): the vectorized block path
(:mod:`fedrec_flwr.local.block_engine`) evaluates its batched loss at the perturbed stacked parameters; the per-user
:class:`SAMTrainer` is the batch of one, whose :class:`ModuleGradient` writes the point into the model's parameters,
backpropagates and copies the saved values back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.losses import batch_loss
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer
from fedrec_flwr.models.base import RecModel

GradientAt = Callable[[dict[str, torch.Tensor], list[str]], dict[str, torch.Tensor]]
"""``gradient_at(point, keys)``: the gradients ``(k, ...)`` of each user's loss at ``point`` (key -> ``(k, ...)``
stacked parameter values) with respect to the parameters ``keys``; a key whose parameter gets no gradient is absent."""


def _check_rho(rho: float) -> None:
    if not math.isfinite(rho) or rho < 0:
        raise ValueError(f"SAM rho must be a finite number >= 0, got {rho!r}")


def user_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(k,)`` float64: the L2 norm over all of each user's entries of ``tensors`` (each ``(k, ...)``), summed in
    float64 tensor by tensor."""
    return torch.sqrt(sum((t.double() ** 2).flatten(1).sum(1) for t in tensors))


@torch.no_grad()
def sam_perturbations(grads: Mapping[str, torch.Tensor], rho: float) -> dict[str, torch.Tensor] | None:
    """Each user's SAM perturbation of one parameter group (Foret et al. 2021, Eq. 2): ``eps_u = rho g_u / ||g_u||_2``.

    Args:
        grads: key -> ``(k, ...)`` the group's gradients, stacked over ``k`` users; user ``u``'s norm is taken over
            all of its entries of every key (:func:`user_norms`), so ``||eps_u||_2 = rho`` over the group.
        rho: the radius (>= 0).
    Returns:
        key -> ``(k, ...)`` perturbations in the gradients' dtype (the scale ``rho / ||g_u||`` is divided in float64
        and rounded once), zero for a user whose norm is zero or not finite (that user stays unperturbed, never NaN);
        ``None`` when no user is perturbed (``rho == 0``, no gradient, or every norm zero or not finite), so that the
        caller keeps the gradient at the current point instead of computing the same one again.
    Raises:
        ValueError: ``rho`` is negative or not finite.
    """
    _check_rho(rho)
    if rho == 0 or not grads:
        return None
    norm = user_norms(list(grads.values()))
    ok = torch.isfinite(norm) & (norm > 0)
    if not bool(ok.any()):
        return None
    dtype = next(iter(grads.values())).dtype
    scale = torch.where(ok, torch.full_like(norm, rho) / torch.where(ok, norm, 1.0), 0.0).to(dtype)
    return {key: g * scale.view(-1, *([1] * (g.dim() - 1))) for key, g in grads.items()}


def decoupled_sam_gradients(
    params: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    groups: Sequence[tuple[Sequence[str], float]],
    gradient_at: GradientAt,
) -> dict[str, torch.Tensor]:
    """FedRecGEL's decoupled SAM gradients (Sec. 4.2) of a batch of users: each group perturbed alone, with its own
    radius, the other groups left at the current point.

    For each ``(keys, rho)`` of ``groups`` in order: ``eps`` = :func:`sam_perturbations` of the group's gradients at
    the current point, and the group's SAM gradient is ``gradient_at(params with params[key] + eps[key] for the
    group's keys, keys)``; a group that no user perturbs keeps its gradients at the current point.

    Args:
        params: key -> ``(k, ...)`` the users' current parameter values (not modified).
        base: key -> ``(k, ...)`` the gradients at ``params`` (a parameter without gradient is absent).
        groups: ``(keys, rho)`` per parameter group (FedRecGEL: the shared group with ``rho-shared``, then the
            private one with ``rho-private``; one group of all keys is plain SAM).
        gradient_at: the engine's gradient at a point (:data:`GradientAt`).
    Returns:
        key -> ``(k, ...)`` the SAM gradient of every key of the groups that has a gradient.
    """
    out: dict[str, torch.Tensor] = {}
    for keys, rho in groups:
        present = [key for key in keys if key in base]
        eps = sam_perturbations({key: base[key] for key in present}, rho)
        if eps is None:
            out.update({key: base[key] for key in present})
            continue
        point = {**params, **{key: params[key] + eps[key] for key in present}}
        out.update(gradient_at(point, present))
    return out


class ModuleGradient:
    """:data:`GradientAt` for parameters a module holds, as a batch of one user (the per-user path).

    A call writes the point's values of the requested keys into those parameters, backpropagates ``loss_fn`` from
    cleared gradients, reads the requested parameters' gradients, and copies their saved values back, so they are
    bit-identical afterwards (subtracting ``eps`` is not exact in floating point).

    Args:
        params: key -> parameter (leaf tensors with ``requires_grad``).
        loss_fn: recomputes the scalar loss at the parameters' current values (same examples).

    Attributes:
        loss: the loss at the last point evaluated (detached), ``None`` before the first call.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], loss_fn: Callable[[], torch.Tensor]) -> None:
        self.params = dict(params)
        self.loss_fn = loss_fn
        self.loss: torch.Tensor | None = None

    def point(self) -> dict[str, torch.Tensor]:
        """key -> ``(1, ...)`` the parameters' current values (views, not copies)."""
        return {key: p.detach().unsqueeze(0) for key, p in self.params.items()}

    def gradients(self) -> dict[str, torch.Tensor]:
        """key -> ``(1, ...)`` copies of the parameters' current ``.grad`` (absent where it is ``None``)."""
        return {key: p.grad.detach().clone().unsqueeze(0) for key, p in self.params.items() if p.grad is not None}

    def __call__(self, point: Mapping[str, torch.Tensor], keys: Sequence[str]) -> dict[str, torch.Tensor]:
        group = [self.params[key] for key in keys]
        saved = [p.detach().clone() for p in group]
        with torch.no_grad():
            for key, p in zip(keys, group):
                p.copy_(point[key][0])
        try:
            for p in self.params.values():
                p.grad = None
            loss = self.loss_fn()
            loss.backward()
            self.loss = loss.detach()
            return {key: p.grad.detach().clone().unsqueeze(0) for key, p in zip(keys, group) if p.grad is not None}
        finally:
            with torch.no_grad():
                for p, s in zip(group, saved):
                    p.copy_(s)


def sam_perturbation(grads: Sequence[torch.Tensor | None], rho: float) -> list[torch.Tensor | None]:
    """The SAM perturbation of one user's parameter group (Foret et al. 2021, Eq. 2): ``eps = rho * g / ||g||_2``,
    :func:`sam_perturbations` for a batch of one.

    Args:
        grads: the group's gradients (a ``None`` entry = a parameter without gradient).
        rho: the radius (>= 0).
    Returns:
        One tensor per entry (same shape), or ``None`` where the gradient was ``None``. All zeros if ``rho == 0`` or
        the group's gradient norm is zero or not finite: the point is then left unperturbed, never NaN.
    Raises:
        ValueError: ``rho`` is negative or not finite.
    """
    present = {str(i): g.unsqueeze(0) for i, g in enumerate(grads) if g is not None}
    eps = sam_perturbations(present, rho)
    if eps is None:
        return [None if g is None else torch.zeros_like(g) for g in grads]
    return [None if g is None else eps[str(i)][0] for i, g in enumerate(grads)]


def sam_gradient(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    rho: float,
    loss_fn: Callable[[], torch.Tensor],
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """``∇ L(w + eps)`` of one user's group: :func:`decoupled_sam_gradients` with the one group, taken in place by
    :class:`ModuleGradient` (parameters restored bit-identically; other parameters' ``.grad`` untouched).

    Args:
        params: the group's parameters ``w`` (leaf tensors with ``requires_grad``).
        grads: their gradients at the current point (``None`` allowed).
        rho: the group's radius; with ``rho == 0`` or a zero gradient the input gradients are returned as they are.
        loss_fn: recomputes the scalar loss at the current parameter values (same examples).
    Returns:
        ``(SAM gradients (one per param; None where the param got no gradient), loss at the perturbed point or None
        if no perturbation was made)``.
    """
    keys = [str(i) for i in range(len(params))]
    at = ModuleGradient(dict(zip(keys, params)), loss_fn)
    base = {key: g.detach().clone().unsqueeze(0) for key, g in zip(keys, grads) if g is not None}
    sam = decoupled_sam_gradients(at.point(), base, ((keys, rho),), at)
    return [sam[key][0] if key in sam else None for key in keys], at.loss


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
        """One decoupled SAM step over the given examples (:func:`decoupled_sam_gradients` as a batch of one, the
        shared group first); returns ``(loss at the current point, shared SAM grads)``."""
        private, shared = self.model.private_parameters(), self.model.shared_parameters()
        private_keys = [f"private/{i}" for i in range(len(private))]
        shared_keys = [f"shared/{i}" for i in range(len(shared))]
        at = ModuleGradient(
            dict(zip(private_keys + shared_keys, private + shared)),
            lambda: self.chunked_loss(users, items, labels),
        )
        for p in at.params.values():
            p.grad = None
        loss = at.loss_fn()
        value = float(loss.detach())
        if not math.isfinite(value):
            return value, []
        loss.backward()
        groups = ((shared_keys, self.rho_shared), (private_keys, self.rho_private))
        sam = decoupled_sam_gradients(at.point(), at.gradients(), groups, at)
        for key, p in at.params.items():
            p.grad = sam[key][0] if key in sam else None
        self.optimizer.step()
        if shared_optimizer is not None:
            shared_optimizer.step()
        for p in at.params.values():
            p.grad = None
        return value, [sam[key][0] if key in sam else None for key in shared_keys]

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
