"""The vectorized block engine: a block of users' stacked parameters, padded examples and batched loss.

A :class:`Block` holds what a node's users share in one batched computation (:mod:`fedrec_flwr.local.blocks`): their
private parameters stacked ``(k, 1, d)``, per-user copies of the shared parameters ``(k, ...)`` (compact item rows
padded to the block's largest row count), padded and weighted examples, and the gradient of every user's loss at
stacked parameters (:meth:`Block.gradients`: MF's and NCF's forward pass as batched matrix products,
:func:`batched_loss`, or ``vmap`` of the model for any other). The per-user algorithms' steps are written elsewhere
(plain training in :mod:`fedrec_flwr.local.blocks`, SAM in :mod:`fedrec_flwr.local.sam`); the engine only batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict
from torch.func import functional_call, vmap

from fedrec_flwr.app.runtime import Runtime
from fedrec_flwr.arrays import decode_record, encode_array
from fedrec_flwr.local.training import resolve_device
from fedrec_flwr.local.user_data import round_examples, state_record, user_state_key
from fedrec_flwr.models.base import EMBEDDING_INIT_STD
from fedrec_flwr.seeding import TAG_USER_INIT, torch_generator

CHUNK_EXAMPLES = 1 << 15
"""At most about this many padded examples in one chunk of a block (bounds memory and keeps a chunk's activations
near the CPU caches: on ML-100K, FedRecGEL's 943-user block took 8 ms per user with 2^14, 11 ms with 2^18; ours)."""
PADDING = 1.25
"""A chunk's padded examples are at most this many times its real ones (bounds wasted work; ours)."""


# ---------------------------------------------------------------------------------------------------- the block
@dataclass
class UserData:
    """One user's part of a block: its compact item rows, its examples in local rows, and its shuffle stream."""

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
        """The ``ArrayRecord`` under ``key`` in the node's state, or ``None``
        (:func:`fedrec_flwr.local.user_data.state_record`)."""
        return state_record(self.state, key)

    def load_private(self, users: Sequence[int]) -> dict[str, torch.Tensor]:
        """Private key -> ``(k, 1, d)`` the users' private parameters (initialised as the per-user client does on a
        first visit: :meth:`RecModel.reset_private` from the stream ``(seed, TAG_USER_INIT, user)``)."""
        rows: dict[str, list[np.ndarray]] = {key: [] for key in self.private_keys}
        for user in users:
            record = self.state_record(user_state_key(user))
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
            self.state[user_state_key(user)] = ArrayRecord(
                {key: encode_array(arrays[key][index]) for key in self.private_keys}
            )

    # ------------------------------------------------------------------------------------------ data
    def user_data(self, user: int, server_round: int) -> UserData:
        """One user's compact rows and examples, exactly as :meth:`FedRecClient.fit_named` and
        :meth:`LocalTrainer.train` build them (BCE: positives then negatives; BPR: positive ``j`` repeated for its
        ``k`` negatives; :func:`fedrec_flwr.local.user_data.round_examples`)."""
        examples = round_examples(self.runtime, user, server_round)
        items, pos, neg, generator = examples.items, examples.positives, examples.negatives, examples.generator
        if self.runtime.config.loss == "bpr":
            k = len(neg) // len(pos)
            return UserData(user, items, np.repeat(pos, k), neg, None, generator)
        labels = np.concatenate([np.ones(len(pos), np.float32), np.zeros(len(neg), np.float32)])
        return UserData(user, items, np.concatenate([pos, neg]), None, labels, generator)

    def shared_copies(
        self, shared: Mapping[str, np.ndarray], data: Sequence[UserData], exclude: Iterable[str] = ()
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

    def padded(self, data: Sequence[UserData], orders: Sequence[torch.Tensor], width: int, group: int):
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


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
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
        q = gather_rows(params["item_embedding.weight"], items)
        logits = torch.bmm(q, params["user_embedding.weight"].transpose(1, 2)).squeeze(-1)  # (a, N)
    else:
        d = model.mlp_embedding_dim  # the MLP embeddings' width: W_1 = [W_u, W_i] splits at it
        gmf = params["user_embedding_gmf.weight"] * gather_rows(params["item_embedding_gmf.weight"], items)
        qm = gather_rows(params["item_embedding_mlp.weight"], items)
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


def chunk_users(sizes: Sequence[int]) -> list[list[int]]:
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


def check_finite(users: Sequence[int], values: torch.Tensor, what: str) -> None:
    """Raise ``FloatingPointError`` naming the users (at most 10) whose entry of ``values`` ``(k,)`` is not finite."""
    if bool(torch.isfinite(values).all()):
        return
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        which = [users[i] for i in torch.nonzero(bad).flatten().tolist()]
        raise FloatingPointError(
            f"non-finite training {what} of users {which[:10]} in the vectorized block; no "
            "update of this message is kept"
        )


def check_finite_parameters(users: Sequence[int], params: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ``FloatingPointError`` naming the users with a NaN or infinite entry in any ``(k, ...)`` of ``params``."""
    # first one norm per tensor (torch._foreach_norm: finite when every entry is, unless the norm overflows); only a
    # non-finite norm needs the per-user check (a third of the check's cost on a one-user message)
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(list(params.values())))).all()):
        return
    # p * 0 is NaN exactly where p is NaN or infinite, and a sum of zeros cannot overflow: (k,) NaN for a bad user
    check_finite(users, sum(torch.mul(p, 0).flatten(1).sum(1) for p in params.values()), what)


def split_updates(block: Block, part: Sequence[UserData], values: Mapping[str, torch.Tensor]):
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
