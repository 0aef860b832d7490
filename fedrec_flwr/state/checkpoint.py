"""Server checkpoints: what the ServerApp needs to continue an interrupted run exactly (``checkpoint-every``,
``resume-from``).

Every ``checkpoint-every`` rounds the ServerApp writes ``results-dir/<run-name>/checkpoint.npz`` atomically
(:func:`fedrec_flwr.io.atomic_save_npz`), replacing the previous one. It holds:

* the shared parameters after the round (never a user's private parameter: the server has none);
* the strategy's own state (:meth:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg.checkpoint_state`: failure counts,
  users no longer trained, the unlearning report; the server optimizer's moments for
  :class:`fedrec_flwr.strategies.server_optimizer.ServerOptimizerStrategy`);
* the round, the run's name and validated config, and the metrics rows so far;
* the data's fingerprint (:data:`DATA_FACTS`: the sha256 of the source files and the split's own counts), so a resume
  on other data is refused (:func:`check_same_data`) instead of training on it as if the run had used it throughout;
* the sampler's state. Users are drawn from the counter-based stream ``(seed, round)``
  (:func:`fedrec_flwr.wire.sample_users`), so the seed and the next round *are* its state; they are recorded so a
  resume can check them.

``resume-from`` (the interrupted run's results folder or its ``checkpoint.npz``) continues in that folder from the
round after the checkpoint. Every key of the run config other than :data:`MAY_DIFFER` must equal the checkpoint's;
the clients' private state comes from their own files (``client-state-dir``, :mod:`fedrec_flwr.state.client_state`), never
from the server. With both, an interrupted and resumed run gives the same model as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.io import atomic_save_npz, load_npz
from fedrec_flwr.state.client_state import ClientStateStore

log = logging.getLogger(__name__)

TRAINED_KEY = "trained-users"
"""The strategy checkpoint array (``(num_users,)`` bool) of the users whose training replies the server accepted
(:attr:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg.trained`)."""

CHECKPOINT_FILE = "checkpoint.npz"
"""The checkpoint's file name in the results folder."""

MAY_DIFFER = (
    "resume-from",
    "checkpoint-every",
    "round-timeout",
    "client-state-dir",
    "resume-resets-client-state",
    "results-dir",
)
"""Run-config keys a resumed run may set differently from the interrupted one (they change no result; a resumed run
writes into the checkpoint's folder, wherever it now is, so ``results-dir`` may follow a moved folder)."""

FORMAT = 1
_MANIFEST = "__manifest__"

DATA_FACTS = ("source-sha256", "num-users", "num-items", "num-interactions")
"""What a checkpoint records of the data its run trained on (``Checkpoint.data``), compared on resume: the sha256 over
the source files read (:attr:`fedrec_flwr.data.Split.meta` ``source_sha256``; for a generic CSV it covers how it was
parsed too) and the split's users, items and interactions."""


def split_data_facts(split) -> dict[str, Any]:
    """The :data:`DATA_FACTS` of a :class:`~fedrec_flwr.data.Split` (plus its ``fingerprint``, recorded only)."""
    from fedrec_flwr.app.queries import split_fingerprint

    return {
        "source-sha256": split.meta.get("source_sha256"),
        "num-users": int(split.num_users),
        "num-items": int(split.num_items),
        "num-interactions": split.meta.get("num_interactions"),
        "fingerprint": split_fingerprint(split),
    }


def check_same_data(checkpoint: Checkpoint, data: Mapping[str, Any], where: str = "") -> None:
    """Refuse to resume ``checkpoint`` on data whose :data:`DATA_FACTS` differ from the ones it recorded.

    Args:
        data: the facts of the data now (:func:`split_data_facts`, or what the nodes reported).
        where: who read the data now (for the message), e.g. ``"the nodes report"``.

    Raises:
        ConfigError: naming both checksums and every count that differs; before any training. A checkpoint that
            recorded no data facts (an older version's) is not checked; a warning says so.
    """
    recorded = checkpoint.data
    if not recorded:
        log.warning(
            "checkpoint %s does not record the data it was trained on (an older version's): a resume on "
            "changed data cannot be detected",
            checkpoint.folder,
        )
        return
    differ = [k for k in DATA_FACTS if k in recorded and recorded.get(k) != data.get(k)]
    if not differ:
        return
    detail = "; ".join(f"{k} {recorded.get(k)} -> {data.get(k)}" for k in differ)
    raise ConfigError(
        f"run-config key 'resume-from' = {str(checkpoint.folder)!r}: the data differ from the ones the "
        f"checkpoint's run trained on (source-sha256 {recorded.get('source-sha256')} in the checkpoint, "
        f"{data.get('source-sha256')} {where or 'now'}; {detail}); resume on the data the run started "
        "with, or start a new run"
    )


@dataclass
class Checkpoint:
    """One server checkpoint (see the module docstring).

    Attributes:
        server_round: the last finished round (the resumed run starts at ``server_round + 1``).
        run_name: the run's name (its results folder's name, and the clients' state sub-folder).
        run_config: the validated run config, kebab-case.
        arrays: shared key -> array (the shared parameters after ``server_round``).
        strategy_state: the strategy's JSON-able state.
        strategy_arrays: the strategy's array state (e.g. server optimizer moments), name -> array.
        rows: the metrics rows of rounds ``1..server_round`` (as in ``metrics.json``).
        sampler: ``{"seed", "next-round"}`` of the counter-based user sampler.
        client_state: whether every node of the run kept its users' private state in files (``client-state-dir``),
            so a resumed run finds it; ``None`` when unknown (a checkpoint written before this was recorded: then
            the run config's ``client-state-dir`` decides).
        folder: where the checkpoint was read from (set by :func:`load_checkpoint`).
        data: the facts of the data the run trained on (:data:`DATA_FACTS`, and the split's ``fingerprint``); ``{}``
            in a checkpoint written before this was recorded.
    """

    server_round: int
    run_name: str
    run_config: dict[str, Any]
    arrays: dict[str, np.ndarray]
    strategy_state: dict[str, Any] = field(default_factory=dict)
    strategy_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    sampler: dict[str, Any] = field(default_factory=dict)
    client_state: bool | None = None
    folder: Path | None = None
    data: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(folder: str | Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` to ``folder/checkpoint.npz`` atomically (a crash leaves the previous one intact)."""
    arrays: dict[str, np.ndarray] = {}
    index: dict[str, list[str]] = {}
    for group, values in (("arrays", checkpoint.arrays), ("strategy", checkpoint.strategy_arrays)):
        for key, value in values.items():
            name = f"a{len(index)}"
            index[name] = [group, key]
            arrays[name] = np.asarray(value)
    manifest = {
        "format": FORMAT,
        "round": int(checkpoint.server_round),
        "run-name": checkpoint.run_name,
        "run-config": checkpoint.run_config,
        "strategy": checkpoint.strategy_state,
        "rows": checkpoint.rows,
        "sampler": checkpoint.sampler,
        "arrays": index,
        "client-state": checkpoint.client_state,
        "data": checkpoint.data,
        "row-columns": [list(row) for row in checkpoint.rows],  # sort_keys reorders the rows: their order, kept
    }
    text = json.dumps(manifest, sort_keys=True, default=_json_default)
    return atomic_save_npz(Path(folder) / CHECKPOINT_FILE, **arrays, **{_MANIFEST: np.array(text)})


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint: ``path`` is a results folder holding ``checkpoint.npz``, or the file itself.

    Raises:
        ConfigError: no checkpoint there, or the file is unreadable (the message names it).
    """
    path = Path(path).expanduser()
    file = path / CHECKPOINT_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"run-config key 'resume-from' = {str(path)!r}: no checkpoint at {file} (a run writes one "
            "every 'checkpoint-every' rounds)"
        )
    try:
        with load_npz(file) as data:
            manifest = json.loads(str(data[_MANIFEST]))
            groups: dict[str, dict[str, np.ndarray]] = {"arrays": {}, "strategy": {}}
            for name, (group, key) in manifest["arrays"].items():
                groups[group][key] = np.array(data[name])
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT}")
        return Checkpoint(
            server_round=int(manifest["round"]),
            run_name=str(manifest["run-name"]),
            run_config=dict(manifest["run-config"]),
            arrays=groups["arrays"],
            strategy_state=manifest["strategy"],
            strategy_arrays=groups["strategy"],
            rows=_rows_in_order(manifest),
            sampler=dict(manifest["sampler"]),
            client_state=manifest.get("client-state"),
            folder=file.parent,
            data=dict(manifest.get("data") or {}),
        )
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, json.JSONDecodeError) as err:
        raise ConfigError(f"checkpoint {file} is unreadable ({type(err).__name__}: {err})") from err


