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
  SuperNode ``--root-certificates <ca>``; CLI ``root-certificates`` in the connection. :func:`make_tls_files`
  writes a CA and a server certificate for 127.0.0.1/localhost with the ``cryptography`` package.
* SuperNode authentication (needs TLS): SuperLink ``--enable-supernode-auth``; each SuperNode has an EC key pair
  (NIST curve, OpenSSH format), its public key registered with ``flwr supernode register <key.pub> <connection>``
  before it connects with ``--auth-supernode-private-key <key>``. Unregistered SuperNodes are refused.

Node config: every SuperNode is started with ``--node-config "partition-id=<i> num-partitions=<N>"``; it serves the
users ``i * users-per-node ..``. :func:`check_node_config` (and the ``supernode`` command below, a checking wrapper
around ``flower-supernode``) refuses a bad node config or a SuperLink address where nothing listens *before*
``flower-supernode`` starts (which would otherwise retry forever, and a bad node would only be noticed by the server
once a run starts).

Command line::

    python -m fedrec_flwr.deploy supernode --partition-id I --num-partitions N \\
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

import argparse
import datetime as _dt
import ipaddress
import json
import os
import shlex
import socket
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedrec_flwr.errors import ConfigError, FedRecError
from fedrec_flwr.launch import (
    PROJECT_ROOT,
    _alive,
    _group_members,
    flwr_env,
    processes_with_env,
    run_config_args,
    shipped_files,
    terminate,
)

CONNECTION = "fedrec-deploy"
"""Name of the SuperLink connection written into the deployment's ``$FLWR_HOME/config.toml``."""

MARKER_ENV = "FEDREC_DEPLOYMENT_ID"
"""Environment variable (a fresh id per :class:`Deployment`) every started process and its children inherit, so
processes that left their process group (Flower detaches the SuperLink's SuperExec) are found and ended too."""

DEFAULT_SUPERLINK = "127.0.0.1:8000"
"""``flower-supernode``'s default ``--superlink`` in flwr 1.42."""

CACHE_DIR_ENV = "FEDREC_FLWR_CACHE"
"""Environment variable of the default cache folder (:func:`fedrec_flwr.data.loaders.default_cache_dir`)."""

SUPERNODE_READY = "SuperNode ID:"
"""What a SuperNode logs once the SuperLink has accepted it (flwr 1.42)."""


class DeploymentError(RuntimeError):
    """A deployed process failed to start, or a run did not produce its results folder."""


class NodeConfigError(ConfigError):
    """A SuperNode's node config (or its SuperLink address) cannot serve a run."""


