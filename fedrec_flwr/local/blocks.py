"""Vectorized user blocks: a node trains and evaluates all of a message's users as one batched computation.

A node serving ``k`` users would otherwise run ``k`` tiny local trainings one after another, each costing PyTorch's
per-call overhead on tensors of a few hundred rows (about 10 ms per user on one CPU core). Here the ``k`` users are
stacked along a leading *user* dimension and trained together, so the per-call overhead is paid once per step for the
whole block. For MF and NCF the forward pass is written as a few batched matrix products over the stacked parameters
(:func:`batched_loss`); any other model runs through :mod:`torch.func` (``vmap`` over a ``functional_call`` of the
process's model; :meth:`Block.autograd_gradients`, also the tests' reference). Both are differentiated by autograd:
the gradient of the sum of the users' losses with respect to the stacked parameters is each user's own gradient. A block holds:

* per-user private parameters (user embeddings) stacked, ``(k, 1, d)``;
* per-user copies of the shared parameters the step changes: each user's compact item rows (positives and sampled
  negatives, as :meth:`RecModel.item_subset` gives the per-user client), padded to the block's largest row count,
  ``(k, T_max, d)``, and the score function (MLP, output layer), ``(k, ...)``;
* padded and masked mini-batches: each user's examples in the order its own shuffle stream gives, a per-example
  weight ``1 / (size of its mini-batch or chunk)`` (0 on padding); users are sorted by size, so the users with a
  mini-batch left at a step are a prefix of the block and only that prefix (a view) is stepped;
* per-user optimizer state (:class:`BlockAdam` / SGD), including FedRecGEL's persistent Adam of the user embeddings
  (users sharing one step count are stepped by torch's fused Adam kernel, :data:`FUSED_ADAM`).

The per-user ``NumPyClient`` subclasses stay the reference: the block path draws the same negatives
(:func:`fedrec_flwr.data.sample_train_negatives`), the same shuffles (:func:`fedrec_flwr.seeding.torch_generator`,
``TAG_SHUFFLE``), forms the same mini-batches, and gives the same per-user updates and private state up to float32
rounding (``tests/test_blocks.py`` compares both on real ML-100K users). Users are independent, so a block is split
into chunks of users of similar size (sorted by example count) to bound padding and memory; the result does not depend
on the chunking.

Supported (a client class declares it with its own ``block_training`` attribute, :func:`block_kind`):

* ``"plain"``: :class:`fedrec_flwr.clients.fedrec.FedRecClient` (FedNCF with ``model = "ncf"``, FedMF with ``model = "mf"``): the
  :class:`~fedrec_flwr.local.training.LocalTrainer` loop (BCE or BPR mini-batches, Adam or SGD fresh every round);
* ``"sam"``: :class:`fedrec_flwr.clients.fedrecgel.FedRecGELClient`: the decoupled SAM step of :class:`~fedrec_flwr.local.sam.SAMTrainer`
  (``rho-shared`` / ``rho-private``, full-batch chunked loss, persistent private optimizer, gradient or parameter
  uploads).

* ``"plain"`` with a :class:`BlockTerm`: :class:`fedrec_flwr.clients.fedau2.FedAU2Client` in its default arm (the entropy pull
  toward ``h_w``'s uniform prediction at every step, ``h_w`` frozen on the server's copy, its gradient uploaded:
  :class:`fedrec_flwr.clients.fedau2.EntropyPullBlock`; :meth:`~fedrec_flwr.clients.fedau2.FedAU2Client.block_supports` names the arm).

Per-user only (for now): PFedRec (a personalised item table and its own item learning rate), FedAU²'s other arms
(the gradient reversal, the SGD pull, per-client ``h_w``, ``user-embedding-noise``) and FedAU² on FedRecGEL, and any subclass or plug-in client that does not declare ``block_training`` itself, since
it may override hooks (``make_trainer``, ``shared_update``, ``prepare_evaluation``, ...) the block path does not call.

The block path runs on the run's ``device`` (``"cuda"`` included): every tensor of a block lives there; only the
shuffles are drawn on the CPU (as in the per-user path) and moved.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict
from torch.func import functional_call, vmap

from fedrec_flwr.app.runtime import Runtime
from fedrec_flwr.arrays import decode_record, encode_array
from fedrec_flwr.data import sample_train_negatives
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.training import resolve_device
from fedrec_flwr.metrics import ranking_metrics_batch
from fedrec_flwr.models.base import EMBEDDING_INIT_STD
from fedrec_flwr.seeding import TAG_SHUFFLE, TAG_USER_INIT, torch_generator
from fedrec_flwr.state.client_state import OPTIMIZER_PREFIX, STATE_PREFIX
from fedrec_flwr.wire import UserUpdate

BLOCK_MODES = ("auto", "on", "off")
"""Values of the run-config key ``block-training``: ``auto`` (the default: the block path for every message, one user
included, whose client class and model support it, :func:`block_kind`; the others per-user), ``on`` (the same, but a
client that does not support it is refused at start), ``off`` (always per-user: the per-user clients are the
reference, kept as this named arm).

One-user messages take the block path under ``auto`` because the per-user path's first ``torch.optim`` optimizer in a
process imports ``torch._dynamo`` (``Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo``, which
imports it on its first call: about 1.7 s on an idle core, 4 s under load), which every deployed train message (a new
``flwr-clientapp`` process per message) and every Ray actor's first user paid; the block path steps its own
:class:`BlockAdam` (``torch._fused_adam_``) and never creates a ``torch.optim`` optimizer. The two paths agree up to
float32 rounding (``tests/test_blocks.py``), so ``auto`` changed the default runs' figures at that rounding."""

BLOCK_KINDS = ("plain", "sam")
"""Block trainers: ``plain`` (:class:`~fedrec_flwr.local.training.LocalTrainer`'s loop) and ``sam`` (FedRecGEL's
:class:`~fedrec_flwr.local.sam.SAMTrainer`)."""

