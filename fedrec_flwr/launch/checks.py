"""Checks that run before anything starts: the run config with its data and plug-ins (the app must ship them),
the number of SuperNodes, and a ``--ray-address`` that answers."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedrec_flwr.config import default_mapping
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.launch.env import PROJECT_ROOT


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
