"""Vectorized user blocks: a node trains and evaluates all of a message's users as one batched computation.

A node serving ``k`` users would otherwise run ``k`` tiny local trainings one after another, each costing PyTorch's
per-call overhead on tensors of a few hundred rows (about 10 ms per user on one CPU core). Here the ``k`` users are
stacked along a leading *user* dimension and trained together, so the per-call overhead is paid once per step for the
whole block. For MF and NCF the forward pass is written as a few batched matrix products over the stacked parameters
(:func:`~fedrec_flwr.local.block_engine.batched_loss`); any other model runs through :mod:`torch.func` (``vmap`` over a
``functional_call`` of the process's model; :meth:`~fedrec_flwr.local.block_engine.Block.autograd_gradients`, also the
tests' reference). Both are differentiated by autograd:
the gradient of the sum of the users' losses with respect to the stacked parameters is each user's own gradient. A
block holds:

* per-user private parameters (user embeddings) stacked, ``(k, 1, d)``;
* per-user copies of the shared parameters the step changes: each user's compact item rows (positives and sampled
  negatives, as :meth:`RecModel.item_subset` gives the per-user client), padded to the block's largest row count,
  ``(k, T_max, d)``, and the score function (MLP, output layer), ``(k, ...)``;
* padded and masked mini-batches: each user's examples in the order its own shuffle stream gives, a per-example
  weight ``1 / (size of its mini-batch or chunk)`` (0 on padding); users are sorted by size, so the users with a
  mini-batch left at a step are a prefix of the block and only that prefix (a view) is stepped;
* per-user optimizer state (:class:`~fedrec_flwr.local.block_optim.BlockAdam` / SGD), including FedRecGEL's persistent
  Adam of the user embeddings (users sharing one step count are stepped by torch's fused Adam kernel,
  :data:`fedrec_flwr.local.block_optim.FUSED_ADAM`).

This module selects the block path (:func:`block_kind`, :func:`use_blocks`) and runs each client family's local step
over a block (:func:`train_block`, :func:`evaluate_block`); the batching itself is
:mod:`fedrec_flwr.local.block_engine` (the :class:`~fedrec_flwr.local.block_engine.Block`, its batched loss and
gradients) and :mod:`fedrec_flwr.local.block_optim` (the optimizers). FedRecGEL's SAM step is not written here: the
block calls :func:`fedrec_flwr.local.sam.decoupled_sam_gradients`, the same function the per-user trainer calls as a
batch of one. The names tests and clients use (``Block``, ``BlockTerm``, ``BlockAdam``, ``batched_model``, ...) are
re-exported here; module constants that tests or benchmarks switch (``FUSED_ADAM``, ``GRADIENTS``) are read in their
own modules and must be set there.

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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict
from torch.func import functional_call

from fedrec_flwr.app.runtime import Runtime
from fedrec_flwr.arrays import decode_record, encode_array
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.block_engine import (
    Block,
    BlockTerm,
    UserData,
    as_tensor,
    batched_gradients,
    batched_loss,
    batched_model,
    check_finite,
    check_finite_parameters,
    chunk_users,
    split_updates,
)
from fedrec_flwr.local.block_optim import BlockAdam, BlockSGD, make_optimizer
from fedrec_flwr.local.sam import decoupled_sam_gradients, user_norms
from fedrec_flwr.local.user_data import evaluation_phases
from fedrec_flwr.metrics import ranking_metrics_batch
from fedrec_flwr.state.client_state import OPTIMIZER_PREFIX
from fedrec_flwr.wire import UserUpdate

__all__ = [
    "BLOCK_KINDS",
    "BLOCK_MODELS",
    "BLOCK_MODES",
    "EVAL_USERS_PER_CALL",
    "PER_USER_MESSAGE_KEYS",
    "Block",
    "BlockAdam",
    "BlockSGD",
    "BlockTerm",
    "batched_gradients",
    "batched_loss",
    "batched_model",
    "block_kind",
    "check_block_config",
    "evaluate_block",
    "make_optimizer",
    "train_block",
    "use_blocks",
]

BLOCK_MODES = ("auto", "on", "off")
"""Values of the run-config key ``block-training``: ``auto`` (the default: the block path for every message, one user
included, whose client class and model support it, :func:`block_kind`; the others per-user), ``on`` (the same, but a
client that does not support it is refused at start), ``off`` (always per-user: the per-user clients are the
reference, kept as this named arm).

One-user messages take the block path under ``auto`` because the per-user path's first ``torch.optim`` optimizer in a
process imports ``torch._dynamo`` (``Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo``, which
imports it on its first call: about 1.7 s on an idle core, 4 s under load), which every deployed train message (a new
``flwr-clientapp`` process per message) and every Ray actor's first user paid; the block path steps its own
:class:`~fedrec_flwr.local.block_optim.BlockAdam` (``torch._fused_adam_``) and never creates a ``torch.optim``
optimizer. The two paths agree up to float32 rounding (``tests/test_blocks.py``), so ``auto`` changed the default
runs' figures at that rounding."""

