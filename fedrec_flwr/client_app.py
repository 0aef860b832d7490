"""The ClientApp: a thin Message-API adapter over the configured ``NumPyClient`` subclass.

Why not ``ClientApp(client_fn=...)``: in flwr 1.42 a ``client_fn`` app speaks the legacy message format, which the
strategies of ``flwr.serverapp.strategy`` cannot read, and it cannot receive custom message types. So each handler
here unpacks a message, calls the client algorithm by name (``fit_named`` / ``evaluate_named``), and packs the reply
under the key scheme of :mod:`fedrec_flwr.wire`.

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

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .registry import resolve
from .runtime import Runtime, get_runtime, node_users
from .wire import ARRAYS, CONFIG, GRADIENT_USERS, METRICS, NUM_EXAMPLES, Contribution



def split_fingerprint(split) -> str:
    """A short hash of the split's preprocessing facts: nodes that disagree on the data are caught at start."""
    facts = json.dumps(split.meta, sort_keys=True, default=str)
    return hashlib.sha256(facts.encode()).hexdigest()[:16]

IDENTIFY = "identify"
"""Action of the ``query`` message by which the server learns which users each node serves."""


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
    return client_app


def _with_config(handler, run_config, message: Message, context: Context) -> Message:
    _one_thread_per_worker()
    return handler(message, context, run_config=None if context.run_config else run_config)


app = make_client_app()
"""The ClientApp ``flwr run`` loads (``[tool.flwr.app.components] clientapp``)."""
