"""The ClientApp: a thin Message-API adapter over the configured ``NumPyClient`` subclass.

Why not ``ClientApp(client_fn=...)``: in flwr 1.42 a ``client_fn`` app speaks the legacy message format, which the
strategies of ``flwr.serverapp.strategy`` cannot read, and it cannot receive custom message types. So each handler
here unpacks a message, calls the client algorithm by name (``fit_named`` / ``evaluate_named``), and packs the reply
under the key scheme of :mod:`fedrec_flwr.wire`.

Query handlers: ``identify`` (which users a node serves) and the queries of client unlearning
(:mod:`fedrec_flwr.strategies.unlearning`): ``unlearn_gradient``, ``unlearn_affected``, ``unlearn_hvp``, ``unlearn_local_cg``,
``unlearn_loss``, ``unlearn_diagonal``, ``unlearn_counts`` and ``unlearn_margin``.
Their replies carry row-sparse vectors over the shared parameters (:func:`fedrec_flwr.wire.pack_sparse`), never a
private parameter. ``adversary_gradient`` (FedAU²'s extra server steps of ``h_w``) replies with ``h_w``'s mean
gradient over the node's users.

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

import hashlib
import json
import logging
import math
import numbers
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedrec_flwr.app.runtime import Runtime, get_runtime, node_users
from fedrec_flwr.arrays import decode_array, encode_array
from fedrec_flwr.errors import ConfigError, FedRecError
from fedrec_flwr.local.blocks import evaluate_block, train_block, use_blocks
from fedrec_flwr.registry import resolve
from fedrec_flwr.state.client_state import (
    DURABLE_ROUND_KEY,
    NEW_RUN_KEY,
    RESUME_ROUND_KEY,
    STATE_DIR_KEY,
    ClientStateError,
    ClientStateStore,
    nonfinite_records,
    state_folder,
    user_record_keys,
)
from fedrec_flwr.unlearning.influence import can_batch, influence_gn_diagonal, influence_loss_sums
from fedrec_flwr.unlearning.margin import margin_sums, positive_counts
from fedrec_flwr.wire import (
    ADVERSARY_GRADIENT,
    ARRAYS,
    CONFIG,
    GRADIENT_USERS,
    IDENTIFY,
    ISOLATED_USERS,
    METRICS,
    NUM_EXAMPLES,
    SUPPORT,
    UNLEARN_AFFECTED,
    UNLEARN_COUNTS,
    UNLEARN_DIAGONAL,
    UNLEARN_GRADIENT,
    UNLEARN_HVP,
    UNLEARN_LOCAL_CG,
    UNLEARN_LOSS,
    UNLEARN_MARGIN,
    VECTOR,
    Contribution,
    SparseSum,
    unpack_sparse,
)

log = logging.getLogger(__name__)


def split_fingerprint(split) -> str:
    """A short hash of the split's preprocessing facts: nodes that disagree on the data are caught at start."""
    facts = json.dumps(split.meta, sort_keys=True, default=str)
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


SPLIT_FACTS = (
    "held_out_order",
    "tie_rule",
    "tie_rule_applied",
    "timestamps",
    "min_user_interactions",
    "interactions_in_file",
    "duplicates_removed",
    "dropped_users",
    "dropped_items",
    "interactions_of_dropped_users",
    "num_interactions",
    "users_with_tied_latest",
    "holdout_validation",
    "num_test_negatives",
    "seed",
    "source_sha256",
    "format_version",
)
"""What the split did (keys of :attr:`fedrec_flwr.data.Split.meta`), reported by ``identify`` and written to the
results folder's ``config.json`` by the ServerApp, which never reads the data itself."""


def split_facts(split) -> dict:
    """The :data:`SPLIT_FACTS` of ``split`` with kebab-case names (those its ``meta`` has)."""
    return {key.replace("_", "-"): split.meta[key] for key in SPLIT_FACTS if key in split.meta}


