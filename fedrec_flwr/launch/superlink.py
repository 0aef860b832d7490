"""The local SuperLink a launcher starts, owns and stops, the Flower homes runs hold while they use one, and the
``stop`` command that ends what a killed launcher (or a plain ``flwr run``) left behind."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from fedrec_flwr.errors import ConfigError, FedRecError
from fedrec_flwr.io import atomic_write_text
from fedrec_flwr.launch.env import default_home
from fedrec_flwr.launch.processes import TOKEN_ENV, cmdline, process_argv, run_processes, start_time, terminate

LOCK_FILE = "fedrec-launch.lock"
"""In a Flower home: locked (``flock``) by the launcher using that home; holds its PID and command line."""

RECORD_FILE = Path("local-superlink") / "fedrec-launch.json"
"""In a Flower home: the SuperLink a launcher started there (PID, start time, token, ports)."""

MAX_CONCURRENT = 16
"""Flower homes a checkout offers to concurrent runs: the home itself and ``concurrent-1`` .. ``concurrent-15``."""


def superlink_pids(env: Mapping[str, str] | None = None) -> list[int]:
    """PIDs of local ``flower-superlink`` processes whose control API uses this environment's port."""
    env = env or os.environ
    port = env.get("FLWR_LOCAL_CONTROL_API_PORT", "39093")
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in command and f"127.0.0.1:{port}" in command:
            pids.append(int(proc.name))
    return pids


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` (free now; bind it soon)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
        [pid] if pid > 1 and start_time(pid) == record.get("start-time") and "flower-superlink" in cmdline(pid) else []
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
        env: the environment for the SuperLink and ``flwr run`` (from :func:`~fedrec_flwr.launch.env.flwr_env`); its
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
                self.env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(free_port())
                self.env["FLWR_LOCAL_CONTROL_API_PORT"] = str(free_port())
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
        argv = process_argv(int(proc.name))
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
            busy = [p for p in members if FLOWER_RUN_PROCESSES & {Path(a).name for a in process_argv(p)}]
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
