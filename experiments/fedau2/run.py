"""Reproduce the FedAU² experiments on MovieLens-100K: one command per table (see ``experiments/fedau2/README.md``).

    python -m experiments.fedau2.run main                     # arms x {FedMF, FedNCF} x seeds, gender
    python -m experiments.fedau2.run main --attributes age    # the adversarial arms against age
    python -m experiments.fedau2.run main --leaking           # embedding-dim 64 (methods.LEAKING_PROTOCOL)
    python -m experiments.fedau2.run tradeoff                 # FedAU2 on FedMF / gender across eps
    python -m experiments.fedau2.run tradeoff-server          # the server-adversary arm across eps (seed 1)
    python -m experiments.fedau2.run tradeoff-server-ncf      # FedNCF's server-adversary arm across eps (seed 1)
    python -m experiments.fedau2.run select-eps               # eps chosen on the validation item (seed 3)
    python -m experiments.fedau2.run protocol-check           # the eps-10 SGD pull, age, test protocol, seeds 3 4
    python -m experiments.fedau2.run diagnostics              # the per-client arm again, with adversary-diagnostics.csv
    python -m experiments.fedau2.run report                   # tables and plots from the finished runs

Every run goes through the package's ServerApp, the honest-but-curious strategy and the ClientApp
(:func:`fedrec_flwr.serial.run_serial`). After the run, the attacks are applied (:mod:`fedrec_flwr.attacks`):

* attribute inference on the users' final embeddings, read from the simulated nodes' private state (evaluation
  only), for every protected attribute, with logistic regression and an MLP over 5 random halves;
* every 10 rounds, the same attack (logistic regression, 3 halves) on the run's protected attribute: the training
  stability curve;
* the server's label-leakage log (``label-leakage.csv``, iDLG / DLG per upload) scored against the true attributes.

Each run writes ``attack.json`` and ``stability.csv`` next to its metrics; a run with ``attack.json`` is skipped, so
an interrupted command resumes. Start the same command in several processes to use several cores (jobs are claimed),
or split them with ``--shard i/n``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import claimed, quiet_flower, run_jobs, slug
from experiments.fedau2.methods import (
    ARMS,
    ATTRIBUTES,
    AUDIT_SEED,
    CLASS_PRIORS,
    EPSILONS,
    LEAKING_PROTOCOL,
    MODELS,
    NCF_SERVER_ARM,
    NCF_SERVER_EPSILONS,
    PROTOCOL,
    PROTOCOL_CHECK_ARMS,
    SELECTION_GRIDS,
    SELECTION_KEYS,
    SELECTION_SEED,
    SERVER_ARM,
    SERVER_EPSILONS,
    SGD_PULL_SELECTION_SEEDS,
    uses_attribute,
    uses_prior,
)
from fedrec_flwr.attacks import attribute_inference, collect_user_embeddings
from fedrec_flwr.attributes import encode_attribute
from fedrec_flwr.config import make_run_config
from fedrec_flwr.io import atomic_write_json, atomic_write_text

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "runs"
STABILITY_EVERY = 10


def run_config(model: str, arm: str, attribute: str, seed: int, data_dir: str, folder: Path, name: str, **extra):
    """The validated run config of one job (``attribute`` is the protected one; ignored by arms without adversary)."""
    overrides = {
        **PROTOCOL,
        **MODELS[model],
        **ARMS[arm],
        "seed": seed,
        "users-per-node": 1 if seed == AUDIT_SEED else 100,
        **extra,
        "results-dir": str(folder),
        "run-name": name,
    }
    if uses_attribute(arm):
        overrides["protected-attribute"] = attribute
        if uses_prior(arm):
            overrides["adversary-class-prior"] = CLASS_PRIORS[attribute]
    if data_dir:
        overrides["data-dir"] = str(Path(data_dir) / PROTOCOL["dataset"])
    return make_run_config(**{key: value for key, value in overrides.items() if value is not None})


def leakage_rates(folder: Path, labels: np.ndarray, num_classes: int) -> dict[str, float]:
    """iDLG / DLG label recovery rates of the run's server log against the true labels, with the chance rates."""
    path = folder / "label-leakage.csv"
    if not path.is_file():
        return {}
    log = pd.read_csv(path)
    log = log[log["user"] >= 0]
    if log.empty:
        return {}
    truth = labels[log["user"].to_numpy()]
    dlg = log["dlg-label"].to_numpy() >= 0
    prior = np.bincount(labels, minlength=num_classes) / len(labels)
    linked = {}
    if "idlg-linked-label" in log.columns:  # the server's guess from the mean of each node's uploads, at its last one
        last = log[log["idlg-linked-label"] >= 0].drop_duplicates("user", keep="last")
        if not last.empty:
            linked = {
                "idlg-linked-recovery": float(
                    (last["idlg-linked-label"].to_numpy() == labels[last["user"].to_numpy()]).mean()
                ),
                "idlg-linked-users": int(len(last)),
            }
    return {
        **linked,
        "idlg-recovery": float((log["idlg-label"].to_numpy() == truth).mean()),
        "idlg-attacks": int(len(log)),
        "dlg-recovery": float((log["dlg-label"].to_numpy()[dlg] == truth[dlg]).mean()) if dlg.any() else float("nan"),
        "dlg-attacks": int(dlg.sum()),
        "chance-uniform": 1.0 / num_classes,
        "chance-majority": float(prior.max()),
    }


