"""``max-in-flight``: at most a window of messages stored in the SuperLink at a time (fedrec_flwr/app/message_window.py)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedrec_flwr.app.message_window import (
    MIN_WINDOW,
    WindowedGrid,
    send_and_receive,
    simulation_window,
    window_for,
    windowed,
)
from fedrec_flwr.config import RunConfig, default_mapping
from fedrec_flwr.errors import ConfigError


class FakeLink:
    """A SuperLink stand-in: each pushed message is answered after ``delay`` pulls (``None``: never); records the
    largest number of messages it held at once."""

    def __init__(self, delay: dict[int, int | None] | None = None, refuse: set[int] = frozenset()) -> None:
        self.delay = delay or {}
        self.refuse = refuse
        self.stored: dict[str, tuple[Message, int]] = {}
        self.most_stored = 0
        self.pushed: list[int] = []
        self.pulls = 0
        self.next_id = 0

    def push(self, messages):
        ids = []
        for m in messages:
            node = m.metadata.dst_node_id
            self.pushed.append(node)
            if node in self.refuse:
                continue
            self.next_id += 1
            mid = f"m{self.next_id}"
            self.stored[mid] = (m, self.pulls)
            ids.append(mid)
        self.most_stored = max(self.most_stored, len(self.stored))
        return ids

    def pull(self, ids):
        self.pulls += 1
        out = []
        for mid in list(ids):
            if mid not in self.stored:
                continue
            m, at = self.stored[mid]
            wait = self.delay.get(m.metadata.dst_node_id, 0)
            if wait is not None and self.pulls - at > wait:
                reply = Message(RecordDict({"config": ConfigRecord({"node": m.metadata.dst_node_id})}), reply_to=m)
                reply.metadata.__dict__["_reply_to_message_id"] = mid
                out.append(reply)
                del self.stored[mid]
        return out


@pytest.fixture(autouse=True)
def _identity(task_identity):
    return task_identity


def messages(n: int) -> list[Message]:
    return [
        Message(RecordDict({"config": ConfigRecord({"i": i})}), dst_node_id=i + 1, message_type="train")
        for i in range(n)
    ]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def replied_nodes(replies) -> list[int]:
    return sorted(int(r.content["config"]["node"]) for r in replies)


def test_every_message_is_answered_and_no_more_than_the_window_is_ever_stored():
    link, clock = FakeLink(delay={n: n % 3 for n in range(1, 51)}), Clock()
    replies = send_and_receive(
        link.push, link.pull, messages(50), window=8, timeout=60.0, clock=clock, sleep=clock.sleep
    )
    assert replied_nodes(replies) == list(range(1, 51))
    assert link.most_stored == 8
    assert link.pushed == list(range(1, 51))  # in the batch's order, each once


def test_without_a_window_all_would_be_stored_at_once():
    link, clock = FakeLink(), Clock()
    send_and_receive(link.push, link.pull, messages(50), window=50, timeout=None, clock=clock, sleep=clock.sleep)
    assert link.most_stored == 50


def test_the_deadline_counts_for_the_whole_batch_and_unsent_messages_are_never_pushed():
    # node 1 never answers and holds the only slot: nothing after it is sent before the deadline
    link, clock = FakeLink(delay={1: None}), Clock()
    replies = send_and_receive(
        link.push, link.pull, messages(5), window=1, timeout=1.0, pull_interval=0.1, clock=clock, sleep=clock.sleep
    )
    assert replies == []
    assert link.pushed == [1]
    assert 1.0 <= clock.t <= 1.1 + 1e-9  # returns within one pull interval of the deadline


def test_a_stuck_node_holds_one_slot_while_the_others_go_through():
    link, clock = FakeLink(delay={3: None}), Clock()
    replies = send_and_receive(
        link.push, link.pull, messages(20), window=4, timeout=5.0, clock=clock, sleep=clock.sleep
    )
    assert replied_nodes(replies) == [n for n in range(1, 21) if n != 3]


def test_a_message_the_link_refuses_frees_its_slot():
    link, clock = FakeLink(refuse={2, 4}), Clock()
    replies = send_and_receive(link.push, link.pull, messages(6), window=2, timeout=5.0, clock=clock, sleep=clock.sleep)
    assert replied_nodes(replies) == [1, 3, 5, 6]


def test_a_window_below_one_is_refused():
    link = FakeLink()
    with pytest.raises(ValueError, match="max-in-flight"):
        send_and_receive(link.push, link.pull, messages(2), window=0, timeout=None)


def test_auto_windows_only_flowers_simulation_grid():
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from fedrec_flwr.serial import SerialGrid

    sim = InMemoryGrid.__new__(InMemoryGrid)  # no link state needed to pick the window
    serial = SerialGrid.__new__(SerialGrid)
    assert window_for(sim, 0) == simulation_window() >= MIN_WINDOW
    assert window_for(serial, 0) is None and windowed(serial, 0) is serial
    assert window_for(serial, 16) == 16
    wrapped = windowed(sim, 0)
    assert isinstance(wrapped, WindowedGrid) and wrapped.grid is sim and wrapped.window == simulation_window()


def test_max_in_flight_is_declared_and_validated():
    mapping = default_mapping()
    assert mapping["max-in-flight"] == 0
    assert RunConfig.from_mapping({**mapping, "max-in-flight": 64}).max_in_flight == 64
    with pytest.raises(ConfigError, match="max-in-flight"):
        RunConfig.from_mapping({**mapping, "max-in-flight": -1})


def test_the_auto_window_grows_with_the_cores_and_never_falls_below_the_minimum(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert simulation_window() == 256
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert simulation_window() == MIN_WINDOW
