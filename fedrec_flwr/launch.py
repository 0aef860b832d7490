"""Run the app with ``flwr run`` on a managed local SuperLink, and stop that SuperLink afterwards.

``flwr run .`` (flwr 1.42) starts a *detached* local SuperLink that outlives the command (ports 39091/39093 unless
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` / ``FLWR_LOCAL_CONTROL_API_PORT`` say otherwise), and by default installs the
app's dependencies with ``uv`` at run time. This module wraps it so a run is self-contained:

* runtime dependency installation is off (``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``): the environment the
  install command made is the one that runs;
* ``num-supernodes`` is computed from the dataset's users and ``users-per-node`` unless given;
* a SuperLink already listening on the local ports is stopped first (it could serve stale code), and the one the run
  started is stopped at the end, with its process group (the simulation and Ray).

Command line::

    python -m fedrec_flwr.launch run [--num-supernodes N] [--flwr-home DIR] [--ray-address HOST:PORT]
                                     [--federation-config KEY=VALUE ...] [--] [key=value ...]
    python -m fedrec_flwr.launch stop [--flwr-home DIR]

``key=value`` pairs are run-config overrides (TOML values: strings in quotes, e.g. ``dataset='filmtrust'``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import default_mapping

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def flwr_env(flwr_home: str | os.PathLike | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for ``flwr run``: no runtime dependency installation, no Ray accelerator warning."""
    env = dict(os.environ)
    # flwr starts `flower-superlink` and `flwr-simulation` by name: they live beside this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    env.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    if flwr_home:
        env["FLWR_HOME"] = str(flwr_home)
    env.update(extra or {})
    return env


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


def _flwr_home(env: Mapping[str, str]) -> str:
    return str(Path(env.get("FLWR_HOME") or Path.home() / ".flwr").expanduser().resolve())


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def foreign_superlinks(env: Mapping[str, str] | None = None) -> list[int]:
    """Local SuperLinks on this environment's ports that belong to another ``FLWR_HOME`` (another checkout)."""
    env = env or os.environ
    return [pid for pid in superlink_pids(env) if _flwr_home(_env_of(pid)) != _flwr_home(env)]


def stop_local_superlink(env: Mapping[str, str] | None = None, timeout: float = 15.0) -> list[int]:
    """Stop the local SuperLink(s) of this environment's ports with everything they started. Returns their PIDs.

    Only SuperLinks of this environment's ``FLWR_HOME`` are stopped, never another checkout's. The SuperLink runs in
    its own session: its whole process group (the simulation, Ray, client actors) gets SIGTERM,
    then SIGKILL after ``timeout`` seconds. When ``env`` names a ``FLWR_HOME``, any process still running with that
    ``FLWR_HOME`` in its environment (Ray daemons that left the group) is ended the same way.
    """
    env = env or os.environ
    pids = [pid for pid in superlink_pids(env) if pid not in foreign_superlinks(env)]
    targets: set[int] = set()
    for pid in pids:
        try:
            targets.update(_group_members(os.getpgid(pid)))
        except ProcessLookupError:
            continue
    if env.get("FLWR_HOME"):
        targets.update(processes_with_env("FLWR_HOME", str(env["FLWR_HOME"])))
    terminate(targets, timeout)
    return pids


