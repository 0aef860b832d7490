"""Private client state in files on the client's own side (``client-state-dir``), so a device restart loses nothing.

Without ``client-state-dir`` a user's private records (its embedding, FedRecGEL's optimizer moments, PFedRec's
personalised rows, ...) live only in the node's ``context.state``, which dies with the SuperNode process (or with
the simulation). With it, the ClientApp adapter (:mod:`fedrec_flwr.app.client_app`) loads each user's records from
``<client-state-dir>/<run>/user-<id>.npz`` before the user's client runs and writes them back, atomically
(:func:`fedrec_flwr.io.atomic_save_npz`), after the user trained. The folder is the device's: a SuperNode's
``--node-config "client-state-dir=..."`` overrides the run config's key. ``<run>`` is the run's name, which the
server sends with every message (a resumed run keeps its name, so it finds its clients' files).

**Versions.** A file keeps the user's state after each training round it took part in that the server may still
need to replay: when the server resumes from a checkpoint of round ``c`` (:mod:`fedrec_flwr.state.checkpoint`), rounds
``c+1..`` run again, and each must start from the state as it was then, not from a state trained further before the
crash. So a message of round ``t`` reads the newest version of round ``< t`` (training) or ``<= t`` (evaluation and
queries), and a save drops every version the server can no longer return to: all but the newest at or before the
last checkpoint (``durable-round``, sent by the server; ``-1`` without checkpoints keeps the newest version only).

**What a record is.** By convention every private record of user ``u`` is stored in ``context.state`` under a key
ending in ``":<u>"`` (``"user:<u>"``, ``"user-opt:<u>"``, ``"user-rows:<u>"``; see :class:`fedrec_flwr.clients.fedrec.FedRecClient`);
only such records are written, and nothing here ever leaves the node.
"""

from __future__ import annotations

import json
import logging
import re
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.io import atomic_save_npz, load_npz, remove_dead_temporaries

log = logging.getLogger(__name__)

STATE_PREFIX = "user:"
"""``context.state`` key prefix of a user's private record: ``"user:<partition id>"`` (its embedding and other
private parameters). The block and per-user paths both read and write these keys, so they can alternate."""
OPTIMIZER_PREFIX = "user-opt:"
"""``context.state`` key prefix of a user's private optimizer state (FedRecGEL's SAM clients)."""
ROWS_PREFIX = "user-rows:"
"""``context.state`` key prefix of a user's personal item rows (PFedRec's private copy of its item embedding)."""

STATE_DIR_KEY = "client-state-dir"
"""Node-config (and run-config) key of the folder holding the clients' private state files."""

RUN_KEY = "run"
"""Message-config key: the run's name (the state files' sub-folder)."""

DURABLE_ROUND_KEY = "durable-round"
"""Message-config key: the round of the server's last checkpoint (``-1``: the server keeps none)."""

NEW_RUN_KEY = "new-run"
"""Identify-query key of a run that starts afresh (no ``resume-from``): each node reports state files of its users that
an earlier run of the same name left in its state folder (:meth:`ClientStateStore.earlier_users`)."""

RESUME_ROUND_KEY = "resume-round"
"""Identify-query key of a resumed run: the checkpoint's round (each node then checks its users' state files)."""

_MANIFEST = "__manifest__"

RUN_NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+-]{0,199}")
"""What a run's name may be (matched whole, :func:`run_name_problem`): it names the results folder under
``results-dir`` and the clients' state folder under ``client-state-dir``, so the same rule holds for both. At most
200 ASCII characters (200 bytes: below the 255-byte file-name limit of the common file systems, with room for the
files named after it); letters, digits and ``. _ = , + -``, starting with a letter or digit (no path separator, no
space or control character, no hidden folder, no ``.``/``..``)."""

RUN_NAME_RULE_TEXT = (
    "1-200 ASCII letters, digits and '.', '_', '=', ',', '+', '-', starting with a letter or digit "
    "(no space, '/', '\\', control or non-ASCII character)"
)
""":data:`RUN_NAME_RULE` in words, for error messages."""