RESERVED_METRICS = (NUM_EXAMPLES, "num-users", "train-loss", GRADIENT_USERS, ISOLATED_USERS)
"""Metric keys a train reply sets itself; a client's ``UserUpdate.metrics`` may not use them."""


class RecordValueError(TypeError):
    """A client returned a value Flower's records cannot carry (the message names the key and the client class)."""


def _class_name(client) -> str:
    if client is None:
        return "(none: the node served no user)"
    cls = client if isinstance(client, type) else type(client)
    return f"{cls.__module__}:{cls.__qualname__}"


def record_number(value: Any, key: str, client) -> int | float:
    """``value`` as the Python ``int`` or ``float`` Flower's ``MetricRecord`` accepts.

    Accepts Python and numpy numbers, booleans (as 0/1) and one-element arrays or tensors (``.item()``); numpy
    scalars such as ``np.float32`` are not ``float`` and a record refuses them, so every value our apps put in a
    record goes through here (or :func:`metric_record`).

    Raises:
        RecordValueError: anything else (a string, ``None``, an array of several values); the message names ``key``
            and ``client``'s class.
    """
    item = value
    if (
        not isinstance(item, (numbers.Number, np.generic))
        and hasattr(item, "item")
        and getattr(item, "ndim", None) is not None
        and int(np.prod(getattr(item, "shape", ()))) == 1
    ):
        item = item.item()  # a one-element numpy array or torch tensor
    if isinstance(item, (bool, np.bool_)):
        return int(item)
    if isinstance(item, numbers.Integral):
        return int(item)
    if isinstance(item, numbers.Real):
        return float(item)
    raise RecordValueError(
        f"client {_class_name(client)}: metric {key!r} = {value!r} ({type(value).__name__}) is "
        "not a number; Flower's MetricRecord holds int or float values only"
    )


def metric_record(values: Mapping[str, Any], client) -> MetricRecord:
    """A ``MetricRecord`` of ``values``, each converted by :func:`record_number` (lists of numbers: element-wise).

    Raises:
        RecordValueError: a key is not a string or a value is not a number (names the key and the client class).
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise RecordValueError(f"client {_class_name(client)}: metric key {key!r} is not a string")
        if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1):
            items = [record_number(v, key, client) for v in value]
            out[key] = [float(v) for v in items] if any(isinstance(v, float) for v in items) else items
        else:
            out[key] = record_number(value, key, client)
    return MetricRecord(out)


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
        raise ValueError(
            f"users {outside[:10]} are not served by this node (it serves {served.start}..{served.stop - 1})"
        )
    return users


@contextmanager
def private_state(
    context: Context, runtime: Runtime, config: Mapping[str, Any], users, *, save: bool = False
) -> Iterator[None]:
    """Make ``users``' private records available in ``context.state`` for one message.

    Without ``client-state-dir`` (node config, else run config) this does nothing: the records stay in the node's
    memory. With it (:mod:`fedrec_flwr.state.client_state`), each user's records are loaded from its file (the version of
    the message's round: before round ``t`` for training, ``<= t`` otherwise; the newest when the message names no
    round), written back as round ``t``'s version after a training message (``save``), and removed from
    ``context.state`` afterwards, so the node's memory and the state Flower ships with each message stay small.
    """
    folder = state_folder(context.node_config, runtime.config.client_state_dir, config)
    if folder is None:
        yield
        return
    store = ClientStateStore(folder)
    server_round = config.get("server-round")
    as_of = None if server_round is None else int(server_round) - (1 if save else 0)
    users = [int(u) for u in users]
    try:
        for user in users:
            store.load(user, context.state, as_of)
        yield
        if save:
            durable = int(config.get(DURABLE_ROUND_KEY, -1))
            for user in users:
                store.save(user, context.state, int(server_round), durable)
    finally:
        for user in users:
            for key in user_record_keys(context.state, user):
                del context.state[key]


_LAST_SHARED: list = [None, (), {}]
"""``[ArrayRecord, its Array objects, the decoded mapping]`` of the last message's shared arrays (one per process)."""


