"""The ``supernode`` command (``python -m fedrec_flwr.launch.deploy supernode``): a SuperNode's node config and
SuperLink address checked before ``flower-supernode`` starts (which would otherwise retry forever, and a bad node
would only be noticed by the server once a run starts), then ``flower-supernode`` exec'd with them."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedrec_flwr.errors import ConfigError, FedRecError
from fedrec_flwr.launch.env import console_script

DEFAULT_SUPERLINK = "127.0.0.1:8000"
"""``flower-supernode``'s default ``--superlink`` in flwr 1.42."""

CACHE_DIR_ENV = "FEDREC_FLWR_CACHE"
"""Environment variable of the default cache folder (:func:`fedrec_flwr.data.loaders.default_cache_dir`)."""


class NodeConfigError(ConfigError):
    """A SuperNode's node config (or its SuperLink address) cannot serve a run."""


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


def supernode_main(argv: Sequence[str]) -> int:
    """``supernode`` command: check the node config and the SuperLink address, then exec ``flower-supernode``."""
    parser = argparse.ArgumentParser(
        prog="python -m fedrec_flwr.launch.deploy supernode",
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
    command = [console_script("flower-supernode"), *flower_args, "--node-config", format_node_config(node_config)]
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
