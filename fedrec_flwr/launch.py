"""Run the app with ``flwr run`` on a local SuperLink that this launcher starts, owns and stops.

``flwr run .`` (flwr 1.42) starts a *detached* local SuperLink that outlives the command, on fixed ports (39091 unless
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` says otherwise), and by default installs the app's dependencies with ``uv`` at
run time. This module wraps it so a run is self-contained and never touches what it did not start:

* the launcher starts the local SuperLink itself, in its own session, on free ports (or the ports the two
  ``FLWR_LOCAL_*`` variables name), with an in-memory database; ``flwr run`` finds it there and uses it;
* every process the run starts carries a fresh per-run token in its environment (:data:`TOKEN_ENV`), so the
  SuperLink's process group, the simulation, and Ray daemons that left the group are found and ended afterwards --
  and nothing else: never a process that merely shares ``FLWR_HOME``, never an ancestor of the launcher;
* two runs in one checkout run side by side: a launcher holds a lock on its Flower home, and a second launcher
  takes the next free home ``<FLWR_HOME>/concurrent-<i>`` (Flower installs apps there without a lock, so two runs
  must not share one) and its own ports, and says so;
* a SuperLink left behind by a launcher that was killed (``kill -9``) is recorded in its home
  (``local-superlink/fedrec-launch.json``: PID, start time, token) and stopped by the next run or by ``stop``;
* runtime dependency installation is off (``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``);
* ``num-supernodes`` is computed from the dataset's users and ``users-per-node`` unless given, and a given number
  that does not match is refused before anything starts;
* every check that needs no Flower (:func:`fedrec_flwr.app.preflight.preflight`, with the data: keys, plug-ins, the
  dataset, attributes, ``forget-users``, ``resume-from``, the results folder, a Flower strategy's config keys) runs
  before anything starts: one ``error:`` line, exit 2, nothing created; so do the command line's own checks (a key
  given twice, ``--federation-config`` keys and values as ``flwr run`` checks them) and an unusable Flower home;
* the exit status is 0 only when Flower reports the run ``finished:completed``, 1 for a run that started and failed
  (its own error is the last line printed), 2 for a usage or config error found before the start;
* a run whose simulation does not exit :data:`END_GRACE` s after its ServerApp's last line (a ClientApp that never
  returns keeps Flower 1.42's simulation waiting, and ``flwr run`` with it) is stopped: exit 1, with the nodes that
  gave no reply and their rounds; ``--timeout SECONDS`` stops the whole run after SECONDS: exit 124, likewise;
* Ctrl-C (or SIGTERM / SIGHUP) stops the run, its SuperLink and Ray, and exits 128 + the signal's number, as a
  shell reports a process a signal ended: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP).

Command line::

    python -m fedrec_flwr.launch run [--num-supernodes N] [--flwr-home DIR] [--ray-address HOST:PORT]
                                     [--federation-config KEY=VALUE ...] [--timeout SECONDS] [--verbose] [--debug]
                                     [key=value ...]
    python -m fedrec_flwr.launch stop [--flwr-home DIR]

``key=value`` pairs are run-config overrides; flags may come before, between or after them. Values are TOML
(``num-server-rounds=20``, ``fraction-train=0.5``, ``dataset='filmtrust'``); a key whose default is a string also
takes the bare text (``dataset=filmtrust``, ``data-dir=/data/o'brien/ml-100k``), passed on exactly. Spaces around
``=`` and around the value are dropped (``"model = ncf"``); to keep them, quote the value (``run-name=" a "``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from fedrec_flwr.config import app_root, default_mapping
from fedrec_flwr.errors import ConfigError, FedRecError
from fedrec_flwr.io import atomic_write_text
from fedrec_flwr.registry import LOGGER_ROOTS
from fedrec_flwr.state.results import SOURCE_COMMIT_ENV, source_commit


def _project_root() -> Path:
    """:func:`~fedrec_flwr.config.app_root`, or the folder above the package when there is none (every use of the
    defaults then raises :class:`~fedrec_flwr.errors.ConfigError` from :func:`~fedrec_flwr.config.default_mapping`)."""
    try:
        return app_root()
    except ConfigError:
        return Path(__file__).resolve().parents[1]


PROJECT_ROOT = _project_root()
"""The Flower app folder that ``flwr run`` is given: the source checkout, or the installed copy of the app."""

TOKEN_ENV = "FEDREC_LAUNCH_TOKEN"
"""Environment variable holding a fresh random token per run; every process the run starts inherits it. The
launcher ends processes by this token only (a value it made, which no user sets), never by ``FLWR_HOME``."""

LOCK_FILE = "fedrec-launch.lock"
"""In a Flower home: locked (``flock``) by the launcher using that home; holds its PID and command line."""

RECORD_FILE = Path("local-superlink") / "fedrec-launch.json"
"""In a Flower home: the SuperLink a launcher started there (PID, start time, token, ports)."""

MAX_CONCURRENT = 16
"""Flower homes a checkout offers to concurrent runs: the home itself and ``concurrent-1`` .. ``concurrent-15``."""

FEDERATION_KEYS = {
    "num-supernodes": "--num-supernodes N",
    "client-resources-num-cpus": "--federation-config client-resources-num-cpus=N",
    "client-resources-num-gpus": "--federation-config client-resources-num-gpus=N",
    "init-args-num-cpus": "--federation-config init-args-num-cpus=N",
    "init-args-num-gpus": "--federation-config init-args-num-gpus=N",
}
"""Federation (simulation) settings users give as run-config keys by mistake -> the flag that sets them."""

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# --------------------------------------------------------------------------------------------- environment
RAY_INLINE_ENV = "RAY_max_direct_call_object_size"
RAY_INLINE_BYTES = 1 << 20
"""Bytes up to which Ray passes a message to a client actor and its reply back inside its own RPC messages instead of
its shared-memory object store (Ray's default: 100 KiB); :func:`flwr_env` sets it for ``flwr run`` (1 MiB: the
ML-100K model, 0.44 MB, and every one-user reply fit; larger models still take the object store)."""


def flwr_env(flwr_home: str | os.PathLike | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for ``flwr run``: no runtime dependency installation, no Ray accelerator warning, and Ray's
    task events off (``RAY_task_events_report_interval_ms=0``, unless set): Ray's GCS otherwise keeps a record of
    every actor call, up to 100,000 of them, for its dashboard's task list; one per message here, so the simulation's
    memory grew about 2 MiB a round on Amazon-Video at 10 users per node (``experiments/bench/soak.py``). Set the
    variable to Ray's default ``1000`` to have the task list back.

    Also glibc's ``MALLOC_ARENA_MAX=2`` (unless set): Flower's simulation process runs many threads, each of which may
    get a malloc arena of its own (up to 8 per core), and an evaluation round's extra messages left a high-water mark
    in them (+7 to +60 MiB at round 10 in three Amazon-Video soaks, simulation process and actors). With two arenas
    the step at round 10 was +2.5 MiB and the round times unchanged (one 20-round soak,
    ``experiments/bench/README.md``). Set the variable yourself to override it.

    And Ray's inline-object limit ``RAY_max_direct_call_object_size`` raised to :data:`RAY_INLINE_BYTES` (unless
    set): Ray returns a task's result and passes its arguments inside its own RPC messages only up to 100 KiB by
    default, and moves anything larger through its shared-memory object store, which cost several milliseconds of the
    simulation's two-core budget per message: on ML-100K every train and evaluate message carries the 0.44 MB model
    and a one-user train reply is 104-116 KB. Measured on Flower's simulation engine (``bench_simulation.py``, 100 of
    943 one-user nodes): a bare app sending the model took 1.22-1.26 s per round with Ray's default, 0.64 s with
    1 MiB; the same bare app replying with 110 KB took 1.81-1.95 s against 0.65 s. Transport only: no result
    changes. Set the variable yourself to override it."""
    env = dict(os.environ)
    # flwr starts `flower-superlink` and `flwr-simulation` by name: they live beside this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    env.setdefault("RAY_task_events_report_interval_ms", "0")
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.setdefault(RAY_INLINE_ENV, str(RAY_INLINE_BYTES))
    env.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    if flwr_home:
        env["FLWR_HOME"] = str(flwr_home)
    commit = source_commit(PROJECT_ROOT)  # config.json's "produced-by": the ServerApp runs from the unpacked FAB
    if commit:
        env[SOURCE_COMMIT_ENV] = commit
    env.update(extra or {})
    return env