def _shared_arrays(message: Message) -> dict:
    """The message's shared arrays by key, decoded (:func:`fedrec_flwr.arrays.decode_array`).

    Messages that carry the very same ``ArrayRecord`` with the same ``Array`` objects (the server's messages of one
    round, delivered in-process by :class:`fedrec_flwr.serial.SerialGrid` or Flower's in-process simulation) get the
    same mapping object: it is decoded once, and the per-user clients' :meth:`~fedrec_flwr.clients.fedrec.FedRecClient.load_shared`
    then reloads only the keys a previous user changed instead of validating and copying every table again. Callers
    read the mapping and never write to it. A message deserialized on its own (a SuperNode, a Ray worker) is decoded
    as usual."""
    record = message.content[ARRAYS]
    arrays = tuple(record.values())
    record_then, arrays_then, decoded = _LAST_SHARED
    if record_then is record and len(arrays_then) == len(arrays) and all(a is b for a, b in zip(arrays_then, arrays)):
        return decoded
    decoded = {key: decode_array(array) for key, array in record.items()}
    _LAST_SHARED[:] = [record, arrays, decoded]
    return decoded


def isolate_nonfinite_users(context: Context, users: list[int], what: str) -> tuple[list[int], list[int]]:
    """Split ``users`` into those whose private state (loaded in ``context.state``) is finite and those whose state
    holds a NaN or an infinity (:func:`fedrec_flwr.state.client_state.nonfinite_records`), which are left out of ``what``
    (``"training"``, ``"evaluation"``) with a warning naming each user and record, so the node's other users go on.

    Raises:
        ClientStateError: every requested user's state is non-finite (the message names them): nothing to reply.
    """
    isolated = []
    for user in users:
        bad = nonfinite_records(context.state, user)
        if bad:
            isolated.append(user)
            log.warning(
                "user %d: private state %s holds NaN or infinity: left out of %s (the node's other users go on)",
                user,
                ", ".join(bad[:3]),
                what,
            )
    if isolated and len(isolated) == len(users):
        raise ClientStateError(
            f"users {isolated[:10]}: every requested user's private state holds NaN or infinity; "
            f"none can take part in {what}"
        )
    return ([u for u in users if u not in set(isolated)], isolated) if isolated else (users, [])


def train(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Train the requested users of this node; reply with their summed contribution (no private parameter)."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    users = _requested_users(message, served)
    shared = _shared_arrays(message)
    config = dict(message.content[CONFIG])
    contribution = Contribution(runtime.layout)
    gradients = 0
    extra = UserMetrics()
    client = None
    with private_state(context, runtime, config, users, save=True):
        users, isolated = isolate_nonfinite_users(context, users, "training")
        for client, update in _user_updates(runtime, users, context, shared, config):
            weight = float(
                record_number(
                    update.aggregation_weight, "aggregation weight (UserUpdate.weight or num_examples)", client
                )
            )
            loss = float(record_number(update.loss, "train-loss (UserUpdate.loss)", client))
            contribution.add_user(update.dense, update.rows, weight, loss)
            extra.add(getattr(update, "metrics", None) or {}, weight, client)
            gradients += int(update.is_gradient)
    metrics = {
        NUM_EXAMPLES: float(contribution.num_examples),
        "num-users": contribution.num_users,
        "train-loss": float(contribution.mean_loss),
        GRADIENT_USERS: gradients,
        **extra.means(),
    }
    if isolated:
        metrics[ISOLATED_USERS] = float(len(isolated))
    content = RecordDict(
        {
            ARRAYS: ArrayRecord({k: encode_array(v) for k, v in contribution.pack().items()}),
            METRICS: metric_record(metrics, client),
        }
    )
    return Message(content=content, reply_to=message)


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
                    f"client {_class_name(client)}: UserUpdate.metrics key {key!r} is "
                    f"{'reserved' if isinstance(key, str) else 'not a string'} (reserved: "
                    f"{list(RESERVED_METRICS)})"
                )
        if self.users and set(metrics) != set(self.sums):
            raise RecordValueError(
                f"client {_class_name(client)}: users of one node report different "
                f"UserUpdate.metrics keys ({sorted(self.sums)} and {sorted(metrics)})"
            )
        for key, value in metrics.items():
            number = float(record_number(value, key, client))
            if not math.isfinite(number):
                raise RecordValueError(f"client {_class_name(client)}: metric {key!r} = {value!r} is not finite")
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
    users = _requested_users(message, served)
    shared = _shared_arrays(message)
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


