"""The influence objective: one user's (or one node's users') recommendation loss as a function of the shared
parameters, the private user embeddings held fixed. HF-KCU's gradients and Hessian-vector products are taken of it
(:mod:`fedrec_flwr.strategies.unlearning`, :mod:`fedrec_flwr.unlearning.krylov`).

``L_u(theta)`` is the training loss (``loss``: BCE or BPR) averaged over user ``u``'s training positives and a fixed
negative sample (:func:`influence_examples`), plus the L2 term of ``weight-decay`` where
set (on the item rows the user's loss uses and on the dense parameters, as in training). A node's objective is
``sum_u L_u`` over its users, evaluated in one batched pass when the model's private parameters are user-embedding
tables (MF, NCF): the node's users become the rows of one user table, so one product costs one forward-backward over
the node's examples instead of one per user.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from fedrec_flwr.data import sample_train_negatives
from fedrec_flwr.models import RecModel
from fedrec_flwr.unlearning.curvature import CompositeLoss, gauss_newton_diagonal

INFLUENCE_ROUND = 0
"""Round tag of the fixed negative sample in a user's influence loss (training rounds are 1-based, so never 0)."""


def influence_examples(runtime, user: int) -> tuple[np.ndarray, np.ndarray]:
    """``(positives, negatives)`` global item ids of user ``user``'s influence loss: its training positives and a
    fixed negative sample (``num-train-negatives`` per positive, drawn from the stream of round
    :data:`INFLUENCE_ROUND`, which training never uses)."""
    cfg, split = runtime.config, runtime.split
    negatives = sample_train_negatives(split, user, INFLUENCE_ROUND, cfg.num_train_negatives, cfg.seed)
    return split.positives(user), negatives


def compact_vector(
    vector: Mapping[str, np.ndarray], items: np.ndarray, params: Mapping[str, torch.Tensor], item_keys
) -> dict[str, torch.Tensor]:
    """Full shared arrays ``vector`` (key -> array, item tables ``(num_items, ...)``) cut to the compact parameters
    ``params`` of :func:`influence_objective`: item tables (``item_keys``) to rows ``items`` ``(T,)``, dense keys
    whole; each as a tensor of its parameter's dtype and device."""
    return {
        k: torch.as_tensor(
            np.asarray(vector[k])[items] if k in item_keys else np.asarray(vector[k]),
            dtype=p.dtype,
            device=p.device,
        )
        for k, p in params.items()
    }


def expand_compact(compact: Mapping[str, torch.Tensor], items: np.ndarray, layout) -> tuple[dict, dict]:
    """Compact tensors (as :func:`compact_vector` makes them) -> ``(dense key -> float64 array, item key -> (rows
    items (T,), float64 values (T, ...)))``, the form of :class:`fedrec_flwr.wire.SparseSum`'s parts."""
    arrays = {k: v.detach().cpu().numpy().astype(np.float64) for k, v in compact.items()}
    return ({k: arrays[k] for k in layout.dense_keys}, {k: (items, arrays[k]) for k in layout.item_keys})


def can_batch(model: RecModel) -> bool:
    """Whether every private parameter of ``model`` is a user-embedding table (then users can share one model)."""
    tables = {f"{name}.weight" for name in model.user_embedding_modules()}
    return set(model.private_state()) == tables


def node_model(runtime, num_users: int) -> RecModel:
    """A model like ``runtime.model`` with ``num_users`` user rows (cached per size on the runtime)."""
    from fedrec_flwr.app.runtime import build_shared_model

    cache = runtime.__dict__.setdefault("_node_models", {})
    if num_users not in cache:
        classes = runtime.protected.num_classes if runtime.protected else 0
        model = build_shared_model(runtime.config, runtime.split.num_items, num_users=num_users, num_classes=classes)
        cache[num_users] = model.to(next(runtime.model.parameters()).device)
    return cache[num_users]


def node_users_model(runtime, clients: Sequence) -> RecModel:
    """:func:`node_model` for ``clients`` with their private rows loaded, in order (row ``i`` is ``clients[i]``'s
    user; the model's shared parameters are whatever it held last: the caller loads them)."""
    model = node_model(runtime, len(clients))
    rows: dict[str, list] = {}
    for client in clients:
        client.load_private()
        for key, value in runtime.model.private_state().items():
            rows.setdefault(key, []).append(value)
    model.load_private_state({k: torch.cat(v) for k, v in rows.items()})
    return model