def run_job(job) -> Path:
    """Train one arm, then attack it (module docstring); returns its folder."""
    from fedrec_flwr.app.runtime import get_runtime
    from fedrec_flwr.serial import run_serial

    config, attribute = job
    folder = Path(config.results_dir) / config.run_name
    with claimed(folder, RESULTS, done_file="attack.json") as mine:
        if not mine:
            return folder
        runtime = get_runtime(config.to_dict())
        split = runtime.split
        encoded = {name: encode_attribute(split.attributes, name) for name in ATTRIBUTES}
        tracked = encoded[attribute].labels
        stability = []

        def embeddings(grid):
            states = [context.state for context in grid.contexts.values()]
            return collect_user_embeddings(states, runtime.layout.private_keys, split.num_users)

        def on_round(view) -> None:
            server_round = view.server_round
            if server_round % STABILITY_EVERY:
                return
            x, present = embeddings(view.grid)
            result = attribute_inference(x[present], tracked[present], splits=3, seed=server_round)
            stability.append(
                {
                    "round": server_round,
                    "attribute": attribute,
                    "users": int(present.sum()),
                    "auc": result.auc[0],
                    "balanced-accuracy": result.balanced_accuracy[0],
                }
            )

        _, grid = run_serial(config, return_grid=True, on_round=on_round)
        x, present = embeddings(grid)
        attacks = {}
        for name, labels in encoded.items():
            for classifier in ("logreg", "mlp"):
                result = attribute_inference(
                    x[present], labels.labels[present], classifier=classifier, splits=5, seed=config.seed
                )
                attacks[f"{name}/{classifier}"] = result.as_row()
        out = {
            "attribute": attribute,
            "users-attacked": int(present.sum()),
            "attribute-inference": attacks,
            "label-leakage": leakage_rates(folder, encoded[attribute].labels, encoded[attribute].num_classes),
            "classes": {name: list(e.classes) for name, e in encoded.items()},
            "class-counts": {name: e.class_counts().tolist() for name, e in encoded.items()},
        }
        atomic_write_text(folder / "stability.csv", pd.DataFrame(stability).to_csv(index=False, float_format="%.5f"))
        atomic_write_json(folder / "attack.json", out)
    return folder


