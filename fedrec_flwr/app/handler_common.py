"""What the ClientApp's handlers share: reading a message (the node's requested users, the shared arrays, the
config), the users' private records around one message (:func:`private_state`), the client object of one user
(:func:`make_client`), and the records a reply is packed in (:func:`metric_record`, :func:`sparse_reply`), with the
checks that keep a client's values inside what Flower's records carry.

The train and evaluate handlers (:mod:`fedrec_flwr.app.client_app`) and the query handlers
(:mod:`fedrec_flwr.app.queries`) are built from these, so each handler only unpacks its message, calls the client
algorithm and packs the reply.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedrec_flwr.app.runtime import Runtime, get_runtime, node_users
from fedrec_flwr.arrays import decode_array, encode_array
from fedrec_flwr.registry import resolve
from fedrec_flwr.state.client_state import (
    DURABLE_ROUND_KEY,
    ClientStateError,
    ClientStateStore,
    nonfinite_records,
    state_folder,
    user_record_keys,
)
from fedrec_flwr.wire import (
    ARRAYS,
    CONFIG,
    METRICS,
    SparseSum,
)

log = logging.getLogger(__name__)


class RecordValueError(TypeError):
    """A client returned a value Flower's records cannot carry (the message names the key and the client class)."""


def class_name(client) -> str:
    """``module:QualName`` of a client object or class, for error messages."""
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
        f"client {class_name(client)}: metric {key!r} = {value!r} ({type(value).__name__}) is "
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
            raise RecordValueError(f"client {class_name(client)}: metric key {key!r} is not a string")
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


def requested_users(message: Message, served: range) -> list[int]:
    """The message config's ``users`` (all of ``served`` when absent).

    Raises:
        ValueError: a requested user is not served by this node.
    """
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


def shared_arrays(message: Message) -> dict:
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


def query_setup(message: Message, context: Context, run_config):
    """``(runtime, requested users, message config)`` of a query naming its users (all served users if it names
    none; :func:`requested_users`)."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    return runtime, requested_users(message, served), config


def sparse_reply(message: Message, total: SparseSum, metrics: dict, client=None) -> Message:
    """A reply carrying the row-sparse node sum ``total`` (:meth:`fedrec_flwr.wire.SparseSum.pack`) and ``metrics``
    with ``num-users`` = ``total.count``."""
    arrays = ArrayRecord({k: encode_array(v) for k, v in total.pack().items()})
    metrics = metric_record({"num-users": total.count, **metrics}, client)
    return Message(content=RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=message)
