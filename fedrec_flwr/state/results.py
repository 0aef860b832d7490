"""The results folder of a run: config, per-round metrics (CSV and JSON), final shared arrays, learning-curve PNG.

Every file is written atomically (:mod:`fedrec_flwr.io`), so an interrupted run leaves complete files from its last
finished round, never half-written ones. ``summary.json``, written last, marks a finished run; a run that failed once
its folder existed holds ``failed.json`` instead (:func:`write_failure`). Reusing a ``run-name``
(:func:`check_results_folder`): a finished run's folder, or one holding an interrupted run's ``checkpoint.npz``, is
refused; a failed or interrupted run's folder without either is replaced, with a warning naming what it held.

A results folder belongs to one live run (:class:`FolderLock`): the ServerApp holds an exclusive lock on
``.<run-name>.lock`` beside it (``flock``, released by the kernel when the process ends, however it ends) for as long
as it runs, and a second run of that folder is refused, naming the holder (pid, host, start time).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fedrec_flwr.io import atomic_save_npz, atomic_write_bytes, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

PROGRESS = logging.getLogger("fedrec_flwr.progress")
"""Logger of the one-line-per-round progress report."""


COUNT_COLUMNS = frozenset(
    {
        "train-users",
        "num-replies",
        "num-failures",
        "eval-users",
        "gradient-users",
        "num-examples",
        "num-users",
        "isolated-users",
        "eval-isolated-users",
    }
)
"""Metric columns that count users, replies or examples: written as integers (the wire carries them as floats)."""


HEADLINE_K = 10
"""The cut-off of the progress line, ``summary.json``'s ``final`` row, the validation selection and the learning
curves when the run's ``ks`` lists it (HR@10 / NDCG@10, the metric the papers report); otherwise the first K listed."""


def headline_k(ks: str | Iterable[int] | None = None, rows: Iterable[Mapping[str, Any]] = ()) -> int | None:
    """The K whose ``HR@K`` / ``NDCG@K`` a run's one-line summaries show: :data:`HEADLINE_K` when ``ks`` has it, else
    the first K of ``ks``. Without ``ks`` (``None`` or ``""``), the K of the rows' ``HR@K`` columns, by the same rule
    (first-seen order); ``None`` when neither names one.

    ``ks``: the run-config value (``"5,20"``) or its integers."""
    if isinstance(ks, str):
        ks = [int(k) for k in ks.replace(" ", "").split(",") if k.isdigit()]
    listed = list(ks or ())
    if not listed:
        for row in rows:
            for key in row:
                match = re.fullmatch(r"HR@(\d+)", str(key))
                if match and int(match.group(1)) not in listed:
                    listed.append(int(match.group(1)))
    if not listed:
        return None
    return HEADLINE_K if HEADLINE_K in listed else listed[0]


def _cell(key: str, value: Any) -> float | int:
    """One metric value as written to ``metrics.csv`` / ``metrics.json``: an integral count in :data:`COUNT_COLUMNS`
    as ``int`` (``12``, not ``12.0``), everything else as ``float``."""
    number = float(value)
    if key in COUNT_COLUMNS and number.is_integer():
        return int(number)
    return number


FAILED_FILE = "failed.json"
"""Written (atomically) in a run's results folder when the run fails once that folder exists; see
:func:`write_failure`."""

RESULT_FILES = (
    "config.json",
    "metrics.csv",
    "metrics.json",
    "final_arrays.npz",
    "summary.json",
    "learning_curves.png",
    "unlearning.json",
    "before-unlearning.npz",
    "checkpoint.npz",
    FAILED_FILE,
)
"""The files a run writes in its results folder (a new run of the same ``run-name`` replaces them)."""


def check_results_folder(folder: str | Path, clear: bool = True) -> None:
    """Refuse to write into a folder that holds a finished run or a resumable one, and (``clear``) delete what a
    failed or interrupted run without a checkpoint left (:data:`RESULT_FILES`; other files stay), logging a warning
    that names those files and, for a failed run, its error (``failed.json``).

    Raises:
        ConfigError: ``folder/summary.json`` exists (a finished run): choose another ``run-name`` or delete it, so
            a folder never mixes two runs' files; or ``folder/checkpoint.npz`` exists (an interrupted run that can be
            resumed): continue it with ``resume-from``, or choose another ``run-name`` (a new run never deletes a
            checkpoint).
    """
    from fedrec_flwr.errors import ConfigError

    folder = Path(folder)
    if (folder / "summary.json").is_file():
        raise ConfigError(
            f"run-config key 'run-name' = {folder.name!r}: results folder {folder} already holds a "
            "finished run (summary.json); set another 'run-name' or delete the folder"
        )
    if (folder / "checkpoint.npz").is_file():
        raise ConfigError(
            f"run-config key 'run-name' = {folder.name!r}: results folder {folder} holds an interrupted "
            f"run's checkpoint (checkpoint.npz); continue it with resume-from={str(folder)!r}, or set "
            "another 'run-name' (or delete the folder) to start afresh"
        )
    left = [name for name in RESULT_FILES if (folder / name).is_file()] if clear else []
    if left:  # a failed or interrupted run's files, without a checkpoint to resume from: this run replaces them
        failure = read_failure(folder)
        held = (
            "an interrupted run without a checkpoint"
            if failure is None
            else f"a failed run ({describe_failure(failure)})"
        )
        log.warning(
            "results folder %s held %s (%s, no summary.json): this run replaces its files",
            folder,
            held,
            ", ".join(left),
        )
    for name in left:
        (folder / name).unlink(missing_ok=True)


