"""What every experiment script shares: job claiming, job loops, table formatting and atomic plot output.

An experiment declares its jobs (validated run configs) and what to do with one; :func:`run_jobs` runs them in order,
skipping finished ones (``summary.json`` exists) and ones another worker has claimed (a ``.running`` marker), so a
command can be interrupted and resumed, and started in several processes to use several cores.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from fedrec_flwr.io import atomic_write_bytes, atomic_write_text

CLAIM = ".running"
"""Marker a worker creates (atomically) in a run's folder while it runs it, so that several workers started with the
same command share the jobs. A worker killed mid-run leaves it behind: delete such markers before restarting."""


def slug(text: str) -> str:
    """A file-name-safe form of a method or variant name."""
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower().replace("--", "-")


@contextmanager
def claimed(folder: Path, root: Path, done_file: str = "summary.json"):
    """Yield True if this worker should run the job in ``folder`` (``done_file`` absent, not claimed); hold the claim
    while the block runs."""
    shown = folder.relative_to(root) if folder.is_relative_to(root) else folder
    if (folder / done_file).is_file():
        print(f"skip (done): {shown}", flush=True)
        yield False
        return
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        print(f"skip (another worker runs it): {shown}", flush=True)
        yield False
        return
    started = time.time()
    print(f"run: {shown}", flush=True)
    try:
        yield True
        print(f"done in {time.time() - started:.0f} s: {shown}", flush=True)
    finally:
        (folder / CLAIM).unlink(missing_ok=True)


def run_jobs(jobs: Sequence, run_one: Callable, shard: str = "0/1", label: str = "jobs") -> None:
    """Run ``run_one(job)`` for this shard's jobs (``shard = "i/n"``: every n-th job from i); a failing job is
    reported and the others go on. Raises ``SystemExit`` listing the failed jobs at the end."""
    index, count = (int(x) for x in shard.split("/"))
    mine = list(jobs)[index::count]
    print(f"{label}: {len(mine)} of {len(jobs)} jobs in this shard", flush=True)
    failed = []
    for number, job in enumerate(mine, 1):
        print(f"[{number}/{len(mine)}]", end=" ", flush=True)
        try:
            run_one(job)
        except Exception as exc:  # noqa: BLE001 - report, go on with the other jobs
            name = getattr(job, "run_name", str(job))
            print(f"FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
    if failed:
        raise SystemExit(f"{len(failed)} job(s) failed: {failed}")


def quiet_flower() -> None:
    """One torch thread per worker, and Flower's per-round log lines off (the progress lines stay)."""
    import torch

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    os.environ.setdefault("FLWR_LOG_LEVEL", "WARNING")


def mean_std(frame: pd.DataFrame, keys: list[str], columns) -> pd.DataFrame:
    """Mean, standard deviation (ddof=1) and count over seeds."""
    grouped = frame.groupby(keys, sort=False)
    out = grouped[list(columns)].agg(["mean", "std"])
    out.columns = [f"{c}-{s}" for c, s in out.columns]
    out["seeds"] = grouped.size()
    return out.reset_index()


def fmt(mean: float, std: float, digits: int = 4) -> str:
    """``"mean ± std"`` (``"mean"`` for one seed, ``"-"`` for none)."""
    if mean is None or np.isnan(mean):
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std == std else f"{mean:.{digits}f}"


def markdown(frame: pd.DataFrame) -> str:
    """A GitHub Markdown table (no extra dependency)."""
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    """Write a table atomically, floats to 6 significant digits (fixed decimals would write a KL of 3e-4 with one
    digit and a relative update of 1e-8 as 0)."""
    atomic_write_text(path, frame.to_csv(index=False, float_format="%.6g"))


def pyplot():
    """matplotlib's pyplot with the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> None:
    """Save a figure as PNG atomically and close it; ``rect`` is the part of the figure (left, bottom, right, top, as
    fractions) the axes are laid out in, leaving the rest to a figure legend or title."""
    fig.tight_layout(rect=rect)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    pyplot().close(fig)
    atomic_write_bytes(path, buffer.getvalue())
