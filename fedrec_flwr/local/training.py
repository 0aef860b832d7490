"""One user's local training loop and per-user evaluation (pure PyTorch; no Flower).

:class:`LocalTrainer` trains a :class:`~fedrec_flwr.models.RecModel` on one user's positives and sampled negatives.
Subclasses (SAM, adversarial training, ...) override :meth:`LocalTrainer.step` (and optionally
:meth:`LocalTrainer.make_optimizer` / :meth:`LocalTrainer.compute_loss`) and reuse the loop. The centralized
baseline (:mod:`fedrec_flwr.baselines`) uses the same trainer over all users at once via
:meth:`LocalTrainer.fit_examples` / :meth:`LocalTrainer.fit_pairs`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedrec_flwr.errors import ConfigError, DataError
from fedrec_flwr.local.losses import LOSSES, batch_loss
from fedrec_flwr.metrics import DEFAULT_KS, ranking_metrics, ranking_metrics_batch
from fedrec_flwr.models.base import RecModel, all_finite

logger = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adam")


def resolve_device(name: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or ``"auto"`` (CUDA if available, else CPU) -> ``torch.device``.

    Raises:
        ConfigError: the name is not a device, or names CUDA when none is available.
    """
    if isinstance(name, torch.device):
        device = name
    elif str(name).lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(str(name))
        except RuntimeError as exc:
            raise ConfigError(
                f"device: invalid value {name!r} ({exc}); use 'cpu', 'cuda', 'cuda:N' or 'auto'"
            ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {name!r} requested but CUDA is not available; use 'cpu' or 'auto'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU for a parameterless module)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


@dataclass(frozen=True)
class LocalTrainConfig:
    """Hyper-parameters of local training.

    Attributes:
        local_epochs: passes over the user's examples per :meth:`LocalTrainer.train` call (>= 1).
        batch_size: examples (BCE) or (positive, negative) pairs (BPR) per mini-batch (>= 1).
        learning_rate: optimizer step size (>= 0; 0 trains nothing, useful for probes and tests).
        num_train_negatives: negatives sampled per positive by the caller (>= 1; used by the Flower layer and the
            centralized baseline; :meth:`LocalTrainer.train` uses whatever negatives it is given).
        loss: ``"bce"`` or ``"bpr"`` (:data:`fedrec_flwr.local.losses.LOSSES`).
        optimizer: ``"sgd"`` or ``"adam"``.
        weight_decay: L2 coefficient λ >= 0. Dense layers use the optimizer's weight decay; embedding tables are
            regularised lazily, only on rows used in the batch (see :meth:`LocalTrainer.compute_loss`), so rows a
            client never touches stay exactly unchanged.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``.

    Raises:
        ConfigError: a field is out of range or of the wrong type (the message names it and its value).
    """

    local_epochs: int = 1
    batch_size: int = 256
    learning_rate: float = 0.1
    num_train_negatives: int = 4
    loss: str = "bce"
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        for key in ("local_epochs", "batch_size", "num_train_negatives"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"LocalTrainConfig.{key} must be an int >= 1, got {value!r}")
        for key, minimum_ok in (("learning_rate", lambda v: v >= 0), ("weight_decay", lambda v: v >= 0)):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not minimum_ok(value)
            ):
                raise ConfigError(f"LocalTrainConfig.{key} must be a finite number (>= 0), got {value!r}")
        if self.loss not in LOSSES:
            raise ConfigError(f"LocalTrainConfig.loss: unknown loss {self.loss!r}; valid: {sorted(LOSSES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"LocalTrainConfig.optimizer: unknown optimizer {self.optimizer!r}; valid: {list(OPTIMIZERS)}"
            )
        if not isinstance(self.device, (str, torch.device)):
            raise ConfigError(f"LocalTrainConfig.device must be a string, got {self.device!r}")


@dataclass
class LocalTrainResult:
    """Outcome of :meth:`LocalTrainer.train`.

    Attributes:
        num_examples: examples per epoch: positives + negatives (BCE) or (positive, negative) pairs (BPR).
        loss: mean training loss (per example / pair) over the last epoch, without the L2 term.
        touched_items: ``(T,)`` int64 sorted unique item indices used in this call (positives ∪ negatives); every
            other item row of the model is unchanged by the call (for SGD/Adam with a fresh trainer).
    """

    num_examples: int
    loss: float
    touched_items: np.ndarray