def run_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a run's name (:data:`RUN_NAME_RULE`), or ``None`` when it can."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if RUN_NAME_RULE.fullmatch(name):
        return None
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > 200:
        return f"{size} bytes long, more than 200"
    return f"must be {RUN_NAME_RULE_TEXT}"


class ClientStateError(RuntimeError):
    """A state file is unreadable or belongs to another user or run (the message names the file)."""


def user_record_keys(state: RecordDict, user: int) -> list[str]:
    """The keys of user ``user``'s private records in a node's ``context.state`` (those ending in ``":<user>"``)."""
    suffix = f":{int(user)}"
    return [key for key in state.keys() if key.endswith(suffix)]


def nonfinite_records(state: RecordDict, user: int) -> list[str]:
    """``"<record>/<array>"`` of each of user ``user``'s private arrays in ``state`` that holds a NaN or an infinity
    (``[]``: all finite). Such a user cannot be trained or evaluated: its node leaves it out
    (:func:`fedrec_flwr.app.client_app.isolate_nonfinite_users`)."""
    bad = []
    for key in user_record_keys(state, user):
        for name, array in state[key].items():
            value = array.numpy()
            if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                bad.append(f"{key}/{name}")
    return bad


def state_folder(node_config: Mapping[str, Any], run_config_dir: str, message_config: Mapping[str, Any]) -> Path | None:
    """The folder of this run's state files on this node, or ``None`` when the clients keep state in memory only.

    Raises:
        ConfigError: a folder is set but the message names no run, or the run name is not a safe file name.
    """
    folder = str(node_config.get(STATE_DIR_KEY, "") or run_config_dir or "")
    if not folder:
        return None
    run = message_config.get(RUN_KEY)
    if not isinstance(run, str) or run_name_problem(run) is not None:
        raise ConfigError(
            f"'{STATE_DIR_KEY}' is set but the server's message names no usable run "
            f"({RUN_KEY!r} = {run!r}); use this package's ServerApp, which sends it"
        )
    return Path(folder).expanduser() / run


