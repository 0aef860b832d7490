"""Run the ServerApp and ClientApp of this package in one process, without a SuperLink or Ray.

:class:`SerialGrid` is a :class:`flwr.serverapp.Grid` (Flower's interface between a ServerApp and its nodes) that
delivers each message straight to the ClientApp, in this process, with one persistent :class:`flwr.app.Context` per
node (its ``node_config`` holds ``partition-id`` / ``num-partitions``, its ``state`` lives for the whole run). Every
line of the apps, the strategy and the clients is the same as under ``flwr run``; only transport and scheduling
differ. Because replies are put in canonical order by the strategy and all randomness is derived from the seed, a
serial run gives the same model as the Ray simulation (tested, bit for bit, for each client family in
``tests/test_serial_equals_ray.py``).

Use it for experiments with many runs on one machine (``experiments/``), for debugging with a plain debugger, and in
tests. A failing ClientApp handler becomes an error reply, as in Flower, so the strategy's failure handling is
exercised too.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from collections.abc import Iterable, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run, RunStatus
from flwr.supercore.task_identity import TaskIdentity

from fedrec_flwr.config import RunConfig

log = logging.getLogger(__name__)

_FLWR = version("flwr")
if not _FLWR.startswith("1.42."):  # message ids and node ids are set through Metadata's private fields below
    raise ImportError(
        f"fedrec_flwr.serial is written against flwr 1.42 (found {_FLWR}); check SerialGrid.push_messages"
    )

SERVER_NODE_ID = 1
"""Node id of the server side (Flower's ``SUPERLINK_NODE_ID``)."""


class SerialGrid(Grid):
    """A Flower ``Grid`` that runs each message's ClientApp handler in this process (see the module docstring).

    Args:
        client_app: the ClientApp to deliver messages to.
        num_nodes: number of nodes; node ``k`` (``k = 0..num_nodes-1``) gets ``partition-id = k`` and node id
            ``1000 + k``.
        run_config: the run config each node's context carries (kebab-case mapping).
        run_id: the run's id.
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: Mapping[str, Any], run_id: int = 1) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        self.client_app = client_app
        self._run = Run(
            run_id=run_id,
            fab_id="",
            fab_version="",
            fab_hash="",
            override_config=dict(run_config),
            pending_at="",
            starting_at="",
            running_at="",
            finished_at="",
            status=RunStatus("running", "", ""),
            flwr_aid="",
            federation_id="",
            primary_task_id=None,
            bytes_sent=0,
            bytes_recv=0,
            clientapp_runtime=0.0,
        )
        self.contexts = {
            1000 + k: Context(
                run_id=run_id,
                node_id=1000 + k,
                node_config={"partition-id": k, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for k in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}
        self.nodes_settled = True  # every node exists from the start (the identify phase need not wait)
        self.messages_delivered = 0
        self.stopped: set[int] = set()
        self._next_node_id = 1000 + num_nodes

    # ------------------------------------------------------------------------------------------------ faults
    def stop_node(self, node_id: int) -> Context:
        """Emulate a SuperNode that died: it leaves :meth:`get_node_ids`, its in-memory ``context.state`` is gone,
        and every later message to it gets the error reply Flower's SuperLink sends for a node that stopped sending
        heartbeats (``ErrorCode.NODE_UNAVAILABLE``). Returns its last context."""
        self.stopped.add(int(node_id))
        return self.contexts.pop(int(node_id))

    def start_node(self, partition_id: int) -> int:
        """Emulate a SuperNode (re)started with ``partition-id``: a new node id, as the SuperLink gives, and an empty
        ``context.state`` (only a ``client-state-dir`` brings its users' private state back). Returns its id."""
        node_id = self._next_node_id
        self._next_node_id += 1
        self.contexts[node_id] = Context(
            run_id=self._run.run_id,
            node_id=node_id,
            node_config={"partition-id": int(partition_id), "num-partitions": len(self.contexts) + 1},
            state=RecordDict(),
            run_config=dict(self._run.override_config),
        )
        return node_id

    # ------------------------------------------------------------------------------------------------ Grid API
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message now; its reply (or an error reply) is kept until pulled."""
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            message.metadata.__dict__["_src_node_id"] = SERVER_NODE_ID
            message.metadata.__dict__["_run_id"] = self._run.run_id
            context = self.contexts.get(message.metadata.dst_node_id)
            if context is not None:
                self._replies[message_id] = self._deliver(message, context)
                self.messages_delivered += 1
            elif message.metadata.dst_node_id in self.stopped:
                self._replies[message_id] = Message(
                    Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable (the node was stopped)"),
                    reply_to=message,
                )
            else:
                raise ValueError(f"no node with id {message.metadata.dst_node_id}")
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(list(self.push_messages(messages)))

    # ------------------------------------------------------------------------------------------------ delivery
    def _deliver(self, message: Message, context: Context) -> Message:
        saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = self._run.run_id, context.node_id, 2
        try:
            return self.client_app(message, context)
        except Exception as exc:  # noqa: BLE001 - a failing client becomes an error reply, as in Flower
            log.debug("node %d failed: %s", context.node_id, traceback.format_exc())
            return Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=message)
        finally:
            TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def run_serial(
    run_config: Mapping[str, Any] | RunConfig,
    *,
    client_app: ClientApp | None = None,
    return_grid: bool = False,
    on_round=None,
) -> Path | tuple[Path, SerialGrid]:
    """Run one federated experiment in this process (the ServerApp's :func:`~fedrec_flwr.app.server_app.main` over a
    :class:`SerialGrid` with as many nodes as ``users-per-node`` implies).

    Args:
        run_config: a complete kebab-case run config (e.g. ``make_run_config(...).to_dict()``) or a ``RunConfig``.
        client_app: the ClientApp (default: this package's, built for ``run_config``).
        return_grid: also return the grid, whose node contexts hold every user's private state after the run (for
            simulation-only analyses such as loss landscapes; a deployment never exposes them).
        on_round: ``callable(view)`` run after every round with a :class:`~fedrec_flwr.app.server_app.RoundView` (round,
            grid, strategy, arrays; e.g. an attack on the users' embeddings as training goes). With an attribute
            adversary (FedAU²), :class:`fedrec_flwr.adversary.DiagnosticsHook` runs first and writes
            ``adversary-diagnostics.csv`` (from the nodes' private state and the split's labels: simulation only).
    Returns:
        The results folder (``results-dir/<run-name>/``), and the grid if ``return_grid``.
    Raises:
        ConfigError / DataError: bad config or data (:func:`fedrec_flwr.app.preflight.preflight`: before any message, and
            before the results folder is created).
    """
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.app.preflight import preflight
    from fedrec_flwr.app.server_app import main

    plan = preflight(run_config, with_data=True)  # every check that needs no message, before the first one
    config, runtime = plan.config, plan.runtime
    mapping = config.to_dict()
    num_nodes = -(-runtime.split.num_users // config.users_per_node)
    grid = SerialGrid(client_app or make_client_app(mapping), num_nodes, mapping)
    if (
        config.adversary != "none" and runtime.protected is not None
    ):  # FedAU²: per-round diagnostics of h_w (evaluation only)
        from fedrec_flwr.adversary import DiagnosticsHook

        on_round = DiagnosticsHook(runtime, on_round)
    context = Context(run_id=1, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(), run_config=mapping)
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SERVER_NODE_ID, 1
    started = time.perf_counter()
    try:
        folder = main(grid, context, mapping, on_round=on_round)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    log.info("serial run finished in %.1f s (%d messages)", time.perf_counter() - started, grid.messages_delivered)
    return (folder, grid) if return_grid else folder
