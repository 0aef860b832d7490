"""Base class of the recommendation models: an explicit, by-module split into private and shared parameters.

In federated recommendation (one client per user) the user embedding never leaves the client, while the item
embeddings and the score function are aggregated by the server. :class:`RecModel` makes that split explicit: each
subclass names its private modules and its shared modules, and every state dictionary is built from the
``named_parameters()`` of exactly those modules (never by matching parameter names).

State keys are ``"<module>.<param>"``, e.g. ``"user_embedding.weight"``, ``"item_embedding.weight"`` or
``"mlp.0.weight"``; they are stable across versions and are what the Flower layer puts on the wire (prefixed).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

#: Standard deviation of the Gaussian initialisation of embedding tables (He et al. 2017, Sec. 4.1: "randomly
#: initialized the model parameters with a Gaussian distribution (with a mean of 0 and standard deviation of 0.01)").
EMBEDDING_INIT_STD = 0.01


def new_embedding(num_rows: int, dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight is allocated but NOT initialised (no global RNG is touched).

    The caller must initialise it, e.g. with :func:`init_embedding`. (Not ``torch.nn.utils.skip_init``: it builds the
    module on the meta device, whose initialisers import ``torch._dynamo``, about 1.5 s idle and 4 s on a loaded
    machine, paid by every ClientApp process; measured.)
    """
    return nn.Embedding(num_rows, dim, _weight=torch.empty(num_rows, dim))


def new_linear(in_features: int, out_features: int) -> nn.Linear:
    """An ``nn.Linear`` whose values the caller sets (:func:`init_linear`); the global RNG state is left as it was
    (``nn.Linear`` draws its default initialisation from it, which is restored afterwards)."""
    with torch.random.fork_rng(devices=[]):
        return nn.Linear(in_features, out_features)


@torch.no_grad()
def init_embedding(module: nn.Embedding, generator: torch.Generator, std: float = EMBEDDING_INIT_STD) -> None:
    """Initialise an embedding table in place from N(0, std²) drawn with ``generator``."""
    nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)


@torch.no_grad()
def init_linear(module: nn.Linear, generator: torch.Generator) -> None:
    """Initialise a linear layer in place: Glorot/Xavier-uniform weight (Glorot & Bengio 2010, Eq. 16), zero bias."""
    nn.init.xavier_uniform_(module.weight, generator=generator)
    if module.bias is not None:
        module.bias.zero_()


