"""Every check a run can make before Flower starts: one function, :func:`preflight`, for every way a run starts.

The launcher (:func:`fedrec_flwr.launch.check_run`) calls it before it starts a SuperLink, :func:`fedrec_flwr.serial.
run_serial` before its first message, and the ServerApp (:func:`fedrec_flwr.app.server_app.main`) first thing, so plain
``flwr run .`` gets it too. It raises :class:`~fedrec_flwr.errors.ConfigError` / :class:`~fedrec_flwr.errors.DataError`
naming the key and value, and leaves nothing behind: no results folder, no file.

Without the data (the ServerApp: the server never reads the interaction data) it checks what holds anywhere:

* the client's and the strategy's own ``check_config`` (:func:`fedrec_flwr.registry.check_components`), which for a
  Flower strategy builds it from ``strategy-args`` and refuses a config key it would send that the client ignores
  (FedProx with ``proximal_mu > 0``: :func:`fedrec_flwr.strategies.flower_adapter.check_sent_keys`);
* ``run-name`` (and, with ``resume-from``, the name of the checkpoint's folder, which a resumed run keeps): one rule,
  :data:`fedrec_flwr.state.client_state.RUN_NAME_RULE`, for the results folder under ``results-dir`` and the clients' state
  folder under ``client-state-dir``, and short enough for the file system of ``results-dir`` (its ``NAME_MAX``);
* ``resume-from``: a readable checkpoint there, written with the same config (:mod:`fedrec_flwr.state.checkpoint`), in a
  folder that holds no finished run (``summary.json``: a finished run is never rewritten) and that no live run holds,
  from a run that kept its clients' private state in files (else ``resume-resets-client-state`` must accept
  restarting it), and, with the data (read afresh, never a split this process loaded before), on the same data
  (:func:`fedrec_flwr.state.checkpoint.check_same_data`; the ServerApp checks what the nodes report too);
* the results folder: not held by a live run (:class:`fedrec_flwr.state.results.FolderLock`), not a finished run's
  (``summary.json``) nor an interrupted one's (``checkpoint.npz``: resume it with ``resume-from``), and creatable /
  writable under ``results-dir`` (probed with an empty folder, removed at once).

With the data (the launcher and ``run_serial``, which read it in this process) it also builds what a node builds
(:func:`fedrec_flwr.app.runtime.get_runtime`: the split, the ``protected-attribute`` labels, the model) and the strategy
itself, as the ServerApp will, over a topology of ``users-per-node`` blocks (``forget-users`` in range, the
adversary's class prior, ...). The ServerApp makes those checks again when the nodes have reported the data, before
round 1 and before it creates the results folder.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.state.checkpoint import Checkpoint, check_client_state, check_resumable, load_checkpoint
from fedrec_flwr.state.client_state import RUN_NAME_RULE_TEXT, run_name_problem
from fedrec_flwr.state.results import check_folder_free, check_results_folder


@dataclass(frozen=True)
class Preflight:
    """What a run that passed :func:`preflight` will use.

    Attributes:
        config: the validated run config.
        folder: the results folder (``results-dir/<run-name>``, or the checkpoint's folder with ``resume-from``); not
            created.
        resume: the checkpoint to resume from, or ``None``.
        runtime: with the data: the :class:`~fedrec_flwr.app.runtime.Runtime` (split, attribute labels, model), else
            ``None``.
    """

    config: RunConfig
    folder: Path
    resume: Checkpoint | None = None
    runtime: Any = None

    @property
    def num_users(self) -> int | None:
        """The split's users (``None`` without the data)."""
        return None if self.runtime is None else self.runtime.split.num_users


def preflight(config: RunConfig | Mapping[str, Any], *, with_data: bool = False) -> Preflight:
    """Check everything about a run that needs no Flower (see the module docstring); creates nothing.

    Args:
        config: a :class:`RunConfig` or a complete kebab-case mapping (validated here).
        with_data: also load the split here and build the model and the strategy (the launcher, ``run_serial``);
            ``False`` for the ServerApp, which never reads the data.

    Raises:
        ConfigError: a bad key or value, a client / strategy combination they refuse, a ``resume-from`` without a
            usable checkpoint, a results folder holding a finished run or not writable, a ``protected-attribute``
            the data lacks, a ``forget-users`` id beyond the users. The message names the key and the value.
        DataError: the dataset cannot be loaded.
    """
    from fedrec_flwr.registry import check_components

    if not isinstance(config, RunConfig):
        config = RunConfig.from_mapping(config)
    check_components(config)
    check_run_name(config.run_name)
    resume = None
    if config.resume_from:
        resume = load_checkpoint(config.resume_from)
        check_resumable(resume, config.to_dict())
        # the interrupted run kept no state files: refused here already (the nodes' own settings are checked by the
        # ServerApp, which asks them)
        check_client_state(resume, [], config.resume_resets_client_state)
        folder = Path(resume.folder).resolve()
        problem = run_name_problem(folder.name)
        if problem is not None:  # a resumed run keeps its folder's name: its clients' state folder is named after it
            raise ConfigError(
                f"run-config key 'resume-from' = {config.resume_from!r}: the checkpoint's folder name "
                f"{folder.name!r} cannot name a run ({problem}); rename the folder (the run's name is "
                "its folder's name)"
            )
        if (folder / "summary.json").is_file():
            raise ConfigError(
                f"run-config key 'resume-from' = {config.resume_from!r}: {folder} holds a finished run "
                "(summary.json), which is never rewritten; to train further start a new run (another "
                "'run-name')"
            )
        check_folder_free(folder, "resume-from", config.resume_from)
    else:
        folder = Path(config.results_dir).expanduser().resolve() / default_run_name(config)
        check_folder_free(folder)
        check_results_folder(folder, clear=False)
    _check_writable(
        folder,
        "resume-from" if resume is not None else "results-dir",
        config.resume_from if resume is not None else config.results_dir,
    )
    _check_name_fits(
        folder,
        "resume-from" if resume is not None else "run-name",
        config.resume_from if resume is not None else folder.name,
    )
    runtime = None
    if with_data:
        from fedrec_flwr.app.runtime import forget_cached_data, get_runtime

        if resume is not None:  # the data as they are now, not a split this process loaded before they changed
            forget_cached_data()
        runtime = get_runtime(config.to_dict())
        if resume is not None:
            from fedrec_flwr.state.checkpoint import check_same_data, split_data_facts

            check_same_data(resume, split_data_facts(runtime.split), "in the data now")
        build_strategy(config, runtime.layout, _block_topology(config, runtime.split.num_users), dry=True)
    return Preflight(config, folder, resume, runtime)


def build_strategy(config: RunConfig, layout, topology, dry: bool = False):
    """The configured strategy (a Flower one through the adapter), as the ServerApp runs it.

    Args:
        layout: the model's :class:`~fedrec_flwr.wire.ModelLayout` (shared keys and shapes).
        topology: the :class:`~fedrec_flwr.wire.Topology` (which node serves each user).
        dry: a check only: build it :func:`quiet` (the run logs the same warnings when it builds it).

    Raises:
        ConfigError: the strategy refuses the config (e.g. ``forget-users`` out of range), or ``unlearning`` is set
            and the strategy has no unlearning phase.
    """
    from fedrec_flwr.registry import resolve_strategy

    with quiet() if dry else nullcontext():
        strategy = resolve_strategy(config.strategy).from_run_config(config, layout, topology)
    if config.unlearning != "none" and not hasattr(strategy, "run_unlearning"):
        raise ConfigError(
            f"run-config key 'unlearning' = {config.unlearning!r}: strategy {config.strategy!r} has no "
            "unlearning phase (use a strategy derived from ItemEmbeddingFedAvg, e.g. 'item-fedavg')"
        )
    return strategy


def check_run_name(name: str) -> None:
    """Refuse a ``run-name`` that breaks :data:`fedrec_flwr.state.client_state.RUN_NAME_RULE`: it names the results folder
    under ``results-dir`` and the clients' state folder under ``client-state-dir``, so both must accept it (a path
    separator, ``.`` or ``..`` would put them elsewhere; a space, a non-ASCII letter or a name over 200 bytes is
    refused by the clients' state folder, or by the file system). ``""``: a generated name (:func:`default_run_name`).

    Raises:
        ConfigError: naming the key, the value (control characters escaped: one line) and the rule.
    """
    if not name:
        return
    problem = run_name_problem(name)
    if problem is not None:
        raise ConfigError(
            f"run-config key 'run-name' = {name!r}: {problem}: it names the results folder under "
            "'results-dir' and the clients' state folder under 'client-state-dir' (a run name is "
            f"{RUN_NAME_RULE_TEXT})"
        )


RESULTS_FOLDER_SIDE_FILES = (".lock",)
"""Suffixes of the files named after a results folder beside it (``.<name>.lock``, :mod:`fedrec_flwr.state.results`)."""


def _check_name_fits(folder: Path, key: str, value: str) -> None:
    """Refuse a results folder whose name, or a file named after it, is longer than the file system of its nearest
    existing ancestor allows (``NAME_MAX``, in bytes; 255 on most).

    Raises:
        ConfigError: naming ``key``, ``value``, the name's length in bytes and the limit.
    """
    existing = folder.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # not POSIX, or the file system does not say
        limit = 255
    longest = max(
        len(folder.name.encode("utf-8", "surrogatepass")) + len(suffix) + 1
        for suffix in ("", *RESULTS_FOLDER_SIDE_FILES)
    )
    if limit and longest > limit:
        raise ConfigError(
            f"run-config key {key!r} = {value!r}: the results folder's name {folder.name!r} is too long "
            f"for the file system of {str(existing)!r} ({longest} bytes with its lock file, at most "
            f"{limit})"
        )


def default_run_name(config: RunConfig) -> str:
    """``<dataset>-<model>-<client>-<strategy>[-unlearn-<method>]-<UTC time>-p<pid>-<6 random hex digits>`` unless
    ``run-name`` is set (two runs started in the same second, in one process or two, get different names); a
    character outside :data:`~fedrec_flwr.state.client_state.RUN_NAME_RULE` (a plug-in's name) becomes ``-``, and the
    descriptive part is cut so that the name stays within the rule's 200 characters."""
    if config.run_name:
        return config.run_name
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + f"-p{os.getpid()}-{secrets.token_hex(3)}"
    client = config.client.rsplit(":", 1)[-1].lower()
    strategy = config.strategy.rsplit(":", 1)[-1].lower()
    unlearn = f"-unlearn-{config.unlearning}" if config.unlearning != "none" else ""
    described = re.sub(r"[^A-Za-z0-9._=,+-]+", "-", f"{config.dataset}-{config.model}-{client}-{strategy}{unlearn}")
    described = described.lstrip("._=,+-") or "run"
    tail = f"-{stamp}"
    return described[: 200 - len(tail)] + tail


@contextmanager
def quiet() -> Iterator[None]:
    """Log records at WARNING and below are dropped inside (for dry runs of code that logs what the real run logs)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def _block_topology(config: RunConfig, num_users: int):
    """The topology the nodes will report: user ``u`` on node ``u // users-per-node`` (node ids = partition ids)."""
    from fedrec_flwr.wire import Topology

    return Topology((np.arange(num_users) // config.users_per_node).astype(np.uint64))


def _check_writable(folder: Path, key: str, value: str) -> None:
    """Refuse a results folder that cannot be created or written: its nearest existing ancestor must be a folder in
    which a folder can be made (probed: an empty hidden folder is made there and removed at once; ``os.access``
    says yes to root everywhere, even in ``/proc``).

    Raises:
        ConfigError: naming ``key`` and ``value``, the folder and why.
    """
    import tempfile

    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"run-config key {key!r} = {value!r}: the results folder {folder} cannot be created: {existing} is a file"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fedrec-preflight-", dir=existing))
    except OSError as err:
        raise ConfigError(
            f"run-config key {key!r} = {value!r}: the results folder {folder} cannot be "
            f"{'written' if existing == folder else 'created'}: {existing} does not allow it "
            f"({err.strerror or err})"
        ) from None