INDEX_CACHE_SIZE = 64
"""How many node groups' example indexes :func:`example_index` keeps per runtime (a node's group is the same in every
query of a phase, so one entry per node and query kind suffices; a node's entry is about 1 MB on ML-100K; the cache is
emptied when full, e.g. by local CG's one-user groups)."""


def example_index(runtime, clients: Sequence, extra_rows: np.ndarray | None, device) -> SimpleNamespace:
    """The tensors that index ``clients``' influence examples (:meth:`fedrec_flwr.clients.fedrec.FedRecClient.influence_examples`)
    into the compact item rows: ``items`` ``(T,)`` (the rows used and ``extra_rows``), ``user_t`` / ``weight_t`` /
    ``item_t`` / ``label_t`` (BCE; ``item_t`` / ``label_t`` are ``None`` for BPR), ``used_items`` / ``used_users``
    (every scored pair) and ``row_users`` ``(T,)`` (how many of the users use each row, for weight decay).

    They depend only on the users, the split, the seed and ``extra_rows`` (the negatives are a fixed sample), so they
    are cached per runtime (ours: the profile of a FedNCF phase showed every query rebuilding them, about a quarter of
    a product's time). Returns a namespace of them.
    """
    cfg = runtime.config
    key = (
        type(clients[0]).__qualname__,
        tuple(int(c.user) for c in clients),
        str(device),
        runtime.train_config.weight_decay > 0,
        None if extra_rows is None else np.asarray(extra_rows, dtype=np.int64).tobytes(),
    )
    cache = runtime.__dict__.setdefault("_influence_index", {})
    if key in cache:
        return cache[key]
    examples = [client.influence_examples() for client in clients]
    items = np.unique(
        np.concatenate(
            [np.concatenate(e) for e in examples]
            + ([np.asarray(extra_rows, dtype=np.int64)] if extra_rows is not None else [])
        )
    )
    items = items.astype(np.int64)
    users, left, right, weights = [], [], [], []
    for row, (positives, negatives) in enumerate(examples):
        pos, neg = np.searchsorted(items, positives), np.searchsorted(items, negatives)
        if cfg.loss == "bpr":
            k = neg.size // pos.size
            left.append(np.repeat(pos, k))
            right.append(neg)
            count = neg.size
        else:
            left.append(np.concatenate([pos, neg]))
            right.append((pos.size, neg.size))
            count = pos.size + neg.size
        users.append(np.full(count, row))
        weights.append(np.full(count, 1.0 / count))
    user_t = torch.as_tensor(np.concatenate(users), device=device)
    weight_t = torch.as_tensor(np.concatenate(weights), dtype=torch.float32, device=device)
    item_t = label_t = None
    if cfg.loss == "bpr":
        pos_t = torch.as_tensor(np.concatenate(left), device=device)
        neg_t = torch.as_tensor(np.concatenate(right), device=device)
        used_items = torch.cat([pos_t, neg_t])
        used_users = torch.cat([user_t, user_t])
    else:
        item_t = torch.as_tensor(np.concatenate(left), device=device)
        label_t = torch.as_tensor(
            np.concatenate([np.concatenate([np.ones(p), np.zeros(n)]) for p, n in right]),
            dtype=torch.float32,
            device=device,
        )
        used_items, used_users = item_t, user_t
    row_users = None
    if runtime.train_config.weight_decay > 0:  # each user regularises the rows its loss uses once (compute_loss)
        row_users = torch.zeros(items.size, device=device)
        for row in range(len(clients)):
            row_users[torch.unique(used_items[used_users == row])] += 1.0
    if len(cache) >= INDEX_CACHE_SIZE:
        cache.clear()
    cache[key] = SimpleNamespace(
        items=items,
        user_t=user_t,
        weight_t=weight_t,
        item_t=item_t,
        label_t=label_t,
        used_items=used_items,
        used_users=used_users,
        row_users=row_users,
    )
    return cache[key]