def jobs_main(args) -> list:
    """``main``'s jobs; ``--users-per-node k`` overrides the protocol's (1 for the audit seed, else 100), e.g. to run
    seed 0 without the one-user audit when the clock is short (the run's config.json records it)."""
    extra = {} if args.users_per_node is None else {"users-per-node": args.users_per_node}
    main_folder = RUNS / ("main-leaking" if args.leaking else "main")
    if args.leaking:  # the declared setting where the unprotected FedMF leaks (methods.LEAKING_PROTOCOL)
        extra.update(LEAKING_PROTOCOL)
    jobs = []
    for seed in args.seeds:
        for model in args.models:
            for arm in args.arms:
                if not uses_attribute(arm):
                    if "gender" in args.attributes:  # attacked on every attribute; tracked on gender
                        jobs.append(
                            (
                                run_config(
                                    model,
                                    arm,
                                    "gender",
                                    seed,
                                    args.data_dir,
                                    main_folder / model,
                                    f"{slug(arm)}-seed{seed}",
                                    **extra,
                                ),
                                "gender",
                            )
                        )
                    continue
                for attribute in args.attributes:
                    jobs.append(
                        (
                            run_config(
                                model,
                                arm,
                                attribute,
                                seed,
                                args.data_dir,
                                main_folder / model,
                                f"{slug(arm)}-{attribute}-seed{seed}",
                                **extra,
                            ),
                            attribute,
                        )
                    )
    return jobs


def jobs_tradeoff(args) -> list:
    jobs = []
    for seed in args.seeds:
        for eps in EPSILONS:
            if eps == 1.0:
                continue  # the main table's FedAU2 run
            config = run_config(
                "FedMF",
                "FedAU2",
                "gender",
                seed,
                args.data_dir,
                RUNS / "tradeoff" / "FedMF",
                f"fedau2-gender-eps{eps:g}-seed{seed}",
                **{"adversary-epsilon": eps},
            )
            jobs.append((config, "gender"))
    return jobs


def jobs_tradeoff_server(args) -> list:
    """The server-adversary arm across eps (FedMF / gender, ``--seeds``, default 1)."""
    jobs = []
    for seed in args.seeds:
        for eps in SERVER_EPSILONS:
            config = run_config(
                "FedMF",
                SERVER_ARM,
                "gender",
                seed,
                args.data_dir,
                RUNS / "tradeoff-server" / "FedMF",
                f"{slug(SERVER_ARM)}-gender-eps{eps:g}-seed{seed}",
                **{"adversary-epsilon": eps},
            )
            jobs.append((config, "gender"))
    return jobs


def jobs_tradeoff_server_ncf(args) -> list:
    """FedNCF's server-adversary arm (``NCF_SERVER_ARM``) across eps (gender, ``--seeds``, default 1)."""
    return [
        (
            run_config(
                "FedNCF",
                NCF_SERVER_ARM,
                "gender",
                seed,
                args.data_dir,
                RUNS / "tradeoff-server" / "FedNCF",
                f"{slug(NCF_SERVER_ARM)}-gender-eps{eps:g}-seed{seed}",
                **{"adversary-epsilon": eps},
            ),
            "gender",
        )
        for seed in args.seeds
        for eps in NCF_SERVER_EPSILONS
    ]


def jobs_select_eps(args) -> list:
    """The eps of each ``--selection-arms`` arm (default ``NCF_SERVER_ARM``) chosen on the validation item
    (``holdout-validation``): the original model and the arm at each eps of ``SELECTION_GRIDS[arm, attribute]`` per
    ``--attributes`` (default gender), seed ``SELECTION_SEED`` (``--seeds`` overrides), per ``--models``; the rule is
    :func:`experiments.fedau2.report.select_epsilon`. The original model has no adversary: one run serves every
    attribute (it is attacked on all of them)."""
    jobs = []
    for seed in args.seeds:
        for model in args.models:
            folder = RUNS / "select-eps" / model
            jobs.append(
                (
                    run_config(
                        model,
                        "original",
                        "gender",
                        seed,
                        args.data_dir,
                        folder,
                        f"original-seed{seed}",
                        **SELECTION_KEYS,
                    ),
                    "gender",
                )
            )
            for arm in args.selection_arms:
                for attribute in args.attributes:
                    if (arm, attribute) not in SELECTION_GRIDS:
                        raise SystemExit(
                            f"select-eps: no eps grid declared for arm {arm!r} and attribute "
                            f"{attribute!r} (methods.SELECTION_GRIDS)"
                        )
                    jobs += [
                        (
                            run_config(
                                model,
                                arm,
                                attribute,
                                seed,
                                args.data_dir,
                                folder,
                                f"{slug(arm)}-{attribute}-eps{eps:g}-seed{seed}",
                                **{"adversary-epsilon": eps, **SELECTION_KEYS},
                            ),
                            attribute,
                        )
                        for eps in SELECTION_GRIDS[arm, attribute]
                    ]
    return jobs


