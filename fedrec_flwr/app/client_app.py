"""The ClientApp: a thin Message-API adapter over the configured ``NumPyClient`` subclass.

Why not ``ClientApp(client_fn=...)``: in flwr 1.42 a ``client_fn`` app speaks the legacy message format, which the
strategies of ``flwr.serverapp.strategy`` cannot read, and it cannot receive custom message types. So each handler
here unpacks a message, calls the client algorithm by name (``fit_named`` / ``evaluate_named``), and packs the reply
under the key scheme of :mod:`fedrec_flwr.wire`.

The train and evaluate handlers are here; the query handlers (``identify``, client unlearning's ``unlearn_*``,
FedAU²'s ``adversary_gradient``) are in :mod:`fedrec_flwr.app.queries`, each registered by its message type in
:data:`fedrec_flwr.app.queries.QUERY_HANDLERS` (a new query goes there); what all handlers share (the requested users,
the shared arrays, the private records around a message, the reply records) is :mod:`fedrec_flwr.app.handler_common`.
Their names are re-exported here, where tests and experiments import them.

One node serves the users ``partition-id * users-per-node ..`` (:func:`fedrec_flwr.app.runtime.node_users`); each user is
its own client object with its own private record in ``context.state``. Where the client class declares a vectorized
block path and ``block-training`` allows (``"auto"``, the default: every message, one user included), train and
evaluate messages run all of their users as one batched computation instead (:mod:`fedrec_flwr.local.blocks`; same updates
up to float32 rounding, same private records); query handlers are always per-user. A train reply is the exact
sum-and-count :class:`~fedrec_flwr.wire.Contribution` of the node's trained users.

With ``client-state-dir`` (node config, else run config) the users' private records live in files on the node's own
disk instead, loaded before and saved after each message (:func:`private_state`, :mod:`fedrec_flwr.state.client_state`), so
a SuperNode that is killed and restarted loses no user's embedding, and a resumed run finds every user's state as of
the round it resumes from.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedrec_flwr.adversary.models import ADVERSARY_MODULE
from fedrec_flwr.adversary.secure import route_train_vector, wants_statistics
from fedrec_flwr.app.handler_common import (
    RecordValueError,
    class_name,
    isolate_nonfinite_users,
    make_client,
    metric_record,
    private_state,
    record_number,
    requested_users,
    shared_arrays,
)
from fedrec_flwr.app.queries import (
    QUERY_HANDLERS,
    adversary_gradient_query,
    identify,
    split_facts,
    split_fingerprint,
    unlearn_affected,
    unlearn_counts,
    unlearn_diagonal,
    unlearn_gradient,
    unlearn_hvp,
    unlearn_local_cg,
    unlearn_loss,
    unlearn_margin,
)
from fedrec_flwr.app.runtime import Runtime, get_runtime, node_users
from fedrec_flwr.arrays import encode_array
from fedrec_flwr.local.blocks import evaluate_block, train_block, use_blocks
from fedrec_flwr.registry import resolve
from fedrec_flwr.unlearning.history import CONTRIBUTIONS, pack_user_contributions
from fedrec_flwr.wire import (
    ARRAYS,
    CONFIG,
    GRADIENT_USERS,
    ISOLATED_USERS,
    METRICS,
    NUM_EXAMPLES,
    Contribution,
)

__all__ = [
    "QUERY_HANDLERS",
    "RESERVED_METRICS",
    "RecordValueError",
    "UserMetrics",
    "adversary_gradient_query",
    "app",
    "evaluate",
    "identify",
    "isolate_nonfinite_users",
    "make_client",
    "make_client_app",
    "metric_record",
    "private_state",
    "record_number",
    "split_facts",
    "split_fingerprint",
    "train",
    "unlearn_affected",
    "unlearn_counts",
    "unlearn_diagonal",
    "unlearn_gradient",
    "unlearn_hvp",
    "unlearn_local_cg",
    "unlearn_loss",
    "unlearn_margin",
]

log = logging.getLogger(__name__)


RESERVED_METRICS = (NUM_EXAMPLES, "num-users", "train-loss", GRADIENT_USERS, ISOLATED_USERS)
"""Metric keys a train reply sets itself; a client's ``UserUpdate.metrics`` may not use them."""


