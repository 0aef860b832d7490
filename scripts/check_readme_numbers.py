#!/usr/bin/env python
"""Check the README's quickstart figures against a fresh run of the current code.

The README quotes the quickstart's progress lines (``round   10 | HR@10 0.3807 | ...``)
and the final HR@10 / NDCG@10 of the default run. This script runs the default experiment (MovieLens-100K, 943
per-user nodes, the defaults of ``pyproject.toml``) for ``--rounds`` rounds in this process with
:func:`fedrec_flwr.serial.run_serial` -- the same ServerApp, strategy and ClientApp as ``flwr run``'s simulation,
bit-identical models (``tests/test_simulation_properties.py``), without Ray's start-up -- and compares every
README figure of a round it ran (the progress lines' HR@10, NDCG@10 and train loss, and the "HR@10 climbs from ..
(round ..) to .. (round ..), NDCG@10 from .. to .." sentence) at the precision the README prints. Timings
are not compared (they depend on the machine).

Usage::

    FEDREC_DATA_DIR=/path/to/data python scripts/check_readme_numbers.py [--rounds 10] [--readme README.md]

**Exact here, within a tolerance elsewhere.** The figures are deterministic on one machine, but another CPU's kernels
sum in another order, so float32 rounding moves them a little. The machine that wrote the figures is recorded in
``scripts/readme_figures_machine.json`` (its CPU model, torch's CPU capability, the torch and numpy versions; written
by ``--record-machine``). On that machine every figure must match exactly at the README's precision; on any other,
within the spread the README states ("within **±0.002**"). The script prints which comparison it made.

Exit status 0 when every quoted figure of the rounds run matches, 1 otherwise (each difference printed), 2 when the
README quotes no line of those rounds. Without ``--results-dir`` the run goes to a ``readme-check-*`` temp folder,
removed afterwards unless a figure differs (then its path is printed). ``--rounds 10`` takes about 11 s at low load
on a 2-core machine; ``--rounds 100`` (the README's final figures too) about 1.5 minutes (since one-user messages
take the block path by default; about 2 and 15 minutes on the per-user path).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"round\s+(\d+) \| HR@10 ([\d.]+|\s*-\s*) \| NDCG@10 ([\d.]+|\s*-\s*) \| train loss ([\d.]+)")
TOLERANCE = re.compile(r"within \*\*±([\d.]+)\*\*")
MACHINE_FILE = ROOT / "scripts" / "readme_figures_machine.json"
FINAL = re.compile(
    r"HR@10 climbs from ([\d.]+) \(round (\d+)\) to ([\d.]+) \(round (\d+)\), NDCG@10 from ([\d.]+) to "
    r"([\d.]+)"
)


def quoted(readme: str) -> dict[int, dict[str, str]]:
    """The README's quoted progress lines: round -> {"HR@10", "NDCG@10", "train-loss"} as printed ("-" if none)."""
    out = {}
    for match in LINE.finditer(readme):
        out[int(match.group(1))] = {
            "HR@10": match.group(2).strip(),
            "NDCG@10": match.group(3).strip(),
            "train-loss": match.group(4),
        }
    return out


def machine() -> dict[str, str]:
    """This machine as far as float32 results depend on it: CPU model, torch's CPU capability (the vectorised
    kernels it picks: AVX512, AVX2, ...), machine type, torch and numpy versions."""
    import platform

    import numpy
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu-capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }


def describe(record: dict) -> str:
    """``cpu, capability, torch version`` of a :func:`machine` record."""
    return f"{record.get('cpu', '?')}, {record.get('cpu-capability', '?')}, torch {record.get('torch', '?')}"


def stated_tolerance(readme: str) -> float | None:
    """The spread across machines the README states for its figures ("within **±0.002**"), or None."""
    match = TOLERANCE.search(readme)
    return float(match.group(1)) if match else None


def compare(quotes: dict[int, dict[str, str]], rows: list[dict], tolerance: float = 0.0) -> list[str]:
    """Differences between quoted figures and ``metrics.json`` rows, formatted as the progress line formats them.

    With ``tolerance`` 0 a figure must print the same at the README's precision; with ``tolerance`` > 0 the fresh
    value may differ from the quoted one by at most that much (plus half a unit of the printed precision)."""
    by_round = {int(r["round"]): r for r in rows}
    problems = []
    for rnd, figures in sorted(quotes.items()):
        row = by_round.get(rnd)
        if row is None:
            continue
        for key, value in figures.items():
            column = "train-loss" if key == "train-loss" else key
            decimals = len(value.partition(".")[2])
            fresh = f"{row[column]:.{decimals}f}" if column in row else "-"
            if tolerance > 0 and value != "-" and fresh != "-":
                if abs(float(row[column]) - float(value)) <= tolerance + 0.5 * 10**-decimals:
                    continue
            if value != fresh:
                problems.append(f"round {rnd} {key}: README {value}, fresh run {fresh}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds to run (default 10)")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument(
        "--results-dir",
        default=None,
        help="where the run's folder goes (default: a temp folder, removed unless a figure differs)",
    )
    parser.add_argument(
        "--machine-file",
        default=str(MACHINE_FILE),
        help="the record of the machine that wrote the figures (default scripts/readme_figures_machine.json)",
    )
    parser.add_argument(
        "--record-machine",
        action="store_true",
        help="record this machine as the one that wrote the figures, when every figure matches exactly",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    import logging

    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    text = Path(args.readme).read_text()
    quotes = quoted(text)
    final = FINAL.search(text)
    if final:
        quotes.setdefault(int(final.group(2)), {}).update({"HR@10": final.group(1), "NDCG@10": final.group(5)})
        quotes.setdefault(int(final.group(4)), {}).update({"HR@10": final.group(3), "NDCG@10": final.group(6)})
    ran = {r: q for r, q in quotes.items() if r <= args.rounds}
    if not ran:
        print(f"the README quotes no figure of rounds 1..{args.rounds}", file=sys.stderr)
        return 2
    here = machine()
    recorded = json.loads(Path(args.machine_file).read_text()) if Path(args.machine_file).is_file() else None
    tolerance = 0.0
    if args.record_machine or recorded == here:
        print(f"comparing exactly: this is the machine that wrote the figures ({describe(here)})")
    else:
        tolerance = stated_tolerance(text) or 0.0
        how = (
            f"comparing within ±{tolerance:g}, the spread the README states across machines"
            if tolerance
            else "the README states no spread across machines: comparing exactly"
        )
        print(
            f"this machine ({describe(here)}) is not the one that wrote the figures "
            f"({describe(recorded) if recorded else 'not recorded'}): {how}"
        )
    temp = None if args.results_dir else Path(tempfile.mkdtemp(prefix="readme-check-"))
    problems = None
    try:
        config = make_run_config(
            num_server_rounds=args.rounds, results_dir=str(args.results_dir or temp), run_name="readme-check"
        )
        folder = run_serial(config)
        rows = json.loads((folder / "metrics.json").read_text())
        problems = compare(ran, rows, tolerance)
        for line in problems:
            print(line)
        print(
            f"{len(ran)} quoted round(s) checked against {folder}: "
            f"{'all match' if not problems else f'{len(problems)} difference(s)'}"
            + (f" (within ±{tolerance:g})" if tolerance else " (exactly)")
        )
        if args.record_machine and not problems:
            Path(args.machine_file).write_text(json.dumps(here, indent=2) + "\n")
            print(f"recorded this machine in {args.machine_file}")
    finally:
        if temp is not None:  # our own temp folder: kept only when a figure differs, to look at
            if problems:
                print(f"results kept in {temp}")
            else:
                shutil.rmtree(temp, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
