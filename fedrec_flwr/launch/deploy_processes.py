"""The processes of a :class:`~fedrec_flwr.launch.deploy.Deployment` on one host: the command lines of
``flower-superlink`` and ``flower-supernode``, the SuperLink's health and the CLI's connection to it, SuperNode key
registration, each started process with its log, and the wait for a run's results folder."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedrec_flwr.launch.env import console_script
from fedrec_flwr.launch.processes import end_processes
from fedrec_flwr.launch.superlink import free_port
from fedrec_flwr.launch.tls import NodeKeys, TLSFiles

CONNECTION = "fedrec-deploy"
"""Name of the SuperLink connection written into the deployment's ``$FLWR_HOME/config.toml``."""


class DeploymentError(RuntimeError):
    """A deployed process failed to start, or a run did not produce its results folder."""


# ------------------------------------------------------------------------------------------------- the app


@dataclass
class Started:
    """One process a :class:`~fedrec_flwr.launch.deploy.Deployment` started (in its own session: its PID is its
    process group)."""

    name: str
    process: subprocess.Popen
    log: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def superlink_command(host: str, port: int, tls_files: TLSFiles | None, auth: bool) -> list[str]:
    """``flower-superlink``'s command line for ``host:port``: TLS with ``tls_files`` (else ``--insecure``),
    SuperNode authentication with ``auth``, one process per app (``--isolation subprocess``), no runtime
    dependency installation."""
    command = [
        console_script("flower-superlink"),
        "--host",
        host,
        "--port",
        str(port),
        "--isolation",
        "subprocess",
        "--disable-runtime-dependency-installation",
    ]
    if tls_files:
        command += [
            "--ssl-ca-certfile",
            str(tls_files.ca_cert),
            "--ssl-certfile",
            str(tls_files.server_cert),
            "--ssl-keyfile",
            str(tls_files.server_key),
        ]
    else:
        command += ["--insecure"]
    if auth:
        command += ["--enable-supernode-auth"]
    return command


def superlink_healthy(address: str, tls_files: TLSFiles | None) -> bool:
    """Whether the SuperLink at ``address`` answers ``/health`` with 200 (HTTPS with the CA of ``tls_files``)."""
    scheme = "https" if tls_files else "http"
    context = ssl.create_default_context(cafile=str(tls_files.ca_cert)) if tls_files else None
    try:
        with urllib.request.urlopen(f"{scheme}://{address}/health", timeout=2.0, context=context) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(link: Started, address: str, tls_files: TLSFiles | None, timeout: float) -> None:
    """Wait until the SuperLink ``link`` at ``address`` is healthy (:func:`superlink_healthy`).

    Raises:
        DeploymentError: it exited, or was not healthy after ``timeout`` s (with the end of its log).
    """
    deadline = time.monotonic() + timeout
    while not superlink_healthy(address, tls_files):
        if link.process.poll() is not None:
            raise DeploymentError(f"flower-superlink exited with code {link.process.returncode}:\n{link.tail()}")
        if time.monotonic() > deadline:
            raise DeploymentError(f"flower-superlink not healthy after {timeout:.0f} s at {address}:\n{link.tail()}")
        time.sleep(0.5)


def connection_config(address: str, tls_files: TLSFiles | None) -> str:
    """The ``flwr`` CLI's ``config.toml`` with connection :data:`CONNECTION` (the default) for the SuperLink at
    ``address``: ``root-certificates`` naming the CA of ``tls_files``, else ``insecure = true``."""
    lines = [
        "[superlink]",
        f'default = "{CONNECTION}"',
        "",
        f"[superlink.{CONNECTION}]",
        f'address = "{address}"',
    ]
    if tls_files:
        lines.append(f"root-certificates = {json.dumps(str(tls_files.ca_cert))}")
    else:
        lines.append("insecure = true")
    return "\n".join(lines) + "\n"


def register_node_keys(keys: Sequence[NodeKeys], env: Mapping[str, str], cwd: Path, timeout: float) -> list[int]:
    """Register every SuperNode public key with the SuperLink of ``env``'s CLI connection (``flwr supernode
    register``, in parallel); returns the node ids, in the order of ``keys``.

    Raises:
        DeploymentError: a registration failed or took longer than ``timeout`` s (with its output).
    """
    running = [
        subprocess.Popen(
            [console_script("flwr"), "supernode", "register", str(k.public), CONNECTION, "--format", "json"],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            start_new_session=True,
        )
        for k in keys
    ]
    node_ids = []
    for key, process in zip(keys, running):
        try:
            out, err = process.communicate(timeout=timeout)
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
        node_ids.append(int(reply["node-id"]))
    return node_ids


def supernode_args(address: str, host: str, tls_files: TLSFiles | None, keys: NodeKeys | None) -> list[str]:
    """``flower-supernode``'s arguments for a SuperLink at ``address``: its own Runtime API on a free port of
    ``host``, TLS with the CA of ``tls_files`` (else ``--insecure``), authentication with ``keys``."""
    flower_args = [
        "--superlink",
        address,
        "--host",
        host,
        "--port",
        str(free_port(host)),
        "--isolation",
        "subprocess",
    ]
    if tls_files:
        flower_args += ["--root-certificates", str(tls_files.ca_cert)]
    else:
        flower_args += ["--insecure"]
    if keys is not None:
        flower_args += ["--auth-supernode-private-key", str(keys.private)]
    return flower_args


def await_results(
    process: subprocess.Popen, link: Started, folder: Path, log: Path, started: float, timeout: float, echo: bool
) -> tuple[str | None, int]:
    """Wait until ``folder`` holds ``summary.json`` and ``learning_curves.png``; returns ``(None, offset)``, or
    ``(why, offset)`` when ``flwr run`` (``process``) ended without them, the SuperLink (``link``) exited or
    ``timeout`` s passed since ``started`` (``time.monotonic()``). With ``echo``, the log is copied to stderr as it
    grows; ``offset``: how much of it was copied."""
    reason = None
    shown = 0
    while reason is None:
        if echo:
            shown = follow_log(log, shown)
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
    return reason, shown


def port_taken(started: Started) -> bool:
    """Whether a process that exited failed to bind its port (another process took it after
    :func:`~fedrec_flwr.launch.superlink.free_port`)."""
    return started.process.poll() is not None and "already in use" in started.tail(20_000).lower()


def follow_log(path: Path, offset: int) -> int:
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
