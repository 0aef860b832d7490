"""The acceptance ratios of one ``idle_suite.sh`` run (issues 17 and 20), from the raw files in its folder.

Usage: ``.venv/bin/python experiments/bench/idle_summary.py experiments/bench/results/idle-<stamp>``
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

QUICKSTART_BEFORE_S = 17 * 60
"""The default quickstart at commit daae3bd (the baseline of the speed target)."""


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _loads(folder: Path, step: str) -> str:
    """The load averages the suite logged at a step's start and end."""
    found = re.findall(
        rf"load ([\d. ]+)\] (?:start|end) {step}\b",
        (folder / "suite.log").read_text() if (folder / "suite.log").exists() else "",
    )
    return " -> ".join(f.split()[0] for f in found) or "?"


def simulation(folder: Path) -> list[str]:
    lines = []
    for name in ("sim_100", "sim_943"):
        rows = _load(folder / f"{name}.json")
        if not rows:
            lines.append(f"| per message, {name} | <= 1.3x | missing (see {name}.log) | - |")
            continue
        bare = [r["seconds-per-round"] for r in rows if r["app"] == "bare+model"]
        ours = [r["seconds-per-round"] for r in rows if r["app"] == "fedrec"]
        ratio = statistics.median(ours) / statistics.median(bare)
        lines.append(
            f"| per message, one user per node, {rows[0]['sampled-users']} sampled of {rows[0]['nodes']} "
            f"nodes: ours / bare+model (s/round: ours {ours}, bare {bare}) | <= 1.3x | {ratio:.2f}x "
            f"(load {_loads(folder, name)}) | {'yes' if ratio <= 1.3 else 'no'} |"
        )
    return lines


def deploy(folder: Path) -> list[str]:
    result = _load(folder / "deploy.json")
    if not result:
        return ["| deployed cold start | <= 1.5x | missing (see deploy.log) | - |"]
    summary = result["median-seconds"]
    lines = []
    for kind in ("train", "evaluate", "query.identify"):
        ours, bare = summary.get(f"ours {kind}"), summary.get(f"bare {kind}")
        if ours and bare:
            ratio = ours["total"] / bare["total"]
            lines.append(
                f"| deployed cold start per {kind} message (ours {ours['total']:.2f} s, bare "
                f"{bare['total']:.2f} s; ours' app import {ours['app']:.2f} s) | <= 1.5x | {ratio:.2f}x "
                f"(load {_loads(folder, 'deploy')}) | {'yes' if ratio <= 1.5 else 'no'} |"
            )
    train = (result.get("deployed") or {}).get("mean-training-round")
    if train:
        ratio = train["ours"] / (train["bare"] + train["serial"])
        lines.append(
            f"| 3 SuperNodes, mean training round: ours {train['ours']:.1f} s / (bare {train['bare']:.1f} s "
            f"+ in-process {train['serial']:.2f} s) | <= 2x | {ratio:.2f}x | {'yes' if ratio <= 2 else 'no'} |"
        )
    return lines


def imports(folder: Path) -> list[str]:
    result = _load(folder / "imports.json")
    if not result:
        return []
    extra = result["extra-by-group-seconds"]
    return [
        f"| imports beyond the bare app (median self time): torch {extra['torch']:.2f} s, ours "
        f"{extra['ours']:.2f} s, other {extra['other']:.2f} s; bare imports {result['bare-imports-seconds']:.2f} s "
        f"(interpreter {result['bare-interpreter-wall-seconds']:.2f} s), ours {result['ours-imports-seconds']:.2f} s "
        f"({result['ours-interpreter-wall-seconds']:.2f} s) | | | |"
    ]


def verdict(within: bool, rounds: int) -> str:
    if rounds != 100:
        return "scaled run: not comparable"
    return "reachable" if within else "not reachable with one user per node"


def quickstart(folder: Path) -> list[str]:
    rows = _load(folder / "quickstart_bare.json")
    if not rows:
        return ["| quickstart pattern, bare app | | missing (see quickstart_bare.log) | - |"]
    lines = []
    target = 0.4 * QUICKSTART_BEFORE_S
    for row in rows:
        if row["app"] == "bare":
            lines.append(
                f"| bare app, quickstart pattern ({row['rounds']} rounds; train {row['train-ms-per-message']} "
                f"ms/message, evaluate {row['evaluate-ms-per-message']} ms/message): wall {row['wall-seconds']} "
                f"s vs the target's {target:.0f} s | <= 0.4x of 17 min | {row['vs-17-min']}x (load "
                f"{row['load-start'][0]} -> {row['load-end'][0]}) | "
                f"{verdict(row['wall-seconds'] <= target, row['rounds'])} |"
            )
        else:
            lines.append(
                f"| ours, default quickstart ({row['rounds']} rounds): wall {row['wall-seconds']} s | "
                f"<= 0.4x of 17 min | {row['vs-17-min']}x | {('yes' if row['vs-17-min'] <= 0.4 else 'no') if row['rounds'] == 100 else 'scaled run'} |"
            )
    return lines


def main(folder: str) -> int:
    path = Path(folder)
    print(f"# Speed acceptance, {path.name}\n")
    print((path / "env.txt").read_text() if (path / "env.txt").exists() else "")
    print("| item | target | measured | met? |\n|---|---|---|---|")
    for line in simulation(path) + deploy(path) + imports(path) + quickstart(path):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
