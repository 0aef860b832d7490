"""Reproduce the HF-KCU client-unlearning experiments: one command per part (see ``experiments/hfkcu/README.md``).

    python -m experiments.hfkcu.run main       # originals + unlearning variants, and the retrained models
    python -m experiments.hfkcu.run forget     # the defaults on the 1% and 5% random forget sets
    python -m experiments.hfkcu.run poison     # poisoning removal (experiments/hfkcu/poison.py)
    python -m experiments.hfkcu.run poison-dev # the development setting the HF-KCU defaults were chosen on
    python -m experiments.hfkcu.run poison-dev-precond --name 1   # krylov-preconditioner on the development settings
    python -m experiments.hfkcu.run band       # the calibrated benchmark (experiments/hfkcu/band.py)
    python -m experiments.hfkcu.run band-report   # its recipe.csv / recipe.md
    python -m experiments.hfkcu.run report     # tables and plots from the finished runs

Every run goes through the package's ServerApp, strategy and ClientApp (:func:`fedrec_flwr.serial.run_serial`):

* **original** (per dataset and model): 100 rounds; after round 100 (an ``on_round`` hook) every unlearning variant of
  :data:`experiments.hfkcu.methods.VARIANTS` (and the ablations, on ML-100K's 1% set) is run as a Flower phase on the
  trained model for each forget set (:class:`fedrec_flwr.strategies.unlearning.ClientUnlearning`, from the same node states;
  ``continue`` trains the remaining users, so their states are restored after it). Each variant's model is evaluated
  federatedly on the remaining users, and its candidate scores are kept for the KL divergence.
* **retrain** (per dataset, model and forget set): ``unlearning = "retrain"``, the same seed and 100 rounds; the
  forgotten users are never sampled, every other user trains in the same rounds as in the original.

Timing: a variant's time is its phase's server wall time (``unlearning.json``'s ``seconds``); retraining's is the sum
of its rounds' training time (``train-seconds``, evaluation excluded), measured the same way on the same machine.
A finished run (``phase.json`` / ``retrain.json`` present) is skipped, so an interrupted command resumes; start it in
several processes to use several cores (jobs are claimed).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import numpy as np

from experiments.common import claimed, quiet_flower, run_jobs, slug
from experiments.hfkcu.analysis import candidate_scores, exposure, private_records
from experiments.hfkcu.methods import (
    ABLATION_SETTING,
    ABLATIONS,
    DATASETS,
    FORGET_SETS,
    MODELS,
    PROTOCOL,
    ROUNDS,
    VARIANTS,
)
from fedrec_flwr.config import make_run_config
from fedrec_flwr.io import atomic_save_npz, atomic_write_json

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "runs"
CACHE = Path(__file__).resolve().parent / ".cache"
SEED = 0


def base_config(dataset: str, model: str, data_dir: str, folder: Path, name: str, **extra):
    overrides = {
        **PROTOCOL,
        **MODELS[model],
        "dataset": dataset,
        "seed": SEED,
        "results-dir": str(folder),
        "run-name": name,
        **extra,
    }
    if data_dir and dataset != "generic":
        overrides["data-dir"] = str(Path(data_dir) / dataset)
    return make_run_config(**overrides)


def forget_sets(num_users: int, seed: int = SEED) -> dict[str, np.ndarray]:
    """Forget-set name -> users (seeded; :func:`fedrec_flwr.strategies.unlearning.forget_set`)."""
    from fedrec_flwr.strategies.unlearning import forget_set

    out = {}
    for name, fraction in FORGET_SETS.items():
        config = make_run_config(seed=seed, forget_fraction=(1.0 / num_users) if fraction is None else fraction)
        out[name] = forget_set(config, num_users)
    return out


def _arrays(record) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in record.items()}


def _settings(config, forget: np.ndarray, changes: dict, num_users: int):
    from fedrec_flwr.strategies.unlearning import UnlearningSettings

    settings = UnlearningSettings.from_config(
        config.replace(unlearning="hfkcu", forget_users=",".join(str(int(u)) for u in forget)), num_users
    )
    return settings.replace(**changes)


def run_phases(
    view, runtime, forget: dict[str, np.ndarray], variants_for, out: Path, poison_target: int | None = None
) -> list[dict]:
    """Apply every variant to the trained model in ``view`` (an ``on_round`` hook's RoundView); write each variant's
    arrays and candidate scores under ``out`` and return one row per (forget set, variant)."""
    from fedrec_flwr.strategies.unlearning import ClientUnlearning

    strategy, grid, config = view.strategy, view.grid, view.config
    num_users = runtime.split.num_users
    records = private_records(grid, range(num_users))
    atomic_save_npz(
        out / "private-records.npz", **{f"{u}/{k}": v.numpy() for u, rec in records.items() for k, v in rec.items()}
    )
    trained = _arrays(view.arrays)
    rows = []
    for set_name, users in forget.items():
        remaining = np.setdiff1d(np.arange(num_users), users)

        def record(name: str, arrays: dict, metrics: dict, report: dict, user_records) -> None:
            scores = candidate_scores(runtime, user_records, arrays, remaining)
            atomic_save_npz(out / "variants" / slug(set_name) / f"{slug(name)}.npz", scores=scores, **arrays)
            row = {
                "forget-set": set_name,
                "forgotten": int(users.size),
                "variant": name,
                "seconds": float(report.get("seconds", 0.0)),
                **metrics,
                **{k: v for k, v in report.items() if k not in ("forget-users", "before", "seconds")},
            }
            if poison_target is not None:
                row.update(exposure(runtime, user_records, arrays, remaining, poison_target))
            rows.append(row)
            atomic_write_json(out / "phase.partial.json", rows)
            print(
                f"  {set_name:9s} {name:38s} HR@10 {metrics.get('HR@10', float('nan')):.4f} "
                f"{row['seconds']:7.2f} s"
                + (
                    f" exposure {row['exposure']:.3f} percentile {row['target-percentile']:.3f}"
                    if "exposure" in row
                    else ""
                ),
                flush=True,
            )

        before = strategy.evaluate_arrays(grid, view.arrays, view.server_round, users=remaining)
        record("original", trained, before, {}, records)
        for name, changes in variants_for(set_name).items():
            settings = _settings(config, users, changes, num_users)
            saved = (
                {n: copy.deepcopy(c.state) for n, c in grid.contexts.items()} if settings.method == "continue" else None
            )
            new, report = ClientUnlearning(strategy, settings, timeout=config.round_timeout).run(
                grid, view.arrays, view.server_round
            )
            metrics = strategy.evaluate_arrays(grid, new, view.server_round, users=remaining)
            user_records = private_records(grid, range(num_users)) if saved is not None else records
            record(name, _arrays(new), metrics, report, user_records)
            if saved is not None:
                for node, context in grid.contexts.items():
                    context.state = saved[node]
    return rows


def train_then(config, out: Path, done_file: str, at_end) -> None:
    """Train ``config`` (serial grid) into ``out`` unless ``done_file`` is there or another worker holds the job, and
    call ``at_end(view, train_seconds)`` after the last round (``train_seconds``: its rounds' training time)."""
    from fedrec_flwr.serial import run_serial

    with claimed(out, RESULTS, done_file=done_file) as mine:
        if not mine:
            return
        (out / "summary.json").unlink(missing_ok=True)  # an interrupted job's run is redone
        train_seconds = []

        def on_round(view) -> None:
            train_seconds.append(float(view.strategy.last_train.get("train-seconds", 0.0)))
            if view.server_round == ROUNDS:
                at_end(view, float(sum(train_seconds)))

        run_serial(config, on_round=on_round)


def run_original(job) -> None:
    from fedrec_flwr.app.runtime import get_runtime

    dataset, model, data_dir = job
    folder = RUNS / dataset / model
    config = base_config(dataset, model, data_dir, folder, "original")
    out = folder / "original"
    runtime = get_runtime(config.to_dict())
    forget = forget_sets(runtime.split.num_users)

    def variants_for(set_name: str) -> dict:
        extra = ABLATIONS if (dataset, set_name) == ABLATION_SETTING else {}
        return {**VARIANTS, **extra}

    def at_end(view, train_seconds: float) -> None:
        rows = run_phases(view, runtime, forget, variants_for, out)
        atomic_write_json(
            out / "phase.json",
            {"train-seconds": train_seconds, "rows": rows, "forget-sets": {k: v.tolist() for k, v in forget.items()}},
        )
        (out / "phase.partial.json").unlink(missing_ok=True)

    train_then(config, out, "phase.json", at_end)


def retrain_end(runtime, out: Path, set_name: str, users: np.ndarray, target: int | None = None):
    """The ``at_end`` of a retraining job: metrics on the remaining users, candidate scores (and the poisoning target's
    exposure) written to ``retrained.npz`` / ``retrain.json``."""

    def at_end(view, train_seconds: float) -> None:
        remaining = np.setdiff1d(np.arange(runtime.split.num_users), users)
        metrics = view.strategy.evaluate_arrays(view.grid, view.arrays, ROUNDS, users=remaining)
        records = private_records(view.grid, remaining)
        arrays = _arrays(view.arrays)
        atomic_save_npz(out / "retrained.npz", scores=candidate_scores(runtime, records, arrays, remaining), **arrays)
        extra = exposure(runtime, records, arrays, remaining, target) if target is not None else {}
        atomic_write_json(
            out / "retrain.json",
            {"forget-set": set_name, "forgotten": int(users.size), "train-seconds": train_seconds, **metrics, **extra},
        )

    return at_end


def run_retrain(job) -> None:
    from fedrec_flwr.app.runtime import get_runtime

    dataset, model, set_name, data_dir = job
    folder = RUNS / dataset / model
    runtime = get_runtime(base_config(dataset, model, data_dir, folder, "original").to_dict())
    users = forget_sets(runtime.split.num_users)[set_name]
    name = f"retrain-{slug(set_name)}"
    config = base_config(
        dataset, model, data_dir, folder, name, unlearning="retrain", forget_users=",".join(str(int(u)) for u in users)
    )
    train_then(config, folder / name, "retrain.json", retrain_end(runtime, folder / name, set_name, users))


FORGET_VARIANTS = {
    "HF-KCU distributed (default)": {"method": "hfkcu"},
    "HF-KCU distributed, paper defaults (CG, Hessian, eta 0.01)": {
        "method": "hfkcu",
        "krylov_solver": "cg",
        "curvature": "hessian",
        "scale": 0.01,
        "adaptive_scale": True,
    },
    "gradient ascent": {"method": "gradient-ascent"},
    "continued training (5 rounds)": {"method": "continue"},
}
"""The random forget sets (1% and 5%): the defaults against the `paper` arm (the paper's defaults) and the baselines."""


def forget_root(seed: int) -> Path:
    """Results of the ``forget`` part for one training seed, laid out like ``main``'s (``runs/<dataset>/<model>/...``)
    so that :func:`experiments.hfkcu.report.collect` reads them."""
    return RESULTS / "forget" / f"seed-{seed}"


def run_forget(job) -> None:
    """The random forget sets: one original (every variant of :data:`FORGET_VARIANTS` applied after round 100
    to the 1% and 5% sets) or one retrained model, per dataset and model."""
    from fedrec_flwr.app.runtime import get_runtime

    dataset, model, kind, data_dir, seed = job
    folder = forget_root(seed) / "runs" / dataset / model
    config = base_config(dataset, model, data_dir, folder, "original", seed=seed)
    runtime = get_runtime(config.to_dict())
    every = forget_sets(runtime.split.num_users, seed)
    chosen = {k: v for k, v in every.items() if k in ("1%", "5%")}
    if kind == "original":
        out = folder / "original"

        def at_end(view, train_seconds: float) -> None:
            rows = run_phases(view, runtime, chosen, lambda _: FORGET_VARIANTS, out)
            atomic_write_json(
                out / "phase.json",
                {
                    "train-seconds": train_seconds,
                    "rows": rows,
                    "forget-sets": {k: v.tolist() for k, v in every.items()},
                },
            )
            (out / "phase.partial.json").unlink(missing_ok=True)

        train_then(config, out, "phase.json", at_end)
        return
    users = chosen[kind]
    name = f"retrain-{slug(kind)}"
    config = base_config(
        dataset,
        model,
        data_dir,
        folder,
        name,
        seed=seed,
        unlearning="retrain",
        forget_users=",".join(str(int(u)) for u in users),
    )
    train_then(config, folder / name, "retrain.json", retrain_end(runtime, folder / name, kind, users))


BAND = RESULTS / "band"
"""The calibrated benchmark's measurements (small JSON per run) and its recipe."""


def _band(args) -> None:
    """The ``band`` part: every setting's poisoned run, then its retraining seeds (one job each, claimable by
    several processes); ``band-report``: the recipe of the finished settings."""
    from experiments.hfkcu import band

    if args.part == "band-report":
        band.report(BAND / "runs", BAND, CACHE)
        if (BAND / "dev" / "runs").is_dir():  # the development settings' own recipe, never counted with the others
            band.report(BAND / "dev" / "runs", BAND / "dev", CACHE)
        return
    if args.methods == "all":
        methods = band.METHODS
    else:
        methods = {k: band.METHODS[k] for k in args.methods.split(";") if k and k != "none"}
    settings = [
        band.Setting(d, m, a, int(s))
        for d in args.datasets.split(",")
        for m in args.models.split(",")
        for a in args.attacks.split(",")
        for s in args.seeds.split(",")
    ]
    dev = {int(s) for s in args.seeds.split(",")} == {band.DEV_SEED}
    if not dev and band.DEV_SEED in {int(s) for s in args.seeds.split(",")}:
        raise SystemExit(f"band: run the development seed {band.DEV_SEED} on its own (--seeds {band.DEV_SEED})")
    common = {"data_dir": args.data_dir, "cache": CACHE, "out": BAND / ("dev" if dev else "") / "runs"}
    jobs = []
    for setting in settings:
        if args.band_part in ("all", "poisoned"):
            jobs.append((setting, None))
        if args.band_part in ("all", "retrain"):
            jobs += [(setting, r) for r in band.retrain_seeds(setting.seed, args.retrain_seeds or band.RETRAIN_SEEDS)]

    def one(job) -> None:
        setting, seed = job
        forget = setting.attack.startswith("forget-")  # a random forget set ("forget-1%"), not an attack
        if seed is None:
            if forget:
                band.run_forget_trained(setting, methods=methods, add=args.add_methods, **common)
            else:
                band.run_poisoned(setting, methods=methods, add=args.add_methods, **common)
        else:
            (band.run_forget_retrain if forget else band.run_retrain)(setting, seed, **common)

    run_jobs(jobs, one, args.shard, "band")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "part",
        choices=[
            "main",
            "forget",
            "poison",
            "poison-dev",
            "poison-replay",
            "poison-dev-sweep",
            "poison-probe",
            "poison-retime",
            "poison-profile",
            "poison-level",
            "poison-dev-precond",
            "poison-calibration",
            "poison-dev-margin",
            "band",
            "band-report",
            "report",
        ],
    )
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("FEDREC_DATA_DIR", ""),
        help="folder holding <dataset>/ (default: $FEDREC_DATA_DIR; empty = download)",
    )
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th job from i")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--models", default=",".join(MODELS), help="poison: FedMF,FedNCF")
    parser.add_argument("--fakes", default="100,20", help="poison: numbers of fake users")
    parser.add_argument("--seeds", default="0,1,2", help="poison: training seeds")
    parser.add_argument(
        "--only",
        default="",
        help="poison-replay: replay only the variants whose name contains one of these comma-separated strings",
    )
    parser.add_argument("--changes", default="{}", help="poison-probe: JSON of UnlearningSettings fields")
    parser.add_argument("--rounds", type=int, default=10, help="poison-retime: retraining rounds timed (scaled to 100)")
    parser.add_argument("--name", default="replay", help="poison-replay / poison-dev-sweep: the output's name")
    parser.add_argument(
        "--attacks",
        default="weaker",
        help="band: attacks of experiments.hfkcu.band.ATTACKS, or forget-1%%,forget-5%% (random forget sets)",
    )
    parser.add_argument("--part-of-band", dest="band_part", default="all", choices=["all", "poisoned", "retrain"])
    parser.add_argument(
        "--add-methods",
        action="store_true",
        help="band: add the --methods a finished poisoned run lacks (trains it again; it must reproduce exactly)",
    )
    parser.add_argument(
        "--methods",
        default="all",
        help="band: ';'-separated names of band.METHODS, 'all' or 'none' (poisoned run)",
    )
    parser.add_argument("--retrain-seeds", type=int, default=0, help="band: retraining runs (0 = band.RETRAIN_SEEDS)")
    args = parser.parse_args(argv)
    quiet_flower()
    if args.part in ("band", "band-report"):
        _band(args)
        return
    if args.part == "report":
        from experiments.hfkcu.report import report

        report(RESULTS, args.data_dir)
        return
    if args.part == "forget":  # --seeds: training seeds (each seed also draws its own forget sets)
        jobs = [
            (d, m, kind, args.data_dir, int(seed))
            for seed in args.seeds.split(",")
            for d in args.datasets.split(",")
            for m in args.models.split(",")
            for kind in ("original", "1%", "5%")
        ]
        run_jobs(jobs, run_forget, args.shard, "forget")
        return
    if args.part == "poison-profile":  # cProfile of one phase (--changes, e.g. '{"cg_iterations": 2}')
        from experiments.hfkcu.poison import profile_phase

        profile_phase(
            args.datasets.split(",")[0],
            args.models.split(",")[0],
            int(args.fakes.split(",")[0]),
            int(args.seeds.split(",")[0]),
            data_dir=args.data_dir,
            cache=CACHE,
            changes=json.loads(args.changes),
        )
        return
    if args.part == "poison-retime":  # phase vs retraining time at one machine load (first --seeds only)
        from experiments.hfkcu.poison import (
            RETIMED_CAPPED,
            RETIMED_MARGIN,
            RETIMED_REPEATED,
            RETIMED_SAMPLED,
            retime,
        )

        # --name capped: cg-iterations 1 / 2; --name sampled: curvature-sample 0.5 / 0.25 (each against the default)
        extra = {
            "capped": {"variants": RETIMED_CAPPED, "name": "retime-capped"},
            "sampled": {"variants": RETIMED_SAMPLED, "name": "retime-sampled"},
            "margin": {"variants": RETIMED_MARGIN, "name": "retime-margin"},
            "repeated": {"variants": RETIMED_REPEATED, "name": "retime-repeated"},
        }.get(args.name, {})
        for d in args.datasets.split(","):
            for m in args.models.split(","):
                for f in args.fakes.split(","):
                    retime(
                        d,
                        m,
                        int(f),
                        int(args.seeds.split(",")[0]),
                        data_dir=args.data_dir,
                        runs=RESULTS / "runs" / "poison-retime",
                        cache=CACHE,
                        rounds=args.rounds,
                        **extra,
                    )
        return
    if args.part in ("poison-level", "poison-calibration"):  # along the default step, every cached snapshot
        # poison-level: the forgotten users' loss vs the retrained model's; poison-calibration: their membership
        # margins (diagnostics)
        from experiments.hfkcu.poison import DEV, calibration_probe, level_probe, snapshot_path

        level = args.part == "poison-level"
        for d in args.datasets.split(","):
            for m in args.models.split(","):
                for f in args.fakes.split(","):
                    for seed in args.seeds.split(","):
                        dev = int(seed) == DEV["seed"]
                        if not snapshot_path(
                            CACHE, d, m, int(f), int(seed), DEV["target-seed"] if dev else 0
                        ).is_file():
                            continue  # no saved federation of this setting
                        common = {
                            "data_dir": args.data_dir,
                            "cache": CACHE,
                            "runs": RESULTS / "runs" / ("poison-dev" if dev else "poison"),
                            "target_seed": DEV["target-seed"] if dev else 0,
                        }
                        if level:
                            level_probe(
                                d,
                                m,
                                int(f),
                                int(seed),
                                changes=json.loads(args.changes),
                                name=f"level-{args.name}",
                                **common,
                            )
                        else:
                            calibration_probe(d, m, int(f), int(seed), name=f"calibration-{args.name}", **common)
        return
    if args.part == "poison-probe":  # the line search's loss and the target along the step (--seeds 100: dev)
        from experiments.hfkcu.poison import DEV, probe

        changes = {"method": "hfkcu", "line_search": "remaining-loss", **json.loads(args.changes)}
        for d in args.datasets.split(","):
            for m in args.models.split(","):
                for f in args.fakes.split(","):
                    for seed in args.seeds.split(","):
                        dev = int(seed) == DEV["seed"]
                        probe(
                            d,
                            m,
                            int(f),
                            int(seed),
                            changes,
                            data_dir=args.data_dir,
                            runs=RESULTS / "runs" / ("poison-dev" if dev else "poison"),
                            cache=CACHE,
                            target_seed=DEV["target-seed"] if dev else 0,
                            name=f"probe-{args.name}",
                        )
        return
    if args.part == "poison-dev-precond":  # the preconditioned solve on every development setting
        from experiments.hfkcu.poison import DEV, DEV_EXTRA, DEV_NCF, DEV_PRECONDITIONED, replay, snapshot_path

        chosen = {
            k: v for k, v in DEV_PRECONDITIONED.items() if not args.only or any(w in k for w in args.only.split(","))
        }
        for d, m, f in ((DEV["dataset"], DEV["model"], DEV["fakes"]),) + DEV_EXTRA + DEV_NCF:
            folder = RESULTS / "runs" / "poison-dev" / d / m / f"fakes-{f}" / f"seed-{DEV['seed']}" / "original"
            if (
                m not in args.models.split(",")
                or not snapshot_path(CACHE, d, m, f, DEV["seed"], DEV["target-seed"]).is_file()
            ):
                continue  # not selected, or that development federation is not trained (poison-dev --name ncf)
            if args.name == "probe" and not (folder / "precond-probe.json").is_file():
                # the target row's M and share of the first step (diagnostic)
                from experiments.hfkcu.poison import precond_probe

                precond_probe(
                    d,
                    m,
                    f,
                    DEV["seed"],
                    data_dir=args.data_dir,
                    runs=RESULTS / "runs" / "poison-dev",
                    cache=CACHE,
                    target_seed=DEV["target-seed"],
                )
            elif args.name != "probe" and not (folder / f"precond-{args.name}.json").is_file():
                replay(
                    d,
                    m,
                    f,
                    DEV["seed"],
                    chosen,
                    data_dir=args.data_dir,
                    runs=RESULTS / "runs" / "poison-dev",
                    cache=CACHE,
                    target_seed=DEV["target-seed"],
                    name=f"precond-{args.name}",
                )
        return
    if args.part == "poison-dev-margin":  # the membership-margin step and the default on every development setting
        from experiments.hfkcu.poison import DEV, DEV_EXTRA, DEV_MARGIN, DEV_NCF, replay, snapshot_path

        for d, m, f in ((DEV["dataset"], DEV["model"], DEV["fakes"]),) + DEV_EXTRA + DEV_NCF:
            folder = RESULTS / "runs" / "poison-dev" / d / m / f"fakes-{f}" / f"seed-{DEV['seed']}" / "original"
            if (
                m in args.models.split(",")
                and snapshot_path(CACHE, d, m, f, DEV["seed"], DEV["target-seed"]).is_file()
                and not (folder / f"margin-{args.name}.json").is_file()
            ):
                replay(
                    d,
                    m,
                    f,
                    DEV["seed"],
                    DEV_MARGIN,
                    data_dir=args.data_dir,
                    runs=RESULTS / "runs" / "poison-dev",
                    cache=CACHE,
                    target_seed=DEV["target-seed"],
                    name=f"margin-{args.name}",
                )
        return
    if args.part == "poison-dev-sweep":
        from experiments.hfkcu.poison import DEV, DEV_REFINE, DEV_VARIANTS, replay

        sweep = DEV_REFINE if args.name == "3" else DEV_VARIANTS
        replay(
            DEV["dataset"],
            DEV["model"],
            DEV["fakes"],
            DEV["seed"],
            sweep,
            data_dir=args.data_dir,
            runs=RESULTS / "runs" / "poison-dev",
            cache=CACHE,
            target_seed=DEV["target-seed"],
            name=f"sweep-{args.name}",
        )
        return
    if args.part == "poison-replay":  # the replayed variants on every finished original of the selection
        from experiments.hfkcu.poison import REPLAYED, replay, snapshot_path

        jobs = [
            (d, m, int(f), int(seed))
            for d in args.datasets.split(",")
            for m in args.models.split(",")
            for f in args.fakes.split(",")
            for seed in args.seeds.split(",")
            if snapshot_path(CACHE, d, m, int(f), int(seed), 0).is_file()
            and not (
                RUNS / "poison" / d / m / f"fakes-{f}" / f"seed-{seed}" / "original" / f"{args.name}.json"
            ).is_file()
        ]
        chosen = {k: v for k, v in REPLAYED.items() if not args.only or any(w in k for w in args.only.split(","))}
        run_jobs(
            jobs,
            lambda job: replay(*job, chosen, data_dir=args.data_dir, runs=RUNS / "poison", cache=CACHE, name=args.name),
            args.shard,
            args.part,
        )
        return
    if args.part in ("poison", "poison-dev"):
        from experiments.hfkcu.poison import DEV, DEV_EXTRA, DEV_NCF, run_setting

        if args.part == "poison-dev":  # --name extra / ncf: the further development settings (DEV_EXTRA / DEV_NCF)
            chosen = {"extra": DEV_EXTRA, "ncf": DEV_NCF}.get(
                args.name, ((DEV["dataset"], DEV["model"], DEV["fakes"]),)
            )
            jobs = [(d, m, f, DEV["seed"], kind) for d, m, f in chosen for kind in ("original", "retrain")]
            extra = {"target_seed": DEV["target-seed"], "variants": {}, "runs": RESULTS / "runs" / "poison-dev"}
        else:  # one setting at a time: every seed of the first setting before the next one
            jobs = [
                (d, m, int(f), int(seed), kind)
                for d in args.datasets.split(",")
                for m in args.models.split(",")
                for f in args.fakes.split(",")
                for seed in args.seeds.split(",")
                for kind in ("original", "retrain")
            ]
            extra = {"runs": RUNS / "poison"}
        run_jobs(
            jobs, lambda job: run_setting(*job, data_dir=args.data_dir, cache=CACHE, **extra), args.shard, args.part
        )
        return
    datasets = [d for d in args.datasets.split(",") if d]
    jobs = []
    for dataset in datasets:
        for model in MODELS:
            jobs.append(("original", (dataset, model, args.data_dir)))
            jobs += [("retrain", (dataset, model, name, args.data_dir)) for name in FORGET_SETS]
    run_jobs(jobs, lambda job: (run_original if job[0] == "original" else run_retrain)(job[1]), args.shard, "hfkcu")


if __name__ == "__main__":
    sys.exit(main())