LOCK_SUFFIX = ".lock"
"""The lock file of results folder ``<name>`` is ``.<name>.lock`` beside it (:class:`FolderLock`)."""


def lock_path(folder: str | Path) -> Path:
    """The lock file of a results folder: ``<parent>/.<name>.lock``."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


class FolderLock:
    """An exclusive lock on a results folder, held by the run writing into it (see the module docstring).

    The lock is ``flock(LOCK_EX)`` on :func:`lock_path`; the file holds its holder (``pid``, ``host``, ``started``,
    ``folder``, JSON) for the refusal of a second run. A lock file left by a process that died is not held by anyone
    (the kernel released its lock), so it never blocks: the next run takes it over. Released (and the file removed)
    by :meth:`release` or on leaving the ``with`` block.

    Args:
        folder: the results folder (need not exist; its parent is created).
        key, value: the run-config key and value the refusal names (``run-name`` or ``resume-from``).
    """

    def __init__(self, folder: str | Path, key: str = "run-name", value: str | None = None) -> None:
        self.folder = Path(folder)
        self.path = lock_path(self.folder)
        self.key, self.value = key, self.folder.name if value is None else value
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        """Take the lock.

        Raises:
            ConfigError: another live process holds it (the message names it and the lock file).
            OSError: the lock file cannot be created (the message names it).
        """
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise self._refusal(holder) from None
            except BaseException:
                os.close(fd)
                raise
            try:  # the holder before us may have removed the file after we opened it: lock the file that is there
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "folder": str(self.folder),
            "started": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _refusal(self, holder: Mapping[str, Any]):
        from fedrec_flwr.errors import ConfigError

        who = (
            f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')!r}, since {holder.get('started', '?')}"
            if holder
            else "a process that has not written its name yet"
        )
        return ConfigError(
            f"run-config key {self.key!r} = {self.value!r}: results folder {str(self.folder)!r} is in "
            f"use by a live run ({who}; lock file {str(self.path)!r}); wait for it to end or set "
            "another 'run-name'"
        )


def check_folder_free(folder: str | Path, key: str = "run-name", value: str | None = None) -> None:
    """Refuse a results folder a live run holds (:class:`FolderLock`), leaving nothing behind.

    Raises:
        ConfigError: naming the key, the value and the holder.
    """
    lock = FolderLock(folder, key, value)
    if not lock.path.exists():
        return
    lock.acquire()  # raises while the holder lives; else the stale file is ours for a moment
    lock.release()


def _read_holder(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_failure(
    folder: str | Path, error: BaseException, *, server_round: int | None, rounds_completed: int, num_server_rounds: int
) -> Path:
    """Record in ``folder/failed.json`` (atomically) why the run failed; returns its path.

    The record: ``error`` (``"<type>: <message>"``, one line), ``error-type``, ``message``, ``round`` (the round
    that was running, ``None`` before round 1 or after the last: the unlearning phase, the final files),
    ``rounds-completed`` (the last round whose metrics are in ``metrics.csv``), ``num-server-rounds`` and
    ``failed-at`` (UTC, ISO 8601).
    """
    message = " ".join(str(error).split())
    record = {
        "error": f"{type(error).__name__}: {message}",
        "error-type": type(error).__name__,
        "message": message,
        "round": server_round,
        "rounds-completed": int(rounds_completed),
        "num-server-rounds": int(num_server_rounds),
        "failed-at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return atomic_write_json(Path(folder) / FAILED_FILE, record)


def read_failure(folder: str | Path) -> dict | None:
    """The failure record of ``folder`` (:func:`write_failure`), ``None`` without one; a ``failed.json`` that is not a
    JSON object gives ``{"error": "unreadable failed.json"}``."""
    path = Path(folder) / FAILED_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    return record if isinstance(record, dict) else {"error": f"unreadable {FAILED_FILE}"}


def describe_failure(record: Mapping[str, Any]) -> str:
    """One line for a failure record: ``"failed in round 1: RoundFailed: ..."`` (the round when it has one)."""
    where = f"failed in round {record['round']}" if isinstance(record.get("round"), int) else "failed"
    return f"{where}: {record.get('error', 'unknown error')}"


SOURCE_COMMIT_ENV = "FEDREC_SOURCE_COMMIT"
"""Environment variable the launcher sets to the git commit of the checkout it runs: Flower's ServerApp imports the
package from the app (FAB) folder it unpacked, which is no git checkout."""


def source_commit(root: str | Path | None = None) -> str | None:
    """The git commit of the source tree that holds this package (``<sha>-dirty`` when tracked files differ from it),
    else ``$FEDREC_SOURCE_COMMIT``, else ``None`` (an installed wheel, or no ``git``)."""
    import os
    import subprocess

    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        top, sha = head.stdout.split() if head.returncode == 0 else ("", "")
        if sha and Path(top).resolve() == root.resolve():
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
            return f"{sha}-dirty" if dirty else sha
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    return os.environ.get(SOURCE_COMMIT_ENV) or None


def provenance() -> dict[str, Any]:
    """What produced a run, for ``config.json``: this package's version, the git commit of its source (or ``None``),
    and the versions of Python, flwr, torch, numpy and pandas in the process that wrote the results."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from fedrec_flwr import __version__

    versions = {"python": platform.python_version()}
    for name in ("flwr", "torch", "numpy", "pandas"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return {"package": "fedrec-flwr", "version": __version__, "git-commit": source_commit(), "versions": versions}


class RunRecorder:
    """Collects one row per round and keeps the results folder up to date.

    Args:
        folder: the run's results folder (created).
        run_config: the validated config as a kebab-case mapping (written to ``config.json``).
        info: extra facts to record (dataset statistics; the split's facts, ``split``: duplicates removed, users
            and items dropped, what ordered the held-out items; the tie rule as applied).
        rows: the rows of rounds already run (a resumed run's, from its checkpoint).
    """

    def __init__(
        self,
        folder: str | Path,
        run_config: Mapping[str, Any],
        info: Mapping[str, Any],
        rows: Iterable[Mapping[str, Any]] = (),
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = [dict(r) for r in rows]
        self._last = time.monotonic()
        self._start = self._last
        self.k = headline_k(run_config.get("ks"), self.rows)
        atomic_write_json(
            self.folder / "config.json", {"run-config": dict(run_config), **dict(info), "produced-by": provenance()}
        )

    def record(self, server_round: int, train: Mapping[str, float], evaluate: Mapping[str, float]) -> dict:
        """Add the row of one finished round, log its progress line, and rewrite the metrics files."""
        now = time.monotonic()
        row: dict[str, Any] = {"round": server_round, "seconds": round(now - self._last, 3)}
        self._last = now
        row.update({k: _cell(k, v) for k, v in train.items()})
        row.update({k: _cell(k, v) for k, v in evaluate.items()})
        self.rows.append(row)
        if self.k is None:  # no ks in the run config: the first evaluated round's metrics say
            self.k = headline_k(None, [evaluate])
        k = self.k if self.k is not None else HEADLINE_K
        hr, ndcg = evaluate.get(f"HR@{k}"), evaluate.get(f"NDCG@{k}")
        PROGRESS.info(
            "round %4d | HR@%d %s | NDCG@%d %s | train loss %.4f | %.1f s",
            server_round,
            k,
            f"{hr:.4f}" if hr is not None else "   -  ",
            k,
            f"{ndcg:.4f}" if ndcg is not None else "   -  ",
            float(train.get("train-loss", math.nan)),
            row["seconds"],
        )
        self.write_metrics()
        return row

    def write_metrics(self) -> None:
        """Write ``metrics.csv`` and ``metrics.json`` (all rounds so far)."""
        columns: list[str] = [c for c in ("round", "seconds") if any(c in row for row in self.rows)]
        for row in self.rows:  # then in first-seen order (a resumed run's rows come back from a checkpoint sorted)
            columns += [c for c in row if c not in columns]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.folder / "metrics.csv", buffer.getvalue())
        atomic_write_json(self.folder / "metrics.json", self.rows)

    def finish(self, arrays: Mapping[str, np.ndarray], summary: Mapping[str, Any]) -> Path:
        """Write the final shared arrays, the learning-curve plot and, last, the summary; returns the folder."""
        atomic_save_npz(self.folder / "final_arrays.npz", **{k.replace("/", "_"): v for k, v in arrays.items()})
        unlearning = summary.get("unlearning")
        marks = (
            {f"unlearning ({unlearning.get('method', '')})": unlearning["round"]}
            if isinstance(unlearning, Mapping) and "round" in unlearning
            else {}
        )
        k = self.k if self.k is not None else headline_k(None, self.rows)
        plot_learning_curves(self.rows, self.folder / "learning_curves.png", title=self.folder.name, marks=marks, k=k)
        evaluated = [r for r in self.rows if f"HR@{k}" in r]
        final = dict(evaluated[-1]) if evaluated else {}
        selected = select_on_validation(self.rows, k=k)
        atomic_write_json(  # last: summary.json marks a finished run
            self.folder / "summary.json",
            {
                "final": final,
                "selected-on-validation": selected,
                "total-seconds": round(time.monotonic() - self._start, 3),
                **dict(summary),
            },
        )
        return self.folder


def select_on_validation(
    rows: list[Mapping[str, Any]], key: str | None = None, k: int | None = None
) -> dict[str, Any] | None:
    """The evaluated round with the best validation metric (earliest on ties), or ``None`` without validation.

    The round is chosen on each user's validation item (``holdout-validation``), never on the test item; the row's
    test metrics are then an honest estimate, unlike picking the round with the best test HR@K. ``k``: the cut-off
    (default :func:`headline_k` of the rows); ``key``: the validation column (default ``val-HR@<k>``).
    """
    k = k if k is not None else headline_k(None, rows)
    if k is None:
        return None
    key = key if key is not None else f"val-HR@{k}"
    candidates = [r for r in rows if key in r and f"HR@{k}" in r]
    if not candidates:
        return None
    best = max(candidates, key=lambda r: (r[key], -r["round"]))
    return dict(best)


def plot_learning_curves(
    rows: list[Mapping[str, Any]],
    path: str | Path,
    title: str = "",
    marks: Mapping[str, float] | None = None,
    k: int | None = None,
) -> None:
    """Plot HR@K and NDCG@K (evaluated rounds; ``k`` default: :func:`headline_k` of the rows) and the train loss
    (every round) against the round, to a PNG.

    ``marks`` maps a label to a round after which something happened (e.g. ``{"unlearning (hfkcu)": 50}``): a dashed
    vertical line at that round + 0.5 on both panels, named in the left panel's legend."""
    import matplotlib.pyplot as plt

    fig = learning_curves_figure(rows, title, marks, k=k)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def learning_curves_figure(
    rows: list[Mapping[str, Any]], title: str = "", marks: Mapping[str, float] | None = None, k: int | None = None
):
    """The figure :func:`plot_learning_curves` saves (a ``matplotlib.figure.Figure``, Agg backend; close it with
    ``plt.close``): left panel HR@K and NDCG@K (``k`` default: :func:`headline_k` of the rows) with their legend
    below it (outside the axes, so that no point, e.g. a short run's last evaluation at the right edge, is hidden),
    right panel the train loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    k = k if k is not None else headline_k(None, rows)
    shown = (f"HR@{k}", f"NDCG@{k}") if k is not None else ()
    evaluated = [r for r in rows if shown and shown[0] in r]
    if evaluated:
        rounds = [r["round"] for r in evaluated]
        for key, marker in zip(shown, ("o", "s")):
            values = [r[key] for r in evaluated]
            left.plot(rounds, values, marker=marker, label=f"{key} (last {values[-1]:.3f})")
    last_round = max((r["round"] for r in rows), default=1)
    for axis in (left, right):
        axis.set_xlim(0, last_round + max(0.5, 0.03 * last_round))  # room for the last marker
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    for label, after in (marks or {}).items():
        for axis in (left, right):
            axis.axvline(
                float(after) + 0.5, color="0.35", linestyle="--", linewidth=1, label=label if axis is left else None
            )
    peak = max((r[key] for r in evaluated for key in shown if key in r), default=0.0)
    left.set_ylim(0, max(left.get_ylim()[1], 1.06 * peak))  # room for the highest marker (a single point, HR 1.0)
    left.set_xlabel("round")
    left.set_ylabel("metric on held-out items")
    left.grid(alpha=0.3)
    if left.get_legend_handles_labels()[1]:  # below the panel, outside the axes: it never hides a point
        left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize="small", frameon=False)
    trained = [r for r in rows if "train-loss" in r]
    right.plot([r["round"] for r in trained], [r["train-loss"] for r in trained], color="tab:red")
    right.set_xlabel("round")
    right.set_ylabel("mean local train loss")
    right.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