@contextmanager
def influence_objective(
    runtime, clients: Sequence, shared: Mapping[str, np.ndarray], extra_rows: np.ndarray | None = None
):
    """``sum_u L_u(theta)`` over ``clients`` (module docstring) as a function of the shared parameters.

    Inside the block the item tables are compact copies of rows ``items`` (the users' rows and ``extra_rows``), so
    every gradient or product costs O(rows used).

    Args:
        runtime: the process's :class:`~fedrec_flwr.app.runtime.Runtime`.
        clients: :class:`fedrec_flwr.clients.fedrec.FedRecClient` objects of this node's users (one, or several when
            :func:`can_batch` holds for the model).
        shared: shared key -> full array (the server's parameters).
        extra_rows: more item rows to include (e.g. a right-hand side's support), or ``None``.
    Yields:
        ``(loss_fn, params, items)``: ``loss_fn(params) -> scalar``, a :class:`~fedrec_flwr.unlearning.curvature.CompositeLoss`
        (model outputs, a loss convex in them, the weight-decay term) so that its Gauss-Newton product is defined;
        ``params`` the compact shared parameters (name
        -> detached tensor); ``items`` ``(T,)`` the global row of each compact row.
    Raises:
        ValueError: no clients, or several for a model whose private parameters are not user tables.
    """
    if not clients:
        raise ValueError("influence_objective: no users")
    cfg, layout = runtime.config, runtime.layout
    if len(clients) == 1:
        model = runtime.model
        clients[0].load_shared(shared)
        clients[0].load_private()
    else:
        if not can_batch(runtime.model):
            raise ValueError(f"model {cfg.model!r} has private parameters other than user tables: one user at a time")
        model = node_users_model(runtime, clients)
        if getattr(model, "_influence_shared", None) is not shared:
            model.load_shared_state(dict(shared))
            model._influence_shared = shared
    device = next(model.parameters()).device
    index = example_index(runtime, clients, extra_rows, device)
    items, user_t, weight_t = index.items, index.user_t, index.weight_t
    item_t, label_t, used_items, used_users = index.item_t, index.label_t, index.used_items, index.used_users
    row_users = index.row_users
    decay = runtime.train_config.weight_decay
    item_keys = set(layout.item_keys)
    with model.item_subset(items):
        if cfg.loss == "bpr":
            n = user_t.numel()
            output_users, output_items = used_users, used_items  # (2n,): positives then their sampled negatives

            def output_loss(scores):
                return -(weight_t * F.logsigmoid(scores[:n] - scores[n:])).sum()

            def output_curvature(scores):  # diag of H_z: w sigma(d)(1 - sigma(d)) for both scores of a pair
                s = torch.sigmoid(scores[:n] - scores[n:])
                c = weight_t * s * (1.0 - s)
                return torch.cat([c, c])
        else:
            output_users, output_items = user_t, item_t  # (n,) logits

            def output_loss(logits):
                return (weight_t * F.binary_cross_entropy_with_logits(logits, label_t, reduction="none")).sum()

            def output_curvature(logits):  # diag of H_z: w sigma(z)(1 - sigma(z))
                s = torch.sigmoid(logits)
                return weight_t * s * (1.0 - s)

        def outputs(params):
            return torch.func.functional_call(model, params, (output_users, output_items))

        each_row = torch.arange(output_items.numel(), device=output_items.device)

        def example_outputs(params):  # item tables (n_out, ...): output j reads row j (gauss_newton_diagonal)
            return torch.func.functional_call(model, params, (output_users, each_row))

        def regulariser(params):
            loss = 0.0
            for key, value in params.items():
                if key in item_keys:
                    loss = loss + 0.5 * decay * (row_users * value.pow(2).sum(dim=tuple(range(1, value.dim())))).sum()
                else:
                    loss = loss + 0.5 * decay * len(clients) * value.pow(2).sum()
            return loss

        loss_fn = CompositeLoss(
            outputs,
            output_loss,
            regulariser if decay > 0 else None,
            output_curvature=output_curvature,
            row_keys=tuple(layout.item_keys),
            example_rows=output_items,
            example_outputs=example_outputs,
        )
        params = {k: p.detach() for k, p in model.named_parameters() if k in layout.shared_shapes}
        yield loss_fn, params, items