class ClientStateStore:
    """The versioned private-state files of one run on one node (see the module docstring).

    Args:
        folder: ``<client-state-dir>/<run>``, created on the first save.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def path(self, user: int) -> Path:
        """``folder/user-<user>.npz``."""
        return self.folder / f"user-{int(user)}.npz"

    def read_versions(self, user: int) -> dict[int, dict[str, dict[str, np.ndarray]]]:
        """Round -> record key -> array key -> array, for every version in the user's file (``{}`` if none).

        Raises:
            ClientStateError: the file exists but cannot be read, or it is another user's.
        """
        path = self.path(user)
        if not path.is_file():
            return {}
        try:
            with load_npz(path) as data:
                manifest = json.loads(str(data[_MANIFEST]))
                if int(manifest["user"]) != int(user):
                    raise ClientStateError(f"{path}: holds user {manifest['user']}'s state, not user {user}'s")
                versions: dict[int, dict[str, dict[str, np.ndarray]]] = {}
                for name, (round_, record, key) in manifest["arrays"].items():
                    versions.setdefault(int(round_), {}).setdefault(record, {})[key] = np.array(data[name])
                for round_ in manifest.get("rounds", []):
                    versions.setdefault(int(round_), {})
                return versions
        except ClientStateError:
            raise
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, json.JSONDecodeError) as err:
            raise ClientStateError(
                f"{path}: unreadable client state file ({type(err).__name__}: {err}); it was "
                "written atomically, so something else changed it — restore or delete it"
            ) from err

    def load(self, user: int, state: RecordDict, as_of: int | None) -> int | None:
        """Replace user ``user``'s records in ``state`` by its newest saved version of round ``<= as_of`` (``None``:
        the newest of all). With no such version the user's records are removed, so the client starts from its
        seeded initial state, as on a first visit. Returns the round of the version loaded, or ``None``."""
        versions = self.read_versions(user)
        eligible = [r for r in versions if as_of is None or r <= as_of]
        for key in user_record_keys(state, user):
            del state[key]
        if not eligible:
            return None
        chosen = max(eligible)
        for record, arrays in versions[chosen].items():
            state[record] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        return chosen

    def resume_problems(
        self, users: Iterable[int], resume_round: int, set_aside: bool = False
    ) -> tuple[list[int], list[int]]:
        """What this folder holds for a resume after round ``resume_round`` (ids only, no values). Temporary files
        of these users' files left by a writer killed mid-save are removed first
        (:func:`fedrec_flwr.io.remove_dead_temporaries`).

        Args:
            users: the users this node serves.
            set_aside: rename each damaged file to ``user-<id>.npz.damaged`` (kept for inspection), so the user
                restarts from its seeded initial state (``resume-resets-client-state = true``).

        Returns:
            ``(damaged, absent)``: users whose file :meth:`read_versions` cannot read (or is another user's), or whose
            version to resume from holds a NaN or an infinity (:func:`check_finite`; each logged with its file); users
            without a readable version of round ``<= resume_round`` (no file, or only later versions). The server
            decides which absent users lose state: those its checkpoint says trained
            (:func:`fedrec_flwr.state.checkpoint.check_client_state`).
        """
        users = [int(u) for u in users]
        removed = remove_dead_temporaries(self.folder, [self.path(u).name for u in users])
        if removed:  # a writer killed mid-save (its pid is gone): the file it was replacing is intact
            log.info(
                "removed %d temporary file(s) of a writer killed mid-save in %s (e.g. %s)",
                len(removed),
                self.folder,
                removed[0].name,
            )
        damaged, absent = [], []
        for user in users:
            try:
                versions = self.read_versions(user)
                resumed = max((r for r in versions if r <= resume_round), default=None)
                if resumed is not None:
                    check_finite(self.path(user), resumed, versions[resumed])
            except ClientStateError as err:
                log.warning("%s", err)
                damaged.append(user)
                if set_aside:
                    self.path(user).replace(self.path(user).with_suffix(".npz.damaged"))
                continue
            if resumed is None:
                absent.append(user)
        return damaged, absent

    def earlier_users(self, users: Iterable[int]) -> list[int]:
        """The users among ``users`` that already have a state file here: left by an earlier run of the same name (a
        run that failed, or one with another ``results-dir``, even one still running). A new run would load their
        versions (evaluation, and training in a later round) as if they were its own."""
        if not self.folder.is_dir():
            return []
        return [int(u) for u in users if self.path(int(u)).is_file()]

    def save(self, user: int, state: RecordDict, server_round: int, durable_round: int) -> Path:
        """Write the user's records in ``state`` as the version of ``server_round`` (atomically), keeping only the
        versions the server may still return to (see the module docstring). Returns the file's path."""
        versions = {r: v for r, v in self.read_versions(user).items() if r != server_round}
        versions[int(server_round)] = {
            key: {name: np.asarray(array.numpy()) for name, array in state[key].items()}
            for key in user_record_keys(state, user)
        }
        keep = _versions_to_keep(versions, int(durable_round), int(server_round))
        arrays: dict[str, np.ndarray] = {}
        index: dict[str, list] = {}
        for round_ in sorted(keep):
            for record, values in versions[round_].items():
                for key, value in values.items():
                    name = f"a{len(index)}"
                    index[name] = [round_, record, key]
                    arrays[name] = value
        manifest = {"user": int(user), "rounds": sorted(keep), "arrays": index}
        return atomic_save_npz(self.path(user), **arrays, **{_MANIFEST: np.array(json.dumps(manifest))})


def check_finite(path: Path, round_: int, records: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Refuse a saved version holding a NaN or an infinity (a client would train on it, and its node's replies would
    be rejected every round).

    Raises:
        ClientStateError: naming the file, the round of the version, the record and the array.
    """
    for record, arrays in records.items():
        for key, value in arrays.items():
            if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
                raise ClientStateError(
                    f"{path}: the version of round {round_} holds {bad} non-finite value(s) in "
                    f"record {record!r}, array {key!r}"
                )


def _versions_to_keep(versions: Iterable[int], durable_round: int, newest: int) -> set[int]:
    """The newest version at or before ``durable_round`` and every later one; only ``newest`` when ``durable_round``
    is negative (no checkpoints)."""
    rounds = set(versions)
    if durable_round < 0:
        return {newest}
    settled = [r for r in rounds if r <= durable_round]
    return {r for r in rounds if r > durable_round} | ({max(settled)} if settled else set())