def jobs_protocol_check(args) -> list:
    """``PROTOCOL_CHECK_ARMS`` on FedNCF against age with the test items' protocol (no
    ``holdout-validation``) on the validation seeds (``--seeds``, default ``SGD_PULL_SELECTION_SEEDS``), in
    ``runs/protocol-check/FedNCF`` (read by :func:`experiments.fedau2.report.protocol_check`). Raises ``SystemExit``
    for a test seed (0-2): this check must not add runs of the reported seeds."""
    if set(args.seeds) & {0, 1, 2}:
        raise SystemExit("protocol-check: seeds 0-2 are the test seeds; use validation seeds (default 3 4)")
    folder = RUNS / "protocol-check" / "FedNCF"
    return [
        (
            run_config(
                "FedNCF",
                arm,
                "age",
                seed,
                args.data_dir,
                folder,
                f"{slug(arm)}-age-seed{seed}" if uses_attribute(arm) else f"{slug(arm)}-seed{seed}",
            ),
            "age",
        )
        for seed in args.seeds
        for arm in PROTOCOL_CHECK_ARMS
    ]


def jobs_diagnostics(args) -> list:
    """The per-client arm re-run (its first runs predate the diagnostics file) on FedMF / gender, ``--seeds``."""
    return [
        (
            run_config(
                "FedMF",
                "FedAU2",
                "gender",
                seed,
                args.data_dir,
                RUNS / "diagnostics" / "FedMF",
                f"{slug('FedAU2')}-gender-seed{seed}",
            ),
            "gender",
        )
        for seed in args.seeds
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "command",
        choices=(
            "main",
            "tradeoff",
            "tradeoff-server",
            "tradeoff-server-ncf",
            "select-eps",
            "protocol-check",
            "diagnostics",
            "report",
        ),
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--attributes", nargs="+", default=["gender"], choices=list(ATTRIBUTES))
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (main), 0 (tradeoff)")
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("FEDREC_DATA_DIR", ""),
        help="folder holding ml-100k/ (default $FEDREC_DATA_DIR; empty = download)",
    )
    parser.add_argument(
        "--selection-arms",
        nargs="+",
        default=[NCF_SERVER_ARM],
        choices=sorted({a for a, _ in SELECTION_GRIDS}),
        help="select-eps: the arms whose eps is chosen (grids: methods.SELECTION_GRIDS)",
    )
    parser.add_argument(
        "--users-per-node",
        type=int,
        default=None,
        help="main: users per node for every seed (default: 1 for the audit seed 0, else 100)",
    )
    parser.add_argument(
        "--leaking",
        action="store_true",
        help="main: the setting where the unprotected FedMF leaks (methods.LEAKING_PROTOCOL), in runs/main-leaking",
    )
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th job starting at i")
    args = parser.parse_args(argv)
    if args.seeds is None:
        args.seeds = {
            "main": [0, 1, 2],
            "tradeoff": [0],
            "select-eps": [SELECTION_SEED],
            "protocol-check": list(SGD_PULL_SELECTION_SEEDS),
        }.get(args.command, [1])
    quiet_flower()
    if args.command == "report":
        from experiments.fedau2.report import write_all

        write_all(RESULTS)
        return
    jobs = {
        "main": jobs_main,
        "tradeoff": jobs_tradeoff,
        "tradeoff-server": jobs_tradeoff_server,
        "tradeoff-server-ncf": jobs_tradeoff_server_ncf,
        "select-eps": jobs_select_eps,
        "protocol-check": jobs_protocol_check,
        "diagnostics": jobs_diagnostics,
    }[args.command](args)
    run_jobs(jobs, run_job, args.shard, args.command)


if __name__ == "__main__":
    main(sys.argv[1:])
