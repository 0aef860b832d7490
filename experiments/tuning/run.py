"""The tuning protocol, one command (see ``experiments/tuning/README.md``).

    python -m experiments.tuning.run all --datasets ml-100k   # grid -> selection -> seeds -> 300 rounds -> ceilings -> report
    python -m experiments.tuning.run grid                      # only the grid (seed 0, 100 rounds) and its selection
    python -m experiments.tuning.run seeds                     # the selected settings with every seed, 100 rounds
    python -m experiments.tuning.run long                      # the selected settings with every seed, 300 rounds
    python -m experiments.tuning.run centralized               # centralized MF and NCF (epochs chosen on validation)
    python -m experiments.tuning.run preset --rounds 100       # the presets (grid.PRESETS) at their base's selection
    python -m experiments.tuning.run report                    # tables and curves from whatever has finished

Each federated run goes through :func:`fedrec_flwr.serial.run_serial` (the ServerApp, strategy and ClientApp of
``flwr run``, bit-identical to the Ray simulation) and writes its own folder under
``results/runs/<dataset>/<method>/<budget>/<setting>-seed<k>/``: ``config.json`` (the validated run config),
``provenance.json`` (git commit, whether the tree had uncommitted changes, command), ``metrics.json`` (every round),
``summary.json``. A finished run (``summary.json``) is skipped, so every command resumes after an interruption;
``selection-<dataset>.json`` records the grid's choice per method (validation only, :mod:`.selection`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.common import claimed, quiet_flower, slug
from experiments.tuning import grid as G
from experiments.tuning.selection import row_at_round, select_setting
from fedrec_flwr.config import make_run_config
from fedrec_flwr.io import atomic_write_json
from fedrec_flwr.state.results import FAILED_FILE, read_failure

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "runs"
ROOT = Path(__file__).resolve().parents[2]


def provenance() -> dict:
    """The git commit of the code a run uses, and whether tracked files had uncommitted changes then."""

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted-changes": bool(git("status", "--porcelain", "-uno")),
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_folder(dataset: str, method: str, setting: dict, seed: int, rounds: int) -> Path:
    return RUNS / dataset / slug(method) / f"r{rounds}" / f"{G.setting_name(setting)}-seed{seed}"


def config_with_retry(overrides: dict, tries: int = 6, wait_s: float = 30.0):
    """``make_run_config(**overrides)``, retried when a key is unknown: in a working tree shared with other
    developers, ``pyproject.toml`` can briefly declare a key that ``config.py`` does not know yet (seen twice during
    the protocol's runs); any other error, or the same one after ``tries`` attempts, is raised."""
    from fedrec_flwr.errors import ConfigError

    for attempt in range(tries):
        try:
            return make_run_config(**overrides)
        except ConfigError as exc:
            if "unknown run-config key" not in str(exc) or attempt == tries - 1:
                raise
            print(f"config not loadable ({exc}); retrying in {wait_s:.0f} s", flush=True)
            time.sleep(wait_s)


def run_one(dataset: str, method: str, setting: dict, seed: int, rounds: int, data_dir: str) -> Path:
    """Run one federated job unless it has finished (or another worker holds it); returns its folder."""
    from fedrec_flwr.serial import run_serial

    folder = run_folder(dataset, method, setting, seed, rounds)
    overrides = {
        **G.run_overrides(method, setting, dataset, seed, rounds),
        "results-dir": str(folder.parent),
        "run-name": folder.name,
    }
    if data_dir:
        overrides["data-dir"] = str(Path(data_dir) / dataset)
    config = config_with_retry(overrides)
    if (folder / FAILED).is_file():
        print(f"skip (failed before: {json.loads((folder / FAILED).read_text())['error']}): {folder}", flush=True)
        return folder
    with claimed(folder, RESULTS) as mine:
        if mine:
            atomic_write_json(folder / "provenance.json", provenance())
            try:
                run_serial(config)
            except Exception as exc:  # noqa: BLE001 - a diverging grid point is a result, not a crash of the grid
                if read_failure(folder) is None:  # the run's own record (error, round, rounds completed) is kept
                    atomic_write_json(folder / FAILED, {"error": f"{type(exc).__name__}: {exc}"[:500]})
                print(f"FAILED {folder}: {type(exc).__name__}: {exc}", flush=True)
    return folder


FAILED = FAILED_FILE
"""``failed.json`` in a run's own folder (``results-dir`` is the point's parent folder, ``run-name`` its setting and
seed, so no two points share one): the run's own record (:func:`fedrec_flwr.state.results.write_failure`: the error, the
round, the rounds completed) when it failed once its folder existed, else ours (the error only, e.g. a config the
preflight refused). A point with it is failed (never selected) and later commands skip it (delete it to retry)."""


def last_row(folder: Path, rounds: int) -> dict | None:
    """The evaluated row of round ``rounds`` of a finished run (``None`` if unfinished)."""
    if not (folder / "summary.json").is_file():
        return None
    return row_at_round(json.loads((folder / "metrics.json").read_text()), rounds)


def tune(dataset: str, method: str, data_dir: str) -> dict:
    """Run the method's grid stage by stage at the grid seed; returns ``{"setting": ..., "grid": [...]}`` (the
    selected setting and every grid point's validation scores at the grid's last round), also written to
    ``results/selection-<dataset>.json``."""
    fixed = G.default_setting(method)
    points: dict[str, dict] = {}
    for stage in range(len(G.GRIDS[method])):
        stage_points = []
        for setting in G.stage_settings(method, stage, fixed):
            folder = run_one(dataset, method, setting, G.GRID_SEED, G.GRID_ROUNDS, data_dir)
            row = last_row(folder, G.GRID_ROUNDS)
            if row is None and not (folder / FAILED).is_file():
                raise RuntimeError(f"grid run {folder} did not finish")
            stage_points.append((G.setting_name(setting), setting, row))
        name = select_setting([(n, r) for n, _, r in stage_points if r is not None])
        fixed = next(s for n, s, _ in stage_points if n == name)
        for n, s, r in stage_points:
            scores = {k: v for k, v in r.items() if k.startswith("val-")} if r is not None else {"failed": True}
            points.setdefault(n, {"setting": s, "stage": stage, **scores})  # the incumbent keeps its first stage
    record = {
        "setting": fixed,
        "name": G.setting_name(fixed),
        "grid": list(points.values()),
        "selected-on": f"val-HR@10 (then val-NDCG@10) at round {G.GRID_ROUNDS}, seed {G.GRID_SEED}",
    }
    path = RESULTS / f"selection-{dataset}.json"
    current = json.loads(path.read_text()) if path.is_file() else {}
    current[method] = record
    atomic_write_json(path, current)
    return record


def selected(dataset: str, method: str) -> dict | None:
    path = RESULTS / f"selection-{dataset}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(method, {}).get("setting")


def split_of(dataset: str, seed: int, data_dir: str):
    """The protocol's split of ``dataset`` for ``seed`` (the one the federated runs of that seed use)."""
    from fedrec_flwr.app.runtime import load_split_for

    overrides = {**G.PROTOCOL, "dataset": dataset, "seed": seed}
    if data_dir:
        overrides["data-dir"] = str(Path(data_dir) / dataset)
    return load_split_for(make_run_config(**overrides))


def centralized(dataset: str, model: str, seed: int, data_dir: str, epochs: int) -> Path:
    """Centralized ``model`` on the seed's split (all users at once), evaluated on test and validation after every
    epoch; the report takes the epoch with the best validation HR@10 (:func:`.selection.select_epoch`)."""
    from fedrec_flwr.baselines import train_centralized

    folder = RUNS / dataset / f"centralized-{model}" / f"e{epochs}" / f"seed{seed}"
    with claimed(folder, RESULTS) as mine:
        if mine:
            config = make_run_config(**{**G.PROTOCOL, "dataset": dataset, "seed": seed})
            split = split_of(dataset, seed, data_dir)
            settings = {
                "model": model,
                "epochs": epochs,
                "batch_size": 1024,
                "learning_rate": 0.001,
                "optimizer": "adam",
                "num_train_negatives": config.num_train_negatives,
                "embedding_dim": config.embedding_dim,
                "mlp_layers": list(config.mlp_layer_sizes),
                "seed": seed,
            }
            atomic_write_json(folder / "provenance.json", {**provenance(), "settings": settings})
            started = time.time()
            result = train_centralized(
                split,
                model,
                epochs=epochs,
                batch_size=1024,
                learning_rate=0.001,
                optimizer="adam",
                num_train_negatives=config.num_train_negatives,
                embedding_dim=config.embedding_dim,
                mlp_layers=config.mlp_layer_sizes,
                seed=seed,
                eval_which="both",
                ks=config.k_values,
            )
            atomic_write_json(folder / "metrics.json", result.history)
            atomic_write_json(folder / "summary.json", {"seconds": round(time.time() - started, 1), **settings})
    return folder


CENTRAL_EPOCHS = {"mf": 40, "ncf": 20}
"""Epoch budget of each centralized model (the epoch is chosen on validation within it): NCF peaks on validation
at epochs 13-14 of 20 on ML-100K; MF was still rising at 20 (chosen 18, 20, 20), hence 40."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("all", "grid", "seeds", "long", "centralized", "preset", "report"))
    parser.add_argument("--datasets", nargs="+", default=["ml-100k"])
    parser.add_argument("--methods", nargs="+", default=list(G.METHODS), choices=list(G.METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(G.SEEDS))
    parser.add_argument("--presets", nargs="+", default=list(G.PRESETS), choices=list(G.PRESETS))
    parser.add_argument(
        "--rounds",
        type=int,
        default=G.GRID_ROUNDS,
        choices=(G.GRID_ROUNDS, G.LONG_ROUNDS),
        help="the preset step's budget",
    )
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("FEDREC_DATA_DIR", ""),
        help="folder holding <dataset>/ folders (default $FEDREC_DATA_DIR; empty = download)",
    )
    args = parser.parse_args(argv)
    quiet_flower()
    steps = {
        "all": ("grid", "seeds", "centralized", "long"),
    }.get(args.command, (args.command,))
    for dataset in args.datasets:
        for step in steps:
            if step == "grid":
                for method in args.methods:
                    record = tune(dataset, method, args.data_dir)
                    print(f"selected for {method} on {dataset}: {record['name']}", flush=True)
            elif step in ("seeds", "long"):
                rounds = G.GRID_ROUNDS if step == "seeds" else G.LONG_ROUNDS
                for seed in args.seeds:
                    for method in args.methods:
                        setting = selected(dataset, method)
                        if setting is None:
                            print(f"no selection for {method} on {dataset}: run 'grid' first", flush=True)
                            continue
                        run_one(dataset, method, setting, seed, rounds, args.data_dir)
            elif step == "preset":
                for seed in args.seeds:
                    for preset in args.presets:
                        setting = selected(dataset, G.PRESETS[preset][0])
                        if setting is None:
                            print(f"no selection for {G.PRESETS[preset][0]} on {dataset}: run 'grid' first", flush=True)
                            continue
                        run_one(dataset, preset, G.preset_setting(preset, setting), seed, args.rounds, args.data_dir)
            elif step == "centralized":
                for seed in args.seeds:
                    for model in ("mf", "ncf"):
                        centralized(dataset, model, seed, args.data_dir, CENTRAL_EPOCHS[model])
    if args.command in ("all", "report"):
        from experiments.tuning.report import write_all

        write_all(RESULTS, args.datasets, args.data_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
