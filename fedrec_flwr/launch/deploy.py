"""Run the app on real Flower processes: one ``flower-superlink`` and N ``flower-supernode`` on one host.

This is Flower's deployment runtime (not the simulation engine): every SuperNode is its own OS process that connects
to the SuperLink over the network and runs one ClientApp process per message; the ServerApp runs in a process the
SuperLink starts. :class:`Deployment` starts them on free ports of 127.0.0.1, writes a Flower CLI connection for that
SuperLink into a private ``FLWR_HOME``, submits the app with ``flwr run <project> <connection> --stream``, waits for
the results folder, and ends every process it started (by process group, SIGTERM then SIGKILL), also when something
fails.

What flwr 1.42 offers, and what is used here:

* One HTTP(S) port per SuperLink (``--host``/``--port``) serves the Fleet API (SuperNodes), the Control API
  (``flwr`` CLI) and the Runtime API (ServerApp). Each SuperNode serves its own Runtime API (its ClientApp
  processes connect to it) on ``--host``/``--port``, so every SuperNode on one host needs its own port.
  (``--clientappio-api-address`` / ``--serverappio-api-address`` of older releases are rejected in 1.42.)
* The CLI names a SuperLink by a *connection* in ``$FLWR_HOME/config.toml`` (``[superlink.<name>]`` with
  ``address`` and either ``insecure = true`` or ``root-certificates = "<absolute path of the CA cert>"``), used as
  ``flwr run <app> <name>``. The ``[tool.flwr.federations]`` tables of ``pyproject.toml`` are legacy in 1.42.
* TLS: SuperLink ``--ssl-ca-certfile --ssl-certfile --ssl-keyfile`` (one certificate for all its APIs);
  SuperNode ``--root-certificates <ca>``; CLI ``root-certificates`` in the connection.
  :func:`~fedrec_flwr.launch.tls.make_tls_files` writes a CA and a server certificate for 127.0.0.1/localhost with the
  ``cryptography`` package.
* SuperNode authentication (needs TLS): SuperLink ``--enable-supernode-auth``; each SuperNode has an EC key pair
  (NIST curve, OpenSSH format), its public key registered with ``flwr supernode register <key.pub> <connection>``
  before it connects with ``--auth-supernode-private-key <key>``. Unregistered SuperNodes are refused.

Node config: every SuperNode is started with ``--node-config "partition-id=<i> num-partitions=<N>"``; it serves the
users ``i * users-per-node ..``. :func:`~fedrec_flwr.launch.supernode.check_node_config` (and the ``supernode``
command below, a checking wrapper around ``flower-supernode``: :mod:`fedrec_flwr.launch.supernode`) refuses a bad node
config or a SuperLink address where nothing listens *before* ``flower-supernode`` starts (which would otherwise retry
forever, and a bad node would only be noticed by the server once a run starts).

Command line::

    python -m fedrec_flwr.launch.deploy supernode --partition-id I --num-partitions N \\
        [--dataset D --users-per-node K --data-dir DIR --cache-dir DIR --run-config "k=v ..."] \\
        [flower-supernode arguments, e.g. --superlink HOST:PORT --root-certificates ca.crt --port 9095]

    --dataset, --users-per-node, --run-config: check only (num-partitions against the dataset's users); the run
        itself uses its run config.
    --data-dir DIR, --cache-dir DIR: used for the check, and passed on to the node as FEDREC_DATA_DIR /
        FEDREC_FLWR_CACHE (absolute) in flower-supernode's environment; its ClientApps read them when the run
        config's data-dir / cache-dir is empty (FEDREC_DATA_DIR: not for dataset generic).

See ``scripts/deploy_local.py`` for a whole deployed run on one machine.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.launch.checks import shipped_files
from fedrec_flwr.launch.deploy_processes import (
    CONNECTION,
    DeploymentError,
    Started,
    await_results,
    connection_config,
    follow_log,
    port_taken,
    register_node_keys,
    superlink_command,
    supernode_args,
    wait_healthy,
)
from fedrec_flwr.launch.env import PROJECT_ROOT, console_script, flwr_env
from fedrec_flwr.launch.overrides import run_config_args
from fedrec_flwr.launch.processes import alive, end_processes, processes_with_env, session_members
from fedrec_flwr.launch.superlink import free_port
from fedrec_flwr.launch.supernode import supernode_main
from fedrec_flwr.launch.tls import NodeKeys, TLSFiles, make_node_keys, make_tls_files

MARKER_ENV = "FEDREC_DEPLOYMENT_ID"
"""Environment variable (a fresh id per :class:`Deployment`) every started process and its children inherit, so
processes that left their process group (Flower detaches the SuperLink's SuperExec) are found and ended too."""

SUPERNODE_READY = "SuperNode ID:"
"""What a SuperNode logs once the SuperLink has accepted it (flwr 1.42)."""


def app_snapshot(dest: str | os.PathLike, source: str | os.PathLike = PROJECT_ROOT) -> Path:
    """Copy the files of the Flower app that ``flwr run`` would ship (``pyproject.toml`` and what its
    ``fab-include`` selects, by Flower's own filter) into ``dest``, for ``flwr run <dest>``; returns ``dest``.

    ``flwr run .`` (flwr 1.42) reads every file under the project folder before it filters them: with the virtual
    environment in ``.venv/`` that is ~48,000 files (7.5-13 s here). The snapshot walks only non-hidden folders and
    holds exactly the same app (0.7 MB), so its FAB builds at once.
    """
    import shutil

    source, dest = Path(source), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for relative in shipped_files(source):
        (dest / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / relative, dest / relative)
    return dest


@dataclass
class RunOutcome:
    """What :meth:`Deployment.run` returns."""

    folder: Path
    """``results-dir/<run-name>/``."""
    output: str
    """Everything ``flwr run --stream`` printed (the ServerApp's log)."""
    seconds: float
    """Wall time from submitting the run until its results folder was complete."""
    returncode: int

    def summary(self) -> dict:
        return json.loads((self.folder / "summary.json").read_text())

    def metrics(self) -> list[dict]:
        return json.loads((self.folder / "metrics.json").read_text())


@dataclass
class Deployment:
    """A SuperLink and SuperNodes on one host, as a context manager that ends all of them on exit.

    Args:
        workdir: private folder: ``flwr-home/`` (``FLWR_HOME`` of the SuperLink and of the CLI, with the CLI's
            ``config.toml``), ``supernode-<i>/flwr-home/`` (each SuperNode's), ``logs/<process>.log``, ``tls/``,
            ``keys/``.
        num_supernodes: SuperNodes to start, with ``partition-id`` 0..N-1 and ``num-partitions`` N.
        tls: TLS on the SuperLink (Fleet, Control and Runtime APIs), with a CA made by
            :func:`~fedrec_flwr.launch.tls.make_tls_files`.
        auth: SuperNode authentication (needs ``tls``): ``--enable-supernode-auth`` and every SuperNode's public
            key registered through the ``flwr`` CLI before it starts.
        host: interface to bind (loopback by default).
        node_configs: per-SuperNode node config strings instead of the default ones (``None`` in the list: start
            that SuperNode with no ``--node-config`` at all); its length is the number of SuperNodes.
        check_nodes: start SuperNodes through the checking wrapper (``python -m fedrec_flwr.launch.deploy supernode``)
            instead of ``flower-supernode`` directly (only for default node configs).
        env_extra: more environment variables for every process.
        project: the Flower app folder passed to ``flwr run`` (default: this project; :func:`app_snapshot` makes
            a lean copy whose FAB builds in a fraction of the time).

    Use::

        with Deployment(tmp, num_supernodes=3, tls=True, auth=True) as deployment:
            outcome = deployment.run({"users-per-node": 315, "results-dir": ..., "run-name": "a"})
    """

    workdir: Path
    num_supernodes: int = 1
    tls: bool = False
    auth: bool = False
    host: str = "127.0.0.1"
    node_configs: Sequence[str | None] | None = None
    check_nodes: bool = True
    env_extra: Mapping[str, str] | None = None
    project: Path = PROJECT_ROOT
    startup_timeout: float = 180.0
    processes: list[Started] = field(default_factory=list)
    port: int = 0
    tls_files: TLSFiles | None = None
    node_ids: list[int] = field(default_factory=list)
    superlink: Started | None = None
    _node_specs: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()
        self.home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.marker = (MARKER_ENV, uuid.uuid4().hex)
        if self.auth and not self.tls:
            raise ConfigError(
                "SuperNode authentication needs TLS (flwr refuses --enable-supernode-auth with "
                "--insecure): set tls as well"
            )
        if self.node_configs is not None:
            self.num_supernodes = len(self.node_configs)
        if self.num_supernodes < 1:
            raise ConfigError(f"num_supernodes must be >= 1, got {self.num_supernodes}")

    # -- environment ----------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def env(self, home: Path | None = None) -> dict[str, str]:
        """Environment of a started process: ``FLWR_HOME`` (default: the SuperLink's and the CLI's), no runtime
        dependency installation, no update check, one OpenMP thread, and this deployment's marker."""
        extra = {
            self.marker[0]: self.marker[1],
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        extra.update(self.env_extra or {})
        return flwr_env(home or self.home, extra)

    def _spawn(self, name: str, command: Sequence[str], home: Path | None = None) -> Started:
        """Start ``command`` in its own session, output to ``logs/<name>.log``."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        if home is not None:
            home.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                list(command),
                env=self.env(home),
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.workdir,
            )
        started = Started(name, process, log)
        self.processes.append(started)
        return started

    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI with this deployment's ``FLWR_HOME`` (its connection :data:`CONNECTION`)."""
        return subprocess.run(
            [console_script("flwr"), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.workdir,
        )

    # -- start ----------------------------------------------------------------------------------------------
    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """SuperLink, CLI connection, (auth: key registration), SuperNodes; returns once all SuperNodes joined."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        if self.tls:
            self.tls_files = make_tls_files(self.workdir / "tls", hosts=(self.host, "localhost"))
        self.start_superlink()
        self.write_cli_config()
        keys = self.register_supernodes() if self.auth else [None] * self.num_supernodes
        nodes = [self.start_supernode(i, keys[i]) for i in range(self.num_supernodes)]
        self.wait_supernodes(nodes)

    def start_superlink(self, attempts: int = 3) -> Started:
        """Start ``flower-superlink`` on a free port and wait for its ``/health``; a port another process took
        between choosing and binding it is replaced (up to ``attempts`` times)."""
        for attempt in range(attempts):
            self.port = free_port(self.host)
            link = self._spawn("superlink", superlink_command(self.host, self.port, self.tls_files, self.auth))
            try:
                wait_healthy(link, self.address, self.tls_files, self.startup_timeout)
            except DeploymentError:
                if attempt + 1 < attempts and port_taken(link):
                    self.processes.remove(link)
                    continue
                raise
            self.superlink = link
            return link
        raise AssertionError("not reached")

    def write_cli_config(self) -> Path:
        """``$FLWR_HOME/config.toml`` with connection :data:`CONNECTION` (the default) for this SuperLink."""
        path = self.home / "config.toml"
        path.write_text(connection_config(self.address, self.tls_files))
        return path

    def register_supernodes(self) -> list[NodeKeys]:
        """Make a key pair per SuperNode and register the public keys (:func:`register_node_keys`); the node ids the
        SuperLink gave them are in :attr:`node_ids`."""
        keys = [make_node_keys(self.workdir / "keys", f"supernode-{i}") for i in range(self.num_supernodes)]
        self.node_ids = register_node_keys(keys, self.env(), self.workdir, self.startup_timeout)
        return keys

    def supernode_command(self, index: int, keys: NodeKeys | None = None) -> list[str]:
        """The command line of SuperNode ``index`` (the checking wrapper or ``flower-supernode`` itself)."""
        node_config = (
            self.node_configs[index]
            if self.node_configs is not None
            else f"partition-id={index} num-partitions={self.num_supernodes}"
        )
        flower_args = supernode_args(self.address, self.host, self.tls_files, keys)
        if self.check_nodes and self.node_configs is None:
            return [
                sys.executable,
                "-m",
                "fedrec_flwr.launch.deploy",
                "supernode",
                "--partition-id",
                str(index),
                "--num-partitions",
                str(self.num_supernodes),
                *flower_args,
            ]
        return [
            console_script("flower-supernode"),
            *flower_args,
            *(["--node-config", node_config] if node_config is not None else []),
        ]

    def start_supernode(self, index: int, keys: NodeKeys | None = None, name: str | None = None) -> Started:
        """Start SuperNode ``index`` (its own ``FLWR_HOME`` ``<workdir>/<name>/flwr-home``: Flower installs the
        app there without a lock, so SuperNodes on one host must not share one)."""
        name = name or f"supernode-{index}"
        self._node_specs[name] = (index, keys)
        return self._spawn(name, self.supernode_command(index, keys), home=self.workdir / name / "flwr-home")

    def wait_supernodes(self, nodes: Sequence[Started]) -> None:
        """Wait until every SuperNode logged that the SuperLink accepted it."""
        deadline = time.monotonic() + self.startup_timeout
        waiting = list(nodes)
        retries = {node.name: 2 for node in nodes}
        while waiting:
            for node in list(waiting):
                if SUPERNODE_READY in node.tail(100_000):
                    waiting.remove(node)
                elif node.process.poll() is not None and retries[node.name] > 0 and port_taken(node):
                    retries[node.name] -= 1  # its Runtime API port was taken meanwhile: a new port, same node
                    self.processes.remove(node)
                    waiting[waiting.index(node)] = self.start_supernode(*self._node_specs[node.name], name=node.name)
                elif node.process.poll() is not None:
                    raise DeploymentError(f"{node.name} exited with code {node.process.returncode}:\n{node.tail()}")
            if waiting and time.monotonic() > deadline:
                raise DeploymentError(
                    f"{[n.name for n in waiting]} did not join the SuperLink within "
                    f"{self.startup_timeout:.0f} s:\n{waiting[0].tail()}"
                )
            if waiting:
                time.sleep(0.5)

    # -- run ------------------------------------------------------------------------------------------------
    def run(self, overrides: Mapping[str, Any], timeout: float = 1800.0, echo: bool = False) -> RunOutcome:
        """``flwr run <project> <connection> --run-config ... --stream``; returns once ``summary.json`` is written.

        ``overrides`` must name an absolute ``results-dir`` and a ``run-name`` (the folder to wait for).

        Raises:
            DeploymentError: the run ended (or the SuperLink died, or ``timeout`` passed) without a complete results
                folder; the message holds the tail of the streamed log, where the ServerApp's error is.
        """
        if self.superlink is None:
            raise DeploymentError("the deployment is not started (use it as a context manager, or call start())")
        overrides = dict(overrides)
        folder = new_results_folder(overrides)
        command = [
            console_script("flwr"),
            "run",
            str(self.project),
            CONNECTION,
            *run_config_args(overrides),
            "--stream",
        ]
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"flwr-run-{overrides['run-name']}.log"
        if echo:
            print("$ " + shlex.join(["flwr", *command[1:]]), file=sys.stderr, flush=True)
        started = time.monotonic()
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                command,
                env=self.env(),
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.workdir,
            )
            self.processes.append(Started("flwr-run", process, log))
            reason, shown = await_results(process, self.superlink, folder, log, started, timeout, echo)
        seconds = time.monotonic() - started
        if process.poll() is None:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                end_processes([process.pid])
        output = log.read_text(errors="replace")
        if echo:
            follow_log(log, shown)
        if reason is not None:
            raise DeploymentError(f"{reason}; logs in {self.logs}. flwr run output:\n{output[-4000:]}")
        return RunOutcome(folder, output, seconds, process.returncode if process.returncode is not None else -1)

    # -- stop -----------------------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        return [p.process.pid for p in self.processes]

    def leftover(self) -> list[int]:
        """Processes of this deployment still running (started ones, their groups, and marked descendants)."""
        running = session_members(self.pids())
        running.update(p for p in processes_with_env(*self.marker) if alive(p))
        running.discard(os.getpid())
        return sorted(running)

    def stop(self, timeout: float = 10.0) -> list[int]:
        """End every process this deployment started, with their process groups and marked descendants."""
        pids = end_processes(self.pids(), self.marker, timeout)
        for started in self.processes:
            try:
                started.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        return pids


def new_results_folder(overrides: Mapping[str, Any]) -> Path:
    """``results-dir/<run-name>/`` of ``overrides``, the folder :meth:`Deployment.run` waits for.

    Raises:
        ConfigError: ``results-dir`` is not absolute, ``run-name`` is missing, or the folder already holds a
            finished run (its ``summary.json`` would end the wait at once).
    """
    if not overrides.get("run-name") or not Path(str(overrides.get("results-dir", ""))).is_absolute():
        raise ConfigError("Deployment.run needs an absolute 'results-dir' and a 'run-name'")
    folder = Path(overrides["results-dir"]) / overrides["run-name"]
    if (folder / "summary.json").exists():
        raise ConfigError(
            f"results folder {folder} already holds a finished run (summary.json); set another "
            "'run-name' or delete the folder"
        )
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("Command line::")[1].split("See ")[0].strip("\n"))
        return 0 if argv else 2
    if argv[0] == "supernode":
        return supernode_main(argv[1:])
    print(f"unknown command {argv[0]!r} (expected: supernode)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