def default_home(env: Mapping[str, str] | None = None) -> Path:
    """``$FLWR_HOME``, else ``~/.flwr`` (Flower's default), as an absolute path."""
    env = os.environ if env is None else env
    return Path(env.get("FLWR_HOME") or Path.home() / ".flwr").expanduser().resolve()


# ----------------------------------------------------------------------------------------------- processes
def superlink_pids(env: Mapping[str, str] | None = None) -> list[int]:
    """PIDs of local ``flower-superlink`` processes whose control API uses this environment's port."""
    env = env or os.environ
    port = env.get("FLWR_LOCAL_CONTROL_API_PORT", "39093")
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in cmdline and f"127.0.0.1:{port}" in cmdline:
            pids.append(int(proc.name))
    return pids


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
        while time.monotonic() < deadline and any(_alive(p) for p in targets):
            time.sleep(0.2)
        if not any(_alive(p) for p in targets):
            break
        if more is not None:
            targets |= set(more()) - spared
    return targets


def _group_members(pgid: int) -> list[int]:
    members = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    members.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue
    return members


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _argv(pid: int) -> list[str]:
    """The process's command line, word by word (``[]`` if gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _cmdline(pid: int) -> str:
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------- Flower home slots
class HomeBusy(FedRecError):
    """Every Flower home of this checkout is in use by a running launcher."""


@contextmanager
def claim_home(base: str | os.PathLike, max_slots: int = MAX_CONCURRENT) -> Iterator[tuple[Path, list[str]]]:
    """Hold a Flower home for one run: ``base`` if no other launcher holds it, else the first free
    ``base/concurrent-<i>``. Yields ``(home, others)``: ``others`` describes the launchers holding the homes passed
    over. The lock is an ``flock`` on ``<home>/fedrec-launch.lock``, released when this process ends however it ends.

    Raises:
        HomeBusy: all ``max_slots`` homes are held; the message names the running launchers.
        ConfigError: a home cannot be created or written (``--flwr-home`` in ``/proc``, read-only, ...).
    """
    base = Path(base).expanduser().resolve()
    others: list[str] = []
    for slot in range(max_slots):
        home = base if slot == 0 else base / f"concurrent-{slot}"
        try:
            home.mkdir(parents=True, exist_ok=True)
            handle = open(home / LOCK_FILE, "a+")
        except OSError as err:
            raise ConfigError(
                f"--flwr-home {base} (or $FLWR_HOME): the Flower home {home} cannot be created or "
                f"written ({err.strerror or err})"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            others.append(f"{home}: {handle.read().strip() or 'a running launcher'}")
            handle.close()
            continue
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(
                f"launcher pid {os.getpid()} since {datetime.now().strftime('%H:%M:%S')}: {' '.join(sys.argv)[:300]}\n"
            )
            handle.flush()
            yield home, others
        finally:
            handle.close()
        return
    raise HomeBusy(
        f"{max_slots} runs already use this checkout's Flower homes; wait for one to finish:\n  " + "\n  ".join(others)
    )


def _home_held(home: Path) -> str | None:
    """The description a running launcher left in ``home``'s lock, or ``None`` when no launcher holds it."""
    path = home / LOCK_FILE
    if not path.is_file():
        return None
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            return handle.read().strip() or "a running launcher"
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def stop_recorded_superlink(home: str | os.PathLike, timeout: float = 15.0) -> list[int]:
    """Stop the SuperLink an earlier launcher recorded in ``home`` (and every process carrying that run's token), if
    it is still the same process (PID and start time match, and it is a ``flower-superlink``); then forget the
    record. Call only while holding ``home`` (:func:`claim_home`) or after checking no launcher holds it. Returns
    the PIDs signalled."""
    path = Path(home) / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    pid, token = int(record.get("pid", 0)), str(record.get("token", ""))
    roots = (
        [pid] if pid > 1 and start_time(pid) == record.get("start-time") and "flower-superlink" in _cmdline(pid) else []
    )
    sessions: set[int] = set()
    targets = run_processes(token, roots, sessions) if token or roots else set()
    signalled = sorted(terminate(targets, timeout, lambda: run_processes(token, roots, sessions))) if targets else []
    path.unlink(missing_ok=True)
    return signalled