class ProximalTerm:
    """FedProx's proximal term, a :attr:`LocalTrainer.loss_terms` entry: ``(mu/2) * sum_p ||p - p_0||^2`` over the
    given parameters, with ``p_0`` their values when the term was made (the round's global model, loaded before local
    training starts). Its gradient is ``mu (p - p_0)`` on every parameter at every step, pulling the local model
    toward the global one.

    Source: Li et al., "Federated Optimization in Heterogeneous Networks" (FedProx), MLSys 2020, Eq. (2): the local
    objective ``h_k(w; w^t) = F_k(w) + (mu/2) ||w - w^t||^2``. (Flower 1.42's ``FedProx`` docstring sketches the
    unsquared norm; we follow the paper.) Our clients apply it to the **shared** parameters only (the item rows the
    user trains, in their compact copy, and the score function): those are what the server averages; the private user
    embedding has no global value to stay near.

    Args:
        parameters: the tensors to keep near their current values (any shapes); snapshotted (detached copies) here.
        mu: the proximal weight ``mu`` (the ``"proximal-mu"`` the strategy sends), finite and > 0.
    Raises:
        ValueError: ``mu`` is not a finite number > 0.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], mu: float) -> None:
        mu = float(mu)
        if not math.isfinite(mu) or mu <= 0:
            raise ValueError(f"proximal-mu must be a finite number > 0, got {mu!r}")
        self.mu = mu
        self.parameters = list(parameters)
        self.anchors = [p.detach().clone() for p in self.parameters]

    def __call__(self) -> torch.Tensor:
        total = sum((p - a).pow(2).sum() for p, a in zip(self.parameters, self.anchors))
        return 0.5 * self.mu * total


def as_index_array(values, name: str, upper: int) -> np.ndarray:
    """``values`` as a 1-D int64 array with every entry in ``[0, upper)``.

    Raises:
        DataError: not 1-D, not integers, or an entry out of range (names the position and value).
    """
    array = np.asarray(values)
    if array.ndim != 1:
        raise DataError(f"{name}: expected a 1-D array of indices, got shape {array.shape}")
    if array.size == 0:
        return array.astype(np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise DataError(f"{name}: expected integer indices, got dtype {array.dtype}")
    bad = np.flatnonzero((array < 0) | (array >= upper))
    if bad.size:
        raise DataError(f"{name}: index {array[bad[0]]} at position {bad[0]} is outside [0, {upper})")
    return array.astype(np.int64, copy=False)


class LocalTrainer:
    """One user's local training loop (also used for all users at once by the centralized baseline).

    The model is moved to ``cfg.device`` on construction. The optimizer is created lazily by
    :meth:`make_optimizer` on the first step and kept for the trainer's lifetime (Adam moments persist across
    :meth:`train` calls; build a fresh trainer per federated round for a stateless client).

    Subclasses override :meth:`step` (and optionally :meth:`make_optimizer`); they never copy the loop.
    """

    def __init__(self, model: RecModel, cfg: LocalTrainConfig) -> None:
        if not isinstance(model, RecModel):
            raise TypeError(f"LocalTrainer: model must be a RecModel, got {type(model).__name__}")
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model = model.to(self.device)
        self._optimizer: torch.optim.Optimizer | None = None
        self._snapshot: list[torch.Tensor] | None = None
        self.loss_terms: list[Callable[[], torch.Tensor]] = []
        """Extra differentiable loss terms, each called once per mini-batch and added to its loss (e.g. FedAU²'s
        adversarial term, :class:`fedrec_flwr.adversary.AdversarialTerm`); trainers that build their loss
        differently (SAM) add them too, so a term composes with any trainer."""

    # ------------------------------------------------------------------------------------------ optimizer
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, created by :meth:`make_optimizer` on first use."""
        if self._optimizer is None:
            self._optimizer = self.make_optimizer()
        return self._optimizer

    def _embedding_tables(self) -> dict[str, nn.Embedding]:
        return {**self.model.user_embedding_modules(), **self.model.item_embedding_modules()}

    def make_optimizer(self) -> torch.optim.Optimizer:
        """SGD or Adam over the private + shared parameters.

        Two parameter groups: embedding tables (``weight_decay=0``; their L2 term is added row-sparsely in
        :meth:`compute_loss`) and every other parameter (``weight_decay=cfg.weight_decay``).
        """
        table_ids = {id(p) for m in self._embedding_tables().values() for p in m.parameters()}
        params = self.model.private_parameters() + self.model.shared_parameters()
        groups = [
            {"params": [p for p in params if id(p) in table_ids], "weight_decay": 0.0},
            {"params": [p for p in params if id(p) not in table_ids], "weight_decay": self.cfg.weight_decay},
        ]
        groups = [g for g in groups if g["params"]]
        if self.cfg.optimizer == "adam":
            return torch.optim.Adam(groups, lr=self.cfg.learning_rate)
        return torch.optim.SGD(groups, lr=self.cfg.learning_rate)

    # ------------------------------------------------------------------------------------------ one batch
    def compute_loss(self, users: torch.Tensor, items: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Differentiable loss of one mini-batch: ``batch_loss(cfg.loss, model(users, items), labels) + R`` plus every
        term of :attr:`loss_terms`.

        ``R = (λ/2) Σ_tables Σ_{r ∈ rows used in the batch} ||e_r||²`` (λ = ``cfg.weight_decay``; each distinct row
        counted once, so a row's gradient gets exactly ``λ e_r`` as with dense weight decay, but only for rows the
        batch uses). Layout of (users, items, labels): see :func:`fedrec_flwr.local.losses.batch_loss`.
        """
        loss = batch_loss(self.cfg.loss, self.model(users, items), labels)
        if self.cfg.weight_decay > 0:
            loss = loss + self.cfg.weight_decay * 0.5 * self._row_l2(users, items)
        return self.add_loss_terms(loss)

    def add_loss_terms(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus each of :attr:`loss_terms` (called now, once each)."""
        for term in self.loss_terms:
            loss = loss + term()
        return loss

    def _row_l2(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        unique_users, unique_items = torch.unique(users), torch.unique(items)
        for table in self.model.user_embedding_modules().values():
            total = total + table(unique_users).pow(2).sum()
        for table in self.model.item_embedding_modules().values():
            total = total + table(unique_items).pow(2).sum()
        return total

    def step(self, users: torch.Tensor, items: torch.Tensor, labels: torch.Tensor) -> float:
        """One mini-batch: zero grads, :meth:`compute_loss`, backward, optimizer step; returns the loss value.

        Args:
            users, items: ``(B,)`` int64 on ``self.device``; labels: ``(B,)`` float32 (1 positive, 0 negative).
        Returns:
            The batch loss (float). If it is not finite, no backward/step is done and it is returned as is; the
            loop then restores the parameters and raises.
        """
        return self.optimizer_step(self.optimizer, users, items, labels)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, users: torch.Tensor, items: torch.Tensor, labels: torch.Tensor
    ) -> float:
        """Zero every gradient, :meth:`compute_loss`, backward and ``optimizer.step()``; returns the loss value (no
        backward or step if it is not finite)."""
        self.model.zero_grad(set_to_none=True)
        loss = self.compute_loss(users, items, labels)
        value = float(loss.detach())
        if not math.isfinite(value):
            return value
        loss.backward()
        optimizer.step()
        return value

    # ------------------------------------------------------------------------------------------ loops
    def train(
        self, user_index: int, positives: np.ndarray, negatives: np.ndarray, generator: torch.Generator
    ) -> LocalTrainResult:
        """Train on one user's examples for ``cfg.local_epochs`` epochs.

        BCE: examples are (user, positive, 1) and (user, negative, 0), shuffled each epoch with ``generator``.
        BPR: positive ``j`` is paired with ``negatives[j*k:(j+1)*k]`` (k = ``len(negatives) // len(positives)``);
        the pairs are shuffled each epoch.

        Args:
            user_index: row of the user in the model's user table(s) (0 for a client model with ``num_users=1``).
            positives: ``(P,)`` int item indices the user interacted with (P >= 1).
            negatives: ``(N,)`` int item indices (N may be 0 for BCE; for BPR, a positive multiple of P).
            generator: CPU ``torch.Generator`` for shuffling; the same generator state gives bit-identical results.
        Returns:
            :class:`LocalTrainResult`.
        Raises:
            ValueError: empty positives, BPR with ``N % P != 0`` or ``N == 0``.
            DataError: an index is out of range or not an integer.
            FloatingPointError: a step gave a non-finite loss (the message names epoch and step), or the parameters
                became non-finite (checked after each epoch); the parameters are restored to their values before
                this call and the optimizer is discarded.
        """
        if (
            isinstance(user_index, bool)
            or not isinstance(user_index, (int, np.integer))
            or not (0 <= user_index < self.model.num_users)
        ):
            raise DataError(f"user_index {user_index!r} is outside [0, {self.model.num_users})")
        pos = as_index_array(positives, "positives", self.model.num_items)
        neg = as_index_array(negatives, "negatives", self.model.num_items)
        if pos.size == 0:
            raise ValueError(f"user {user_index}: no positives to train on")
        if self.cfg.loss == "bpr":
            if neg.size == 0 or neg.size % pos.size:
                raise ValueError(
                    f"user {user_index}: BPR needs k >= 1 negatives per positive, got {neg.size} negatives for "
                    f"{pos.size} positives"
                )
            k = neg.size // pos.size
            users = np.full(neg.size, user_index, dtype=np.int64)
            loss, count = self.fit_pairs(users, np.repeat(pos, k), neg, generator)
        else:
            items = np.concatenate([pos, neg])
            labels = np.concatenate([np.ones(pos.size, np.float32), np.zeros(neg.size, np.float32)])
            users = np.full(items.size, user_index, dtype=np.int64)
            loss, count = self.fit_examples(users, items, labels, generator)
        touched = np.unique(np.concatenate([pos, neg])).astype(np.int64)
        return LocalTrainResult(num_examples=count, loss=loss, touched_items=touched)

    def fit_examples(
        self,
        users: np.ndarray,
        items: np.ndarray,
        labels: np.ndarray,
        generator: torch.Generator,
        epochs: int | None = None,
    ) -> tuple[float, int]:
        """Pointwise loop over ``(n,)`` users / items / float labels for ``epochs`` (default ``cfg.local_epochs``).

        Returns ``(mean loss over the last epoch, n)``. Indices are assumed valid (checked by :meth:`train`).
        Raises ``FloatingPointError`` as :meth:`train`.
        """
        u = torch.as_tensor(np.asarray(users, np.int64), device=self.device)
        i = torch.as_tensor(np.asarray(items, np.int64), device=self.device)
        y = torch.as_tensor(np.asarray(labels, np.float32), device=self.device)

        def batch(idx: torch.Tensor):
            return u[idx], i[idx], y[idx]

        return self._loop(u.numel(), batch, generator, epochs), u.numel()

    def fit_pairs(
        self,
        users: np.ndarray,
        pos_items: np.ndarray,
        neg_items: np.ndarray,
        generator: torch.Generator,
        epochs: int | None = None,
    ) -> tuple[float, int]:
        """Pairwise (BPR) loop over ``(n,)`` (user, positive item, negative item) triples.

        Each mini-batch of b pairs is passed to :meth:`step` as ``users=(u, u)``, ``items=(pos, neg)``,
        ``labels=(1…1, 0…0)`` (length 2b; the layout of :func:`fedrec_flwr.local.losses.batch_loss`).
        Returns ``(mean loss per pair over the last epoch, n)``.
        """
        u = torch.as_tensor(np.asarray(users, np.int64), device=self.device)
        p = torch.as_tensor(np.asarray(pos_items, np.int64), device=self.device)
        q = torch.as_tensor(np.asarray(neg_items, np.int64), device=self.device)

        def batch(idx: torch.Tensor):
            b = idx.numel()
            labels = torch.cat([torch.ones(b, device=self.device), torch.zeros(b, device=self.device)])
            return torch.cat([u[idx], u[idx]]), torch.cat([p[idx], q[idx]]), labels

        return self._loop(u.numel(), batch, generator, epochs), u.numel()

    def _loop(
        self, n: int, make_batch: Callable[[torch.Tensor], tuple], generator: torch.Generator, epochs: int | None
    ) -> float:
        if n == 0:
            raise ValueError("no training examples")
        epochs = self.cfg.local_epochs if epochs is None else int(epochs)
        self.model.train()
        snapshot = self._take_snapshot()  # once per call: restoring to here keeps the model finite
        mean_loss = float("nan")
        for epoch in range(epochs):
            order = torch.randperm(n, generator=generator).to(self.device)
            total = 0.0
            for step_no, start in enumerate(range(0, n, self.cfg.batch_size)):
                idx = order[start : start + self.cfg.batch_size]
                value = self.step(*make_batch(idx))
                if not math.isfinite(value):
                    self._restore(snapshot, f"loss {value} at epoch {epoch + 1}, step {step_no + 1}")
                total += value * idx.numel()
            if not all(all_finite(p.detach()) for p in self.model.parameters()):
                self._restore(snapshot, f"parameters after epoch {epoch + 1}")
            mean_loss = total / n
        return mean_loss

    @torch.no_grad()
    def _take_snapshot(self) -> list[torch.Tensor]:
        params = list(self.model.parameters())
        if self._snapshot is None or len(self._snapshot) != len(params):
            self._snapshot = [torch.empty_like(p) for p in params]
        for buf, p in zip(self._snapshot, params):
            buf.copy_(p)
        return self._snapshot

    @torch.no_grad()
    def _restore(self, snapshot: list[torch.Tensor], what: str) -> None:
        for buf, p in zip(snapshot, self.model.parameters()):
            p.copy_(buf)
        self._optimizer = None  # its state may hold non-finite moments
        raise FloatingPointError(
            f"non-finite training {what} (lr={self.cfg.learning_rate}, optimizer={self.cfg.optimizer}); "
            "parameters restored to their values before this local training"
        )


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def score_candidates(
    model: RecModel, users: np.ndarray, candidates: np.ndarray, *, users_per_batch: int = 2048
) -> np.ndarray:
    """Scores (logits) of each user's candidate items.

    Args:
        model: any RecModel (evaluated on its own device, in eval mode; its train/eval mode is restored).
        users: ``(U,)`` int user rows of the model.
        candidates: ``(U, C)`` int item indices.
        users_per_batch: users scored per forward pass (memory bound).
    Returns:
        ``(U, C)`` float64 numpy array.
    Raises:
        DataError: shapes disagree or an index is out of range.
    """
    users = as_index_array(users, "users", model.num_users)
    cands = np.asarray(candidates)
    if cands.ndim != 2 or cands.shape[0] != users.size:
        raise DataError(f"candidates: expected shape ({users.size}, C), got {cands.shape}")
    as_index_array(cands.reshape(-1), "candidates", model.num_items)
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        out = np.empty(cands.shape, dtype=np.float64)
        num_cands = cands.shape[1]
        for start in range(0, users.size, users_per_batch):
            u = torch.as_tensor(users[start : start + users_per_batch], device=device)
            c = torch.as_tensor(cands[start : start + users_per_batch].astype(np.int64), device=device)
            scores = model(u.repeat_interleave(num_cands), c.reshape(-1)).reshape(-1, num_cands)
            out[start : start + u.numel()] = scores.double().cpu().numpy()
    finally:
        model.train(was_training)
    return out


def evaluate_user(
    model: RecModel, user_index: int, target_item: int, negatives: np.ndarray, ks: Sequence[int] = DEFAULT_KS
) -> dict[str, float]:
    """Leave-one-out metrics for one user: rank ``target_item`` among itself and ``negatives`` (usually 99).

    The target is placed first; ties count against the model (:func:`fedrec_flwr.metrics.rank_of_target`).

    Args:
        model: the model (its device is used); user_index: row in the model's user table (0 for a client).
        target_item: held-out item index; negatives: ``(C-1,)`` int item indices.
    Returns:
        ``{"HR@k": float, "NDCG@k": float, ...}`` for ``k`` in ``ks``.
    Raises:
        DataError: an index is out of range. ValueError: the model produced NaN scores.
    """
    negatives = as_index_array(negatives, "negatives", model.num_items)
    candidates = np.concatenate([as_index_array([target_item], "target_item", model.num_items), negatives])
    scores = score_candidates(model, np.array([user_index]), candidates[None, :])[0]
    return ranking_metrics(scores, 0, ks)


def evaluate_users(
    model: RecModel, users: np.ndarray, targets: np.ndarray, negatives: np.ndarray, ks: Sequence[int] = DEFAULT_KS
) -> dict[str, np.ndarray]:
    """Batched :func:`evaluate_user`: ``(U,)`` users and targets, ``(U, C-1)`` negatives -> per-user metric arrays."""
    targets = np.asarray(targets).reshape(-1, 1)
    negatives = np.asarray(negatives)
    if negatives.ndim != 2 or negatives.shape[0] != targets.shape[0]:
        raise DataError(f"negatives: expected shape ({targets.shape[0]}, C-1), got {negatives.shape}")
    scores = score_candidates(model, users, np.concatenate([targets, negatives], axis=1))
    return ranking_metrics_batch(scores, 0, ks)


def optimizer_state_arrays(optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """An optimizer's per-parameter state as flat arrays: ``"<param index>/<name>"`` -> array (e.g. Adam's
    ``exp_avg``, ``exp_avg_sq``, ``step``). Hyper-parameters are not saved: they come from the config."""
    out = {}
    for index, entry in optimizer.state_dict()["state"].items():
        for name, value in entry.items():
            out[f"{index}/{name}"] = torch.as_tensor(value).detach().cpu().numpy().copy()
    return out


def load_optimizer_state_arrays(optimizer: torch.optim.Optimizer, arrays: Mapping[str, np.ndarray]) -> None:
    """Inverse of :func:`optimizer_state_arrays` (the optimizer must have the same parameters)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = torch.as_tensor(np.array(value))
    full = optimizer.state_dict()
    full["state"] = state
    optimizer.load_state_dict(full)
