"""The ClientApp: a thin Message-API adapter over the configured ``NumPyClient`` subclass.

Why not ``ClientApp(client_fn=...)``: in flwr 1.42 a ``client_fn`` app speaks the legacy message format, which the
strategies of ``flwr.serverapp.strategy`` cannot read, and it cannot receive custom message types. So each handler
here unpacks a message, calls the client algorithm by name (``fit_named`` / ``evaluate_named``), and packs the reply
under the key scheme of :mod:`fedrec_flwr.wire`.

Query handlers: ``identify`` (which users a node serves) and the four phases of client unlearning
(:mod:`strategies.unlearning`): ``unlearn_gradient``, ``unlearn_affected``, ``unlearn_hvp`` and ``unlearn_local_cg``.
Their replies carry row-sparse vectors over the shared parameters (:func:`fedrec_flwr.wire.pack_sparse`), never a
private parameter.

One node serves the users ``partition-id * users-per-node ..`` (:func:`fedrec_flwr.runtime.node_users`); each user is
its own client object with its own private record in ``context.state``. A train reply is the exact sum-and-count
:class:`~fedrec_flwr.wire.Contribution` of the node's trained users.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .influence import can_batch
from .registry import resolve
from .runtime import Runtime, get_runtime, node_users
from .wire import (
    ARRAYS, CONFIG, GRADIENT_USERS, METRICS, NUM_EXAMPLES, Contribution, SparseSum, pack_sparse, unpack_sparse,
)



def split_fingerprint(split) -> str:
    """A short hash of the split's preprocessing facts: nodes that disagree on the data are caught at start."""
    facts = json.dumps(split.meta, sort_keys=True, default=str)
    return hashlib.sha256(facts.encode()).hexdigest()[:16]

IDENTIFY = "identify"
"""Action of the ``query`` message by which the server learns which users each node serves."""

UNLEARN_GRADIENT = "unlearn_gradient"
"""Query: the summed influence-loss gradient of the named (forgotten) users at the sent shared parameters."""
UNLEARN_AFFECTED = "unlearn_affected"
"""Query: for each named user, how many of its loss rows are in the sent support rows, and its gradient norm."""
UNLEARN_HVP = "unlearn_hvp"
"""Query: the summed Hessian-vector product of the named users' losses with the sent direction (distributed CG)."""
UNLEARN_LOCAL_CG = "unlearn_local_cg"
"""Query: the weighted sum of the named users' local CG solutions for the sent right-hand side (local CG)."""
VECTOR = "vector"
"""Content key of the row-sparse vector (direction, right-hand side) an unlearning query carries."""
SUPPORT = "support"
"""Content key of the support rows (``"rows"``, int64) of an ``unlearn_affected`` query."""


def make_client(runtime: Runtime, user: int, context: Context):
    """Build the configured client algorithm for one user (``client`` key: registry name or ``module:Class``)."""
    cls = resolve("client", runtime.config.client)
    return cls(runtime, user, context.state)


def _requested_users(message: Message, served: range) -> list[int]:
    config = message.content[CONFIG] if CONFIG in message.content else ConfigRecord()
    requested = config.get("users")
    if requested is None:
        return list(served)
    users = [int(u) for u in requested]
    outside = [u for u in users if u not in served]
    if outside:
        raise ValueError(f"users {outside[:10]} are not served by this node (it serves {served.start}..{served.stop - 1})")
    return users


def _shared_arrays(message: Message) -> dict:
    return {key: array.numpy() for key, array in message.content[ARRAYS].items()}