class LocalSuperLink:
    """A ``flower-superlink --simulation`` this launcher starts in ``home``, marked with a per-run token.

    Args:
        home: the run's Flower home (held through :func:`claim_home`).
        env: the environment for the SuperLink and ``flwr run`` (from :func:`flwr_env`); its
            ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` / ``FLWR_LOCAL_CONTROL_API_PORT`` are used if set, else free ports
            are chosen and written into :attr:`env`.
    """

    def __init__(self, home: Path, env: Mapping[str, str], startup_timeout: float = 60.0) -> None:
        self.home = Path(home)
        self.token = uuid.uuid4().hex
        self.env = dict(env)
        self.env["FLWR_HOME"] = str(self.home)
        self.env[TOKEN_ENV] = self.token
        self.env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
        self.fixed_ports = "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT" in env
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self._sessions: set[int] = set()
        self.log = self.home / "local-superlink" / "fedrec-launch-superlink.log"

    @property
    def port(self) -> str:
        return self.env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]

    def start(self, attempts: int = 3) -> LocalSuperLink:
        """Start it and wait for ``/health``; a chosen port taken meanwhile is replaced (up to ``attempts`` times).

        Raises:
            FedRecError: it exited or did not answer; the message holds the end of its log.
        """
        self.log.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(attempts):
            if not self.fixed_ports:
                self.env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(_free_port())
                self.env["FLWR_LOCAL_CONTROL_API_PORT"] = str(_free_port())
            self.env.setdefault("FLWR_LOCAL_CONTROL_API_PORT", "39093")
            self.log.write_text("")
            command = [
                str(Path(sys.executable).with_name("flower-superlink")),
                "--insecure",
                "--simulation",
                "--isolation",
                "subprocess",
                "--control-api-address",
                f"127.0.0.1:{self.env['FLWR_LOCAL_CONTROL_API_PORT']}",
                "--host",
                "127.0.0.1",
                "--port",
                self.port,
                "--log-file",
                str(self.log),
            ]
            # in the caller's folder, as `flwr run` starts it: a relative results-dir means the same folder there
            self.process = subprocess.Popen(
                command,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            atomic_write_text(
                self.home / RECORD_FILE,
                json.dumps(
                    {  # a write error names the file
                        "pid": self.process.pid,
                        "start-time": start_time(self.process.pid),
                        "token": self.token,
                        "port": self.port,
                        "launcher-pid": os.getpid(),
                    }
                )
                + "\n",
            )
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline and self.process.poll() is None and not self.healthy():
                time.sleep(0.2)
            if self.process.poll() is None and self.healthy():
                return self
            tail = self.log.read_text(errors="replace")[-1500:] if self.log.is_file() else ""
            self.stop()
            if "already in use" in tail.lower() and not self.fixed_ports and attempt + 1 < attempts:
                continue
            if "already in use" in tail.lower():
                raise FedRecError(
                    f"the local SuperLink cannot bind port {self.port} "
                    f"(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT): another process uses it; unset the "
                    "variable to let the launcher choose free ports"
                )
            raise FedRecError(
                f"the local SuperLink did not start within {self.startup_timeout:.0f} s (log {self.log}):\n{tail}"
            )
        raise AssertionError("not reached")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1.0) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def leftover(self) -> list[int]:
        """Processes of this run still alive (:func:`run_processes`: the SuperLink, what carries the run's token,
        their descendants and sessions)."""
        roots = [self.process.pid] if self.process is not None else []
        return sorted(run_processes(self.token, roots, self._sessions))

    def stop(self, timeout: float = 15.0) -> list[int]:
        """End every process of this run (:meth:`leftover`): SIGTERM, then SIGKILL after ``timeout`` s, with the
        processes that appeared meanwhile. Returns the PIDs signalled."""
        targets = set(self.leftover())
        signalled = terminate(targets, timeout, self.leftover) if targets else set()
        if self.process is not None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        (self.home / RECORD_FILE).unlink(missing_ok=True)
        return sorted(signalled)


# -------------------------------------------------------------------------------------------- run config
def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string that Flower's ``--run-config`` parser (a regex that ends a double-quoted value
    at the next ``"``) hands to TOML unchanged: ``"`` and control characters become ``\\uXXXX``, ``\\`` becomes
    ``\\\\``; everything else (apostrophes, spaces, non-ASCII) stays literal."""
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif char == '"' or ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    raise ConfigError(f"run-config value {value!r}: only strings, numbers and booleans can be passed to flwr run")


def run_config_args(overrides: Mapping[str, Any], declared: Iterable[str] | None = None) -> list[str]:
    """``--run-config`` arguments for ``flwr run`` from a mapping of overrides; Flower parses each value back exactly
    (``flwr.common.config.parse_config_args``).

    Keys that ``[tool.flwr.app.config]`` does not declare (``declared``, default: this project's keys) are a plug-in's
    own keys, which Flower would refuse: they travel packed into ``plugin-config`` (``"key=value ..."``), which
    :meth:`fedrec_flwr.config.RunConfig.from_mapping` unpacks and checks against the plug-in's ``config_keys``."""
    if not overrides:
        return []
    for key in overrides:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(key)):
            raise ConfigError(f"run-config key {key!r}: keys are letters, digits, '-', '_' and '.'")
    known = set(default_mapping(PROJECT_ROOT / "pyproject.toml") if declared is None else declared)
    plain = {k: v for k, v in overrides.items() if k in known}
    packed = {k: v for k, v in overrides.items() if k not in known}
    if packed:
        if "plugin-config" not in known:
            raise ConfigError(f"run-config key(s) {sorted(packed)} are not in [tool.flwr.app.config]")
        given = str(plain.get("plugin-config") or "")
        if given:
            from flwr.common.config import parse_config_args

            try:
                inside = parse_config_args([given])
            except Exception:  # malformed: RunConfig.from_mapping names the problem in the preflight
                inside = {}
            packed = {k: v for k, v in packed.items() if k not in inside or inside[k] != v}
            twice = sorted(set(packed) & set(inside))
            if twice:
                raise ConfigError(
                    f"run-config key '{twice[0]}' is given twice: {twice[0]}={packed[twice[0]]!r} and "
                    f"in plugin-config ({twice[0]}={inside[twice[0]]!r}); give it once"
                )
        plain["plugin-config"] = " ".join(
            [*([given] if given else []), *(f"{k}={_toml_value(v)}" for k, v in packed.items())]
        )
    return ["--run-config", " ".join(f"{k}={_toml_value(v)}" for k, v in plain.items())]


