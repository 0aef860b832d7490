"""At most ``max-in-flight`` messages stored in the SuperLink at a time (the per-message cost at scale).

Why: Flower 1.42's simulation engine hands messages to its client actors from one thread
(``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``) that, every 0.1 s, asks the link state for each
node's next message; ``InMemoryLinkState.get_message_ins`` answers by checking *every* stored message (expiry,
federation membership) under the state's lock. A message stays stored until the ServerApp pulls its reply, so a
round that sends to ``N`` nodes at once costs ``N x N`` checks a sweep while it lasts: about 0.9 million at 943 nodes,
which keeps a core and the GIL busy and delays the actors' replies (``py-spy`` of the driver, ML-100K, 943 one-user
nodes: 68% of its samples in that loop). :func:`send_and_receive` pushes at most ``window`` messages, and one more each
time a reply comes back, so a sweep costs ``N x window`` checks. Replies come back in arrival order, as from
Flower's own ``send_and_receive`` (the strategies sort what needs an order). ``fast-link-state``
(:mod:`fedrec_flwr.app.flower_patches`) makes each of those checks about ten times cheaper; with it a larger window
was still slower on two cores (``experiments/bench/README.md``, link-state lookup).

Where it applies (``max-in-flight``, :func:`window_for`): ``0`` (the default) is *auto*: :func:`simulation_window`
(16 messages per CPU core, at least 32) on Flower's in-process simulation engine (``flwr.superlink.grid.InMemoryGrid``, what ``flwr run`` with the Ray backend
uses) and no window anywhere else; a deployed SuperLink (``GrpcGrid``), whose SuperNodes pull on their own schedule,
keeps every message in flight unless a positive ``max-in-flight`` asks for a window. :class:`~fedrec_flwr.serial.
SerialGrid` runs every message synchronously and never needs one.

The round's deadline is unchanged: ``timeout`` (``round-timeout``) counts from the first push for the whole batch, as
in Flower's ``Grid.send_and_receive``; a message still unsent at the deadline is never pushed, and like an unanswered
one it is simply missing from the replies (the strategies count it as a failure). A node that never replies holds
one slot of the window until then.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from itertools import islice

from flwr.app import Message
from flwr.serverapp import Grid

WINDOW_PER_CPU = 16
"""``max-in-flight = 0``'s window on Flower's simulation engine is this many messages per CPU core of the machine,
at least :data:`MIN_WINDOW` (ours; ``experiments/bench/README.md``, message window). Measured on 2 cores only (943
one-user nodes, all sampled; seconds per round, interleaved): every message at once 18.6 / 19.6 s, window 32 11.5 /
13.3 s, 64 14.2 / 13.8 s. A sweep checks ``nodes x window`` messages and delivers at most ``window`` new ones, so a
machine with more client actors needs a larger window to keep them busy; 16 per core is a guess for such machines
(not measured: no larger machine was available)."""

MIN_WINDOW = 32


def simulation_window() -> int:
    """The auto window on this machine: ``max(MIN_WINDOW, WINDOW_PER_CPU x usable CPU cores)``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(MIN_WINDOW, WINDOW_PER_CPU * cores)


def send_and_receive(
    push: Callable[[Iterable[Message]], Iterable[str]],
    pull: Callable[[Iterable[str]], Iterable[Message]],
    messages: Iterable[Message],
    *,
    window: int,
    timeout: float | None,
    pull_interval: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_reply: Callable[[int], None] | None = None,
) -> list[Message]:
    """Send ``messages`` with at most ``window`` pushed and unanswered at any time; return the replies.

    Args:
        push: a grid's ``push_messages`` (returns the stored messages' ids, in order; a message it refuses gets none).
        pull: a grid's ``pull_messages`` (the replies that have arrived for the given ids).
        messages: the batch (e.g. one round's train messages).
        window: at most this many in flight (``>= 1``).
        timeout: seconds from the first push after which the call returns what it has (``None``: wait for all).
        pull_interval: seconds between pulls when nothing came back (Flower's ``InMemoryGrid`` uses 0.1).
        clock, sleep: injectable for tests.
        on_reply: called with the number of replies received so far each time more arrive (progress reports only,
            e.g. :class:`fedrec_flwr.progress.ReplyProgress`).

    Returns:
        The replies, in arrival order; a message never answered (or never sent: deadline) is missing.

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"max-in-flight window must be >= 1, got {window}")
    pending = iter(list(messages))
    deadline = None if timeout is None else clock() + timeout
    in_flight: set[str] = set()
    unsent = True
    replies: list[Message] = []

    def top_up() -> None:
        nonlocal unsent
        while unsent and len(in_flight) < window:
            batch = list(islice(pending, window - len(in_flight)))
            if not batch:
                unsent = False
                return
            in_flight.update(push(batch))  # a refused message returns no id: its slot is free again

    top_up()
    while in_flight or unsent:
        if deadline is not None and clock() >= deadline:
            break
        got = list(pull(set(in_flight))) if in_flight else []
        replies.extend(got)
        if got and on_reply is not None:
            on_reply(len(replies))
        in_flight.difference_update(m.metadata.reply_to_message_id for m in got)
        top_up()
        if not got and (in_flight or unsent):
            sleep(pull_interval)
    return replies


def window_for(grid: Grid, max_in_flight: int) -> int | None:
    """The window a run uses on ``grid``: ``max_in_flight`` if positive; for ``0`` (auto) :func:`simulation_window`
    on Flower's simulation engine (``InMemoryGrid``) and ``None`` (no window) on any other grid."""
    if max_in_flight > 0:
        return max_in_flight
    return simulation_window() if is_simulation_grid(grid) else None


def is_simulation_grid(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's in-process simulation engine's (``InMemoryGrid``, what ``flwr run`` with the Ray
    backend gives the ServerApp)."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


class GridProxy(Grid):
    """A grid that forwards every call, and any other attribute (e.g. ``SerialGrid.nodes_settled``,
    ``InMemoryGrid.pull_interval``), to ``self.grid``; subclasses override what they change (:class:`WindowedGrid`,
    :class:`fedrec_flwr.strategies.flower_adapter.RoundNodes`)."""

    grid: Grid

    def __getattr__(self, name):
        if name == "grid":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.grid, name)

    def set_run(self, run_id: int) -> None:
        self.grid.set_run(run_id)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.grid.send_and_receive(messages, timeout=timeout)


class WindowedGrid(GridProxy):
    """A grid whose ``send_and_receive`` keeps at most ``window`` messages in flight (module docstring); everything
    else (nodes, runs, ``push_messages`` / ``pull_messages`` themselves) is the wrapped grid's. A batch that takes
    long logs how many replies have arrived (:class:`fedrec_flwr.progress.ReplyProgress`)."""

    def __init__(self, grid: Grid, window: int) -> None:
        if window < 1:
            raise ValueError(f"max-in-flight window must be >= 1, got {window}")
        self.grid, self.window = grid, window

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        from fedrec_flwr.progress import ReplyProgress

        messages = list(messages)
        return send_and_receive(
            self.grid.push_messages,
            self.grid.pull_messages,
            messages,
            window=self.window,
            timeout=timeout,
            pull_interval=getattr(self.grid, "pull_interval", 0.1),
            on_reply=ReplyProgress(messages),
        )


def windowed(grid: Grid, max_in_flight: int) -> Grid:
    """``grid`` itself, or a :class:`WindowedGrid` over it when :func:`window_for` gives a window."""
    window = window_for(grid, max_in_flight)
    return grid if window is None else WindowedGrid(grid, window)
