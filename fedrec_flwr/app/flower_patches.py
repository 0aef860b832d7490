"""A cost-only patch to Flower 1.42's simulation engine: a node's next message found by destination first.

Why (the per-message cost at scale): Flower's simulation engine hands messages to its client actors from
one thread (``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``) that, every 0.1 s, asks the link state
for the next message of *every* registered node in turn; ``InMemoryLinkState.get_message_ins(node_id, limit=1)``
answers by running its validity check (``_check_stored_messages``: the message's expiry, both nodes' federation
membership, under the state's lock) on *every* stored message before it looks at the message's destination. A sweep
therefore costs ``nodes x stored messages`` checks, each several microseconds: with the ``max-in-flight`` window of
32 (:mod:`fedrec_flwr.app.message_window`) about 0.2 s a sweep at 943 nodes and 1.7 s at 8,072, and a sweep delivers at
most the window's messages, so the identify phase of the 8,072-node Amazon-Video run took 380 s (47 ms a node)
against 16 ms a node at 943 (``experiments/bench/README.md``, link-state lookup).

What: :func:`get_message_ins_by_destination` is the same method with the destination, delivery and run tests made
*before* the validity check, so the check runs only on the messages that could be returned. What it returns, and the
``delivered_at`` marks it sets, are Flower's for the same state (``tests/test_flower_patches.py`` runs both on equal
states, expired messages included). The one difference is *when* an invalid (expired) message of *another* node is
deleted: Flower deleted it as soon as any node was polled; with the patch it is deleted when its own node is polled
(in the same sweep: the sweep polls every node) or when the ServerApp pulls its reply (``get_message_res`` checks the
messages it is asked for and reports a deleted one as expired, as before).

Where it applies: only to ``flwr`` 1.42.x and only while the installed ``InMemoryLinkState.get_message_ins`` is the
one this patch was written against (its source's SHA-256, :data:`PATCHED_SOURCE_SHA256`); anything else keeps
Flower's own method and logs why (:func:`apply`). The ServerApp applies it on Flower's simulation engine (an
``InMemoryGrid``) unless run-config ``fast-link-state = false``; it patches the class in the simulation process, so
Flower's own sweep thread, in the same process, uses it from its next call. A deployed SuperLink is another process
and is never touched.
"""

from __future__ import annotations

import hashlib
import inspect
import logging

from flwr.app import Message
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.supercore.date import now  # what Flower's method stamps delivered_at with

log = logging.getLogger(__name__)

FLWR_SERIES = "1.42."
"""The Flower release series the patch was written and tested against."""

PATCHED_SOURCE_SHA256 = "6547c8dcbc62e12f5b2aa5c69f4de8c7c7072c10d6c0876512cf37197d941056"
"""SHA-256 of the source of flwr 1.42.0's ``InMemoryLinkState.get_message_ins``: the patch replaces that method only
while the installed one is byte for byte the one it was checked against."""

ORIGINAL_GET_MESSAGE_INS = InMemoryLinkState.get_message_ins
"""Flower's own method, kept so the patch can be undone (:func:`restore`) and compared with (the tests)."""


def get_message_ins_by_destination(
    self: InMemoryLinkState, node_id: int, limit: int | None, *, run_id: int | None = None
) -> list[Message]:
    """``InMemoryLinkState.get_message_ins`` with the cheap tests first: the undelivered messages for ``node_id`` (of
    run ``run_id`` if given) that pass Flower's validity check, at most ``limit``, in storage order, marked delivered.

    Raises:
        AssertionError: ``limit`` is below 1 (as Flower's).
    """
    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    found: list[Message] = []
    with self.lock:
        # the destination test alone first, in one pass (most polls find nothing); then Flower's tests in its order
        mine = [(msg_id, msg) for msg_id, msg in self.message_ins_store.items() if msg.metadata.dst_node_id == node_id]
        for msg_id, msg in mine:
            meta = msg.metadata
            if meta.delivered_at != "" or (run_id is not None and meta.run_id != run_id):
                continue
            self._check_stored_messages({msg_id})  # may delete it (expired, or a node left the federation)
            if self.message_ins_store.get(msg_id) is msg:
                found.append(msg)
            if limit and len(found) == limit:
                break
    delivered_at = now().isoformat()
    for msg in found:
        msg.metadata.delivered_at = delivered_at
    return found