# ------------------------------------------------------------------------------------------------ small helpers
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` (free now; bind it soon)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> ``(host, port)``.

    Raises:
        NodeConfigError: no port, or a port that is not an integer in 1..65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise NodeConfigError(f"SuperLink address {address!r}: expected HOST:PORT")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 < number < 65536:
        raise NodeConfigError(f"SuperLink address {address!r}: port {port!r} is not an integer in 1..65535")
    return host.strip("[]"), number


def listening(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def check_superlink_listening(address: str, timeout: float = 2.0) -> None:
    """Raise :class:`NodeConfigError` ``no SuperLink listening at HOST:PORT`` unless a TCP connection succeeds."""
    host, port = split_address(address)
    if not listening(host, port, timeout):
        raise NodeConfigError(
            f"no SuperLink listening at {host}:{port} (flower-supernode --superlink): start flower-superlink first, "
            "or fix the address"
        )


def parse_node_config(text: str) -> dict[str, Any]:
    """``'partition-id=0 num-partitions=3 name="a b"'`` -> mapping; values are TOML (a non-TOML value stays a str).

    Raises:
        NodeConfigError: an entry is not ``key=value``, or a key is given twice with different values.
    """
    config: dict[str, Any] = {}
    for pair in shlex.split(text or ""):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise NodeConfigError(f"node config entry {pair!r} is not key=value")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        merge_setting(config, key.strip(), parsed, f"{text!r}", f"{text!r}")
    return config


def merge_setting(target: dict[str, Any], key: str, value: Any, source: str, earlier: str) -> None:
    """Set ``target[key] = value`` unless it already holds a different value.

    Raises:
        NodeConfigError: ``key`` is already set to another value; the message names both values and where each
            came from (``earlier``, ``source``), e.g. ``--partition-id 0`` against ``--node-config "partition-id=1"``.
    """
    if key in target and (target[key] != value or type(target[key]) is not type(value)):
        raise NodeConfigError(
            f"'{key}' is given twice with different values: {target[key]!r} ({earlier}) and "
            f"{value!r} ({source}); give it once"
        )
    target[key] = value


def format_node_config(config: Mapping[str, Any]) -> str:
    """The ``--node-config`` string of a mapping (strings quoted as TOML)."""
    parts = []
    for key, value in config.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _int_key(config: Mapping[str, Any], key: str) -> int:
    if key not in config:
        raise NodeConfigError(
            f"node config has no '{key}': start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<N>"'
        )
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise NodeConfigError(f"node config '{key}' = {value!r}: expected an integer")
    return value


def check_node_config(node_config: Mapping[str, Any], run_config: Mapping[str, Any] | None = None) -> range | None:
    """Check a SuperNode's node config before it starts; returns the users it will serve when ``run_config`` says.

    Always: ``partition-id`` and ``num-partitions`` are integers with ``0 <= partition-id < num-partitions``.
    With ``run_config`` (kebab-case overrides of the defaults, e.g. ``dataset``, ``data-dir``, ``users-per-node``):
    the dataset is loaded (cached split) and ``num-partitions`` must equal ``ceil(users / users-per-node)``, and the
    partition's user block is computed with :func:`fedrec_flwr.app.runtime.node_users` (the same check a ClientApp
    makes when the server's identify query arrives).

    Raises:
        NodeConfigError: a key is missing, not an integer, or out of range; the message names the key.
        DataError: the dataset cannot be loaded.
    """
    pid = _int_key(node_config, "partition-id")
    num = _int_key(node_config, "num-partitions")
    if num < 1:
        raise NodeConfigError(f"node config 'num-partitions' = {num}: expected at least 1")
    if not 0 <= pid < num:
        raise NodeConfigError(
            f"node config 'partition-id' = {pid} is out of range: num-partitions = {num}, so "
            f"partition ids run 0..{num - 1}"
        )
    if run_config is None:
        return None
    from fedrec_flwr.app.runtime import load_split_for, node_users
    from fedrec_flwr.config import RunConfig, default_mapping

    mapping = default_mapping()
    mapping.update(run_config)
    config = RunConfig.from_mapping(mapping)
    num_users = load_split_for(config).num_users
    needed = -(-num_users // config.users_per_node)
    if num != needed:
        raise NodeConfigError(
            f"node config 'num-partitions' = {num}, but {config.dataset} has {num_users} users and users-per-node = "
            f"{config.users_per_node}, which needs exactly {needed} SuperNodes (partition-id 0..{needed - 1})"
        )
    try:
        return node_users(config, node_config, num_users)
    except ConfigError as err:
        raise NodeConfigError(str(err)) from None


# ------------------------------------------------------------------------------------- TLS and SuperNode keys
@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a private CA and a server certificate it signed (SANs: the given hosts)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_tls_files(
    folder: str | os.PathLike, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 30
) -> TLSFiles:
    """Write ``ca.crt``, ``server.pem`` and ``server.key`` (EC P-256) into ``folder`` (keys readable by owner only).

    The server certificate carries ``hosts`` as subject alternative names (IP addresses as IP SANs), which is what
    SuperNodes and the ``flwr`` CLI check against the address they dial. For production, use certificates from
    your own CA; this is for tests and single-host deployments.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.UTC) - _dt.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedrec-flwr test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        files.server_key,
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )
    return files


@dataclass(frozen=True)
class NodeKeys:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH format, as flwr 1.42 reads them)."""

    private: Path
    public: Path


def make_node_keys(folder: str | os.PathLike, name: str) -> NodeKeys:
    """Write ``<name>`` (private, owner-only) and ``<name>.pub`` (``ecdsa-sha2-nistp384 ...``) into ``folder``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    keys = NodeKeys(folder / name, folder / f"{name}.pub")
    _write_private(
        keys.private,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    keys.public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
    )
    return keys


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


# ------------------------------------------------------------------------------------------------- the app
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


# ----------------------------------------------------------------------------------------------- processes
def _bin(name: str) -> str:
    """A console script of this environment (beside the interpreter)."""
    return str(Path(sys.executable).with_name(name))


def _session_members(pids: Sequence[int]) -> set[int]:
    """``pids`` that are alive, and the live members of their process groups. Every PID here was started with
    ``start_new_session=True``, so its process group ID is its PID; Linux does not reuse a PID while a group of that
    ID exists, so the group holds only its descendants, even after the leader exited."""
    found = {pid for pid in pids if _alive(pid)}
    for pid in pids:
        found.update(p for p in _group_members(pid) if _alive(p))
    return found


def end_processes(pids: Sequence[int], marker: tuple[str, str] | None = None, timeout: float = 10.0) -> list[int]:
    """End processes started in their own session (``pids``) with their process groups, and processes whose
    environment has ``marker = (name, value)``: SIGTERM, wait up to ``timeout`` s, then SIGKILL. Returns the PIDs
    signalled. Only these processes are touched."""
    targets = _session_members(pids)
    if marker:
        targets.update(processes_with_env(*marker))
    return sorted(terminate(targets, timeout, (lambda: processes_with_env(*marker)) if marker else None))


@dataclass
class Started:
    """One process a :class:`Deployment` started (in its own session: its PID is its process group)."""

    name: str
    process: subprocess.Popen
    log: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


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
        tls: TLS on the SuperLink (Fleet, Control and Runtime APIs), with a CA made by :func:`make_tls_files`.
        auth: SuperNode authentication (needs ``tls``): ``--enable-supernode-auth`` and every SuperNode's public
            key registered through the ``flwr`` CLI before it starts.
        host: interface to bind (loopback by default).
        node_configs: per-SuperNode node config strings instead of the default ones (``None`` in the list: start
            that SuperNode with no ``--node-config`` at all); its length is the number of SuperNodes.
        check_nodes: start SuperNodes through the checking wrapper (``python -m fedrec_flwr.deploy supernode``)
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
            [_bin("flwr"), *args],
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
            link = self._spawn("superlink", self._superlink_command())
            try:
                self._wait_healthy(link)
            except DeploymentError:
                if attempt + 1 < attempts and _port_taken(link):
                    self.processes.remove(link)
                    continue
                raise
            self.superlink = link
            return link
        raise AssertionError("not reached")

    def _superlink_command(self) -> list[str]:
        command = [
            _bin("flower-superlink"),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--isolation",
            "subprocess",
            "--disable-runtime-dependency-installation",
        ]
        if self.tls_files:
            command += [
                "--ssl-ca-certfile",
                str(self.tls_files.ca_cert),
                "--ssl-certfile",
                str(self.tls_files.server_cert),
                "--ssl-keyfile",
                str(self.tls_files.server_key),
            ]
        else:
            command += ["--insecure"]
        if self.auth:
            command += ["--enable-supernode-auth"]
        return command

    def _wait_healthy(self, link: Started) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not self._superlink_healthy():
            if link.process.poll() is not None:
                raise DeploymentError(f"flower-superlink exited with code {link.process.returncode}:\n{link.tail()}")
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"flower-superlink not healthy after {self.startup_timeout:.0f} s at {self.address}:\n{link.tail()}"
                )
            time.sleep(0.5)

    def _superlink_healthy(self) -> bool:
        scheme = "https" if self.tls_files else "http"
        context = ssl.create_default_context(cafile=str(self.tls_files.ca_cert)) if self.tls_files else None
        try:
            with urllib.request.urlopen(f"{scheme}://{self.address}/health", timeout=2.0, context=context) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def write_cli_config(self) -> Path:
        """``$FLWR_HOME/config.toml`` with connection :data:`CONNECTION` (the default) for this SuperLink."""
        lines = [
            "[superlink]",
            f'default = "{CONNECTION}"',
            "",
            f"[superlink.{CONNECTION}]",
            f'address = "{self.address}"',
        ]
        if self.tls_files:
            lines.append(f"root-certificates = {json.dumps(str(self.tls_files.ca_cert))}")
        else:
            lines.append("insecure = true")
        path = self.home / "config.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def register_supernodes(self) -> list[NodeKeys]:
        """Make a key pair per SuperNode and register the public keys (``flwr supernode register``, in parallel)."""
        keys = [make_node_keys(self.workdir / "keys", f"supernode-{i}") for i in range(self.num_supernodes)]
        env = self.env()
        running = [
            subprocess.Popen(
                [_bin("flwr"), "supernode", "register", str(k.public), CONNECTION, "--format", "json"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=self.workdir,
                start_new_session=True,
            )
            for k in keys
        ]
        self.node_ids = []
        for key, process in zip(keys, running):
            try:
                out, err = process.communicate(timeout=self.startup_timeout)
            except subprocess.TimeoutExpired:
                end_processes([p.pid for p in running])
                raise DeploymentError(f"flwr supernode register {key.public} timed out") from None
            try:
                reply = json.loads(out[out.index("{") :])
            except ValueError:
                reply = {}
            if process.returncode != 0 or not reply.get("success"):
                raise DeploymentError(
                    f"flwr supernode register {key.public} failed ({process.returncode}):\n{out[-2000:]}{err[-2000:]}"
                )
            self.node_ids.append(int(reply["node-id"]))
        return keys

    def supernode_command(self, index: int, keys: NodeKeys | None = None) -> list[str]:
        """The command line of SuperNode ``index`` (the checking wrapper or ``flower-supernode`` itself)."""
        node_config = (
            self.node_configs[index]
            if self.node_configs is not None
            else f"partition-id={index} num-partitions={self.num_supernodes}"
        )
        flower_args = [
            "--superlink",
            self.address,
            "--host",
            self.host,
            "--port",
            str(free_port(self.host)),
            "--isolation",
            "subprocess",
        ]
        if self.tls_files:
            flower_args += ["--root-certificates", str(self.tls_files.ca_cert)]
        else:
            flower_args += ["--insecure"]
        if keys is not None:
            flower_args += ["--auth-supernode-private-key", str(keys.private)]
        if self.check_nodes and self.node_configs is None:
            return [
                sys.executable,
                "-m",
                "fedrec_flwr.deploy",
                "supernode",
                "--partition-id",
                str(index),
                "--num-partitions",
                str(self.num_supernodes),
                *flower_args,
            ]
        return [
            _bin("flower-supernode"),
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
                elif node.process.poll() is not None and retries[node.name] > 0 and _port_taken(node):
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
        if not overrides.get("run-name") or not Path(str(overrides.get("results-dir", ""))).is_absolute():
            raise ConfigError("Deployment.run needs an absolute 'results-dir' and a 'run-name'")
        folder = Path(overrides["results-dir"]) / overrides["run-name"]
        if (folder / "summary.json").exists():
            raise ConfigError(
                f"results folder {folder} already holds a finished run (summary.json); set another "
                "'run-name' or delete the folder"
            )
        command = [_bin("flwr"), "run", str(self.project), CONNECTION, *run_config_args(overrides), "--stream"]
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
            link = self.superlink
            reason = None
            shown = 0
            while reason is None:
                if echo:
                    shown = _follow(log, shown)
                if (folder / "summary.json").is_file() and (folder / "learning_curves.png").is_file():
                    break
                if process.poll() is not None:  # stream ended: the run finished; give the files a moment
                    grace = time.monotonic() + 10.0
                    while time.monotonic() < grace and not (folder / "summary.json").is_file():
                        time.sleep(0.5)
                    if not (folder / "summary.json").is_file():
                        reason = f"flwr run ended (code {process.returncode}) without {folder / 'summary.json'}"
                    break
                if link.process.poll() is not None:
                    reason = f"flower-superlink exited with code {link.process.returncode}"
                elif time.monotonic() - started > timeout:
                    reason = f"no results after {timeout:.0f} s"
                time.sleep(0.5)
        seconds = time.monotonic() - started
        if process.poll() is None:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                end_processes([process.pid])
        output = log.read_text(errors="replace")
        if echo:
            _follow(log, shown)
        if reason is not None:
            raise DeploymentError(f"{reason}; logs in {self.logs}. flwr run output:\n{output[-4000:]}")
        return RunOutcome(folder, output, seconds, process.returncode if process.returncode is not None else -1)

    # -- stop -----------------------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        return [p.process.pid for p in self.processes]

    def leftover(self) -> list[int]:
        """Processes of this deployment still running (started ones, their groups, and marked descendants)."""
        alive = _session_members(self.pids())
        alive.update(p for p in processes_with_env(*self.marker) if _alive(p))
        alive.discard(os.getpid())
        return sorted(alive)

    def stop(self, timeout: float = 10.0) -> list[int]:
        """End every process this deployment started, with their process groups and marked descendants."""
        pids = end_processes(self.pids(), self.marker, timeout)
        for started in self.processes:
            try:
                started.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        return pids


def _port_taken(started: Started) -> bool:
    """Whether a process that exited failed to bind its port (another process took it after :func:`free_port`)."""
    return started.process.poll() is not None and "already in use" in started.tail(20_000).lower()


def _follow(path: Path, offset: int) -> int:
    """Copy what ``path`` gained since ``offset`` to stderr; returns the new offset."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return offset
    if data:
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()
    return offset + len(data)


# ------------------------------------------------------------------------------------------ supernode wrapper
def supernode_main(argv: Sequence[str]) -> int:
    """``supernode`` command: check the node config and the SuperLink address, then exec ``flower-supernode``."""
    parser = argparse.ArgumentParser(
        prog="python -m fedrec_flwr.deploy supernode",
        allow_abbrev=False,
        description="Check a SuperNode's node config, then exec flower-supernode with it. Arguments not listed "
        "here are passed to flower-supernode. The run's own settings (dataset, users-per-node, ...) "
        "come from the run config submitted with `flwr run`; --dataset, --users-per-node and "
        "--run-config only check this node against them. --data-dir and --cache-dir are passed on to "
        "the node (as FEDREC_DATA_DIR / FEDREC_FLWR_CACHE in flower-supernode's environment).",
    )
    parser.add_argument("--partition-id", default=None, help="this node's partition (0..num-partitions-1)")
    parser.add_argument("--num-partitions", default=None, help="number of SuperNodes")
    parser.add_argument(
        "--dataset",
        default=None,
        help="check only: with --users-per-node, num-partitions must fit this dataset's users "
        "(the run uses the dataset of its run config)",
    )
    parser.add_argument(
        "--users-per-node",
        default=None,
        help="check only: num-partitions must equal ceil(users / this) (the run uses the "
        "users-per-node of its run config)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="this node's dataset folder (or a folder holding <dataset>/): used for the check and "
        "passed on as FEDREC_DATA_DIR=<absolute path>, which the node's ClientApps read when the "
        "run config's data-dir is empty (not for dataset generic: its files come from the "
        "run config)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help=f"this node's processed-split cache: used for the check and passed on as "
        f"{CACHE_DIR_ENV}=<absolute path>, read when the run config's cache-dir is empty",
    )
    parser.add_argument(
        "--run-config", default=None, help="check only: more run-config keys for the dataset check (k=v ...)"
    )
    parser.add_argument(
        "--probe-timeout", type=float, default=2.0, help="seconds to wait for the SuperLink's TCP port (default 2)"
    )
    parser.add_argument("--dry-run", action="store_true", help="check only; print the flower-supernode command")
    args, rest = parser.parse_known_args(argv)
    passthrough = list(rest)
    if passthrough and passthrough[0] == "--":
        passthrough = passthrough[1:]
    try:
        node_config: dict[str, Any] = {}
        node_sources: dict[str, str] = {}
        flower_args: list[str] = []
        superlink = DEFAULT_SUPERLINK
        superlinks: dict[str, Any] = {}
        i = 0
        while i < len(passthrough):  # take --node-config and --superlink out of flower-supernode's arguments
            arg = passthrough[i]
            name, eq, inline = arg.partition("=")
            if name in ("--node-config", "--superlink"):
                if eq:
                    value = inline
                elif i + 1 < len(passthrough):
                    value, i = passthrough[i + 1], i + 1
                else:
                    raise NodeConfigError(f"{name} needs a value")
                if name == "--node-config":
                    for key, item in parse_node_config(value).items():
                        merge_setting(node_config, key, item, f"--node-config {value!r}", node_sources.get(key, ""))
                        node_sources[key] = f"--node-config {value!r}"
                else:
                    merge_setting(
                        superlinks,
                        "--superlink",
                        value,
                        f"--superlink {value}",
                        f"--superlink {superlinks.get('--superlink')}",
                    )
                    if superlink != value or "--superlink" not in flower_args:
                        flower_args += ["--superlink", value]
                    superlink = value
            else:
                flower_args.append(arg)
            i += 1
        for key, value in (("partition-id", args.partition_id), ("num-partitions", args.num_partitions)):
            if value is not None:
                merge_setting(
                    node_config,
                    key,
                    parse_node_config(f"{key}={value}")[key],
                    f"--{key} {value}",
                    node_sources.get(key, ""),
                )
        run_config: dict[str, Any] | None = None
        if args.dataset or args.users_per_node or args.data_dir or args.run_config:
            run_config = parse_node_config(args.run_config or "")
            earlier = f"--run-config {args.run_config!r}"
            for key, value in (("dataset", args.dataset), ("data-dir", args.data_dir), ("cache-dir", args.cache_dir)):
                if value is not None:
                    merge_setting(run_config, key, value, f"--{key} {value}", earlier)
            if args.users_per_node is not None:
                upn = parse_node_config(f"users-per-node={args.users_per_node}")["users-per-node"]
                if isinstance(upn, bool) or not isinstance(upn, int):
                    raise NodeConfigError(f"'users-per-node' = {args.users_per_node!r}: expected an integer")
                merge_setting(run_config, "users-per-node", upn, f"--users-per-node {upn}", earlier)
        users = check_node_config(node_config, run_config)
        node_env = supernode_environment(args.data_dir, args.cache_dir, (run_config or {}).get("dataset"))
        if not args.dry_run:  # --dry-run checks the node config only and prints the command
            check_superlink_listening(superlink, args.probe_timeout)
    except FedRecError as err:  # NodeConfigError; a bad run config or dataset of the dataset check
        print(f"fedrec-flwr supernode: error: {err}", file=sys.stderr, flush=True)
        return 2
    command = [_bin("flower-supernode"), *flower_args, "--node-config", format_node_config(node_config)]
    served = f", users {users.start}..{users.stop - 1}" if users is not None else ""
    passed = "".join(f"; {key}={value}" for key, value in node_env.items())
    print(
        f"fedrec-flwr supernode: partition-id {node_config['partition-id']} of {node_config['num-partitions']}"
        f"{served}{passed}; SuperLink {superlink}" + (" (not probed: --dry-run)" if args.dry_run else " is listening"),
        file=sys.stderr,
        flush=True,
    )
    if args.data_dir is not None and (run_config or {}).get("dataset") == "generic":
        print(
            "fedrec-flwr supernode: --data-dir was used for the check only: dataset generic reads its files from "
            "the run config (data-dir, generic-file)",
            file=sys.stderr,
            flush=True,
        )
    if args.dry_run:
        print(" ".join([*(f"{key}={shlex.quote(value)}" for key, value in node_env.items()), shlex.join(command)]))
        return 0
    # flower-supernode starts flwr-clientapp by name: this environment's console scripts first on PATH, so the
    # wrapper works without the virtual environment activated
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    os.execve(command[0], command, {**os.environ, **node_env, "PATH": path})
    return 0  # not reached


def supernode_environment(data_dir: str | None, cache_dir: str | None, dataset: str | None) -> dict[str, str]:
    """The environment variables the ``supernode`` command adds to ``flower-supernode``'s environment, which its
    ClientApp processes inherit: ``FEDREC_DATA_DIR`` (``--data-dir``; not for ``dataset = "generic"``, whose files the
    run config names) and ``FEDREC_FLWR_CACHE`` (``--cache-dir``), as absolute paths. A ClientApp reads them only
    where the run config's ``data-dir`` / ``cache-dir`` is empty (:func:`fedrec_flwr.app.runtime.data_dir_for`,
    :func:`fedrec_flwr.data.loaders.default_cache_dir`)."""
    from fedrec_flwr.app.runtime import DATA_DIR_ENV  # imports torch: only once the checks passed

    env: dict[str, str] = {}
    if data_dir and dataset != "generic":
        env[DATA_DIR_ENV] = str(Path(data_dir).expanduser().resolve())
    if cache_dir:
        env[CACHE_DIR_ENV] = str(Path(cache_dir).expanduser().resolve())
    return env


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