BLOCK_MODELS = ("mf", "ncf")
"""Models the block path trains (``pfedrec`` has no user embedding and a personalised item table: per-user only)."""

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
"""``torch.optim.Adam``'s defaults, which every per-user trainer of this package uses."""

CHUNK_EXAMPLES = 1 << 15
"""At most about this many padded examples in one chunk of a block (bounds memory and keeps a chunk's activations
near the CPU caches: on ML-100K, FedRecGEL's 943-user block took 8 ms per user with 2^14, 11 ms with 2^18; ours)."""
PADDING = 1.25
"""A chunk's padded examples are at most this many times its real ones (bounds wasted work; ours)."""


# ---------------------------------------------------------------------------------------------------- selection
def block_kind(cls: type, config) -> str | None:
    """The block trainer that reproduces client class ``cls`` under ``config``, or ``None`` (per-user only).

    Only the class's own declaration counts (``"block_training"`` in ``cls.__dict__``): a subclass that does not
    declare it may override hooks the block path does not call, so it is served per-user. The model must be one of
    :data:`BLOCK_MODELS`, and no attribute-unlearning key may be set unless the class decides itself with a
    classmethod ``block_supports(config) -> bool`` (FedAU²: :meth:`fedrec_flwr.clients.fedau2.AttributeUnlearning.block_supports`).
    """
    kind = cls.__dict__.get("block_training")
    if kind not in BLOCK_KINDS or config.model not in BLOCK_MODELS:
        return None
    supports = getattr(cls, "block_supports", None)  # a class with its own rule (FedAU²: which arms it reproduces)
    if supports is not None:
        return kind if supports(config) else None
    if config.adversary != "none" or config.user_embedding_noise > 0:
        return None
    return kind


PER_USER_MESSAGE_KEYS = ("proximal-mu",)
"""Train-config keys the block path does not implement: a message with a non-zero value of one (FedProx's proximal
term, :class:`fedrec_flwr.local.training.ProximalTerm`) trains its users per user."""


def use_blocks(cls: type, config, num_users: int, message_config: Mapping[str, Any] | None = None) -> bool:
    """Whether a message for ``num_users`` users of client class ``cls`` takes the block path: under ``auto`` and
    ``on`` whenever the class and model have one (:func:`block_kind`), for any ``num_users`` >= 1 (one user
    included: see :data:`BLOCK_MODES`); never under ``off``, for no users, or when ``message_config`` sets one of
    :data:`PER_USER_MESSAGE_KEYS`."""
    if config.block_training == "off" or num_users < 1 or block_kind(cls, config) is None:
        return False
    return not any((message_config or {}).get(key) for key in PER_USER_MESSAGE_KEYS)


def check_block_config(cls: type, config) -> None:
    """Raise :class:`ConfigError` when ``block-training = "on"`` but ``cls`` has no block path under ``config``."""
    if config.block_training == "on" and block_kind(cls, config) is None:
        raise ConfigError(
            f"run-config key 'block-training' = 'on': client {config.client!r} (model {config.model!r}) has no "
            f"vectorized block path (supported: clients declaring block_training {list(BLOCK_KINDS)}, models "
            f"{list(BLOCK_MODELS)}, no adversary or user-embedding-noise except client 'fedau2''s default arm: "
            f"adversary-training 'server', adversary-objective 'entropy', adversary-embedding-optimizer 'local'); "
            f"use 'auto' or 'off'"
        )


# ---------------------------------------------------------------------------------------------------- optimizers
FUSED_ADAM = True
"""Step a :class:`BlockAdam` whose users share one step count (every fresh optimizer: FedNCF / FedMF, FedRecGEL's
shared group) with ``torch._fused_adam_`` (the kernel of ``torch.optim.Adam(fused=True)``: one pass over the entries
instead of eight); users with different step counts (FedRecGEL's persistent private Adam) take the per-user formula."""