def simulation_link_state(num_nodes: int, run_ids: tuple[int, ...] = (1,)) -> tuple[InMemoryLinkState, list[int]]:
    """A link state built as ``flwr.simulation.run_simulation`` builds it: ``num_nodes`` registered nodes (returned
    in partition-id order) and the runs ``run_ids`` pre-registered with their primary tasks. For the tests and
    ``experiments/bench/bench_link_state.py``, which store messages in it and poll it as Flower's engine does."""
    from dataclasses import replace

    from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
    from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.superlink.federation import NoOpFederationManager

    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    for run_id in run_ids:
        task_id = 1000 + run_id
        state.run_ids[run_id] = RunRecord(
            run=replace(Run.create_empty(run_id=run_id), primary_task_id=task_id, federation_id=NOOP_FEDERATION_ID)
        )
        state.task_store[task_id] = Task(task_id=task_id, run_id=run_id)
    mapping = _register_nodes(num_nodes, factory)
    return state, sorted(mapping, key=mapping.get)


def store_message(state: InMemoryLinkState, message_id: str, dst_node_id: int, run_id: int) -> Message:
    """Store a small query message for ``dst_node_id`` under our own ``message_id`` as ``InMemoryGrid.push_messages``
    would (Flower's ``store_message_ins`` checks); returns it. Needs Flower's task identity set (a running app's, or
    ``flwr.supercore.task_identity.TaskIdentity`` set by hand).

    Raises:
        ValueError: Flower refused to store it.
    """
    from flwr.app import ConfigRecord, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID

    message = Message(
        RecordDict({"c": ConfigRecord({"id": message_id})}), dst_node_id=dst_node_id, message_type="query.link_state"
    )
    message.metadata.__dict__.update({"_message_id": message_id, "_run_id": run_id, "_src_node_id": SUPERLINK_NODE_ID})
    if state.store_message_ins(message) != message_id:
        raise ValueError(f"Flower's link state refused message {message_id!r} for node {dst_node_id}")
    return message


def source_digest() -> str:
    """SHA-256 of the source of Flower's own ``InMemoryLinkState.get_message_ins`` as installed."""
    return hashlib.sha256(inspect.getsource(ORIGINAL_GET_MESSAGE_INS).encode()).hexdigest()


def why_not() -> str | None:
    """Why the patch does not apply to the installed Flower (``None``: it does)."""
    import flwr

    version = getattr(flwr, "__version__", "?")
    if not version.startswith(FLWR_SERIES):
        return f"flwr {version} is not the {FLWR_SERIES}x series the patch was checked against"
    try:
        digest = source_digest()
    except (OSError, TypeError) as err:
        return f"the source of InMemoryLinkState.get_message_ins cannot be read ({err})"
    if digest != PATCHED_SOURCE_SHA256:
        return f"InMemoryLinkState.get_message_ins of flwr {version} is not the one the patch was checked against"
    return None


def apply() -> bool:
    """Replace ``InMemoryLinkState.get_message_ins`` by :func:`get_message_ins_by_destination` where :func:`why_not`
    finds nothing against it; returns whether the patch is now in place (logs why not, once per call)."""
    reason = why_not()
    if reason is not None:
        log.info("fast-link-state: Flower's own message lookup kept: %s", reason)
        return False
    InMemoryLinkState.get_message_ins = get_message_ins_by_destination
    return True


def restore() -> None:
    """Put Flower's own ``InMemoryLinkState.get_message_ins`` back."""
    InMemoryLinkState.get_message_ins = ORIGINAL_GET_MESSAGE_INS


def active() -> bool:
    """Whether the patch is in place."""
    return InMemoryLinkState.get_message_ins is get_message_ins_by_destination
