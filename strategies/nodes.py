"""Which node serves which user, and the messages that reach them: topology refresh when SuperNodes (re)join, the
canonical reply order and per-node message building (:class:`fedrec_flwr.wire.Topology`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedrec_flwr.wire import ARRAYS, CONFIG, Topology

log = logging.getLogger("fedrec_flwr.strategies.item_fedavg")  # the strategy's logger: its lines keep their source


def refresh_topology(
    topology: Topology, grid: Grid, rejected: set[int], timeout: float
) -> tuple[Topology | None, list[int]]:
    """Let SuperNodes that joined since ``topology`` was learned take over their users (a restarted SuperNode gets a
    new node id from the SuperLink, so without this its users would stay mapped to the dead id). Costs one
    ``get_node_ids`` call when nothing changed.

    A new node (not in ``topology`` nor ``rejected``) is sent the ``identify`` query (waiting at most ``min(timeout,
    60)`` s); if it reports the run's dataset (same fingerprint and users), the block of users it serves is mapped to
    it and logged. A node that fails to identify, or reports another dataset, is logged and added to ``rejected`` (not
    asked again).

    Returns:
        ``(new topology, joined node ids)``; the topology is ``None`` when no node was new.
    """
    known = {int(n) for n in np.unique(topology.user_to_node)} | rejected
    new = sorted(int(n) for n in grid.get_node_ids() if int(n) not in known)
    if not new:
        return None, []
    from fedrec_flwr.app.server_app import identify_nodes

    facts, errors = identify_nodes(grid, new, timeout=min(timeout, 60.0))
    for node, reason in errors:
        log.warning("node %d joined but cannot serve this run: %s", node, reason)
        rejected.add(node)
    joined = []
    user_to_node = topology.user_to_node.copy()
    for fact in facts:
        node = int(fact["node"])
        if fact.get("fingerprint") != topology.fingerprint or fact.get("num-users-total") != topology.num_users:
            log.warning(
                "node %d joined with another dataset (%s users, fingerprint %s); ignored",
                node,
                fact.get("num-users-total"),
                fact.get("fingerprint"),
            )
            rejected.add(node)
            continue
        block = slice(int(fact["first-user"]), int(fact["first-user"]) + int(fact["num-users"]))
        replaced = sorted({int(n) for n in user_to_node[block]})
        user_to_node[block] = node
        joined.append(node)
        log.info(
            "node %d joined: partition-id %s, users %d..%d (before: node %s)",
            node,
            fact.get("partition-id"),
            block.start,
            block.stop - 1,
            ", ".join(map(str, replaced)),
        )
    return Topology(user_to_node, topology.fingerprint), joined


def canonical_order(replies: Iterable[Message], topology: Topology) -> list[Message]:
    """Replies sorted by the first user their node serves (a node ``topology`` does not know first): float sums then
    do not depend on arrival order, so runs with any number of workers give bit-identical models."""
    first_user: dict[int, int] = {}
    for user, node in enumerate(topology.user_to_node.tolist()):
        first_user.setdefault(int(node), user)
    return sorted(replies, key=lambda m: first_user.get(int(m.metadata.src_node_id), -1))


def node_messages(
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    groups: Mapping[int, list[int]],
    kind: str,
    message_config: Mapping,
) -> list[Message]:
    """One ``kind`` message per node of ``groups`` (node id -> its users), carrying ``arrays`` and a config record of
    ``message_config`` (the run's keys), ``config``, ``server-round`` and the node's ``users``."""
    messages = []
    for node_id, users in groups.items():
        node_config = ConfigRecord({**message_config, **dict(config)})
        node_config["server-round"] = server_round
        node_config["users"] = users
        content = RecordDict({ARRAYS: arrays, CONFIG: node_config})
        messages.append(Message(content=content, message_type=kind, dst_node_id=node_id))
    return messages


def with_adversary_config(config: ConfigRecord, adversary_step) -> ConfigRecord:
    """The round's train config plus the keys FedAU²'s server step adds to it (the adaptive rule's ``eps``:
    :meth:`.adversary.AdversaryServerStep.train_config`); ``config`` itself without a step or with nothing to add."""
    extra = {} if adversary_step is None else adversary_step.train_config()
    return ConfigRecord({**dict(config), **extra}) if extra else config
