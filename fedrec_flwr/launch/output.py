"""The run's log as the launcher shows and reads it: which lines the quiet output shows, the run's own error, what
a run that must be stopped was still doing, and the pump that copies ``flwr run``'s output."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from fedrec_flwr.launch.processes import cmdline
from fedrec_flwr.registry import LOGGER_ROOTS

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b: .+")
"""The last line of a Python traceback: ``package.module.SomeError: message``."""

QUIET_HIDDEN = (
    "Since flwr 1.32",  # the default federation size changed: we always pass num-supernodes
    "flwr federation simulation-config",
    "Manually terminating ClientAppActor",
)


def shown_quietly(line: str) -> bool:
    """Whether the default (quiet) output shows this line of the run's log (ANSI codes already removed): our
    progress line, our own log lines, warnings and errors (with the last line of a traceback); not Flower's INFO
    lines, nor the Flower notices in :data:`QUIET_HIDDEN`."""
    text = line.strip()
    if not text:
        return False
    if any(hidden in text for hidden in QUIET_HIDDEN):
        return False
    if re.match(r"round\s+\d+ \|", text) or ERROR_LINE.match(text):
        return True
    if re.match(rf"(INFO|WARNING|ERROR|CRITICAL) ({'|'.join(LOGGER_ROOTS)})\b", text):
        return True
    return bool(re.match(r"(WARNING|ERROR|CRITICAL)\s*:", text))


def run_error(log: str) -> str | None:
    """The run's own error in its log, the first cause rather than what it set off: the ServerApp's own last line when
    it ended with an exception (``... the ServerApp has ended: SomeError: message`` -> ``SomeError: message``), else
    the first exception line (the end of the first traceback, or the first ``SomeError: message`` line), else the
    refusal of ``flwr run`` itself (its ``Error`` box, e.g. ``Unknown simulation config field(s): foo``), else the last
    ``ERROR`` line. Flower's later lines (``ERROR : Exit Code: 700``) say only that the run failed."""
    lines = [ANSI.sub("", line).rstrip() for line in log.splitlines()]
    for line in lines:
        if SERVERAPP_ENDED in line:
            cause = line.split(SERVERAPP_ENDED, 1)[1].strip(": ")
            if cause and cause != "completed":
                return cause
    in_traceback = False
    for line in lines:
        if "Traceback (most recent call last)" in line:
            in_traceback = True
        elif in_traceback and line.strip() and not line[:1].isspace():
            return line.strip()
        elif not in_traceback and ERROR_LINE.match(line.strip()):
            return line.strip()
    cli = _cli_error(lines)
    if cli:
        return cli
    for line in reversed(lines):
        if line.strip().startswith("ERROR"):
            return line.strip()
    return None


def _cli_error(lines: Sequence[str]) -> str | None:
    """``flwr run``'s own refusal (a ``click`` error, before any run exists): the text of its last ``Error`` box
    (``typer`` with ``rich``), or of its last ``Error: message`` line."""
    found = None
    for i, line in enumerate(lines):
        if line.lstrip().startswith("╭") and " Error " in line:
            body = []
            for inner in lines[i + 1 :]:
                if not inner.lstrip().startswith("│"):
                    break
                body.append(inner.strip().strip("│").strip())
            found = " ".join(part for part in body if part) or found
        elif line.startswith("Error: "):
            found = line.strip()
    return found


SERVERAPP_ENDED = "the ServerApp has ended"
"""The ServerApp's last log line (:data:`fedrec_flwr.app.server_app.SERVERAPP_ENDED`; not imported: the launcher loads
no ServerApp code)."""

NO_REPLY = re.compile(r"round (\d+): (?:node (\d+) failed|evaluation failed on node (\d+))[^:]*: no reply within")
"""The strategy's warning for a node that did not answer a round (:mod:`fedrec_flwr.strategies.item_fedavg`)."""


def still_running(log: str, pids: Iterable[int]) -> str:
    """What a run that must be stopped was still doing, for the message: the nodes that gave no reply (by round,
    from the strategy's warnings in ``log``), the last progress line, and the run's live processes by command."""
    silent: dict[int, list[int]] = {}
    for match in NO_REPLY.finditer(log):
        node = int(match.group(2) or match.group(3))
        rounds = silent.setdefault(node, [])
        if int(match.group(1)) not in rounds:
            rounds.append(int(match.group(1)))
    parts = [f"node {node} (no reply in round {', '.join(map(str, rounds))})" for node, rounds in silent.items()]
    progress = [line.strip() for line in log.splitlines() if re.match(r"\s*round\s+\d+ \|", line)]
    if progress:
        parts.append(f"last round line: {progress[-1][:80]!r}")
    commands: dict[str, int] = {}
    for pid in pids:
        words = cmdline(pid).split()
        if words:
            name = next((Path(w).name for w in words if not Path(w).name.startswith("python")), Path(words[0]).name)
            commands[name] = commands.get(name, 0) + 1
    if commands:
        names = [f"{name} x{n}" if n > 1 else name for name, n in commands.items()]
        parts.append("processes " + ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else ""))
    return "; ".join(parts) or "nothing identifiable"


def pump_output(
    stream: TextIO, log: TextIO, sink: list[str], echo: TextIO | None, verbose: bool, display: Any = None
) -> None:
    """Copy the run's output, ANSI codes removed, to ``log`` and ``sink``, and the lines to show to ``echo``; or,
    with a ``display`` (:class:`fedrec_flwr.progress.RunDisplay`), every line to its ``feed`` with the text to show
    (``None``: not shown). Ends quietly when the log was closed (the run was stopped)."""
    try:
        for raw in stream:
            line = ANSI.sub("", raw)
            log.write(line)
            log.flush()
            sink.append(line)
            if display is not None:
                display.feed(
                    line, (line if verbose else line.strip() + "\n") if verbose or shown_quietly(line) else None
                )
            elif echo is not None and (verbose or shown_quietly(line)):
                echo.write(line if verbose else line.strip() + "\n")
                echo.flush()
    except (ValueError, OSError):  # the log was closed, or the pipe broke, because the run was stopped
        return