class RecModel(nn.Module):
    """Base of every recommendation model; scores (user, item) pairs with a logit.

    Subclasses set three tuples of attribute names in ``__init__`` (after creating the modules):

    * ``_private_names``: modules that hold per-user parameters (user embedding tables, one row per user);
    * ``_shared_names``: every other module (item tables, score function), aggregated by the server;
    * ``_item_table_names``: the subset of shared modules that are item embedding tables (one row per item,
      row-sparse updates).

    and implement :meth:`forward` and :meth:`_init_shared`. Every parameter of the model must belong to exactly
    one declared module (checked by :meth:`_check_partition`).

    Attributes:
        num_users: rows of the user table(s). A federated client uses 1 (its own row, index 0).
        num_items: rows of the item table(s).
        embedding_dim: width of every embedding table.
    """

    _private_names: tuple[str, ...] = ()
    _shared_names: tuple[str, ...] = ()
    _item_table_names: tuple[str, ...] = ()

    def __init__(self, num_users: int, num_items: int, embedding_dim: int) -> None:
        super().__init__()
        for key, value in (("num_users", num_users), ("num_items", num_items), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{type(self).__name__}: {key} must be a positive int, got {value!r}")
        self.num_users = int(num_users)
        self.num_items = int(num_items)
        self.embedding_dim = int(embedding_dim)
        self.active_item_subset: np.ndarray | None = None
        """Inside :meth:`item_subset`: the global item of each local row; ``None`` otherwise."""

    # ----------------------------------------------------------------------------------------- module split
    def private_modules(self) -> dict[str, nn.Module]:
        """The private (per-user) modules by name, e.g. ``{"user_embedding": nn.Embedding(num_users, d)}``."""
        return {name: getattr(self, name) for name in self._private_names}

    def shared_modules(self) -> dict[str, nn.Module]:
        """The shared modules by name: item embedding tables and the score function."""
        return {name: getattr(self, name) for name in self._shared_names}

    def item_embedding_modules(self) -> dict[str, nn.Embedding]:
        """The shared modules that are item embedding tables (``(num_items, d)``, updated row-sparsely)."""
        return {name: getattr(self, name) for name in self._item_table_names}

    def user_embedding_modules(self) -> dict[str, nn.Embedding]:
        """The private modules that are user embedding tables (``(num_users, d)``)."""
        return {name: m for name, m in self.private_modules().items() if isinstance(m, nn.Embedding)}

    def attach_shared_module(self, name: str, module: nn.Module) -> None:
        """Add ``module`` as one more shared (aggregated, non-item-table) module, e.g. FedAU²'s attribute adversary.

        Its parameters then appear in :meth:`shared_state` under ``"<name>.<param>"`` after the model's own, travel
        to and from the server like the score function, and are stepped by local optimizers; ``forward`` ignores it.

        Raises:
            ValueError: ``name`` is already an attribute of the model.
        """
        if hasattr(self, name):
            raise ValueError(f"{type(self).__name__}: cannot attach {name!r}: the name is taken")
        self.add_module(name, module)
        self._shared_names = (*self._shared_names, name)
        self._check_partition()

    def _check_partition(self) -> None:
        """Raise ``TypeError`` unless private and shared modules partition all parameters of the model."""
        declared: dict[int, str] = {}
        for group in (self.private_modules(), self.shared_modules()):
            for mod_name, module in group.items():
                for p_name, param in module.named_parameters():
                    if id(param) in declared:
                        raise TypeError(f"{type(self).__name__}: parameter {mod_name}.{p_name} declared twice")
                    declared[id(param)] = f"{mod_name}.{p_name}"
        for name, param in self.named_parameters():
            if id(param) not in declared:
                raise TypeError(f"{type(self).__name__}: parameter {name} is neither private nor shared")
        if not set(self._item_table_names) <= set(self._shared_names):
            raise TypeError(f"{type(self).__name__}: item tables must be shared modules")

    # ----------------------------------------------------------------------------------------- parameters
    @staticmethod
    def _named(modules: Mapping[str, nn.Module]) -> dict[str, nn.Parameter]:
        return {f"{m}.{p}": param for m, module in modules.items() for p, param in module.named_parameters()}

    def private_parameters(self) -> list[nn.Parameter]:
        """Parameters of the private modules, in key order of :meth:`private_state`."""
        return list(self._named(self.private_modules()).values())

    def shared_parameters(self) -> list[nn.Parameter]:
        """Parameters of the shared modules, in key order of :meth:`shared_state`."""
        return list(self._named(self.shared_modules()).values())

    def private_state(self) -> dict[str, torch.Tensor]:
        """Detached copies of the private parameters, keys ``"<module>.<param>"`` (e.g. ``"user_embedding.weight"``)."""
        return {k: p.detach().clone() for k, p in self._named(self.private_modules()).items()}

    def shared_state(self) -> dict[str, torch.Tensor]:
        """Detached copies of the shared parameters, keys ``"<module>.<param>"`` (e.g. ``"item_embedding.weight"``)."""
        return {k: p.detach().clone() for k, p in self._named(self.shared_modules()).items()}

    def load_private_state(self, state: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Copy ``state`` into the private parameters (strict; see :meth:`_load`)."""
        self._load(self._named(self.private_modules()), state, "private")

    def load_shared_state(self, state: Mapping[str, torch.Tensor | np.ndarray], *, partial: bool = False) -> None:
        """Copy ``state`` into the shared parameters (strict; see :meth:`_load`). With ``partial=True`` only the keys
        in ``state`` are loaded (each must still be a shared key of the right shape)."""
        params = self._named(self.shared_modules())
        if partial:
            params = {k: v for k, v in params.items() if k in state}
        self._load(params, state, "shared")

    @contextmanager
    def item_subset(self, items: np.ndarray) -> Iterator[np.ndarray]:
        """Temporarily replace every item table by a compact copy of its rows ``items``.

        Inside the block the model has ``num_items = len(items)`` and item index ``j`` means global item
        ``items[j]``; an optimizer built inside sees only those rows, so local training costs O(rows used) instead of
        O(catalogue). On exit the original full tables (never modified by the block) are put back. The compact
        tables' final values are what the block trained; read them before leaving it.

        Args:
            items: ``(T,)`` sorted unique int64 global item indices.
        Yields:
            ``items`` (the local-to-global map).
        Raises:
            ValueError: ``items`` is not sorted, unique and within ``[0, num_items)``.
        """
        items = np.asarray(items, dtype=np.int64)
        if (
            items.ndim != 1
            or items.size == 0
            or (np.diff(items) <= 0).any()
            or items[0] < 0
            or items[-1] >= self.num_items
        ):
            raise ValueError(f"item_subset: items must be sorted unique indices in [0, {self.num_items})")
        tables = self.item_embedding_modules()
        saved = {name: (module.weight, module.num_embeddings) for name, module in tables.items()}
        full_items = self.num_items
        index = torch.as_tensor(items, device=next(iter(saved.values()))[0].device)
        try:
            for module in tables.values():
                module.weight = nn.Parameter(module.weight.detach().index_select(0, index).clone())
                module.num_embeddings = int(items.size)
            self.num_items = int(items.size)
            self.active_item_subset = items
            yield items
        finally:
            for name, module in tables.items():
                device = module.weight.device  # a .to(device) inside the block moved the compact copy only
                module.weight, module.num_embeddings = saved[name]
                if module.weight.device != device:
                    module.weight.data = module.weight.data.to(device)
            self.num_items = full_items
            self.active_item_subset = None

    @torch.no_grad()
    def _load(self, params: dict[str, nn.Parameter], state: Mapping, kind: str) -> None:
        """Strict in-place load: values are cast to each parameter's dtype and device.

        Raises:
            ValueError: a key is missing or unexpected, a value has the wrong shape, or holds NaN/inf. Nothing is
                modified unless every entry is valid.
        """
        where = f"{type(self).__name__}.load_{kind}_state"
        missing = [k for k in params if k not in state]
        extra = [k for k in state if k not in params]
        if missing:
            raise ValueError(f"{where}: missing key {missing[0]!r} (expected keys {sorted(params)})")
        if extra:
            raise ValueError(f"{where}: unexpected key {extra[0]!r} (expected keys {sorted(params)})")
        converted = {}
        for key, param in params.items():
            value = state[key]
            tensor = torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{where}: key {key!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            if tensor.is_floating_point() and not all_finite(tensor):
                raise ValueError(f"{where}: key {key!r} contains NaN or infinite values")
            converted[key] = tensor
        for key, param in params.items():
            param.copy_(converted[key].to(device=param.device, dtype=param.dtype))

    # ----------------------------------------------------------------------------------------- init
    def reset_private(self, generator: torch.Generator) -> None:
        """Re-initialise every user embedding table from N(0, 0.01²) with ``generator`` (CPU generator).

        Values are drawn on the CPU and copied to the model's device, so the result does not depend on the device.
        """
        for module in self.user_embedding_modules().values():
            _init_on_cpu(module, generator, init_embedding)

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Initialise all parameters from ``generator``: :meth:`_init_shared` first, then the user tables.

        Shared parameters are drawn first so that they do not depend on ``num_users``: a server model
        (``num_users=U``) and a client model (``num_users=1``) built with the same seed have identical shared state.
        """
        self._init_shared(generator)
        self.reset_private(generator)

    def _init_shared(self, generator: torch.Generator) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Logits (pre-sigmoid scores), shape ``(B,)`` float32, for ``users`` and ``items`` (both ``(B,)`` int64)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"num_users={self.num_users}, num_items={self.num_items}, embedding_dim={self.embedding_dim}"


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry of a floating-point ``tensor`` is finite: ``torch.isfinite(tensor).all()``, cheaper in the
    usual case: a sum is finite only if no entry is NaN or infinite (NaN and inf propagate), so one reduction without
    a temporary settles it; only a non-finite sum (or an overflow of finite values) takes the exact elementwise test."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


@torch.no_grad()
def _init_on_cpu(module: nn.Module, generator: torch.Generator, init) -> None:
    """Run ``init(module_copy, generator)`` on a CPU copy of ``module`` and copy the result back (device-independent)."""
    params = dict(module.named_parameters())
    if all(p.device.type == "cpu" for p in params.values()):
        init(module, generator)
        return
    originals = {k: p.data for k, p in params.items()}
    for p in params.values():
        p.data = torch.empty_like(p.data, device="cpu")
    try:
        init(module, generator)
        values = {k: p.data for k, p in params.items()}
    finally:
        for k, p in params.items():
            p.data = originals[k]
    for k, p in params.items():
        p.copy_(values[k])