def train(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Train the requested users of this node; reply with their summed contribution (no private parameter)."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    users = _requested_users(message, served)
    shared = _shared_arrays(message)
    config = dict(message.content[CONFIG])
    contribution = Contribution(runtime.layout)
    gradients = 0
    for user in users:
        update = make_client(runtime, user, context).fit_named(shared, config)
        contribution.add_user(update.dense, update.rows, update.aggregation_weight, update.loss)
        gradients += int(update.is_gradient)
    metrics = MetricRecord(
        {NUM_EXAMPLES: float(contribution.num_examples), "num-users": contribution.num_users,
         "train-loss": contribution.mean_loss, GRADIENT_USERS: gradients}
    )
    content = RecordDict({ARRAYS: ArrayRecord({k: Array(v) for k, v in contribution.pack().items()}), METRICS: metrics})
    return Message(content=content, reply_to=message)


def evaluate(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Evaluate the requested users of this node on their held-out items; reply with mean metrics."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    users = _requested_users(message, served)
    shared = _shared_arrays(message)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    totals: dict[str, float] = {}
    for user in users:
        for key, value in make_client(runtime, user, context).evaluate_named(shared, config).items():
            totals[key] = totals.get(key, 0.0) + float(value)
    metrics = {key: value / len(users) for key, value in totals.items()} if users else {}
    metrics[NUM_EXAMPLES] = float(len(users))
    return Message(content=RecordDict({METRICS: MetricRecord(metrics)}), reply_to=message)


def identify(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Tell the server which block of users this node serves (derived from ``partition-id``, never ``node_id``)."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    split = runtime.split
    record = ConfigRecord(
        {
            "partition-id": int(context.node_config["partition-id"]),
            "first-user": served.start,
            "num-users": len(served),
            "num-users-total": split.num_users,
            "num-items": split.num_items,
            "fingerprint": split_fingerprint(split),
            "num-attribute-classes": runtime.protected.num_classes if runtime.protected else 0,
        }
    )
    return Message(content=RecordDict({CONFIG: record}), reply_to=message)


def _query_setup(message: Message, context: Context, run_config):
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    return runtime, _requested_users(message, served), config


def _sparse_reply(message: Message, total: SparseSum, metrics: dict) -> Message:
    arrays = ArrayRecord({k: Array(v) for k, v in total.pack().items()})
    metrics = MetricRecord({"num-users": total.count, **metrics})
    return Message(content=RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=message)


def unlearn_gradient(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Sum of the requested users' influence-loss gradients (:meth:`FedRecClient.influence_gradient`); the users are
    the ones being forgotten, and only their gradient, never their data, leaves the node."""
    runtime, users, _ = _query_setup(message, context, run_config)
    shared = _shared_arrays(message)
    total, loss = SparseSum(runtime.layout), 0.0
    for user in users:
        dense, rows, value = make_client(runtime, user, context).influence_gradient(shared)
        total.add(dense, rows)
        loss += value
    return _sparse_reply(message, total, {"loss-sum": loss})


def unlearn_affected(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """For each requested user: how many of its influence-loss rows are among the sent support rows (``overlap``)
    and, with ``"norms" = true``, the norm of its loss gradient at the sent shared parameters (``gradient-norm``; for
    overlapping users, or for all with ``"all-norms" = true``; else 0)."""
    runtime, users, config = _query_setup(message, context, run_config)
    shared = _shared_arrays(message)
    support = message.content[SUPPORT]["rows"].numpy().astype(np.int64)
    want_norms, all_norms = bool(config.get("norms", False)), bool(config.get("all-norms", False))
    overlaps, norms = [], []
    for user in users:
        client = make_client(runtime, user, context)
        overlap = int(np.isin(client.influence_items(), support).sum())
        norm = 0.0
        if want_norms and (overlap or all_norms):
            dense, rows, _ = client.influence_gradient(shared)
            norm = float(np.sqrt(sum(float(np.sum(v ** 2)) for v in dense.values())
                                 + sum(float(np.sum(v ** 2)) for _, v in rows.values())))
        overlaps.append(overlap)
        norms.append(norm)
    record = ConfigRecord({"users": users, "overlap": overlaps, "gradient-norm": norms})
    return Message(content=RecordDict({CONFIG: record}), reply_to=message)


def unlearn_hvp(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Sum over the requested users of ``H_u v`` for the sent direction ``v`` (one distributed-CG product), in one
    batched pass over the node's users where the model allows (:func:`fedrec_flwr.influence.can_batch`)."""
    runtime, users, _ = _query_setup(message, context, run_config)
    shared = _shared_arrays(message)
    direction = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    total = SparseSum(runtime.layout)
    clients = [make_client(runtime, user, context) for user in users]
    groups = [clients] if len(clients) > 1 and can_batch(runtime.model) else [[c] for c in clients]
    for group in groups:
        total.add(*group[0].influence_hvp(shared, direction, group=group))
    total.count = len(clients)
    return _sparse_reply(message, total, {})


def unlearn_local_cg(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Sum over the requested users of ``w_u x_u``, ``x_u`` the user's local CG solution of ``(H_u + damping I) x =
    rhs`` (HF-KCU's Algorithm 1); config: ``weights`` (one per user), ``iterations``, ``damping``, ``tolerance``."""
    runtime, users, config = _query_setup(message, context, run_config)
    shared = _shared_arrays(message)
    rhs = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    weights = [float(w) for w in config["weights"]]
    if len(weights) != len(users):
        raise ValueError(f"{len(weights)} weights for {len(users)} users")
    total = SparseSum(runtime.layout)
    stats = {"max-iterations": 0.0, "max-residual": 0.0, "not-converged": 0.0, "negative-curvature": 0.0}
    for user, weight in zip(users, weights):
        dense, rows, result = make_client(runtime, user, context).influence_solve(
            shared, rhs, iterations=int(config["iterations"]), damping=float(config["damping"]),
            tolerance=float(config["tolerance"]))
        total.add(dense, rows, weight)
        stats["max-iterations"] = max(stats["max-iterations"], float(result.iterations))
        stats["max-residual"] = max(stats["max-residual"], float(result.residual))
        stats["not-converged"] += float(not result.converged)
        stats["negative-curvature"] += float(result.negative_curvature)
    return _sparse_reply(message, total, stats)


def _one_thread_per_worker() -> None:
    """A client's tensors are tiny: torch's intra-op threads only contend with the other workers (measured: one
    epoch of centralized NCF took 200 s with 2 threads on a loaded 2-core machine, 4 s with 1). Each simulation
    actor or SuperNode process is given one CPU, so use one thread."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def make_client_app(run_config: Mapping[str, Any] | None = None, mods: list | None = None) -> ClientApp:
    """Build the ClientApp.

    Args:
        run_config: used when Flower passes an empty ``context.run_config`` (its in-process
            ``flwr.simulation.run_simulation`` does); ``flwr run`` always passes the full config.
        mods: Flower client mods wrapped around every handler (e.g. a message recorder in tests).
    """
    client_app = ClientApp(mods=mods or [])
    client_app.train()(partial(_with_config, train, run_config))
    client_app.evaluate()(partial(_with_config, evaluate, run_config))
    client_app.query(IDENTIFY)(partial(_with_config, identify, run_config))
    for action, handler in ((UNLEARN_GRADIENT, unlearn_gradient), (UNLEARN_AFFECTED, unlearn_affected),
                            (UNLEARN_HVP, unlearn_hvp), (UNLEARN_LOCAL_CG, unlearn_local_cg)):
        client_app.query(action)(partial(_with_config, handler, run_config))
    return client_app


def _with_config(handler, run_config, message: Message, context: Context) -> Message:
    _one_thread_per_worker()
    return handler(message, context, run_config=None if context.run_config else run_config)


app = make_client_app()
"""The ClientApp ``flwr run`` loads (``[tool.flwr.app.components] clientapp``)."""
