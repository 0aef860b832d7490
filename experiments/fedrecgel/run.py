"""Reproduce FedRecGEL's experiments: one command per table (see ``experiments/fedrecgel/README.md``).

    python -m experiments.fedrecgel.run main         # Table 2: 4 methods x 4 datasets x seeds
    python -m experiments.fedrecgel.run ablation     # Table 3
    python -m experiments.fedrecgel.run sensitivity  # RQ2: rho-shared / rho-private sweep (plot)
    python -m experiments.fedrecgel.run landscape    # RQ4: loss landscape of FedNCF and FedRecGEL
    python -m experiments.fedrecgel.run report       # tables and plots from the finished runs

Every run goes through the package's ServerApp, strategy and ClientApp (:func:`fedrec_flwr.serial.run_serial`,
the same code ``flwr run`` executes) and writes its own results folder under ``results/runs/``; a run whose
``summary.json`` exists is skipped, so an interrupted command resumes. Start the same command in several processes
to use several cores: each run is claimed by one worker (a ``.running`` marker), or split the jobs with
``--shard i/n``. Tables (CSV + Markdown) and PNGs go to ``experiments/fedrecgel/results/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments.common import claimed, quiet_flower, run_jobs, slug
from experiments.fedrecgel.methods import ABLATIONS, DATASETS, METHODS, PROTOCOL, RHO_GRID, SENSITIVITY_BASE
from fedrec_flwr.config import make_run_config

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "runs"


def run_config(dataset: str, method: str, seed: int, data_dir: str, folder: Path, name: str, **extra):
    """The validated run config of one job."""
    overrides = {
        **PROTOCOL,
        **METHODS[method],
        **extra,
        "dataset": dataset,
        "seed": seed,
        "results-dir": str(folder),
        "run-name": name,
    }
    if data_dir:
        overrides["data-dir"] = str(Path(data_dir) / dataset)
    return make_run_config(**overrides)


def run_job(config) -> Path:
    """Run one job unless its results exist or another worker has claimed it; returns its results folder."""
    from fedrec_flwr.serial import run_serial

    folder = Path(config.results_dir) / config.run_name
    with claimed(folder, RESULTS) as mine:
        if mine:
            run_serial(config)
    return folder


def jobs_main(args) -> list:
    return [
        run_config(d, m, s, args.data_dir, RUNS / "main" / d, f"{slug(m)}-seed{s}")
        for s in args.seeds
        for d in args.datasets
        for m in args.methods
    ]


def jobs_ablation(args) -> list:
    # the "FedRecGEL" variant is the main table's FedRecGEL run (same config); report.py takes it from there
    variants = args.variants or list(ABLATIONS)
    unknown = sorted(set(variants) - set(ABLATIONS))
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; known: {list(ABLATIONS)}")
    return [
        run_config(d, "FedRecGEL", s, args.data_dir, RUNS / "ablation" / d, f"{slug(v)}-seed{s}", **ABLATIONS[v])
        for s in args.seeds
        for d in args.datasets
        for v in variants
        if ABLATIONS[v]
    ]


def jobs_sensitivity(args) -> list:
    """One rho varied at a time, the other at its default, with :data:`SENSITIVITY_BASE`; the default point is run
    once (``default-seed<k>``). Values are ordered to spread out, alternating the two parameters, so a partial sweep
    still spans both curves."""
    spread = (0.0, 1.0, 0.2, 0.02, 0.5, 0.1, 0.05)  # each value as far (in log scale) from those before as possible
    order = sorted(RHO_GRID, key=lambda r: spread.index(r) if r in spread else len(spread))
    jobs = []
    for s in args.seeds:
        for d in args.datasets:
            jobs.append(
                run_config(
                    d, "FedRecGEL", s, args.data_dir, RUNS / "sensitivity" / d, f"default-seed{s}", **SENSITIVITY_BASE
                )
            )
            for rho in order:
                for key in ("rho-shared", "rho-private"):
                    if rho == METHODS["FedRecGEL"][key]:
                        continue
                    jobs.append(
                        run_config(
                            d,
                            "FedRecGEL",
                            s,
                            args.data_dir,
                            RUNS / "sensitivity" / d,
                            f"{key}-{rho:g}-seed{s}",
                            **SENSITIVITY_BASE,
                            **{key: rho},
                        )
                    )
    return jobs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("main", "ablation", "sensitivity", "landscape", "report"))
    parser.add_argument(
        "--datasets", nargs="+", default=None, help=f"default: all of {DATASETS} (main), ml-100k otherwise"
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="default: 0 1 2")
    parser.add_argument(
        "--variants", nargs="+", default=None, help="ablation: run only these variants (names as in methods.ABLATIONS)"
    )
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("FEDREC_DATA_DIR", ""),
        help="folder holding <dataset>/ folders (default $FEDREC_DATA_DIR; empty = download)",
    )
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th job starting at i")
    args = parser.parse_args(argv)
    if args.datasets is None:
        args.datasets = list(DATASETS) if args.command in ("main", "report") else ["ml-100k"]
    quiet_flower()
    if args.command == "report":
        from experiments.fedrecgel.report import write_all

        write_all(RESULTS, args.data_dir)
        return
    if args.command == "landscape":
        from experiments.fedrecgel.landscape import run_landscape

        for dataset in args.datasets:
            run_landscape(dataset, args.seeds[0], args.data_dir, RESULTS)
        return
    jobs = {"main": jobs_main, "ablation": jobs_ablation, "sensitivity": jobs_sensitivity}[args.command](args)
    run_jobs(jobs, run_job, args.shard, args.command)


if __name__ == "__main__":
    main(sys.argv[1:])