def terminate(targets: set[int], timeout: float, more: Callable[[], Iterable[int]] | None = None) -> set[int]:
    """SIGTERM ``targets`` (never this process), wait up to ``timeout`` s, then SIGKILL what is left; ``more()``, if
    given, names processes that appeared meanwhile (children started while we waited), added before the SIGKILL.
    Returns every PID signalled."""
    targets = set(targets) - {os.getpid()}
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
            targets |= set(more()) - {os.getpid()}
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


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs of processes (other than this one) whose environment has ``name=value``."""
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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def num_supernodes_for(overrides: Mapping[str, Any]) -> int:
    """``ceil(users / users-per-node)`` for the configured dataset (loads the split, cached after the first time)."""
    from .config import RunConfig
    from .runtime import load_split_for

    mapping = default_mapping(PROJECT_ROOT / "pyproject.toml")
    mapping.update(overrides)
    config = RunConfig.from_mapping(mapping)
    return -(-load_split_for(config).num_users // config.users_per_node)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("'", "") + "'"


def run_config_args(overrides: Mapping[str, Any]) -> list[str]:
    """``--run-config`` arguments for ``flwr run`` from a mapping of overrides."""
    if not overrides:
        return []
    return ["--run-config", " ".join(f"{k}={_toml_value(v)}" for k, v in overrides.items())]


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
) -> subprocess.CompletedProcess:
    """``flwr run <project> --stream`` on a fresh local SuperLink, which is stopped afterwards.

    Args:
        overrides: run-config overrides (kebab-case keys).
        num_supernodes: simulated SuperNodes; default ``ceil(users / users-per-node)``.
        flwr_home: ``FLWR_HOME`` for this run (config, installed apps, SuperLink state and log).
        env_extra: more environment variables (e.g. other local SuperLink ports).
        capture: capture stdout/stderr (text) instead of passing them through.
        federation_config: more ``--federation-config`` keys of flwr 1.42's simulation config, e.g.
            ``{"client-resources-num-cpus": 1}`` (CPUs per client actor; Flower's default is 2) or
            ``{"init-args-num-cpus": 4}`` (CPUs of a new local Ray instance; not allowed with ``ray_address``).
        ray_address: run the simulation's client actors on this existing Ray cluster (``host:port`` of its head's
            GCS, as ``ray start --head --port`` printed) instead of a new local Ray instance: sets ``RAY_ADDRESS``
            for the SuperLink, whose simulation process calls ``ray.init()``. Stopping the SuperLink afterwards
            never stops that cluster.

    Returns:
        The finished ``flwr run`` process (its return code says whether the run was submitted and streamed).
    """
    overrides = dict(overrides or {})
    env = flwr_env(flwr_home, {**({"RAY_ADDRESS": ray_address} if ray_address else {}), **(env_extra or {})})
    if num_supernodes is None:
        num_supernodes = num_supernodes_for(overrides)
    foreign = foreign_superlinks(env)
    if foreign:
        raise RuntimeError(
            f"a local SuperLink of another FLWR_HOME (pid {foreign}) listens on control port "
            f"{env.get('FLWR_LOCAL_CONTROL_API_PORT', '39093')}: this run would use it and its stale app code. Stop it "
            "(FLWR_HOME=<its home> python -m fedrec_flwr.launch stop) or set FLWR_LOCAL_SUPERLINK_HTTP_API_PORT and "
            "FLWR_LOCAL_CONTROL_API_PORT to free ports"
        )
    stop_local_superlink(env)
    command = [
        str(Path(sys.executable).with_name("flwr")), "run", str(project),
        "--federation-config", " ".join([f"num-supernodes={num_supernodes}", *(
            f"{k}={_toml_value(v)}" for k, v in (federation_config or {}).items())]),
        *run_config_args(overrides), "--stream",
    ]
    shown_env = f"RAY_ADDRESS={ray_address} " if ray_address else ""
    shown_env += "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1"
    print(f"$ {shown_env} " + " ".join(
        c if " " not in c else f'"{c}"' for c in ["flwr", *command[1:]]), file=sys.stderr, flush=True)
    try:
        return subprocess.run(command, env=env, timeout=timeout, text=True, capture_output=capture, check=False)
    finally:
        if not keep_superlink:
            stop_local_superlink(env)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedrec_flwr.launch", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="flwr run the app on a fresh local SuperLink, then stop it")
    run.add_argument("--num-supernodes", type=int, default=None)
    run.add_argument("--flwr-home", default=None)
    run.add_argument("--ray-address", default=None,
                     help="host:port of an existing Ray cluster's head (ray start --head) to run the client actors on")
    run.add_argument("--federation-config", action="append", default=[], metavar="KEY=VALUE",
                     help="another flwr simulation-config key, e.g. client-resources-num-cpus=1 (repeatable)")
    run.add_argument("overrides", nargs="*", help="run-config overrides key=value (TOML values)")
    stop = sub.add_parser("stop", help="stop the local SuperLink of this environment's ports")
    stop.add_argument("--flwr-home", default=None)
    args = parser.parse_args(argv)
    if args.command == "stop":
        pids = stop_local_superlink(flwr_env(args.flwr_home))
        print(f"stopped local SuperLink {pids}" if pids else "no local SuperLink running")
        return 0
    import tomllib

    def pairs(items: Sequence[str], what: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for pair in items:
            key, sep, value = pair.partition("=")
            if not sep:
                parser.error(f"{what} {pair!r} is not key=value")
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        return out

    overrides = pairs(args.overrides, "override")
    federation = pairs(args.federation_config, "--federation-config")
    result = flwr_run(overrides, num_supernodes=args.num_supernodes, flwr_home=args.flwr_home,
                      federation_config=federation, ray_address=args.ray_address)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