class BlockAdam:
    """``torch.optim.Adam`` (defaults: betas 0.9/0.999, eps 1e-8, no weight decay, no AMSGrad) over stacked per-user
    parameters ``(k, ...)`` with per-user step counts (Kingma & Ba 2015, Algorithm 1, in the
    form of ``torch.optim.Adam``'s single-tensor update).

    Args:
        params: name -> ``(k, ...)`` tensors (updated in place by :meth:`step`).
        lr: step size.
        state: optional name -> ``(exp_avg (k, ...), exp_avg_sq (k, ...))`` and ``steps`` ``(k,)`` float32 to resume
            from (FedRecGEL's persistent private Adam); zeros otherwise.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], lr: float, state=None, steps=None) -> None:
        self.lr = float(lr)
        k = next(iter(params.values())).shape[0]
        device = next(iter(params.values())).device
        self.moments = (
            state
            if state is not None
            else {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in params.items()}
        )
        self.steps = steps if steps is not None else torch.zeros(k, dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: Mapping[str, torch.Tensor], count: int) -> None:
        """One Adam step, in place, of the first ``count`` users (``params`` and ``grads`` hold those users' rows: a
        block sorted by size has its users with a mini-batch left at the front)."""
        beta1, beta2 = ADAM_BETAS
        self.steps[:count] += 1
        if FUSED_ADAM and count and all(p.is_contiguous() for p in params.values()):
            steps = self.steps[:count]
            if count == 1 or bool((steps == steps[0]).all()):  # one step count (a fresh optimizer): fused kernel
                names = list(params)
                step = [steps[0].clone()] * len(names)  # the kernel reads each parameter's step count, never writes it
                # the kernel needs contiguous tensors; autograd gives NCF's MLP weights (used transposed in
                # batched_loss) transposed gradients, which took every NCF block to the eight-pass formula before
                torch._fused_adam_(
                    [params[n] for n in names],
                    [grads[n].contiguous() for n in names],
                    [self.moments[n][0][:count] for n in names],
                    [self.moments[n][1][:count] for n in names],
                    [],
                    step,
                    lr=self.lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=0.0,
                    eps=ADAM_EPS,
                    amsgrad=False,
                    maximize=False,
                )
                return
        step = self.steps[:count].double()
        step_size = -self.lr / (1 - beta1**step)
        correction2_sqrt = torch.sqrt(1 - beta2**step)
        for name, p in params.items():
            m, v = (t[:count] for t in self.moments[name])
            g = grads[name]
            shape = (-1, *([1] * (p.dim() - 1)))
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v.sqrt().div_(correction2_sqrt.to(p.dtype).view(shape)).add_(ADAM_EPS)
            p.addcdiv_(m * step_size.to(p.dtype).view(shape), denom)


class BlockSGD:
    """Plain SGD (``torch.optim.SGD`` without momentum) over stacked per-user parameters."""

    def __init__(self, params: Mapping[str, torch.Tensor], lr: float, state=None, steps=None) -> None:
        self.lr = float(lr)

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: Mapping[str, torch.Tensor], count: int) -> None:
        """One step, in place, of the first ``count`` users (as :meth:`BlockAdam.step`)."""
        for name, p in params.items():
            p.sub_(grads[name], alpha=self.lr)


def make_optimizer(name: str, params, lr: float, state=None, steps=None):
    """``"adam"`` -> :class:`BlockAdam`, ``"sgd"`` -> :class:`BlockSGD`."""
    return (BlockAdam if name == "adam" else BlockSGD)(params, lr, state, steps)


# ---------------------------------------------------------------------------------------------------- the block
@dataclass
class _UserData:
    user: int
    items: np.ndarray  # (T,) sorted global rows of the user's compact table
    first: np.ndarray  # (n,) local item of each example (BCE: the item; BPR: the positive)
    second: np.ndarray | None  # BPR: (n,) local negative of each pair; BCE: None
    labels: np.ndarray | None  # BCE: (n,) float32 labels
    generator: torch.Generator

    @property
    def n(self) -> int:
        return len(self.first)


class Block:
    """One vectorized block of users on one node: their stacked parameters and the loss they share.

    Args:
        runtime: the process's :class:`~fedrec_flwr.app.runtime.Runtime` (its model is used only as the function the
            parameters are plugged into, by ``functional_call``; its own parameters are not changed).
        users: the users' indices.
        state: the node's ``context.state`` (private records are read from and written to it).
    """

    def __init__(self, runtime: Runtime, users: Sequence[int], state: RecordDict) -> None:
        self.runtime = runtime
        self.users = [int(u) for u in users]
        self.state = state
        self.model = runtime.model
        self.layout = runtime.layout
        self.device = resolve_device(runtime.train_config.device)
        self.private_keys = list(self.layout.private_keys)
        self.dtype = next(self.model.parameters()).dtype
        """The model's dtype (float32 as deployed; the tests also run both paths in float64)."""
        model, shapes = runtime.derived.get("block-private-shapes", (None, None))
        if model is not self.model:  # once per process and model (a test's float64 copy has its own)
            shapes = {key: tuple(p.shape) for key, p in zip(self.private_keys, self.model.private_parameters())}
            runtime.derived["block-private-shapes"] = (self.model, shapes)
        self.layout_private_shapes = shapes

    # ------------------------------------------------------------------------------------------ private state
    def state_record(self, key: str) -> ArrayRecord | None:
        record = self.state.get(key) if key in self.state else None
        return record if isinstance(record, ArrayRecord) else None

    def load_private(self, users: Sequence[int]) -> dict[str, torch.Tensor]:
        """Private key -> ``(k, 1, d)`` the users' private parameters (initialised as the per-user client does on a
        first visit: :meth:`RecModel.reset_private` from the stream ``(seed, TAG_USER_INIT, user)``)."""
        rows: dict[str, list[np.ndarray]] = {key: [] for key in self.private_keys}
        for user in users:
            record = self.state_record(f"{STATE_PREFIX}{user}")
            if record is None:
                values = self.initial_private(user)
            else:
                values = decode_record(record, copy=False)
            for key in self.private_keys:
                rows[key].append(values[key])
        return {key: torch.as_tensor(np.stack(v), dtype=self.dtype, device=self.device) for key, v in rows.items()}

    def initial_private(self, user: int) -> dict[str, np.ndarray]:
        """A first-visited user's private parameters, as :meth:`RecModel.reset_private` draws them from the stream
        ``(seed, TAG_USER_INIT, user)``: for MF / NCF (user tables only, each ``N(0, 0.01²)`` in module order) drawn
        directly into arrays of the tables' shape, otherwise by resetting the process's model and reading it back."""
        generator = torch_generator(self.runtime.config.seed, TAG_USER_INIT, user)
        tables = self.model.user_embedding_modules()
        if batched_model(self.model) is not None and {f"{n}.weight" for n in tables} == set(self.private_keys):
            return {
                f"{name}.weight": torch.empty(module.weight.shape, dtype=module.weight.dtype)
                .normal_(0.0, EMBEDDING_INIT_STD, generator=generator)
                .numpy()
                for name, module in tables.items()
            }
        self.model.reset_private(generator)
        return {k: v.detach().cpu().numpy() for k, v in self.model.private_state().items()}

    def save_private(self, users: Sequence[int], private: Mapping[str, torch.Tensor]) -> None:
        """Write each user's private parameters back to its record (the same keys as the per-user client)."""
        arrays = {key: value.detach().cpu().numpy() for key, value in private.items()}
        for index, user in enumerate(users):
            self.state[f"{STATE_PREFIX}{user}"] = ArrayRecord(
                {key: encode_array(arrays[key][index]) for key in self.private_keys}
            )

    # ------------------------------------------------------------------------------------------ data
    def user_data(self, user: int, server_round: int) -> _UserData:
        """One user's compact rows and examples, exactly as :meth:`FedRecClient.fit_named` and
        :meth:`LocalTrainer.train` build them (BCE: positives then negatives; BPR: positive ``j`` repeated for its
        ``k`` negatives)."""
        cfg, split = self.runtime.config, self.runtime.split
        positives = split.positives(user)
        negatives = sample_train_negatives(split, user, server_round, cfg.num_train_negatives, cfg.seed)
        items = np.union1d(positives, negatives).astype(np.int64)
        pos, neg = np.searchsorted(items, positives), np.searchsorted(items, negatives)
        generator = torch_generator(cfg.seed, TAG_SHUFFLE, user, server_round)
        if cfg.loss == "bpr":
            k = len(neg) // len(pos)
            return _UserData(user, items, np.repeat(pos, k), neg, None, generator)
        labels = np.concatenate([np.ones(len(pos), np.float32), np.zeros(len(neg), np.float32)])
        return _UserData(user, items, np.concatenate([pos, neg]), None, labels, generator)

    def shared_copies(
        self, shared: Mapping[str, np.ndarray], data: Sequence[_UserData], exclude: Iterable[str] = ()
    ) -> dict[str, torch.Tensor]:
        """Shared key -> per-user copies: item tables ``(k, T_max, d)`` (each user's compact rows, zero padding), the
        score function ``(k, ...)``; not the keys in ``exclude`` (a :class:`BlockTerm`'s frozen ones)."""
        k, t_max = len(data), max(len(d.items) for d in data)
        index = np.zeros((k, t_max), dtype=np.int64)
        for row, d in enumerate(data):
            index[row, : len(d.items)] = d.items
        index_t = torch.as_tensor(index, device=self.device)
        padded = any(len(d.items) < t_max for d in data)  # without padding (one user) the mask is all ones: skipped
        if padded:
            lengths = torch.as_tensor([len(d.items) for d in data], device=self.device)
            valid = torch.arange(t_max, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        out = {}
        exclude = set(exclude)
        for key in self.layout.shared_shapes:
            if key in exclude:
                continue
            full = as_tensor(shared[key], self.device, self.dtype)
            if key in self.layout.item_keys:
                out[key] = full[index_t] * valid.unsqueeze(-1) if padded else full[index_t]
            else:
                out[key] = full.unsqueeze(0).expand(k, *full.shape).clone()
        return out

    # ------------------------------------------------------------------------------------------ the loss
    def loss_function(self):
        """The per-user loss ``(params, first, second, labels, weights) -> scalar`` for ``vmap``: the weighted sum of
        per-example losses (BCE with logits, or BPR's ``-log σ(s_pos - s_neg)``, :mod:`fedrec_flwr.local.losses`), the
        weights giving each mini-batch's (chunk's) mean."""
        model, loss = self.model, self.runtime.config.loss

        def per_user(params, first, second, labels, weights):
            if loss == "bpr":
                items = torch.cat([first, second])
                logits = functional_call(model, params, (torch.zeros_like(items), items))
                half = first.shape[0]
                values = -F.logsigmoid(logits[:half] - logits[half:])
            else:
                logits = functional_call(model, params, (torch.zeros_like(first), first))
                values = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
            return (values * weights).sum()

        return per_user

    def gradients(self, params: Mapping[str, torch.Tensor], *args: torch.Tensor, keys: Sequence[str] | None = None):
        """``(gradients by key (k, ...), losses (k,))`` of each user's loss at ``params`` (``(k, ...)`` each; only
        ``keys`` returned, default all): by :func:`batched_gradients` where the model is exactly
        :class:`~fedrec_flwr.models.mf.MF` or :class:`~fedrec_flwr.models.ncf.NCF` and :data:`GRADIENTS` is
        ``"batched"``, otherwise by :meth:`autograd_gradients` (``vmap``)."""
        if GRADIENTS == "batched" and batched_model(self.model) is not None:
            return batched_gradients(self.model, self.runtime.config.loss, params, *args, keys=keys)
        return self.autograd_gradients(params, *args, keys=keys)

    def autograd_gradients(
        self, params: Mapping[str, torch.Tensor], *args: torch.Tensor, keys: Sequence[str] | None = None
    ):
        """:meth:`gradients` by reverse-mode autograd through the vmapped :meth:`loss_function` (any model; the
        reference the batched forward pass is tested against)."""
        if not hasattr(self, "_loss"):
            self._loss = vmap(self.loss_function())
        keys = list(params) if keys is None else list(keys)
        with torch.enable_grad():
            leaves = {
                key: (value.detach().requires_grad_() if key in keys else value.detach())
                for key, value in params.items()
            }
            values = self._loss(leaves, *args)
            grads = torch.autograd.grad(values.sum(), [leaves[key] for key in keys])
        return dict(zip(keys, grads)), values.detach()

    def padded(self, data: Sequence[_UserData], orders: Sequence[torch.Tensor], width: int, group: int):
        """Padded ``(k, width)`` examples in each user's shuffled order, and weights ``1 / (size of the example's
        group of ``group`` consecutive examples)`` (0 on padding)."""
        k = len(data)
        first = np.zeros((k, width), dtype=np.int64)
        second = np.zeros((k, width), dtype=np.int64)
        labels = np.zeros((k, width), dtype=np.float32)
        weights = np.zeros((k, width), dtype=np.float64)
        for row, (d, order) in enumerate(zip(data, orders)):
            o = order.numpy()
            first[row, : d.n] = d.first[o]
            if d.second is not None:
                second[row, : d.n] = d.second[o]
            if d.labels is not None:
                labels[row, : d.n] = d.labels[o]
            position = np.arange(d.n)
            start = (position // group) * group
            weights[row, : d.n] = 1.0 / np.minimum(group, d.n - start)
        to = lambda a, dtype=None: torch.as_tensor(a, device=self.device, dtype=dtype)  # noqa: E731
        return to(first), to(second), to(labels, self.dtype), to(weights, self.dtype)


GRADIENTS = "batched"
"""How a block differentiates its users' losses: ``"batched"`` (:func:`batched_gradients`: MF's and NCF's forward pass
as a few batched matrix products, differentiated by autograd; the user half of NCF's first layer computed once per
user) or ``"vmap"`` (:meth:`Block.autograd_gradients`: ``vmap`` of a ``functional_call`` of the process's model,
differentiated by autograd, for any model). Both give the same gradients up to float rounding
(``tests/test_blocks.py``); a module constant, not a run-config key, since it changes no result."""


def batched_model(model: torch.nn.Module) -> str | None:
    """``"mf"`` or ``"ncf"`` when ``model`` is exactly that class with no attached module but FedAU²'s adversary
    ``h_w`` (which the forward pass never reads: the recommendation score is the one :func:`batched_loss` computes;
    a :class:`BlockTerm` keeps ``h_w`` out of the block's parameters), else ``None``."""
    from fedrec_flwr.adversary import ADVERSARY_MODULE
    from fedrec_flwr.models.mf import MF
    from fedrec_flwr.models.ncf import NCF

    names = tuple(model._shared_names) if hasattr(model, "_shared_names") else None
    if names is not None and names[-1:] == (ADVERSARY_MODULE,):
        names = names[:-1]
    if type(model) is MF and names == MF._shared_names:
        return "mf"
    if (
        type(model) is NCF
        and names == NCF._shared_names
        and all(isinstance(m, (torch.nn.Linear, torch.nn.ReLU)) for m in model.mlp)
    ):
        return "ncf"
    return None


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``(a, N, d)`` of per-user tables ``table`` ``(a, T, d)`` at local rows ``index`` ``(a, N)`` (one
    ``index_select`` on the flattened tables; autograd sums the gradients of repeated rows, as an embedding does)."""
    a, t, d = table.shape
    # one user (every one-user message): no offsets to add
    flat = (
        index.reshape(-1) if a == 1 else (index + (torch.arange(a, device=index.device) * t).unsqueeze(1)).reshape(-1)
    )
    return table.reshape(a * t, d).index_select(0, flat).view(a, -1, d)


def batched_loss(
    model: torch.nn.Module,
    loss: str,
    params: Mapping[str, torch.Tensor],
    first: torch.Tensor,
    second: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Each user's weighted loss ``(a,)``: the model's forward pass on stacked per-user parameters as batched matrix
    products, differentiable by autograd (:func:`batched_gradients`).

    The forward pass is the model's (MF: ``<p_u, q_i>``, Chai et al.; NCF: NeuMF, He et al. 2017, Sec. 3.4:
    ``h^T [p_u^G ⊙ q_i^G; MLP([p_u^M; q_i^M])] + b``), the loss that of :meth:`Block.loss_function` (BCE with logits,
    or BPR ``-log σ(s_pos - s_neg)``; per-example ``weights``). NCF's first layer splits ``W_1 = [W_u, W_i]``: the user
    part ``W_u p_u^M + b_1`` is the same for all of a user's examples and is computed once per user (ours).

    Args:
        model: an :class:`~fedrec_flwr.models.mf.MF` or :class:`~fedrec_flwr.models.ncf.NCF` (:func:`batched_model`;
            only its class and layer layout are used). loss: ``"bce"`` or ``"bpr"``.
        params: state key -> ``(a, ...)`` stacked per-user parameters (user tables ``(a, 1, d)``, item tables
            ``(a, T, d)`` indexed by local rows, layers ``(a, out, in)`` / ``(a, out)``).
        first, second: ``(a, N)`` int64 local rows (BCE: the items, ``second`` unused; BPR: positives, negatives).
        labels, weights: ``(a, N)`` in the model's dtype (BCE labels; weight 0 on padding).
    """
    kind = batched_model(model)
    items = torch.cat([first, second], dim=1) if loss == "bpr" else first
    if kind == "mf":
        q = _gather(params["item_embedding.weight"], items)
        logits = torch.bmm(q, params["user_embedding.weight"].transpose(1, 2)).squeeze(-1)  # (a, N)
    else:
        d = model.mlp_embedding_dim  # the MLP embeddings' width: W_1 = [W_u, W_i] splits at it
        gmf = params["user_embedding_gmf.weight"] * _gather(params["item_embedding_gmf.weight"], items)
        qm = _gather(params["item_embedding_mlp.weight"], items)
        layers = [f"mlp.{i}" for i, m in enumerate(model.mlp) if isinstance(m, torch.nn.Linear)]
        w0, b0 = params[f"{layers[0]}.weight"], params[f"{layers[0]}.bias"]
        user_part = torch.baddbmm(b0.unsqueeze(1), params["user_embedding_mlp.weight"], w0[:, :, :d].transpose(1, 2))
        hidden = torch.relu(torch.baddbmm(user_part, qm, w0[:, :, d:].transpose(1, 2)))  # (a, N, L0)
        for name in layers[1:]:
            w, b = params[f"{name}.weight"], params[f"{name}.bias"]
            hidden = torch.relu(torch.baddbmm(b.unsqueeze(1), hidden, w.transpose(1, 2)))
        joint = torch.cat([gmf, hidden], dim=-1)  # (a, N, d + L)
        logits = torch.baddbmm(
            params["output.bias"].unsqueeze(1), joint, params["output.weight"].transpose(1, 2)
        ).squeeze(-1)
    if loss == "bpr":
        half = first.shape[1]
        return (-F.logsigmoid(logits[:, :half] - logits[:, half:]) * weights).sum(1)
    return (F.binary_cross_entropy_with_logits(logits, labels, reduction="none") * weights).sum(1)


def batched_gradients(
    model: torch.nn.Module,
    loss: str,
    params: Mapping[str, torch.Tensor],
    *args: torch.Tensor,
    keys: Sequence[str] | None = None,
):
    """``(gradients by key (a, ...), losses (a,))``: each user's loss (:func:`batched_loss`) and its gradient with
    respect to ``params`` (only ``keys``, default all), by one reverse-mode autograd pass over the sum of the users'
    losses (a user's parameters enter only its own loss, so the gradient of the sum with respect to the stacked
    parameters is each user's own gradient)."""
    keys = list(params) if keys is None else list(keys)
    with torch.enable_grad():
        leaves = {key: value.detach().requires_grad_(key in keys) for key, value in params.items()}
        values = batched_loss(model, loss, leaves, *args)
        grads = torch.autograd.grad(values.sum(), [leaves[key] for key in keys])
    return dict(zip(keys, grads)), values.detach()


def as_tensor(array: np.ndarray, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``dtype`` tensor of a message's array on ``device`` (copied if the array is read-only, as Flower's are)."""
    array = np.asarray(array)
    if not array.flags.writeable:
        array = array.copy()
    return torch.as_tensor(array, dtype=dtype, device=device)


def _chunks(sizes: Sequence[int]) -> list[list[int]]:
    """Positions of ``sizes`` (examples per user) in chunks of users of similar size, largest first: a chunk grows
    while its padded size ``count * largest`` stays within :data:`CHUNK_EXAMPLES` and within :data:`PADDING` times its
    users' real examples (bounds memory and the work spent on padding; ours). Within a chunk the users are in
    decreasing size, so those with a mini-batch left at any step are a prefix."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    chunks: list[list[int]] = []
    total = 0
    for i in order:
        if chunks:
            count, largest = len(chunks[-1]) + 1, sizes[chunks[-1][0]]
            if count * largest <= CHUNK_EXAMPLES and count * largest <= PADDING * (total + sizes[i]):
                chunks[-1].append(i)
                total += sizes[i]
                continue
        chunks.append([i])
        total = sizes[i]
    return chunks


def _check_finite(users: Sequence[int], values: torch.Tensor, what: str) -> None:
    if bool(torch.isfinite(values).all()):
        return
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        which = [users[i] for i in torch.nonzero(bad).flatten().tolist()]
        raise FloatingPointError(
            f"non-finite training {what} of users {which[:10]} in the vectorized block; no "
            "update of this message is kept"
        )


def _check_finite_parameters(users: Sequence[int], params: Mapping[str, torch.Tensor], what: str) -> None:
    # first one norm per tensor (torch._foreach_norm: finite when every entry is, unless the norm overflows); only a
    # non-finite norm needs the per-user check (a third of the check's cost on a one-user message)
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(list(params.values())))).all()):
        return
    # p * 0 is NaN exactly where p is NaN or infinite, and a sum of zeros cannot overflow: (k,) NaN for a bad user
    _check_finite(users, sum(torch.mul(p, 0).flatten(1).sum(1) for p in params.values()), what)


