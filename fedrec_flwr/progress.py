"""A run's console progress: replies within a long round (ServerApp side) and the display of ``fedrec run``.

Two halves, one format:

* In the ServerApp, :class:`ReplyProgress` (called by :class:`fedrec_flwr.app.message_window.WindowedGrid` as replies
  arrive) logs ``replies 120/943 | evaluate round 3`` on the progress logger at most every
  :data:`REPORT_INTERVAL` seconds while a batch of messages is out; a batch answered sooner logs nothing. These lines
  only report; they change no message, reply or result.
* In the launcher, :class:`RunDisplay` receives every line of the run's log. On a terminal it shows a live bar below
  the printed lines: ``round r/total``, the ETA (the mean of the finished rounds' seconds, from their progress lines,
  times the rounds left) and, during a long round, the replies received out of those expected. Elsewhere (a pipe, a
  file, CI) it prints exactly the lines the launcher prints without it: one per round, plus warnings and errors.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

PROGRESS_LOGGER = "fedrec_flwr.progress"
"""The logger of the per-round progress lines (:data:`fedrec_flwr.state.results.PROGRESS`) and of the reply lines."""

REPORT_INTERVAL = 2.0
"""Seconds between two reply lines of one batch (and from the batch's start to its first line)."""

REPLIES_LINE = re.compile(r"^replies (\d+)/(\d+) \| ([\w.-]+)(?: round (\d+))?$")
"""A reply line: received, expected, the messages' type (``train``, ``evaluate``, ``query.<action>``), the round."""

ROUND_LINE = re.compile(r"^round\s+(\d+) \|.*\|\s*([0-9.]+) s$")
"""The per-round progress line of :meth:`fedrec_flwr.state.results.RunRecorder.record`: its round and its seconds."""


class ReplyProgress:
    """Logs how many of a batch's replies have arrived (module docstring); call it with the count so far.

    Args:
        messages: the batch (``flwr.app.Message``); its size is the number of replies expected, its first message's
            type and ``config["server-round"]`` name the batch in the line.
        interval: seconds between lines (:data:`REPORT_INTERVAL`).
        clock: injectable for tests.
    """

    def __init__(
        self, messages: Sequence[Any], interval: float = REPORT_INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.expected = len(messages)
        self.kind, self.round = _describe(messages[0]) if messages else ("messages", None)
        self.interval = interval
        self.clock = clock
        self._last = clock()
        self._log = logging.getLogger(PROGRESS_LOGGER)

    def __call__(self, received: int) -> None:
        now = self.clock()
        if received < self.expected and now - self._last >= self.interval:
            self._last = now
            where = f" round {self.round}" if self.round is not None else ""
            self._log.info("replies %d/%d | %s%s", received, self.expected, self.kind, where)


def _describe(message: Any) -> tuple[str, int | None]:
    """``(message type, server round or None)`` of a message about to be sent."""
    kind = str(getattr(message.metadata, "message_type", "messages"))
    try:
        value = message.content["config"]["server-round"]
        return kind, int(value)
    except (KeyError, TypeError, ValueError):
        return kind, None


def eta_seconds(round_seconds: Sequence[float], completed: int, total: int) -> float | None:
    """Seconds left: the mean of ``round_seconds`` (the rounds seen finishing) times the ``total - completed`` rounds
    left; ``None`` before a round finished."""
    if not round_seconds:
        return None
    return max(0, total - completed) * sum(round_seconds) / len(round_seconds)


def format_duration(seconds: float | None) -> str:
    """``"1:02:03"`` / ``"4:05"``; ``"-"`` for ``None``."""
    if seconds is None:
        return "-"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class RunDisplay:
    """The launcher's console output of one run (module docstring). Use as a context manager around the run and
    pass it to :func:`fedrec_flwr.launch.flwr_run` (``display=``), which calls :meth:`feed` with every log line.

    Args:
        total_rounds: the run's ``num-server-rounds``.
        out: where to print (default ``sys.stdout``).
        live: show the live bar; default: when ``out`` is a terminal.
        console: a ``rich.console.Console`` to draw on (tests; default: one on ``out``).
    """

    def __init__(
        self, total_rounds: int, out: TextIO | None = None, live: bool | None = None, console: Any = None
    ) -> None:
        self.out = out if out is not None else sys.stdout
        self.total = int(total_rounds)
        self.live = bool(live) if live is not None else bool(getattr(self.out, "isatty", lambda: False)())
        self.completed = 0
        self.round_seconds: list[float] = []
        self.replies: tuple[int, int, str] | None = None
        self.started = False
        """Whether the rounds have begun (a round's replies or its line seen): until then the bar says starting."""
        self._progress = None
        self._task = None
        self._console = console

    # -- lifecycle
    def __enter__(self) -> RunDisplay:
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            console = self._console or Console(file=self.out)
            self._progress = Progress(
                TextColumn("round {task.fields[round]}"),
                BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"),
                TextColumn("ETA {task.fields[eta]}"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[replies]}"),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task("run", total=max(self.total, 1), **self._fields())
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the live bar (it stays on screen as last drawn)."""
        if self._progress is not None:
            self._update()
            self._progress.stop()
            self._progress = None

    # -- input
    def feed(self, line: str, shown: str | None) -> None:
        """One line of the run's log (ANSI codes removed); ``shown``: the text the launcher prints for it (with its
        newline), ``None`` for a line it does not print."""
        text = line.strip()
        match = REPLIES_LINE.match(text)
        if match:
            self.replies = (
                int(match.group(1)),
                int(match.group(2)),
                match.group(3) + (f" round {match.group(4)}" if match.group(4) else ""),
            )
            self.started = self.started or match.group(4) is not None
        match = ROUND_LINE.match(text)
        if match:
            self.completed = max(self.completed, int(match.group(1)))
            self.round_seconds.append(float(match.group(2)))
            self.replies = None
            self.started = True
        if shown is not None:
            self.print(shown)
        if self._progress is not None:
            self._update()

    def print(self, text: str) -> None:
        """Print ``text`` (one or more lines, ending in a newline): above the live bar, or plainly."""
        if self._progress is not None:
            self._progress.console.print(text.rstrip("\n"), markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            self.out.write(text)
            self.out.flush()

    # -- output
    def eta(self) -> float | None:
        return eta_seconds(self.round_seconds, self.completed, self.total)

    def status(self) -> str:
        """The bar's text without the bar: ``round 4/100 | ETA 2:03 | evaluate round 4: 120/943 replies``
        (``round -/100 (starting)`` before the first round)."""
        fields = self._fields()
        return " | ".join(
            part for part in (f"round {fields['round']}", f"ETA {fields['eta']}", fields["replies"]) if part
        )

    def _fields(self) -> dict[str, str]:
        current = min(self.completed + 1, self.total)
        replies = f"{self.replies[2]}: {self.replies[0]}/{self.replies[1]} replies" if self.replies else ""
        where = f"{current}/{self.total}" if self.started else f"-/{self.total} (starting)"
        return {"round": where, "eta": format_duration(self.eta()), "replies": replies}

    def _update(self) -> None:
        self._progress.update(self._task, completed=min(self.completed, self.total), **self._fields())