def identify(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Tell the server which block of users this node serves (derived from ``partition-id``, never ``node_id``).

    A node config that cannot serve the run (``partition-id`` out of range, missing keys) is answered with an error
    reply naming the problem rather than raised: the ServerApp stops the run with the first such reason, and Flower
    prints no traceback per node (``--num-supernodes 1000`` on 943 users would print ~4,200 lines of them). The same
    holds for a run config or data that cannot build the node's runtime (e.g. FedAU² on a dataset without the
    protected attribute under plain ``flwr run``, where no launcher preflight ran)."""
    try:
        runtime = get_runtime(run_config or context.run_config)
        served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    except FedRecError as err:
        return Message(error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err)), reply_to=message)
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
            "split-facts": json.dumps(split_facts(split), sort_keys=True, default=str),
            # whether this node keeps its users' private state in files (a resumed run needs them)
            "client-state": bool(context.node_config.get(STATE_DIR_KEY, "") or runtime.config.client_state_dir),
        }
    )
    try:
        record.update(_resume_state_check(message, context, runtime, served))
    except FedRecError as err:
        return Message(error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err)), reply_to=message)
    return Message(content=RecordDict({CONFIG: record}), reply_to=message)


def _resume_state_check(message: Message, context: Context, runtime: Runtime, served: range) -> dict:
    """On a resume (the identify query carries ``resume-round`` R), the ids of this node's users whose state files
    are damaged, and of those without a version of round <= R (:meth:`ClientStateStore.resume_problems`); the
    server, which knows from its checkpoint which users trained, decides what is lost. ``{}`` when not resuming,
    without state files, or when every served user has a readable version <= R."""
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    if config.get(NEW_RUN_KEY):  # a fresh run: state files of an earlier run of this name must not be mixed in
        folder = state_folder(context.node_config, runtime.config.client_state_dir, config)
        earlier = ClientStateStore(folder).earlier_users(served) if folder is not None else []
        return {"client-state-folder": str(folder), "client-state-earlier": earlier} if earlier else {}
    if RESUME_ROUND_KEY not in config:
        return {}
    folder = state_folder(context.node_config, runtime.config.client_state_dir, config)
    if folder is None:
        return {}
    damaged, absent = ClientStateStore(folder).resume_problems(
        served, int(config[RESUME_ROUND_KEY]), set_aside=bool(config.get("resume-resets-client-state", False))
    )
    facts = {"client-state-folder": str(folder)} if damaged or absent else {}
    if damaged:
        facts["client-state-damaged"] = damaged
    if absent:
        facts["client-state-absent"] = absent
    return facts


def _query_setup(message: Message, context: Context, run_config):
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    return runtime, _requested_users(message, served), config


def _sparse_reply(message: Message, total: SparseSum, metrics: dict, client=None) -> Message:
    arrays = ArrayRecord({k: encode_array(v) for k, v in total.pack().items()})
    metrics = metric_record({"num-users": total.count, **metrics}, client)
    return Message(content=RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=message)


def unlearn_gradient(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Sum of the requested users' influence-loss gradients (:meth:`FedRecClient.influence_gradient`); the users are
    the ones being forgotten, and only their gradient, never their data, leaves the node."""
    runtime, users, config = _query_setup(message, context, run_config)
    shared = _shared_arrays(message)
    total, loss, client = SparseSum(runtime.layout), 0.0, None
    with private_state(context, runtime, config, users):
        for user in users:
            client = make_client(runtime, user, context)
            dense, rows, value = client.influence_gradient(shared)
            total.add(dense, rows)
            loss += float(record_number(value, "loss-sum (influence_gradient's loss)", client))
    return _sparse_reply(message, total, {"loss-sum": loss}, client)