def train(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Train the requested users of this node; reply with their summed contribution (no private parameter) and, with
    ``unlearning-history`` on and more than one user, each user's own contribution as well
    (:data:`~fedrec_flwr.unlearning.history.CONTRIBUTIONS`, :mod:`fedrec_flwr.strategies.history_recording`)."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    users = requested_users(message, served)
    shared = shared_arrays(message)
    config = dict(message.content[CONFIG])
    contribution = Contribution(runtime.layout)
    gradients = 0
    extra = UserMetrics()
    client = None
    # unlearning-history with several users here: each user's own contribution travels too (FRU's per-user store)
    per_user = [] if runtime.config.unlearning_history != "off" and len(users) > 1 else None
    with private_state(context, runtime, config, users, save=True):
        users, isolated = isolate_nonfinite_users(context, users, "training")
        for user, (client, update) in zip(users, _user_updates(runtime, users, context, shared, config), strict=True):
            weight = float(
                record_number(
                    update.aggregation_weight, "aggregation weight (UserUpdate.weight or num_examples)", client
                )
            )
            loss = float(record_number(update.loss, "train-loss (UserUpdate.loss)", client))
            contribution.add_user(update.dense, update.rows, weight, loss)
            if per_user is not None:
                per_user.append((user, update.dense, update.rows, weight))
            extra.add(getattr(update, "metrics", None) or {}, weight, client)
            gradients += int(update.is_gradient)
        statistics = _adversary_statistics(runtime, users, context, shared, config)
    metrics = {
        NUM_EXAMPLES: float(contribution.num_examples),
        "num-users": contribution.num_users,
        "train-loss": float(contribution.mean_loss),
        GRADIENT_USERS: gradients,
        **extra.means(),
    }
    if isolated:
        metrics[ISOLATED_USERS] = float(len(isolated))
    packed = contribution.pack()
    records = {}
    if runtime.config.adversary != "none" and runtime.config.adversary_training == "server" and contribution.num_users:
        records = route_train_vector(
            runtime.config,
            context.state,
            int(config["server-round"]),
            [k for k in runtime.layout.dense_keys if k.startswith(ADVERSARY_MODULE + ".")],
            contribution.dense_sum,
            contribution.num_examples,
            packed,
            statistics,
        )
    content = RecordDict(
        {
            ARRAYS: ArrayRecord({k: encode_array(v) for k, v in packed.items()}),
            METRICS: metric_record(metrics, client),
            **records,
        }
    )
    if per_user is not None:
        content[CONTRIBUTIONS] = ArrayRecord(
            {k: encode_array(v) for k, v in pack_user_contributions(runtime.layout, per_user).items()}
        )
    return Message(content=content, reply_to=message)


def _adversary_statistics(runtime: Runtime, users: list[int], context: Context, shared: dict, config: dict):
    """The sum over ``users`` of :func:`fedrec_flwr.adversary.adaptive.adversary_statistics` at the round's ``h_w``
    and their trained embeddings, when the server reads them (:func:`fedrec_flwr.adversary.secure.wants_statistics`:
    the adaptive rule or the ``"aggregate"`` class prior; ``None`` otherwise or without users)."""
    if not users or not wants_statistics(runtime.config):
        return None
    return make_client(runtime, users[0], context).adversary_statistics_sum(shared, users, config)


def _user_updates(runtime: Runtime, users: list[int], context: Context, shared: dict, config: dict):
    """``(client, UserUpdate)`` of each of ``users`` in order: from one vectorized block (:mod:`fedrec_flwr.local.blocks`;
    ``client`` is then the class) when ``block-training`` and the client class allow, else from each user's client.
    A message with a FedProx ``"proximal-mu"`` > 0 is trained per user (:data:`fedrec_flwr.local.blocks.PER_USER_MESSAGE_KEYS`)."""
    cls = resolve("client", runtime.config.client)
    if use_blocks(cls, runtime.config, len(users), config):
        for update in train_block(runtime, cls, users, context.state, shared, config):
            yield cls, update
        return
    for user in users:
        client = make_client(runtime, user, context)
        try:
            update = client.fit_named(shared, config)
        except FloatingPointError as err:  # the block path names its users; name this one too
            raise FloatingPointError(f"user {user}: {err}") from err
        yield client, update


class UserMetrics:
    """A node's extra train metrics (``UserUpdate.metrics``): each key's mean over the node's users, weighted like
    ``train-loss`` by each user's aggregation weight. The server's ``aggregate_metricrecords`` weights the nodes'
    means by their ``num-examples`` (the weight total), so the result in ``metrics.csv`` is the weighted mean over all
    trained users, however they are grouped into nodes. Every user of a node must report the same keys."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weight = 0.0
        self.users = 0

    def add(self, metrics: Mapping[str, Any], weight: float, client) -> None:
        """Add one user's metrics (converted by :func:`record_number`).

        Raises:
            RecordValueError: a value is not a number, a key is reserved (:data:`RESERVED_METRICS`) or not a string,
                or the users of the node report different keys.
        """
        for key in metrics:
            if not isinstance(key, str) or key in RESERVED_METRICS:
                raise RecordValueError(
                    f"client {class_name(client)}: UserUpdate.metrics key {key!r} is "
                    f"{'reserved' if isinstance(key, str) else 'not a string'} (reserved: "
                    f"{list(RESERVED_METRICS)})"
                )
        if self.users and set(metrics) != set(self.sums):
            raise RecordValueError(
                f"client {class_name(client)}: users of one node report different "
                f"UserUpdate.metrics keys ({sorted(self.sums)} and {sorted(metrics)})"
            )
        for key, value in metrics.items():
            number = float(record_number(value, key, client))
            if not math.isfinite(number):
                raise RecordValueError(f"client {class_name(client)}: metric {key!r} = {value!r} is not finite")
            self.sums[key] = self.sums.get(key, 0.0) + weight * number
        self.weight += weight
        self.users += 1

    def means(self) -> dict[str, float]:
        """Key -> weighted mean (``{}`` without extra metrics)."""
        return {key: total / self.weight for key, total in self.sums.items()} if self.weight else {}


def evaluate(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Evaluate the requested users of this node on their held-out items; reply with mean metrics."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    users = requested_users(message, served)
    shared = shared_arrays(message)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    totals: dict[str, float] = {}
    client = None
    isolated: list[int] = []
    with private_state(context, runtime, config, users):
        users, isolated = isolate_nonfinite_users(context, users, "evaluation")
        cls = resolve("client", runtime.config.client)
        if use_blocks(cls, runtime.config, len(users)):  # one batched scoring call (fedrec_flwr.local.blocks)
            results, client = evaluate_block(runtime, users, context.state, shared, config), cls
        else:
            results = []
            for user in users:
                client = make_client(runtime, user, context)
                results.append(client.evaluate_named(shared, config))
        for result in results:
            for key, value in result.items():
                totals[key] = totals.get(key, 0.0) + float(record_number(value, key, client))
    metrics = {key: value / len(users) for key, value in totals.items()} if users else {}
    metrics[NUM_EXAMPLES] = float(len(users))
    if isolated:
        metrics[ISOLATED_USERS] = float(len(isolated))
    return Message(content=RecordDict({METRICS: metric_record(metrics, client)}), reply_to=message)


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
    for action, handler in QUERY_HANDLERS.items():
        client_app.query(action)(partial(_with_config, handler, run_config))
    return client_app


def _with_config(handler, run_config, message: Message, context: Context) -> Message:
    _one_thread_per_worker()
    return handler(message, context, run_config=None if context.run_config else run_config)


app = make_client_app()
"""The ClientApp ``flwr run`` loads (``[tool.flwr.app.components] clientapp``)."""
