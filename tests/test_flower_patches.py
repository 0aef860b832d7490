"""``fast-link-state`` (fedrec_flwr/app/flower_patches.py): Flower's simulation link state with a node's next message
looked up by destination first returns what Flower's own lookup returns, on the real ``InMemoryLinkState``."""

from __future__ import annotations

import random

import pytest
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

from fedrec_flwr.app import flower_patches
from fedrec_flwr.config import make_run_config

RUN_ID = 7


@pytest.fixture(autouse=True)
def _flower_method_back(task_identity):  # task_identity: Flower's identity, which Message(...) needs
    yield
    flower_patches.restore()


def _state(num_nodes: int, *runs: int) -> tuple[InMemoryLinkState, list[int]]:
    return flower_patches.simulation_link_state(num_nodes, (RUN_ID, *runs))


def _store(state: InMemoryLinkState, nodes: list[int], plan: list[tuple[int, int | None, bool]]) -> None:
    """Store one message per ``(node index, run id or None for RUN_ID, expired)`` with the id ``m<i>`` (our own ids,
    so that two states hold the same ones)."""
    for i, (node, run_id, expired) in enumerate(plan):
        message = flower_patches.store_message(state, f"m{i}", nodes[node], RUN_ID if run_id is None else run_id)
        if expired:  # then created long enough ago for its lifetime to be over (Flower refuses to store such)
            message.metadata.__dict__["_created_at"] = message.metadata.created_at - message.metadata.ttl - 1.0


def test_the_patched_lookup_returns_what_flowers_returns_poll_by_poll():
    """Two equal states, many messages per node (some expired, some of another run), random polls with and without
    a run id and with limits 1, 2 and none: every poll returns the same messages in the same order, marked
    delivered, on both; after every node was polled once more both states hold the same messages."""
    rng = random.Random(0)
    other_run = RUN_ID + 1
    state_a, nodes_a = _state(12, other_run)
    state_b, nodes_b = _state(12, other_run)
    plan = [(rng.randrange(12), other_run if rng.random() < 0.1 else None, rng.random() < 0.2) for _ in range(120)]
    _store(state_a, nodes_a, plan)
    _store(state_b, nodes_b, plan)
    position = {node: i for i, node in enumerate(nodes_a)}
    position_b = {node: i for i, node in enumerate(nodes_b)}
    returned = 0
    for _ in range(300):
        node = rng.randrange(12)
        limit = rng.choice([1, 1, 2, None])
        run_id = rng.choice([None, RUN_ID, other_run])
        flower = InMemoryLinkState.get_message_ins(state_a, node_id=nodes_a[node], limit=limit, run_id=run_id)
        ours = flower_patches.get_message_ins_by_destination(state_b, node_id=nodes_b[node], limit=limit, run_id=run_id)
        assert [m.metadata.message_id for m in ours] == [m.metadata.message_id for m in flower]
        assert all(m.metadata.delivered_at != "" for m in ours + flower)
        assert {position_b[m.metadata.dst_node_id] for m in ours} <= {node}
        assert {position[m.metadata.dst_node_id] for m in flower} <= {node}
        returned += len(ours)
    assert returned > 50  # the polls found messages, not only empty answers
    for node in range(12):  # one sweep: each node's own expired messages are gone on both
        InMemoryLinkState.get_message_ins(state_a, node_id=nodes_a[node], limit=1)
        flower_patches.get_message_ins_by_destination(state_b, node_id=nodes_b[node], limit=1)
    assert set(state_a.message_ins_store) == set(state_b.message_ins_store)
    assert not {f"m{i}" for i, (_, _, expired) in enumerate(plan) if expired} & set(state_b.message_ins_store)


def test_a_limit_below_one_is_refused_as_by_flower():
    state, _ = _state(2)
    for method in (InMemoryLinkState.get_message_ins, flower_patches.get_message_ins_by_destination):
        with pytest.raises(AssertionError, match="`limit` must be >= 1"):
            method(state, node_id=1, limit=0)


def test_apply_replaces_the_method_of_the_checked_flower_only(monkeypatch):
    """On the installed flwr 1.42 the patch applies and can be undone; another release, or a changed method, keeps
    Flower's own and says why."""
    assert flower_patches.why_not() is None, flower_patches.why_not()
    assert flower_patches.apply() and flower_patches.active()
    assert InMemoryLinkState.get_message_ins is flower_patches.get_message_ins_by_destination
    flower_patches.restore()
    assert not flower_patches.active()
    import flwr

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    assert "flwr 1.43.0 is not the 1.42.x series" in flower_patches.why_not()
    assert not flower_patches.apply() and not flower_patches.active()
    monkeypatch.undo()
    monkeypatch.setattr(flower_patches, "PATCHED_SOURCE_SHA256", "f" * 64)
    assert "is not the one the patch was checked against" in flower_patches.why_not()
    assert not flower_patches.apply()


def test_the_run_config_turns_it_on_by_default_and_off_by_key():
    assert make_run_config().fast_link_state is True
    assert make_run_config(**{"fast-link-state": False}).fast_link_state is False