def check_resumable(checkpoint: Checkpoint, run_config: dict[str, Any]) -> None:
    """Refuse to resume with a config that would not continue the same run.

    Raises:
        ConfigError: a key outside :data:`MAY_DIFFER` differs (all such keys are listed with both values), or the
            checkpoint's round is not before ``num-server-rounds``.
    """
    # plugin-config only carries plug-in keys through flwr run; their unpacked values are compared as keys of their own
    keys = (set(checkpoint.run_config) | set(run_config)) - set(MAY_DIFFER) - {"plugin-config"}
    differ = sorted(k for k in keys if checkpoint.run_config.get(k) != run_config.get(k))
    if differ:
        detail = ", ".join(f"{k}: {checkpoint.run_config.get(k)!r} -> {run_config.get(k)!r}" for k in differ[:8])
        raise ConfigError(
            f"run-config key 'resume-from': the checkpoint of {checkpoint.folder} was written by a run "
            f"with other settings ({detail}); resume with the same config (only {list(MAY_DIFFER)} "
            "may differ)"
        )
    if checkpoint.server_round > int(run_config["num-server-rounds"]):
        raise ConfigError(
            f"checkpoint of round {checkpoint.server_round} is past num-server-rounds = "
            f"{run_config['num-server-rounds']}"
        )