BLOCK_KINDS = ("plain", "sam")
"""Block trainers: ``plain`` (:class:`~fedrec_flwr.local.training.LocalTrainer`'s loop) and ``sam`` (FedRecGEL's
:class:`~fedrec_flwr.local.sam.SAMTrainer`)."""

BLOCK_MODELS = ("mf", "ncf")
"""Models the block path trains (``pfedrec`` has no user embedding and a personalised item table: per-user only)."""


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
    groups = chunk_users([d.n for d in data])
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


def _train_plain(block: Block, part: Sequence[UserData], shared, upload: str, term: BlockTerm | None = None):
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
            check_finite(users[:a], values, "loss")
            optimizer.step(view, grads, a)
            count = (sizes[:a] - s * batch).clamp(0, batch)
            totals[:a] += values.double() * count
        check_finite_parameters(users, params, f"parameters after epoch {_ + 1}")
    losses = (totals / sizes).tolist()
    block.save_private(users, {key: params[key] for key in block.private_keys})
    shared_values = {key: params[key] for key in block.layout.shared_shapes if key in params}
    split = split_updates(block, part, shared_values)
    if term is not None:
        for (dense, _), frozen in zip(split, term.uploads(params)):
            dense.update(frozen)
    return [(dense, rows, d.n, loss, None, False) for (dense, rows), d, loss in zip(split, part, losses)]


def _train_sam(block: Block, part: Sequence[UserData], shared, upload: str):
    """:class:`~fedrec_flwr.local.sam.SAMTrainer` for a chunk of users: ``local-epochs`` full-batch decoupled SAM steps
    (FedRecGEL, Sec. 4.2), each :func:`fedrec_flwr.local.sam.decoupled_sam_gradients` (the step the per-user trainer
    takes as a batch of one) with the block's batched gradient as ``gradient_at`` and ``eps = rho g / ||g||`` per
    group and user (Foret et al. 2021, Eq. 2); the private group stepped by the user's persistent optimizer, the
    shared group by a fresh one (``"upload" = "parameters"``) or only its mean SAM gradient kept (``"gradient"``)."""
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
    n = torch.as_tensor([d.n for d in part], device=block.device)
    width = max(d.n for d in part)
    sums = {key: torch.zeros_like(shared_copies[key]) for key in shared_keys}
    values = torch.zeros(len(part), device=block.device)
    groups = ((shared_keys, cfg.rho_shared), (block.private_keys, cfg.rho_private))
    for epoch in range(cfg.local_epochs):
        orders = [torch.randperm(d.n, generator=d.generator) for d in part]
        args = block.padded(part, orders, width, cfg.batch_size)

        def gradient_at(point, keys, args=args):
            return block.gradients(point, *args, keys=keys)[0]

        base, values = block.gradients(params, *args)
        check_finite(users, values, f"loss at SAM step {epoch + 1}")
        sam = decoupled_sam_gradients(params, base, groups, gradient_at)
        check_finite(
            users, user_norms([sam[key] for key in shared_keys]), f"shared SAM gradient at SAM step {epoch + 1}"
        )
        private_opt.step(private, {key: sam[key] for key in block.private_keys}, len(part))
        if shared_opt is not None:
            shared_opt.step(shared_copies, {key: sam[key] for key in shared_keys}, len(part))
        params = {**private, **shared_copies}
        for key in shared_keys:
            sums[key] = sums[key] + sam[key]
        check_finite_parameters(users, params, f"parameters after SAM step {epoch + 1}")
    chunks = torch.ceil(n / cfg.batch_size)
    losses = (values.double() / chunks).tolist()
    block.save_private(users, private)
    if private_opt.__class__ is BlockAdam:
        _save_private_optimizer(block, users, private_opt)
    else:
        for user in users:  # torch's SGD keeps no state: the per-user client stores an empty record
            block.state[f"{OPTIMIZER_PREFIX}{user}"] = ArrayRecord({})
    if update_shared:
        out = split_updates(block, part, shared_copies)
        return [(dense, rows, d.n, loss, None, False) for (dense, rows), d, loss in zip(out, part, losses)]
    grads = {key: sums[key] / cfg.local_epochs for key in shared_keys}
    out = split_updates(block, part, grads)
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
    phases = evaluation_phases(runtime.split, config)
    block = Block(runtime, users, state)
    ks = runtime.config.k_values
    shared_t = {key: as_tensor(value, block.device, block.dtype) for key, value in shared.items()}
    out: list[dict[str, float]] = [{} for _ in block.users]
    for start in range(0, len(block.users), EVAL_USERS_PER_CALL):
        part = block.users[start : start + EVAL_USERS_PER_CALL]
        private = block.load_private(part)
        params = {**shared_t, **{key: value.reshape(len(part), -1) for key, value in private.items()}}
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