def _row_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(k,)`` float64: the L2 norm over all of each user's entries of ``tensors`` (each ``(k, ...)``)."""
    return torch.sqrt(sum((t.double() ** 2).flatten(1).sum(1) for t in tensors))


# ---------------------------------------------------------------------------------------------------- training
def train_block(
    runtime: Runtime,
    cls: type,
    users: Sequence[int],
    state: RecordDict,
    shared: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
) -> list:
    """Train ``users`` as one vectorized block; returns their :class:`~fedrec_flwr.wire.UserUpdate` in ``users``'
    order (what each user's ``fit_named`` would return, up to float32 rounding) and saves their private state.

    Args:
        runtime: the process's runtime. cls: the configured client class (:func:`block_kind` must not be None).
        users: the users to train (>= 1). state: the node's ``context.state``.
        shared: shared key -> array (the message's arrays). config: the train message's config
            (``"server-round"``; ``"upload"`` for FedRecGEL).

    Raises:
        ValueError: ``cls`` has no block path, or a bad ``"upload"`` value.
        FloatingPointError: a user's loss, gradient or parameters became non-finite.
    """

    kind = block_kind(cls, runtime.config)
    if kind is None:
        raise ValueError(f"client {cls.__qualname__} has no vectorized block path (see fedrec_flwr.local.blocks)")
    upload = str(config.get("upload", "parameters"))
    if kind == "sam" and upload not in ("gradient", "parameters"):
        raise ValueError(f"train config 'upload' = {upload!r}: expected 'gradient' or 'parameters'")
    server_round = int(config["server-round"])
    block = Block(runtime, users, state)
    data = [block.user_data(u, server_round) for u in block.users]
    groups = _chunks([d.n for d in data])
    updates: list = [None] * len(data)
    make_term = getattr(cls, "block_term", None)
    for group in groups:
        part = [data[i] for i in group]
        if kind == "plain":
            term = make_term(runtime, [d.user for d in part], state, shared, config) if make_term else None
            trained = _train_plain(block, part, shared, upload, term)
        else:
            trained = _train_sam(block, part, shared, upload)
        for i, (dense, rows, n, loss, weight, is_gradient) in zip(group, trained):
            updates[i] = UserUpdate(
                dense=dense, rows=rows, num_examples=n, loss=loss, weight=weight, is_gradient=is_gradient
            )
    return updates