def _remaining_users(message: Message, context: Context, run_config):
    """The node's served users minus the message's ``exclude`` list (the forgotten users), and, with ``"causal" =
    true`` and a support, only those whose influence loss shares a row with it: ``(runtime, clients, config)``.
    The server never chooses individual users here, so every answer is a sum over the node's users."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    excluded = {int(u) for u in config.get("exclude", [])}
    clients = [make_client(runtime, u, context) for u in served if u not in excluded]
    if bool(config.get("causal", False)) and SUPPORT in message.content:
        support = message.content[SUPPORT]["rows"].numpy().astype(np.int64)
        clients = [c for c in clients if np.isin(c.influence_items(), support).any()]
    return runtime, clients, config


def unlearn_affected(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """How many of this node's remaining users share an influence-loss row with the sent support rows
    (``affected-users``), and the node's total number of such shared rows (``overlap``): node totals only."""
    _, clients, _ = _remaining_users(message, context, run_config)
    support = message.content[SUPPORT]["rows"].numpy().astype(np.int64)
    overlaps = [int(np.isin(c.influence_items(), support).sum()) for c in clients]
    record = ConfigRecord(
        {"affected-users": sum(1 for o in overlaps if o), "overlap": sum(overlaps), "remaining-users": len(clients)}
    )
    return Message(content=RecordDict({CONFIG: record}), reply_to=message)


def unlearn_hvp(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Sum over the node's remaining (with ``causal``: affected) users of ``H_u v`` for the sent direction ``v`` (one
    distributed-CG product), in one batched pass where the model allows (:func:`fedrec_flwr.unlearning.influence.can_batch`)."""
    runtime, clients, config = _remaining_users(message, context, run_config)
    shared = _shared_arrays(message)
    direction = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    total = SparseSum(runtime.layout)
    groups = [clients] if len(clients) > 1 and can_batch(runtime.model) else [[c] for c in clients]
    with private_state(context, runtime, config, [c.user for c in clients]):
        for group in groups:
            total.add(
                *group[0].influence_hvp(
                    shared, direction, group=group, curvature=str(config.get("curvature", "hessian"))
                )
            )
    total.count = len(clients)
    return _sparse_reply(message, total, {}, clients[0] if clients else None)


def unlearn_loss(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's line search on this node: ``loss-sums[k] = sum_u L_u(theta + a_k d)`` over the node's remaining (with
    ``causal``: affected) users, for the sent shared parameters ``theta``, direction ``d`` (``VECTOR``) and the
    config's ``steps`` ``a_k`` (:func:`fedrec_flwr.unlearning.influence.influence_loss_sums`). The reply carries only these
    node sums (and ``num-users``), no array and no per-user value."""
    runtime, clients, config = _remaining_users(message, context, run_config)
    shared = _shared_arrays(message)
    direction = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    steps = [float(a) for a in config.get("steps", [])]
    with private_state(context, runtime, config, [c.user for c in clients]):
        sums = influence_loss_sums(runtime, clients, shared, direction, steps)
    metrics = metric_record(
        {"num-users": len(clients), "loss-sums": [float(v) for v in sums]}, clients[0] if clients else None
    )
    return Message(content=RecordDict({METRICS: metrics}), reply_to=message)