def parse_override(pair: str, defaults: Mapping[str, Any] | None = None, what: str = "run-config") -> tuple[str, Any]:
    """``"key=value"`` -> ``(key, value)``.

    Spaces around the ``=`` (and around the whole pair) are dropped, ``"model = ncf"`` being ``model=ncf``: Flower's
    own ``--run-config`` parser (``flwr.common.config.parse_config_args``) would silently skip such a pair. A value
    starting with a quote is a TOML string and must be one; the spaces inside its quotes are kept (``run-name=" a "``).
    Otherwise a key whose default (in ``defaults``) is a string takes the text as it is (``dataset=filmtrust``,
    ``run-name=2024``, ``data-dir=/a/o'b``); other values are TOML (``20``, ``0.5``, ``true``), and text that is not
    TOML stays a string, which the run config's validation then refuses by key if the key needs a number.

    Raises:
        ConfigError: no ``=``, an empty key, a federation setting given as a run-config key (with the flag to use),
            or a quoted value that is not a TOML string (with the fix).
    """
    import tomllib

    key, sep, text = pair.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key:
        raise ConfigError(f"{what} override {pair!r} is not key=value")
    if what == "run-config" and key in FEDERATION_KEYS:
        raise ConfigError(
            f"'{key}' is a federation setting, not a run-config key: use "
            f"{FEDERATION_KEYS[key].replace('N', text or 'N', 1) if text else FEDERATION_KEYS[key]}"
        )
    defaults = defaults or {}
    if text[:1] in ("'", '"'):
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError as err:
            balanced = len(text) >= 2 and text[-1] == text[0]
            control = next((c for c in text[1:-1] if not c.isprintable()), None) if balanced else None
            bare = text.strip(chr(39) + chr(34))
            if control is not None:  # the quotes balance: the value holds what a TOML string holds only escaped
                raise ConfigError(
                    f"{what} key '{key}': {text!r} is not a TOML string: it holds the raw control character "
                    f"{control!r}, which TOML takes only escaped ({repr(control)[1:-1]}); write it as "
                    f"{key}={_toml_string(bare)}"
                ) from None
            hint = "an unbalanced quote?" if not balanced else f"TOML: {err}"
            raise ConfigError(
                f"{what} key '{key}': {text!r} is not a quoted string ({hint}); write it without quotes "
                f"({key}={bare}) or as TOML ({key}={_toml_string(bare)})"
            ) from None
        return key, value
    if isinstance(defaults.get(key), str):
        return key, text
    try:
        return key, tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return key, text


def check_run(overrides: Mapping[str, Any], num_supernodes: int | None = None) -> int:
    """Check the run (defaults + ``overrides``) before anything starts: the plug-ins are shipped with the app
    (:func:`check_shipped`), everything :func:`fedrec_flwr.app.preflight.preflight` checks with the data (config, client
    and strategy, attributes, ``forget-users``, ``resume-from``, the results folder), and the number of SuperNodes.
    Returns the SuperNodes the run needs, ``ceil(users / users-per-node)`` (the split is cached after the first time).

    Raises:
        ConfigError: as :func:`~fedrec_flwr.app.preflight.preflight`, or a plug-in the app does not ship, or
            ``num_supernodes`` given and different from the number needed (the message gives the right number).
        DataError: the dataset cannot be loaded.
    """
    from fedrec_flwr.app.preflight import preflight
    from fedrec_flwr.config import RunConfig

    mapping = default_mapping(PROJECT_ROOT / "pyproject.toml")
    mapping.update(overrides)
    config = RunConfig.from_mapping(mapping)
    check_shipped(config)
    num_users = preflight(config, with_data=True).num_users
    needed = -(-num_users // config.users_per_node)
    if num_supernodes is not None and num_supernodes != needed:
        raise ConfigError(
            f"--num-supernodes {num_supernodes}: {config.dataset} has {num_users} users and users-per-node = "
            f"{config.users_per_node}, which needs exactly {needed} SuperNodes (partition-id 0..{needed - 1}); "
            f"leave --num-supernodes out to get {needed}"
        )
    return needed


def shipped_files(project: str | os.PathLike = PROJECT_ROOT) -> list[str]:
    """The files (paths relative to ``project``) that ``flwr run <project>`` ships in the app (FAB), by Flower's own
    filter of ``fab-include`` / ``fab-exclude``; only non-hidden folders are walked (not ``.venv``)."""
    import tomllib

    from flwr.cli.build import get_filtered_fab_paths

    project = Path(project)
    with open(project / "pyproject.toml", "rb") as handle:
        config = tomllib.load(handle)
    files: dict[str, Path] = {}
    for folder, dirs, names in os.walk(project):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "results")]
        for name in names:
            path = Path(folder) / name
            files[path.relative_to(project).as_posix()] = path
    return ["pyproject.toml", *get_filtered_fab_paths(files, config)]


