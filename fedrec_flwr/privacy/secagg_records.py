"""The SecAgg+ stages of :mod:`fedrec_flwr.privacy.secagg` on Flower messages: one query action, ``"secagg"``.

Wire format (every message ``message_type = "query.secagg"``):

* **server -> node**: a ``ConfigRecord`` under ``"secagg"``: ``"stage"`` (one of :data:`secagg.STAGES`) and that
  stage's config (ints, floats, strings, bytes and lists of them);
* **node -> server**: the same ``ConfigRecord`` with the stage's reply, and for the masked-vector stage an
  ``ArrayRecord`` under ``"secagg-masked"`` of uint32 arrays, keyed as the summed arrays (plus ``"secagg.count"`` and
  ``"secagg.clipped"``).

A node's protocol state is the ``ConfigRecord`` ``context.state.config_records["secagg"]``, so its secrets stay on the
node between stages (and never travel: they are not in any reply).

Server side, :func:`grid_sender` turns a Flower ``Grid`` into the ``send`` callable of :func:`secagg.secure_sum`::

    total = secure_sum(grid_sender(grid, timeout=60.0), node_ids, {"adversary.head.weight": (2, 64)}, threshold=...)

Node side, a ClientApp query handler unpacks, calls the stage's handler and packs the reply with :func:`answer`::

    @app.query(ACTION)
    def secagg_query(message, context):
        return Message(answer(message.content, context.state, lambda: my_arrays(context)), reply_to=message)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedrec_flwr.privacy import secagg
from fedrec_flwr.wire import SECURE_AGGREGATION

log = logging.getLogger(__name__)

ACTION = SECURE_AGGREGATION
MESSAGE_TYPE = f"{MessageType.QUERY}.{ACTION}"
CONFIG_KEY = "secagg"  # the ConfigRecord of every message, and of the node's context.state
MASKED_KEY = "secagg-masked"  # the ArrayRecord of a masked-vector reply


def to_content(stage: str, payload: Mapping[str, Any]) -> RecordDict:
    """A stage's config or reply as a message content: config values in a ConfigRecord, numpy arrays (the masked
    vector) in an ArrayRecord."""
    arrays = {k: v for k, v in payload.items() if isinstance(v, np.ndarray)}
    config = ConfigRecord({"stage": stage, **{k: v for k, v in payload.items() if k not in arrays}})
    content = RecordDict({CONFIG_KEY: config})
    if arrays:
        content[MASKED_KEY] = ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    return content


def from_content(content: RecordDict) -> tuple[str, dict[str, Any]]:
    """The ``(stage, payload)`` of a message content built by :func:`to_content`.

    Raises:
        secagg.SecAggError: the content has no ``"secagg"`` ConfigRecord or names an unknown stage.
    """
    if CONFIG_KEY not in content.config_records:
        raise secagg.SecAggError(f"secagg message: no {CONFIG_KEY!r} ConfigRecord")
    payload = dict(content.config_records[CONFIG_KEY])
    stage = payload.pop("stage", None)
    if stage not in secagg.STAGES:
        raise secagg.SecAggError(f"secagg message: unknown stage {stage!r}")
    if MASKED_KEY in content.array_records:
        payload.update({k: a.numpy() for k, a in content.array_records[MASKED_KEY].items()})
    return stage, payload


def grid_sender(grid: Grid, *, timeout: float | None = None, group_id: str = "") -> secagg.Send:
    """The ``send`` callable of :func:`secagg.secure_sum` over ``grid.send_and_receive``: one query message per node,
    every reply that came back without error and for the stage asked (a node with an error reply, or none within
    ``timeout`` seconds, has dropped)."""

    def send(stage: str, contents: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        messages = [
            Message(to_content(stage, config), dst_node_id=nid, message_type=MESSAGE_TYPE, group_id=group_id)
            for nid, config in contents.items()
        ]
        replies = {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            nid = int(reply.metadata.src_node_id)
            if reply.has_error():
                log.warning("secagg %s: node %s replied with an error: %s", stage, nid, reply.error.reason)
                continue
            try:
                reply_stage, payload = from_content(reply.content)
            except secagg.SecAggError as err:
                log.warning("secagg %s: node %s sent a malformed reply: %s", stage, nid, err)
                continue
            if reply_stage == stage and nid in contents:
                replies[nid] = payload
        return replies

    return send


def answer(
    content: RecordDict,
    node_state: RecordDict,
    arrays: Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]] | None = None,
    *,
    rng: np.random.Generator | None = None,
) -> RecordDict:
    """A node's reply content to a ``"query.secagg"`` message: run the stage's handler of :mod:`secagg` on the state
    ``node_state.config_records["secagg"]`` (created empty when absent) and pack its reply.

    ``arrays``: the node's ``{key: float array}`` to sum, or a function returning them (called only for the
    masked-vector stage). ``rng``: the stochastic rounding's generator (see :func:`secagg.collect_masked_vectors`).

    Raises:
        secagg.SecAggError: the message or the stage breaks the protocol (the handler's errors).
    """
    stage, config = from_content(content)
    if CONFIG_KEY not in node_state.config_records:
        node_state.config_records[CONFIG_KEY] = ConfigRecord()
    state = dict(node_state.config_records[CONFIG_KEY])
    if stage == secagg.COLLECT_MASKED_VECTORS:
        values = arrays() if callable(arrays) else arrays
        if values is None:
            raise secagg.SecAggError("secagg: the node has no arrays to contribute")
        reply = secagg.collect_masked_vectors(state, config, values, rng=rng)
    else:
        reply = secagg.HANDLERS[stage](state, config, None)
    node_state.config_records[CONFIG_KEY] = ConfigRecord(state)
    return to_content(stage, reply)