def unlearn_diagonal(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's preconditioner on this node (``krylov-preconditioner``): the diagonal of ``sum_u G_u`` over the
    node's remaining (with ``causal``: affected) users, ``G_u`` the Gauss-Newton matrix
    (:func:`fedrec_flwr.unlearning.influence.influence_gn_diagonal`; config ``probes``, ``seed``). One row-sparse sum over the
    node's users, as an HVP reply; no per-user value."""
    runtime, clients, config = _remaining_users(message, context, run_config)
    shared = _shared_arrays(message)
    total = SparseSum(runtime.layout)
    if clients:
        with private_state(context, runtime, config, [c.user for c in clients]):
            total.add(
                *influence_gn_diagonal(
                    runtime, clients, shared, probes=int(config.get("probes", 8)), seed=int(config.get("seed", 0))
                )
            )
    total.count = len(clients)
    return _sparse_reply(message, total, {}, clients[0] if clients else None)


def unlearn_counts(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's membership-margin step (:mod:`fedrec_flwr.unlearning.margin`): ``remaining`` = training positives per
    item over the node's remaining users (served minus ``exclude``), ``forgotten`` = the same over its users in
    ``exclude``. Two ``(I,)`` node totals; no model is needed and no per-user value is sent."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    excluded = {int(u) for u in config.get("exclude", [])}
    counts = {
        "remaining": positive_counts(runtime, [u for u in served if u not in excluded]),
        "forgotten": positive_counts(runtime, [u for u in served if u in excluded]),
    }
    return Message(
        content=RecordDict({ARRAYS: ArrayRecord({k: encode_array(v) for k, v in counts.items()})}), reply_to=message
    )


def unlearn_margin(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's membership-margin step on this node: ``margin-sums[k]`` = the sum of the requested (forgotten)
    users' membership margins at ``theta + a_k d`` (config ``steps``, ``bins``, ``dominated``;
    :func:`fedrec_flwr.unlearning.margin.margin_sums`) and ``margin-count``, their number. Node sums only."""
    runtime, users, config = _query_setup(message, context, run_config)
    shared = _shared_arrays(message)
    direction = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    steps = [float(a) for a in config.get("steps", [])]
    with private_state(context, runtime, config, users):
        clients = [make_client(runtime, u, context) for u in users]
        sums, count = margin_sums(
            runtime,
            clients,
            shared,
            direction,
            steps,
            np.asarray(config.get("bins", []), dtype=np.int64),
            np.asarray(config.get("dominated", []), dtype=np.int64),
        )
    metrics = metric_record(
        {"num-users": len(users), "margin-sums": [float(v) for v in sums], "margin-count": count},
        clients[0] if clients else None,
    )
    return Message(content=RecordDict({METRICS: metrics}), reply_to=message)


def unlearn_local_cg(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's Algorithm 1 on this node: each remaining (with ``causal``: affected) user ``u`` solves ``(H_u +
    damping I) x_u = rhs`` by CG on its own Hessian; the reply is ``sum_u w_u x_u`` and ``weight-sum = sum_u w_u``
    with ``w_u = ||∇L_u||`` (with ``causal``; else 1), so the server can normalise over all nodes. A solve that meets
    non-positive curvature (plain CG) or ends with a relative residual above 1 (worse than no step) is left out and
    counted. Config: ``iterations``, ``damping``, ``tolerance``, and optionally ``curvature`` (default
    ``"hessian"``), ``solver`` (``"cg"``) and ``radius`` (each user's trust radius, for ``"steihaug"``)."""
    runtime, clients, config = _remaining_users(message, context, run_config)
    shared = _shared_arrays(message)
    rhs = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    causal = bool(config.get("causal", False))
    total = SparseSum(runtime.layout)
    stats = {
        "weight-sum": 0.0,
        "solved": 0.0,
        "dropped": 0.0,
        "max-iterations": 0.0,
        "max-residual": 0.0,
        "not-converged": 0.0,
        "negative-curvature": 0.0,
        "boundary": 0.0,
    }
    with private_state(context, runtime, config, [c.user for c in clients]):
        for client in clients:
            weight = 1.0
            if causal:
                dense, rows, _ = client.influence_gradient(shared)
                weight = float(
                    np.sqrt(
                        sum(float(np.sum(v**2)) for v in dense.values())
                        + sum(float(np.sum(v**2)) for _, v in rows.values())
                    )
                )
            dense, rows, result = client.influence_solve(
                shared,
                rhs,
                iterations=int(config["iterations"]),
                damping=float(config["damping"]),
                tolerance=float(config["tolerance"]),
                curvature=str(config.get("curvature", "hessian")),
                solver=str(config.get("solver", "cg")),
                radius=float(config["radius"]) if "radius" in config else None,
            )
            stats["not-converged"] += float(not result.converged)
            stats["negative-curvature"] += float(result.negative_curvature)
            stats["boundary"] += float(result.boundary)
            # plain CG's truncated iterate on non-positive curvature, or a step worse than none, is left out; a
            # trust-region step is a descent step of the local model (also along negative curvature) and is kept
            if not result.boundary and (result.negative_curvature or result.residual > 1.0):
                stats["dropped"] += 1.0
                continue
            total.add(dense, rows, weight)
            stats["weight-sum"] += weight
            stats["solved"] += 1.0
            stats["max-iterations"] = max(stats["max-iterations"], float(result.iterations))
            stats["max-residual"] = max(stats["max-residual"], float(result.residual))
    total.count = len(clients)
    return _sparse_reply(message, total, stats, clients[0] if clients else None)


def adversary_gradient_query(
    message: Message, context: Context, run_config: Mapping[str, Any] | None = None
) -> Message:
    """FedAU²'s extra server step of ``h_w`` (:meth:`fedrec_flwr.strategies.adversary.AdversaryServerStep.extra_steps`): the
    mean over the requested users of each one's ``h_w`` gradient (``client.adversary_query_gradient``: the train
    reply's gradient, DSVAE noise included, at the sent ``h_w`` and the user's current embedding, which stays
    unchanged), under ``h_w``'s keys only, with ``num-examples`` = the number of users. No embedding, label or
    count per class leaves the node.

    Raises:
        ConfigError: the message names no user, or the client class has no ``adversary_query_gradient``.
    """
    runtime, users, config = _query_setup(message, context, run_config)
    if not users:
        raise ConfigError("adversary_gradient query: no users requested")
    shared = _shared_arrays(message)
    total: dict[str, np.ndarray] = {}
    with private_state(context, runtime, config, users):
        client = make_client(runtime, users[0], context)
        batched = getattr(client, "adversary_query_mean_gradient", None)  # one batched computation (not "off")
        mean = batched(shared, config, users) if batched is not None else None
        for user in users if mean is None else ():
            client = make_client(runtime, user, context)
            if not hasattr(client, "adversary_query_gradient"):
                raise ConfigError(
                    f"client {_class_name(client)} does not answer the adversary_gradient query "
                    "(use client = 'fedau2' or 'fedau2-gel')"
                )
            for key, grad in client.adversary_query_gradient(shared, config).items():
                total[key] = total.get(key, 0.0) + np.asarray(grad, dtype=np.float64)
    if mean is None:
        mean = {k: v / len(users) for k, v in total.items()}
    arrays = ArrayRecord({k: encode_array(np.asarray(v, dtype=np.float32)) for k, v in mean.items()})
    metrics = metric_record({NUM_EXAMPLES: float(len(users))}, client)
    return Message(content=RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=message)


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
    for action, handler in (
        (UNLEARN_GRADIENT, unlearn_gradient),
        (UNLEARN_AFFECTED, unlearn_affected),
        (UNLEARN_HVP, unlearn_hvp),
        (UNLEARN_LOCAL_CG, unlearn_local_cg),
        (UNLEARN_LOSS, unlearn_loss),
        (UNLEARN_DIAGONAL, unlearn_diagonal),
        (UNLEARN_COUNTS, unlearn_counts),
        (UNLEARN_MARGIN, unlearn_margin),
        (ADVERSARY_GRADIENT, adversary_gradient_query),
    ):
        client_app.query(action)(partial(_with_config, handler, run_config))
    return client_app


def _with_config(handler, run_config, message: Message, context: Context) -> Message:
    _one_thread_per_worker()
    return handler(message, context, run_config=None if context.run_config else run_config)


app = make_client_app()
"""The ClientApp ``flwr run`` loads (``[tool.flwr.app.components] clientapp``)."""