def _split_updates(block: Block, part: Sequence[_UserData], values: Mapping[str, torch.Tensor]):
    """Per user: ``(dense key -> array, item key -> (rows, values))`` of the stacked shared ``values``."""
    arrays = {key: value.detach().cpu().numpy() for key, value in values.items()}
    out = []
    for row, d in enumerate(part):
        dense = {key: arrays[key][row] for key in block.layout.dense_keys if key in arrays}
        rows = {key: (d.items, arrays[key][row, : len(d.items)]) for key in block.layout.item_keys}
        out.append((dense, rows))
    return out


class BlockTerm(Protocol):
    """A client's extra loss term on a chunk of a block (its own ``block_term`` classmethod builds one per chunk, for
    the chunk's users in block order; FedAU²'s entropy pull: :class:`fedrec_flwr.clients.fedau2.EntropyPullBlock`), the block
    form of a :attr:`~fedrec_flwr.local.training.LocalTrainer.loss_terms` entry."""

    frozen_keys: frozenset[str]
    """Shared keys the term keeps fixed (the server's ``h_w``): left out of the block's per-user copies; their upload
    comes from :meth:`uploads`."""

    def add(
        self, params: Mapping[str, torch.Tensor], grads: dict[str, torch.Tensor], values: torch.Tensor, active: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """At one step, for the first ``active`` users (``params`` their current values): ``grads`` and the loss
        ``values`` ``(active,)`` with the term's gradient and value added."""

    def uploads(self, params: Mapping[str, torch.Tensor]) -> list[dict[str, np.ndarray]]:
        """After training: per user, the values uploaded under :attr:`frozen_keys`."""


def _train_plain(block: Block, part: Sequence[_UserData], shared, upload: str, term: BlockTerm | None = None):
    """:class:`~fedrec_flwr.local.training.LocalTrainer`'s loop for a chunk of users: ``local-epochs`` epochs of shuffled
    mini-batches of ``batch-size`` examples (pairs, BPR), one optimizer step each, fresh optimizer state; ``term``:
    a client's extra loss term (:class:`BlockTerm`) added at every step."""
    cfg = block.runtime.config
    users = [d.user for d in part]
    private = block.load_private(users)
    params = {**private, **block.shared_copies(shared, part, exclude=term.frozen_keys if term else ())}
    optimizer = make_optimizer(cfg.optimizer, params, cfg.learning_rate)
    step_fn = block.gradients
    sizes = torch.as_tensor([d.n for d in part], device=block.device)
    batch = cfg.batch_size
    steps = math.ceil(max(d.n for d in part) / batch)
    totals = torch.zeros(len(part), dtype=torch.float64, device=block.device)
    active_users = [sum(1 for d in part if d.n > s * batch) for s in range(steps)]  # a prefix: sorted by size
    for _ in range(cfg.local_epochs):
        orders = [torch.randperm(d.n, generator=d.generator) for d in part]
        first, second, labels, weights = block.padded(part, orders, steps * batch, batch)
        totals.zero_()
        for s, a in enumerate(active_users):
            sl = slice(s * batch, (s + 1) * batch)
            view = params if a == len(part) else {key: value[:a] for key, value in params.items()}
            grads, values = step_fn(view, first[:a, sl], second[:a, sl], labels[:a, sl], weights[:a, sl])
            if term is not None:
                grads, values = term.add(view, grads, values, a)
            _check_finite(users[:a], values, "loss")
            optimizer.step(view, grads, a)
            count = (sizes[:a] - s * batch).clamp(0, batch)
            totals[:a] += values.double() * count
        _check_finite_parameters(users, params, f"parameters after epoch {_ + 1}")
    losses = (totals / sizes).tolist()
    block.save_private(users, {key: params[key] for key in block.private_keys})
    shared_values = {key: params[key] for key in block.layout.shared_shapes if key in params}
    split = _split_updates(block, part, shared_values)
    if term is not None:
        for (dense, _), frozen in zip(split, term.uploads(params)):
            dense.update(frozen)
    return [(dense, rows, d.n, loss, None, False) for (dense, rows), d, loss in zip(split, part, losses)]


def _train_sam(block: Block, part: Sequence[_UserData], shared, upload: str):
    """:class:`~fedrec_flwr.local.sam.SAMTrainer` for a chunk of users: ``local-epochs`` full-batch decoupled SAM steps
    (FedRecGEL, Sec. 4.2): ``g_S^SAM = ∇_S L(w_S + eps_S, w_P)``, ``g_P^SAM = ∇_P L(w_S, w_P + eps_P)`` with ``eps =
    rho g / ||g||`` per group and user (Foret et al. 2021, Eq. 2); the private group stepped by the user's persistent
    optimizer, the shared group by a fresh one (``"upload" = "parameters"``) or only its mean SAM gradient kept
    (``"gradient"``)."""
    cfg = block.runtime.config
    users = [d.user for d in part]
    private = block.load_private(users)
    shared_copies = block.shared_copies(shared, part)
    params = {**private, **shared_copies}
    shared_keys = list(shared_copies)
    moments, steps = _load_private_optimizer(block, users) if cfg.optimizer == "adam" else (None, None)
    private_opt = make_optimizer(cfg.optimizer, private, cfg.learning_rate, moments, steps)
    update_shared = upload == "parameters"
    shared_opt = make_optimizer(cfg.optimizer, shared_copies, cfg.learning_rate) if update_shared else None
    value_and_grad = grad_only = block.gradients
    n = torch.as_tensor([d.n for d in part], device=block.device)
    width = max(d.n for d in part)
    sums = {key: torch.zeros_like(shared_copies[key]) for key in shared_keys}
    values = torch.zeros(len(part), device=block.device)

    def perturbed(group: list[str], base: Mapping[str, torch.Tensor], rho: float) -> dict[str, torch.Tensor]:
        norm = _row_norms([base[key] for key in group])
        ok = torch.isfinite(norm) & (norm > 0) & (rho > 0)
        scale = torch.where(ok, rho / torch.where(ok, norm, 1.0), 0.0).to(block.dtype)
        return {
            **params,
            **{key: params[key] + base[key] * scale.view(-1, *([1] * (base[key].dim() - 1))) for key in group},
        }

    for epoch in range(cfg.local_epochs):
        orders = [torch.randperm(d.n, generator=d.generator) for d in part]
        first, second, labels, weights = block.padded(part, orders, width, cfg.batch_size)
        args = (first, second, labels, weights)
        base, values = value_and_grad(params, *args)
        _check_finite(users, values, f"loss at SAM step {epoch + 1}")
        sam_shared = (
            grad_only(perturbed(shared_keys, base, cfg.rho_shared), *args, keys=shared_keys)[0]
            if cfg.rho_shared > 0
            else base
        )
        sam_private = (
            grad_only(perturbed(block.private_keys, base, cfg.rho_private), *args, keys=block.private_keys)[0]
            if cfg.rho_private > 0
            else base
        )
        _check_finite(
            users, _row_norms([sam_shared[key] for key in shared_keys]), f"shared SAM gradient at SAM step {epoch + 1}"
        )
        private_opt.step(private, {key: sam_private[key] for key in block.private_keys}, len(part))
        if shared_opt is not None:
            shared_opt.step(shared_copies, {key: sam_shared[key] for key in shared_keys}, len(part))
        params = {**private, **shared_copies}
        for key in shared_keys:
            sums[key] = sums[key] + sam_shared[key]
        _check_finite_parameters(users, params, f"parameters after SAM step {epoch + 1}")
    chunks = torch.ceil(n / cfg.batch_size)
    losses = (values.double() / chunks).tolist()
    block.save_private(users, private)
    if private_opt.__class__ is BlockAdam:
        _save_private_optimizer(block, users, private_opt)
    else:
        for user in users:  # torch's SGD keeps no state: the per-user client stores an empty record
            block.state[f"{OPTIMIZER_PREFIX}{user}"] = ArrayRecord({})
    if update_shared:
        out = _split_updates(block, part, shared_copies)
        return [(dense, rows, d.n, loss, None, False) for (dense, rows), d, loss in zip(out, part, losses)]
    grads = {key: sums[key] / cfg.local_epochs for key in shared_keys}
    out = _split_updates(block, part, grads)
    return [(dense, rows, d.n, loss, 1.0, True) for (dense, rows), d, loss in zip(out, part, losses)]


def _load_private_optimizer(block: Block, users: Sequence[int]):
    """The users' persistent private Adam state, in :func:`fedrec_flwr.local.training.optimizer_state_arrays`' layout
    (``"<index of the private parameter>/exp_avg"``, ``.../exp_avg_sq``, ``.../step``): ``(moments, steps)``."""
    keys = block.private_keys
    m = {key: [] for key in keys}
    v = {key: [] for key in keys}
    steps = []
    zeros = {key: torch.zeros(block.layout_private_shapes[key], dtype=block.dtype).numpy() for key in keys}
    for user in users:
        record = block.state_record(f"{OPTIMIZER_PREFIX}{user}")
        arrays = {} if record is None else decode_record(record, copy=False)
        if "0/step" in arrays:
            steps.append(float(arrays["0/step"]))
            for index, key in enumerate(keys):
                m[key].append(arrays[f"{index}/exp_avg"])
                v[key].append(arrays[f"{index}/exp_avg_sq"])
        else:  # first round of this user: a fresh Adam
            steps.append(0.0)
            for key in keys:
                m[key].append(zeros[key])
                v[key].append(zeros[key])
    to = lambda a: torch.as_tensor(np.stack(a), dtype=block.dtype, device=block.device)  # noqa: E731
    moments = {key: (to(m[key]), to(v[key])) for key in keys}
    return moments, torch.as_tensor(steps, dtype=torch.float32, device=block.device)


def _save_private_optimizer(block: Block, users: Sequence[int], optimizer: BlockAdam) -> None:
    steps = optimizer.steps.cpu().numpy()
    moments = {key: (m.cpu().numpy(), v.cpu().numpy()) for key, (m, v) in optimizer.moments.items()}
    for row, user in enumerate(users):
        arrays = {}
        for index, key in enumerate(block.private_keys):
            arrays[f"{index}/step"] = encode_array(np.array(steps[row], dtype=np.float32))
            arrays[f"{index}/exp_avg"] = encode_array(moments[key][0][row])
            arrays[f"{index}/exp_avg_sq"] = encode_array(moments[key][1][row])
        block.state[f"{OPTIMIZER_PREFIX}{user}"] = ArrayRecord(arrays)


# ---------------------------------------------------------------------------------------------------- evaluation
EVAL_USERS_PER_CALL = 2048
"""Users scored per forward pass (as :func:`fedrec_flwr.local.training.score_candidates`)."""


@torch.no_grad()
def evaluate_block(
    runtime: Runtime,
    users: Sequence[int],
    state: RecordDict,
    shared: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
) -> list[dict[str, float]]:
    """Each user's leave-one-out metrics, as :meth:`FedRecClient.evaluate_named` returns them, from one batched
    scoring call per :data:`EVAL_USERS_PER_CALL` users: the model applied (``functional_call``) to the shared
    parameters and a user table stacking the users' private embeddings.

    Raises:
        ValueError: an unknown ``"split"``, or ``"val"`` without validation items (as the per-user client).
    """
    split = runtime.split
    which = str(config.get("split", "test"))
    if which not in ("test", "val", "test+val"):
        raise ValueError(f"evaluation split must be 'test', 'val' or 'test+val', got {which!r}")
    if "val" in which and split.val_items is None:
        raise ValueError(f"evaluation on {which!r} needs holdout-validation = true")
    block = Block(runtime, users, state)
    ks = runtime.config.k_values
    shared_t = {key: as_tensor(value, block.device, block.dtype) for key, value in shared.items()}
    out: list[dict[str, float]] = [{} for _ in block.users]
    for start in range(0, len(block.users), EVAL_USERS_PER_CALL):
        part = block.users[start : start + EVAL_USERS_PER_CALL]
        private = block.load_private(part)
        params = {**shared_t, **{key: value.reshape(len(part), -1) for key, value in private.items()}}
        phases = []
        if which in ("test", "test+val"):
            phases.append(("", split.test_items, split.test_negatives))
        if which in ("val", "test+val"):
            phases.append(("val-" if which == "test+val" else "", split.val_items, split.val_negatives))
        for prefix, targets, negatives in phases:
            candidates = np.concatenate(
                [np.asarray(targets)[part].reshape(-1, 1), np.asarray(negatives)[part]], axis=1
            ).astype(np.int64)
            count = candidates.shape[1]
            rows = torch.arange(len(part), device=block.device).repeat_interleave(count)
            items = torch.as_tensor(candidates.reshape(-1), device=block.device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scores = functional_call(block.model, params, (rows, items)).reshape(len(part), count)
            metrics = ranking_metrics_batch(scores.double().cpu().numpy(), 0, ks)
            for row in range(len(part)):
                out[start + row].update({prefix + key: float(value[row]) for key, value in metrics.items()})
    return out