RESET_STATE = (
    "every user's private parameters (its user embedding) and its client's other private records (e.g. "
    "FedRecGEL's optimizer moments, PFedRec's personal item rows, FedAU2's adversary state) restart from "
    "their seeded initial values"
)
"""What a resume without the clients' saved state loses."""


def check_client_state(
    checkpoint: Checkpoint, nodes_without_state: list, accept_reset: bool, state_problems: list[dict] = ()
) -> str | None:
    """Refuse a resume that would silently restart the clients' private state.

    The clients' private state survives a resume only through their files (``client-state-dir``); the server never
    holds it. It is lost when the interrupted run did not keep it in files (``checkpoint.client_state`` false; setting
    ``client-state-dir`` only on the resumed run finds no files), when some nodes of the resumed run do not
    (``nodes_without_state``: their partition ids), or for single users whose files a node found damaged or missing
    (``state_problems``: per node ``{"partition-id", "node", "folder", "damaged", "absent"}``, user ids only; see
    :meth:`fedrec_flwr.state.client_state.ClientStateStore.resume_problems`). An absent file is lost state only for a user
    whose training reply the server accepted before the checkpoint (the strategy's ``trained-users`` array,
    :attr:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg.trained`) and that is still trained (not in ``removed-users``);
    a checkpoint without that array (an older version's, or a strategy that does not record it) checks damaged files
    only, and a warning says so.

    Returns:
        ``None`` when nothing is lost, else the warning to log (``accept_reset``: ``resume-resets-client-state``).

    Raises:
        ConfigError: state would be lost and ``accept_reset`` is false; the message names the nodes and files, says
            what restarts and how to accept it.
    """
    kept = checkpoint.client_state
    if kept is None:
        kept = bool(checkpoint.run_config.get("client-state-dir"))
    problems = []
    if not kept:
        problems.append(
            f"the interrupted run ({checkpoint.folder}) did not keep its clients' private state in files "
            "('client-state-dir' unset on its nodes), so there is no state to resume from"
        )
    if nodes_without_state:
        problems.append(
            f"the SuperNodes with partition-id {sorted(nodes_without_state)} keep no state files "
            "('client-state-dir' in neither the run config nor their --node-config)"
        )
    trained = checkpoint.strategy_arrays.get(TRAINED_KEY)
    if trained is not None:
        trained = np.asarray(trained, dtype=bool).copy()
        trained[[int(u) for u in checkpoint.strategy_state.get("removed-users", []) if 0 <= int(u) < trained.size]] = (
            False
        )
    elif any(node["absent"] for node in state_problems):
        log.warning(
            "checkpoint %s does not record which users trained (an older version's, or a strategy without "
            "'%s'): only damaged client-state files are checked, not missing ones",
            checkpoint.folder,
            TRAINED_KEY,
        )
    users = []
    for node in state_problems:
        node = {
            **node,
            "missing": []
            if trained is None
            else [int(u) for u in node["absent"] if 0 <= int(u) < trained.size and trained[int(u)]],
        }
        store = ClientStateStore(node["folder"])
        where = f"node {node['node']} (partition-id {node['partition-id']})"
        for _kind, ids, what in (
            ("damaged", node["damaged"], "has unreadable or non-finite state files"),
            (
                "missing",
                node["missing"],
                f"has no state file of round <= "
                f"{checkpoint.server_round} for users whose training the server accepted in "
                f"rounds 1..{checkpoint.server_round}",
            ),
        ):
            if ids:
                files = [str(store.path(u)) for u in ids[:10]] + ([f"... ({len(ids)} in all)"] if len(ids) > 10 else [])
                problems.append(f"{where} {what}: {', '.join(files)}")
                users += ids
    if not problems:
        return None
    lost = (
        (
            f"users {sorted(users)} restart from their seeded initial state (their private parameters and other "
            "private records)"
        )
        if kept and not nodes_without_state
        else f"so {RESET_STATE}"
    )
    message = (
        f"resuming after round {checkpoint.server_round} loses the clients' private state: "
        + "; and ".join(problems)
        + f"; {lost}"
    )
    if not accept_reset:
        fix = "Restore these files (e.g. from a backup of the node's client-state-dir), or set " if users else "Set "
        raise ConfigError(
            f"run-config key 'resume-from': {message}. {fix}'resume-resets-client-state' = true to "
            "resume anyway, or start a new run"
        )
    aside = any(node["damaged"] for node in state_problems)  # the nodes renamed them (client_app.identify)
    return (
        message
        + " (resume-resets-client-state = true"
        + ("; the nodes renamed the unreadable or non-finite files to *.npz.damaged)" if aside else ")")
    )


def _rows_in_order(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The manifest's metrics rows with each row's keys in the order the run recorded them (``row-columns``), so a
    resumed run writes ``metrics.csv`` with the columns of an uninterrupted one; a checkpoint written before that
    field keeps JSON's sorted order."""
    rows = [dict(row) for row in manifest["rows"]]
    orders = manifest.get("row-columns")
    if not isinstance(orders, list) or len(orders) != len(rows):
        return rows
    return [{key: row[key] for key in order if key in row} | row for row, order in zip(rows, orders)]


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