def influence_loss_sums(
    runtime,
    clients: Sequence,
    shared: Mapping[str, np.ndarray],
    direction: Mapping[str, np.ndarray],
    steps: Sequence[float],
) -> np.ndarray:
    """``[sum_u L_u(theta + a_k d) for a_k in steps]``: the summed influence loss of ``clients`` at points along a
    direction, the line search's objective (:func:`fedrec_flwr.unlearning.line_search.ladder_line_search`).

    The loss is the one HF-KCU's products are taken of (module docstring), with each user's fixed negative sample,
    so for a given seed the values are deterministic. One forward pass per step and group (the node's users in one
    batched pass where :func:`can_batch` holds, else one user at a time); no gradient is taken.

    Args:
        runtime: the process's :class:`~fedrec_flwr.app.runtime.Runtime`.
        clients: :class:`fedrec_flwr.clients.fedrec.FedRecClient` objects of this node's (remaining) users.
        shared: shared key -> full array ``theta``.
        direction: shared key -> full array ``d`` (same shapes as ``shared``).
        steps: ``(K,)`` multiples ``a_k`` of ``direction``.
    Returns:
        ``(K,)`` float64 sums (zeros when ``clients`` is empty): one scalar per step over all of ``clients``, never
        a per-user value.
    """
    steps = [float(a) for a in steps]
    totals = np.zeros(len(steps), dtype=np.float64)
    if not clients:
        return totals
    item_keys = set(runtime.layout.item_keys)
    groups = [list(clients)] if len(clients) > 1 and can_batch(runtime.model) else [[c] for c in clients]
    for group in groups:
        with influence_objective(runtime, group, shared) as (loss_fn, params, items):
            compact = compact_vector(direction, items, params, item_keys)
            with torch.no_grad():
                for index, step in enumerate(steps):
                    totals[index] += float(loss_fn({k: params[k] + step * compact[k] for k in params}))
    return totals


def influence_gn_diagonal(
    runtime, clients: Sequence, shared: Mapping[str, np.ndarray], *, probes: int, seed: int
) -> tuple[dict, dict]:
    """The diagonal of ``sum_u G_u`` over ``clients``, ``G_u`` the Gauss-Newton matrix of user ``u``'s influence loss
    (:func:`fedrec_flwr.unlearning.curvature.gauss_newton_diagonal`: exact on the item rows, a ``probes``-draw Monte Carlo estimate
    on the dense parameters), for HF-KCU's preconditioner (``krylov-preconditioner``; ours).

    The node's users in one batched pass where :func:`can_batch` holds, else one at a time; the sign draws come from
    a ``torch.Generator`` seeded with ``seed``. Returns ``(dense key -> array, item key -> (row ids (T,), values (T,
    ...)))``: one sum over all of ``clients`` (:class:`fedrec_flwr.wire.SparseSum`'s form), never a per-user value.
    """
    dense_keys, item_keys = runtime.layout.dense_keys, runtime.layout.item_keys
    dense = {k: np.zeros(runtime.layout.shared_shapes[k], dtype=np.float64) for k in dense_keys}
    ids, values = {k: [] for k in item_keys}, {k: [] for k in item_keys}
    generator = torch.Generator().manual_seed(int(seed))
    groups = [list(clients)] if len(clients) > 1 and can_batch(runtime.model) else [[c] for c in clients]
    for group in groups:
        with influence_objective(runtime, group, shared) as (loss_fn, params, items):
            diagonal = gauss_newton_diagonal(loss_fn, params, probes=probes, generator=generator)
            for key in dense_keys:
                dense[key] += diagonal[key].detach().cpu().numpy().astype(np.float64)
            for key in item_keys:
                ids[key].append(items)
                values[key].append(diagonal[key].detach().cpu().numpy().astype(np.float64))
    rows = {
        k: (
            np.concatenate(ids[k]) if ids[k] else np.zeros(0, dtype=np.int64),
            np.concatenate(values[k]) if values[k] else np.zeros((0,) + tuple(runtime.layout.shared_shapes[k][1:])),
        )
        for k in item_keys
    }
    return dense, rows
