"""Finding and ending the processes a run started, by a per-run token, process group or session, and the signal
handling that turns SIGTERM / SIGHUP into the same cleanup as Ctrl-C. Linux (``/proc``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

TOKEN_ENV = "FEDREC_LAUNCH_TOKEN"
"""Environment variable holding a fresh random token per run; every process the run starts inherits it. The
launcher ends processes by this token only (a value it made, which no user sets), never by ``FLWR_HOME``."""


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs of processes (other than this one) whose environment has ``name=value``.

    Only for finding processes by a value this program made (a per-run token); a variable a user may also set
    (``FLWR_HOME``) finds processes that are not ours."""
    needle = f"{name}={value}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def ancestors(pid: int | None = None) -> set[int]:
    """``pid`` (default: this process) and every process above it up to PID 1."""
    pid = os.getpid() if pid is None else pid
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or ``None`` if gone: with
    the PID it names one process, even after the PID is reused."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def terminate(targets: set[int], timeout: float, more: Callable[[], Iterable[int]] | None = None) -> set[int]:
    """SIGTERM ``targets``, wait up to ``timeout`` s, then SIGKILL what is left; ``more()``, if given, names
    processes that appeared meanwhile (children started while we waited), added before the SIGKILL. This process
    and its ancestors are never signalled, whatever ``targets`` holds. Returns every PID signalled."""
    spared = ancestors()
    targets = set(targets) - spared
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(alive(p) for p in targets):
            time.sleep(0.2)
        if not any(alive(p) for p in targets):
            break
        if more is not None:
            targets |= set(more()) - spared
    return targets


def group_members(pgid: int) -> list[int]:
    members = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    members.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue
    return members


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_argv(pid: int) -> list[str]:
    """The process's command line, word by word (``[]`` if gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _process_table() -> dict[int, tuple[int, int]]:
    """Every live process: ``{pid: (parent pid, session id)}``."""
    table = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                table[int(proc.name)] = (int(fields[1]), int(fields[3]))
    return table


def run_processes(token: str, roots: Iterable[int] = (), sessions: set[int] | None = None) -> set[int]:
    """The live processes of the run marked by ``token``: those carrying it in their environment, ``roots``, all
    their descendants, and every member of a session one of them leads (the SuperLink's session, the simulation's
    session, where Ray's daemons run). A Ray daemon that rewrites its process title can overwrite its environment
    (``ray::DashboardAgent`` loses ``FLWR_HOME``), so the session and the parentage find it too. Never this process,
    its ancestors or its session.

    Args:
        sessions: session ids found so far, updated in place: pass the same set to a later call, after the
            session's leader has exited, and its members are still found.
    """
    sessions = set() if sessions is None else sessions
    table = _process_table()
    mine = set(processes_with_env(TOKEN_ENV, token) if token else []) | {p for p in roots if p in table}
    sessions.update(pid for pid in mine if pid in table and table[pid][1] == pid)  # sessions our processes lead
    sessions.discard(os.getsid(0))
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found = set(mine) | {pid for pid, (_, sid) in table.items() if sid in sessions}
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found - ancestors() - {p for p, (_, sid) in table.items() if sid == os.getsid(0) and p not in mine}


def session_members(pids: Sequence[int]) -> set[int]:
    """``pids`` that are alive, and the live members of their process groups. Every PID here was started with
    ``start_new_session=True``, so its process group ID is its PID; Linux does not reuse a PID while a group of that
    ID exists, so the group holds only its descendants, even after the leader exited."""
    found = {pid for pid in pids if alive(pid)}
    for pid in pids:
        found.update(p for p in group_members(pid) if alive(p))
    return found


def end_processes(pids: Sequence[int], marker: tuple[str, str] | None = None, timeout: float = 10.0) -> list[int]:
    """End processes started in their own session (``pids``) with their process groups, and processes whose
    environment has ``marker = (name, value)``: SIGTERM, wait up to ``timeout`` s, then SIGKILL. Returns the PIDs
    signalled. Only these processes are touched."""
    targets = session_members(pids)
    if marker:
        targets.update(processes_with_env(*marker))
    return sorted(terminate(targets, timeout, (lambda: processes_with_env(*marker)) if marker else None))


def ignore_interrupts() -> dict:
    """Ignore SIGINT while the run's processes are ended (a second Ctrl-C must not leave them behind)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}


def restore_interrupts(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: end the run like Ctrl-C does. ``args``: the signal's name and the exit status to
    return (128 + its number)."""


def raise_stopped(signum, frame) -> None:
    """A signal handler (SIGTERM, SIGHUP) that raises :class:`Stopped`, so ``finally`` / ``with`` cleanup runs."""
    raise Stopped(signal.Signals(signum).name, 128 + signum)