def check_shipped(config: Any, project: str | os.PathLike = PROJECT_ROOT) -> None:
    """Refuse a plug-in strategy or client whose module is a file of the checkout that the app does not ship: the
    ServerApp and ClientApps import from Flower's installed copy of the app, where it would be missing.

    Raises:
        ConfigError: naming the file and where to put it (``plugins/``).
    """
    from fedrec_flwr.registry import resolve

    project = Path(project).resolve()
    shipped: set[str] | None = None
    for kind, spec in (("strategy", config.strategy), ("client", config.client)):
        module = sys.modules.get(resolve(kind, spec).__module__)
        path = Path(getattr(module, "__file__", "") or "/").resolve()
        if project not in path.parents or ".venv" in path.relative_to(project).parts:
            continue  # an installed package or a PYTHONPATH folder outside the checkout: importable there too
        shipped = set(shipped_files(project)) if shipped is None else shipped
        relative = path.relative_to(project).as_posix()
        if relative not in shipped:
            raise ConfigError(
                f"run-config key '{kind}' = {spec!r}: {relative} is not shipped with the app (fab-include in "
                f"pyproject.toml), so the ServerApp and ClientApps cannot import it: move it to plugins/ "
                f"({kind}=plugins.{path.stem}:{spec.rpartition(':')[2]})"
            )


