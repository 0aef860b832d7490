"""What a deployed train message's ClientApp imports beyond a bare Flower ClientApp, by ``python -X
importtime``, in fresh interpreters.

A SuperNode of flwr 1.42 runs every message in a new ``flwr-clientapp`` process, so every import on our ClientApp's
path is paid per message. This runs ``--repeats`` fresh interpreters each for the bare app's imports (``flwr.app``,
``flwr.clientapp``, ``flwr.common.serde``: what ``flwr-clientapp`` itself loads) and for ours on top
(``fedrec_flwr.app.client_app``), and prints the median self-time of the modules loaded only by ours, grouped by top-level
package (torch, ours, the rest), and the largest of them.

Usage::

    .venv/bin/python experiments/bench/import_breakdown.py [--repeats 3] [--out results/imports.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

FLOWER = "import flwr.app, flwr.clientapp, flwr.common.serde"
OURS = FLOWER + "; import fedrec_flwr.app.client_app"
LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)")
OUR_PACKAGES = ("fedrec_flwr",)


def import_times(code: str) -> tuple[dict[str, int], float]:
    """``(module -> self microseconds, wall seconds of the interpreter)`` of a fresh ``python -X importtime -c``."""
    import time

    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    wall = time.perf_counter() - started
    out = {}
    for line in done.stderr.splitlines():
        match = LINE.match(line)
        if match:
            out[match.group(4)] = int(match.group(1))
    return out, wall


def group(module: str) -> str:
    top = module.split(".")[0]
    if top in ("torch", "torchgen", "functorch"):
        return "torch"
    if top in OUR_PACKAGES:
        return "ours"
    return "other"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    runs: dict[str, list] = {"bare": [], "ours": []}
    for _ in range(args.repeats):  # interleaved
        runs["bare"].append(import_times(FLOWER))
        runs["ours"].append(import_times(OURS))
    bare_modules = set().union(*(set(m) for m, _ in runs["bare"]))
    extra_groups: list[Counter] = []
    extra_modules: list[Counter] = []
    for modules, _ in runs["ours"]:
        extra = {m: t for m, t in modules.items() if m not in bare_modules}
        extra_modules.append(Counter(extra))
        groups = Counter()
        for module, micros in extra.items():
            groups[group(module)] += micros
        extra_groups.append(groups)
    median = lambda values: statistics.median(values) if values else 0.0  # noqa: E731
    result = {
        "load-average-start": load_start,
        "load-average-end": os.getloadavg(),
        "repeats": args.repeats,
        "bare-imports-seconds": median([sum(m.values()) / 1e6 for m, _ in runs["bare"]]),
        "bare-interpreter-wall-seconds": median([w for _, w in runs["bare"]]),
        "ours-imports-seconds": median([sum(m.values()) / 1e6 for m, _ in runs["ours"]]),
        "ours-interpreter-wall-seconds": median([w for _, w in runs["ours"]]),
        "extra-by-group-seconds": {g: median([c[g] / 1e6 for c in extra_groups]) for g in ("torch", "ours", "other")},
        "extra-modules-count": median([len(c) for c in extra_modules]),
        "largest-extra-modules-seconds": {
            m: median([c.get(m, 0) / 1e6 for c in extra_modules]) for m, _ in extra_modules[-1].most_common(15)
        },
        "extra-modules-of-ours": sorted(m for m in extra_modules[-1] if group(m) == "other"),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "extra-modules-of-ours"}, indent=1))
    print("other packages ours loads:", sorted({m.split(".")[0] for m in result["extra-modules-of-ours"]}))
    if args.out:
        from fedrec_flwr.io import atomic_write_json

        atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
