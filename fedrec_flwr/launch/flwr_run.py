"""``flwr run`` on a fresh local SuperLink of its own: the command, its output, its watch (a timeout, a simulation
that does not exit after its ServerApp) and its exit status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedrec_flwr.launch.checks import check_ray_address, check_run, num_supernodes_for
from fedrec_flwr.launch.env import PROJECT_ROOT, default_home, flwr_env
from fedrec_flwr.launch.output import SERVERAPP_ENDED, pump_output, run_error, still_running
from fedrec_flwr.launch.overrides import run_config_args, toml_value
from fedrec_flwr.launch.processes import ignore_interrupts, restore_interrupts
from fedrec_flwr.launch.superlink import LocalSuperLink, claim_home, stop_recorded_superlink

END_GRACE = 30.0
"""Seconds a simulation may take to exit after its ServerApp ended (Ray's shutdown; measured: ``flwr run`` exited 8 s
after the ServerApp's last line on the 2-core machine at load average 9) before the launcher stops the run as hung.
With it and the stop (at most 15 s) the launcher returns within 45 s of the ServerApp's end, well
inside ``round-timeout`` + 60 s after the last round."""


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
            ``returncode`` is 124, with a message naming what was still running
            (:func:`~fedrec_flwr.launch.output.still_running`).
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
        check: validate the run config and the plug-ins it names first (:func:`~fedrec_flwr.launch.checks.check_run`).
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
        ConfigError, DataError: what :func:`~fedrec_flwr.launch.checks.check_run` finds (before anything starts).
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
                *(f"{k}={toml_value(v)}" for k, v in (federation_config or {}).items()),
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
                    target=pump_output,
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
                previous = ignore_interrupts()
                try:
                    link.stop()
                finally:
                    restore_interrupts(previous)