def num_supernodes_for(overrides: Mapping[str, Any]) -> int:
    """``ceil(users / users-per-node)`` for the configured dataset (loads the split, cached after the first time)."""
    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.config import RunConfig

    mapping = default_mapping(PROJECT_ROOT / "pyproject.toml")
    mapping.update(overrides)
    config = RunConfig.from_mapping(mapping)
    return -(-load_split_for(config).num_users // config.users_per_node)


# -------------------------------------------------------------------------------------------------- output
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


def run_status(env: Mapping[str, str], timeout: float = 60.0) -> tuple[str | None, str]:
    """``(status, details)`` of the last run on the SuperLink of ``env`` (``flwr ls --format json``), e.g.
    ``("finished:completed", "")``; ``(None, why)`` if it cannot be read."""
    try:
        done = subprocess.run(
            [str(Path(sys.executable).with_name("flwr")), "ls", "--format", "json"],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=PROJECT_ROOT,
        )
        runs = json.loads(done.stdout[done.stdout.index("{") :])["runs"]
    except (subprocess.TimeoutExpired, ValueError, KeyError, OSError) as err:
        return None, f"flwr ls failed: {err}"
    if not runs:
        return None, "the SuperLink knows no run"
    last = max(runs, key=lambda r: int(r.get("run-id", 0)))
    return str(last.get("status")), str(last.get("status-details") or "")


def _pump(
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


# ----------------------------------------------------------------------------------------------------- run
END_GRACE = 30.0
"""Seconds a simulation may take to exit after its ServerApp ended (Ray's shutdown; measured: ``flwr run`` exited 8 s
after the ServerApp's last line on the 2-core machine at load average 9) before the launcher stops the run as hung.
With it and the stop (at most 15 s) the launcher returns within 45 s of the ServerApp's end (the issue asks for
``round-timeout`` + 60 s after the last round)."""

SERVERAPP_ENDED = "the ServerApp has ended"
"""The ServerApp's last log line (:data:`fedrec_flwr.app.server_app.SERVERAPP_ENDED`; not imported: the launcher loads no
ServerApp code)."""

NO_REPLY = re.compile(r"round (\d+): (?:node (\d+) failed|evaluation failed on node (\d+))[^:]*: no reply within")
"""The strategy's warning for a node that did not answer a round (:mod:`fedrec_flwr.strategies.item_fedavg`)."""


def _watch(process: subprocess.Popen, lines: list[str], timeout: float | None, end_grace: float) -> str | None:
    """Wait for ``flwr run`` to exit; ``None`` when it did, else why it must be stopped: ``timeout`` s passed, or
    ``end_grace`` s passed since the ServerApp's last line arrived in ``lines`` (filled by the output pump)."""
    started = time.monotonic()
    ended_at: float | None = None
    how = ""
    seen = 0
    while process.poll() is None:
        now = time.monotonic()
        if ended_at is None:
            new = lines[seen:]
            seen += len(new)
            ends = [line for line in new if SERVERAPP_ENDED in line]
            if ends:
                ended_at, how = now, ends[0].split(SERVERAPP_ENDED, 1)[1].strip(": \n")
        if timeout is not None and now - started > timeout:
            return f"--timeout {timeout:g} s passed"
        if ended_at is not None and now - ended_at > end_grace:
            return (
                f"the ServerApp ended ({how}) {now - ended_at:.0f} s ago but the simulation did not exit (a "
                "ClientApp that never returned keeps it waiting)"
            )
        time.sleep(0.5)
    return None


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
        words = _cmdline(pid).split()
        if words:
            name = next((Path(w).name for w in words if not Path(w).name.startswith("python")), Path(words[0]).name)
            commands[name] = commands.get(name, 0) + 1
    if commands:
        names = [f"{name} x{n}" if n > 1 else name for name, n in commands.items()]
        parts.append("processes " + ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else ""))
    return "; ".join(parts) or "nothing identifiable"


def flwr_run(
    overrides: Mapping[str, Any] | None = None,
    *,
    num_supernodes: int | None = None,
    flwr_home: str | os.PathLike | None = None,
    env_extra: Mapping[str, str] | None = None,
    project: str | os.PathLike = PROJECT_ROOT,
    timeout: float | None = None,
    capture: bool = False,
    keep_superlink: bool = False,
    federation_config: Mapping[str, Any] | None = None,
    ray_address: str | None = None,
    verbose: bool = False,
    check: bool = True,
    end_grace: float = END_GRACE,
    display: Any = None,
) -> subprocess.CompletedProcess:
    """``flwr run <project> --stream`` on a fresh local SuperLink of its own, which is stopped afterwards.

    Args:
        overrides: run-config overrides (kebab-case keys).
        num_supernodes: simulated SuperNodes; default ``ceil(users / users-per-node)``; another number is refused.
        flwr_home: base Flower home (default ``$FLWR_HOME``, else ``~/.flwr``); a run uses it, or, while another
            launcher holds it, ``<flwr_home>/concurrent-<i>``.
        env_extra: more environment variables (e.g. fixed local SuperLink ports
            ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` / ``FLWR_LOCAL_CONTROL_API_PORT``; default: free ports).
        timeout: seconds for the whole run (from ``flwr run``'s start); then the run is stopped and the result's
            ``returncode`` is 124, with a message naming what was still running (:func:`still_running`).
        capture: return the whole log in ``stdout`` instead of printing it.
        keep_superlink: leave the SuperLink running (for inspection; stop it with ``launch stop``).
        federation_config: more ``--federation-config`` keys of flwr 1.42's simulation config, e.g.
            ``{"client-resources-num-cpus": 1}`` (CPUs per client actor; Flower's default is 2) or
            ``{"init-args-num-cpus": 4}`` (CPUs of a new local Ray instance; not allowed with ``ray_address``).
        ray_address: run the simulation's client actors on this existing Ray cluster (``host:port`` of its head's
            GCS, as ``ray start --head --port`` printed) instead of a new local Ray instance: sets ``RAY_ADDRESS``
            for the SuperLink, whose simulation process calls ``ray.init()``. Stopping the run never stops that
            cluster (its processes do not carry the run's token).
        verbose: print Flower's whole log (default: our progress line, our log lines, warnings and errors).
        check: validate the run config and the plug-ins it names first (:func:`check_run`).
        end_grace: seconds the simulation may take to exit after the ServerApp's last line
            (:data:`~fedrec_flwr.app.server_app.SERVERAPP_ENDED`); then the run is stopped (a ClientApp that never
            returns keeps Flower 1.42's simulation alive: its worker pool waits for it) and ``returncode`` is 1.
        display: shows the run's lines instead of plain printing (a :class:`fedrec_flwr.progress.RunDisplay`, whose
            ``feed`` gets every log line); ignored with ``capture``.

    Returns:
        The finished run: ``returncode`` 0 only if Flower reports it ``finished:completed``; 124 when ``timeout``
        passed; 1 otherwise (the run failed, or did not end ``end_grace`` s after its ServerApp, whatever ``flwr
        run``'s own status, which the message gives); ``stdout`` the whole log (ANSI codes
        removed) when ``capture``, else ``""``. A failed or stopped run's error is printed last.

    Raises:
        ConfigError, DataError: what :func:`check_run` finds (before anything starts).
        HomeBusy: every Flower home of ``flwr_home`` is in use.
    """
    overrides = dict(overrides or {})
    extra = {**({"RAY_ADDRESS": ray_address} if ray_address else {}), **(env_extra or {})}
    if ray_address:
        check_ray_address(ray_address)
    if check:
        num_supernodes = check_run(overrides, num_supernodes)
    elif num_supernodes is None:
        num_supernodes = num_supernodes_for(overrides)
    command = [
        str(Path(sys.executable).with_name("flwr")),
        "run",
        str(project),
        "--federation-config",
        " ".join(
            [
                f"num-supernodes={num_supernodes}",
                *(f"{k}={_toml_value(v)}" for k, v in (federation_config or {}).items()),
            ]
        ),
        *run_config_args(overrides),
        "--stream",
    ]
    out = sys.stderr
    with claim_home(flwr_home or default_home(extra if "FLWR_HOME" in extra else None)) as (home, others):
        stop_recorded_superlink(home)  # left by a launcher of this home that was killed
        link = LocalSuperLink(home, flwr_env(home, extra))
        if others and not capture:
            print(
                f"note: another run holds {others[0]}\n      this run uses FLWR_HOME={home} and its own ports",
                file=out,
                flush=True,
            )
        try:
            link.start()
        except BaseException:  # Ctrl-C while it starts, too
            link.stop()
            raise
        logs = home / "logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"run-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{link.token[:6]}.log"
        shown = " ".join(
            c if re.fullmatch(r"[\w@%+=:,./-]+", c) else "'" + c.replace("'", "'\\''") + "'"
            for c in ["flwr", *command[1:]]
        )
        env_shown = f"FLWR_HOME={home} FLWR_LOCAL_SUPERLINK_HTTP_API_PORT={link.port} "
        if ray_address:
            env_shown += f"RAY_ADDRESS={ray_address} "
        if not capture:
            print(f"$ {env_shown}FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 {shown}", file=out, flush=True)
        lines: list[str] = []
        process = None
        stopped: str | None = None
        try:
            with open(log_path, "w") as log:
                log.write(f"$ {env_shown}{shown}\n")
                process = subprocess.Popen(
                    command,
                    env=link.env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    errors="replace",
                )
                pump = threading.Thread(
                    target=_pump,
                    daemon=True,
                    args=(
                        process.stdout,
                        log,
                        lines,
                        None if capture else sys.stdout,
                        verbose,
                        None if capture else display,
                    ),
                )
                pump.start()
                stopped = _watch(process, lines, timeout, end_grace)
                if stopped is None:
                    pump.join(timeout=30)
            if stopped is not None:
                message = (
                    f"error: {stopped}; still running: {still_running(''.join(lines), link.leftover())}; "
                    f"stopped the run\n       full log: {log_path}"
                )
                process.terminate()
                if capture:
                    lines.append(message + "\n")
                else:
                    print(message, file=out, flush=True)
                code = 124 if stopped.startswith("--timeout") else 1
                return subprocess.CompletedProcess(command, code, "".join(lines) if capture else "", "")
            status, details = run_status(link.env)
            text = "".join(lines)
            returncode = 0 if process.returncode == 0 and status == "finished:completed" else 1
            if returncode != 0:
                error = run_error(text) or details or "no error message in the log"
                message = (
                    f"error: the run did not finish ({status or 'status unknown'}"
                    f"{'; flwr run exited ' + str(process.returncode) if process.returncode else ''}): "
                    f"{error}\n       full log: {log_path}"
                )
                if capture:
                    lines.append(message + "\n")
                else:
                    print(message, file=out, flush=True)
            return subprocess.CompletedProcess(command, returncode, "".join(lines) if capture else "", "")
        finally:
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
            if not keep_superlink:
                previous = _ignore_interrupts()
                try:
                    link.stop()
                finally:
                    _restore_interrupts(previous)


def _ignore_interrupts() -> dict:
    """Ignore SIGINT while the run's processes are ended (a second Ctrl-C must not leave them behind)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}


def _restore_interrupts(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: end the run like Ctrl-C does. ``args``: the signal's name and the exit status to
    return (128 + its number)."""


def raise_stopped(signum, frame) -> None:
    """A signal handler (SIGTERM, SIGHUP) that raises :class:`Stopped`, so ``finally`` / ``with`` cleanup runs."""
    raise Stopped(signal.Signals(signum).name, 128 + signum)


# ------------------------------------------------------------------------------------------ command line
FLOWER_RUN_PROCESSES = frozenset({"flwr-simulation", "flwr-serverapp"})
"""Processes a SuperLink starts for a run: while one lives under it, a run is in progress there."""


def flower_superlinks(home: str | os.PathLike) -> list[int]:
    """PIDs of the ``flower-superlink`` processes that ``flwr run`` itself started for Flower home ``home`` (its
    local SuperLink, detached, which outlives a failed ``flwr run``): provably that home's, as their command line
    names its database or log file (``<home>/local-superlink/state.db`` / ``superlink.log``). Linux (``/proc``)."""
    runtime = Path(home).expanduser().resolve() / "local-superlink"
    own = {str(runtime / "state.db"), str(runtime / "superlink.log")}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        argv = _argv(int(proc.name))
        if not any(Path(a).name == "flower-superlink" for a in argv):
            continue
        named = {
            str(Path(b).expanduser().resolve())
            for a, b in zip(argv, argv[1:])
            if a in ("--database", "--log-file") and b
        }
        if named & own:
            found.append(int(proc.name))
    return found


def stop_main(flwr_home: str | None) -> int:
    """``stop``: stop SuperLinks (and their runs' processes) recorded by launchers of this home that are gone, and
    the local SuperLink a plain ``flwr run`` left in it (:func:`flower_superlinks`) unless a run is in progress on
    it; says what it cannot see."""
    base = Path(flwr_home).expanduser().resolve() if flwr_home else default_home()
    homes = [base, *sorted(base.glob("concurrent-*"))] if base.is_dir() else []
    if not Path("/proc").is_dir():
        print(
            f"cannot look for processes on this system (no /proc): any SuperLink left in {base} was not stopped; "
            "end it yourself (its command line names the Flower home)"
        )
        return 0
    stopped, running = [], []
    for home in homes:
        holder = _home_held(home)
        if holder:
            running.append(f"{home}: {holder}")
            continue
        stopped += stop_recorded_superlink(home)
        for pid in flower_superlinks(home):
            sessions: set[int] = set()
            members = run_processes("", [pid], sessions)
            busy = [p for p in members if FLOWER_RUN_PROCESSES & {Path(a).name for a in _argv(p)}]
            if busy:
                running.append(f"{home}: the SuperLink of a plain `flwr run` (pid {pid}) runs {busy}")
                continue
            stopped += sorted(
                terminate(members, 15.0, lambda pid=pid, sessions=sessions: run_processes("", [pid], sessions))
            )
    if stopped:
        print(f"stopped {len(stopped)} process(es) of earlier runs: {stopped}")
    else:
        print(
            f"no SuperLink of an earlier run is left in {base} (looked for launchers' records and for "
            "flower-superlink processes naming its local-superlink/ database or log)"
        )
    for line in running:
        print(f"a run is in progress (not touched; stop it with Ctrl-C or by ending its launcher): {line}")
    return 0


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of ``run`` or ``stop``."""
    prog = f"python -m fedrec_flwr.launch {command}"
    if command == "stop":
        stop = argparse.ArgumentParser(
            prog=prog,
            allow_abbrev=False,
            description="stop SuperLinks left by launchers that were killed (never a running run)",
        )
        stop.add_argument("--flwr-home", default=None, help="Flower home (default $FLWR_HOME, else ~/.flwr)")
        return stop
    run = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,  # --verbos is refused, not read as --verbose
        description="flwr run the app on a fresh local SuperLink, then stop it. "
        "Flags may come anywhere among the key=value overrides.",
    )
    run.add_argument(
        "--num-supernodes",
        type=int,
        default=None,
        help="simulated SuperNodes (default: ceil(users / users-per-node); another number is refused)",
    )
    run.add_argument("--flwr-home", default=None, help="Flower home (default $FLWR_HOME, else ~/.flwr)")
    run.add_argument(
        "--ray-address",
        default=None,
        help="host:port of an existing Ray cluster's head (ray start --head) to run the client actors on",
    )
    run.add_argument(
        "--federation-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another flwr simulation-config key, e.g. client-resources-num-cpus=1 (repeatable)",
    )
    run.add_argument(
        "--timeout",
        default=None,
        metavar="SECONDS",  # checked in parse_args: one error line
        help="stop the run SECONDS after flwr run starts (exit 124), naming what was still running",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="print Flower's whole log (default: progress, warnings, "
        "errors; the whole log is always in <FLWR_HOME>/logs/)",
    )
    run.add_argument("--debug", action="store_true", help="print tracebacks of errors caught before the run starts")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides")
    return run


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, Any], dict[str, Any]]:
    """The parsed command line, the run-config overrides and the federation config (flags anywhere).

    Raises:
        ConfigError: a malformed override (see :func:`parse_override`).
        SystemExit: no or an unknown command, ``--help``, or a bad flag (argparse's message, status 2).
    """
    argv = list(argv)
    if not argv or argv[0] not in ("run", "stop"):
        print(__doc__.split("Command line::")[1].split("``key=value``")[0].strip("\n"), file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    args = build_parser(argv[0]).parse_intermixed_args(argv[1:])
    args.command = argv[0]
    if args.command != "run":
        return args, {}, {}
    args.timeout, overrides, federation = parse_run_options(args.overrides, args.federation_config, args.timeout)
    return args, overrides, federation


def parse_run_options(
    pairs: Sequence[str], federation_pairs: Sequence[str] = (), timeout: str | float | None = None
) -> tuple[float | None, dict[str, Any], dict[str, Any]]:
    """``run``'s values from their words: ``(timeout in seconds or None, run-config overrides, federation config)``.

    Args:
        pairs: the ``key=value`` run-config overrides (:func:`parse_override`, each key once).
        federation_pairs: the ``--federation-config`` values (checked by :func:`check_federation_config`).
        timeout: ``--timeout``'s text.

    Raises:
        ConfigError: a timeout that is not a positive number, a malformed override, a key given twice, or a
            federation setting Flower refuses.
    """
    if timeout is not None:
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = math.nan
        if not seconds > 0:
            raise ConfigError(f"--timeout {timeout}: must be a positive number of seconds")
        timeout = seconds
    defaults = default_mapping(PROJECT_ROOT / "pyproject.toml")
    overrides = _once([parse_override(pair, defaults) for pair in pairs], "run-config key")
    federation = _once(
        [parse_override(pair, {}, "--federation-config") for pair in federation_pairs], "--federation-config key"
    )
    check_federation_config(federation)
    return timeout, overrides, federation


def _once(pairs: Sequence[tuple[str, Any]], what: str) -> dict[str, Any]:
    """``pairs`` as a mapping; a key given twice is refused (silently keeping the last would hide a typo).

    Raises:
        ConfigError: naming the key and both values.
    """
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ConfigError(f"{what} {key!r} is given twice ({key}={found[key]!r} and {key}={value!r}): give it once")
        found[key] = value
    return found


RAY_CONNECT_TIMEOUT = 5.0
"""Seconds :func:`check_ray_address` waits for a TCP connection to the Ray head."""


def check_ray_address(address: str, timeout: float = RAY_CONNECT_TIMEOUT) -> None:
    """Check that ``--ray-address`` (``host:port`` of a Ray head's GCS, or ``ray://host:port``; ``auto`` is left to
    Ray) accepts a TCP connection, before anything starts: Ray's ``ray.init`` inside the simulation process retries
    an unreachable address without end, so ``flwr run`` would wait silently.

    Raises:
        ConfigError: the address has no ``host:port`` form, or nothing answers there within ``timeout`` seconds
            (names the address and the error).
    """
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--ray-address {address!r}: expected host:port of a Ray head (as `ray start --head "
            "--port PORT` prints it), e.g. 127.0.0.1:6379"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise ConfigError(
            f"--ray-address {address!r}: no Ray head answers there ({type(err).__name__}: {err}); start "
            f"one with `ray start --head --port {port}` on {host}, or leave --ray-address out to start "
            "a local Ray instance"
        ) from None


def check_federation_config(federation: Mapping[str, Any]) -> None:
    """Check ``--federation-config`` keys and values as ``flwr run`` will (its own
    ``flwr.supercore.utils.simulation_config_from_json``: the fields of Flower's ``SimulationConfig``, each of its
    type), before anything starts; ``num-supernodes`` has its own flag.

    Raises:
        ConfigError: an unknown key (with the known ones) or a value of the wrong type or range, naming both.
    """
    from flwr.proto.federation_config_pb2 import SimulationConfig
    from flwr.supercore.utils import simulation_config_from_json

    known = sorted(f.name.replace("_", "-") for f in SimulationConfig.DESCRIPTOR.fields if f.name != "num_supernodes")
    for key, value in federation.items():
        if key == "num-supernodes":
            raise ConfigError(f"--federation-config num-supernodes={value}: use --num-supernodes {value}")
        if key not in known:
            raise ConfigError(
                f"--federation-config {key}={value}: Flower knows no simulation setting {key!r} "
                f"(known: {', '.join(known)})"
            )
        try:
            simulation_config_from_json({key.replace("-", "_"): value})
        except (TypeError, ValueError) as err:
            raise ConfigError(f"--federation-config {key}={value}: Flower refuses the value ({err})") from None


PATH_ENV = ("FEDREC_DATA_DIR", "FEDREC_FLWR_CACHE")
"""Environment variables naming a folder that the ClientApps read (:data:`fedrec_flwr.app.runtime.DATA_DIR_ENV`, the
split cache): made absolute against the caller's working folder before anything starts, as the processes started
later inherit them and may run in another folder (a SuperNode's, Ray's)."""


def absolute_path_env(env: dict | None = None) -> dict[str, str]:
    """Make each set variable of :data:`PATH_ENV` in ``env`` (default ``os.environ``, which the processes started
    later inherit) absolute, against this process's working folder; returns what was changed.

    Raises:
        FedRecError: ``FEDREC_DATA_DIR`` names no folder (the message gives the value and the folder it was resolved
            against), before anything starts.
    """
    env = os.environ if env is None else env
    changed = {}
    for name in PATH_ENV:
        value = env.get(name)
        if not value:
            continue
        path = Path(value).expanduser().resolve()
        if name == "FEDREC_DATA_DIR" and not path.is_dir():
            raise FedRecError(
                f"${name} = {value!r}: no such folder ({path}, resolved against the working folder {os.getcwd()})"
            )
        if str(path) != value:
            env[name] = changed[name] = str(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def command() -> int:
        args, overrides, federation = parse_args(argv)
        if args.command == "stop":
            return stop_main(args.flwr_home)
        absolute_path_env()
        result = flwr_run(
            overrides,
            num_supernodes=args.num_supernodes,
            flwr_home=args.flwr_home,
            federation_config=federation,
            ray_address=args.ray_address,
            verbose=args.verbose,
            timeout=args.timeout,
        )
        return result.returncode

    return guarded(command, debug="--debug" in argv)


def guarded(command: Callable[[], int], debug: bool = False) -> int:
    """Run ``command`` as the command line does and return its exit status: SIGTERM / SIGHUP end it like Ctrl-C
    (128 + the signal's number, after one line saying what was stopped), and a :class:`FedRecError` is one
    ``error:`` line on stderr and status 2 (``debug``: its traceback first)."""
    previous = {sig: signal.signal(sig, raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return command()
    except KeyboardInterrupt as stop:
        print(
            f"\nstopped ({stop.args[0] if stop.args else 'Ctrl-C'}): the run, its SuperLink and Ray were ended",
            file=sys.stderr,
        )
        return stop.args[1] if len(stop.args) > 1 else 128 + signal.SIGINT
    except FedRecError as err:
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
