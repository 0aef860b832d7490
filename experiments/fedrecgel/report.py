"""Tables and plots of the FedRecGEL experiments, from the finished runs under ``results/runs/``.

Writes to ``experiments/fedrecgel/results/``: ``main.csv`` / ``main.md`` (Table 2), ``datasets.csv`` / ``datasets.md``
(statistics after cleaning), ``ablation.csv`` / ``ablation.md`` (Table 3), ``sensitivity.csv`` / ``sensitivity.png``
(RQ2), ``curves-<dataset>.png`` (HR@10 per round). Every file is written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import fmt, markdown, mean_std, pyplot, save_figure, slug, write_csv
from experiments.fedrecgel.methods import ABLATIONS, DATASETS, METHODS
from fedrec_flwr.io import atomic_write_text

METRICS = ("HR@5", "NDCG@5", "HR@10", "NDCG@10", "HR@20", "NDCG@20")
DATASET_COLUMNS = [
    "dataset",
    "users",
    "items",
    "interactions",
    "per user",
    "density",
    "users/items",
    "popularity HR@10",
]


def load_runs(folder: Path) -> pd.DataFrame:
    """One row per finished run under ``folder/<dataset>/<run>/``: final metrics, and the test metrics of the round
    chosen on the validation item (columns prefixed ``sel-``)."""
    rows = []
    for summary_path in sorted(folder.glob("*/*/summary.json")):
        summary = json.loads(summary_path.read_text())
        config = json.loads((summary_path.parent / "config.json").read_text())["run-config"]
        name = summary_path.parent.name
        row = {
            "dataset": summary_path.parent.parent.name,
            "run": name.rsplit("-seed", 1)[0],
            "seed": config["seed"],
            "seconds": summary.get("total-seconds"),
        }
        row.update({m: summary["final"].get(m) for m in METRICS})
        selected = summary.get("selected-on-validation") or {}
        row.update({f"sel-{m}": selected.get(m) for m in METRICS})
        row["sel-round"] = selected.get("round")
        rows.append(row)
    return pd.DataFrame(rows)


def dataset_stats(data_dir: str) -> pd.DataFrame:
    """Statistics of each dataset after cleaning (the split the experiments use, seed 0)."""
    from experiments.fedrecgel.methods import PROTOCOL
    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.baselines import evaluate_popularity
    from fedrec_flwr.config import make_run_config

    rows = []
    for dataset in DATASETS:
        overrides = {"dataset": dataset, "holdout-validation": PROTOCOL["holdout-validation"]}
        if data_dir:
            overrides["data-dir"] = str(Path(data_dir) / dataset)
        split = load_split_for(make_run_config(**overrides))
        stats = split.stats()
        popularity = evaluate_popularity(split, (5, 10, 20))
        rows.append(
            {
                "dataset": dataset,
                "users": stats["users"],
                "items": stats["items"],
                "interactions": stats["interactions"],
                "per user": round(stats["avg_interactions_per_user"], 1),
                "density": round(stats["density"], 5),
                "users/items": round(stats["users"] / stats["items"], 3),
                "popularity HR@10": round(popularity["HR@10"], 4),
                **{f"popularity {m}": popularity[m] for m in METRICS if m != "HR@10"},
            }
        )
    return pd.DataFrame(rows)


def main_table(results: Path, stats: pd.DataFrame | None) -> pd.DataFrame | None:
    runs = load_runs(results / "runs" / "main")
    if runs.empty:
        return None
    runs["method"] = runs["run"].map({m.lower(): m for m in METHODS}).fillna(runs["run"])
    summary = mean_std(runs, ["dataset", "method"], [*METRICS, *(f"sel-{m}" for m in METRICS)])
    write_csv(summary, results / "main.csv")
    order = {d: i for i, d in enumerate(DATASETS)}
    summary = summary.sort_values(
        by=["dataset", "method"],
        key=lambda s: (
            s.map(order).fillna(s.map({m: i for i, m in enumerate(METHODS)}))
            if s.name == "dataset"
            else s.map({m: i for i, m in enumerate(METHODS)})
        ),
    )
    text = ["# FedRecGEL Table 2 design: last round (100), mean ± std over seeds (no ± with one seed)\n"]
    table = pd.DataFrame(
        {
            "dataset": summary["dataset"],
            "method": summary["method"],
            "seeds": summary["seeds"],
            **{m: [fmt(a, b) for a, b in zip(summary[f"{m}-mean"], summary[f"{m}-std"])] for m in METRICS},
        }
    )
    if stats is not None:  # the non-federated popularity ranking: the floor every method should beat
        floor = stats.set_index("dataset")
        rows = []
        for dataset in table["dataset"].unique():
            if dataset in floor.index:
                rows.append(
                    {
                        "dataset": dataset,
                        "method": "(popularity)",
                        "seeds": "-",
                        **{m: f"{floor.loc[dataset, f'popularity {m}']:.4f}" for m in METRICS},
                    }
                )
        table = pd.concat([table, pd.DataFrame(rows)], ignore_index=True)
        order = {d: i for i, d in enumerate(DATASETS)}
        table = table.sort_values("dataset", key=lambda c: c.map(order), kind="stable")
    text.append(markdown(table))
    text.append("\n# Test metrics at the round chosen on the validation item (best validation HR@10)\n")
    sel = pd.DataFrame(
        {
            "dataset": summary["dataset"],
            "method": summary["method"],
            **{
                m: [fmt(a, b) for a, b in zip(summary[f"sel-{m}-mean"], summary[f"sel-{m}-std"])]
                for m in ("HR@10", "NDCG@10")
            },
        }
    )
    text.append(markdown(sel))
    gains = []
    for dataset, part in summary.groupby("dataset"):
        by = part.set_index("method")
        if "FedRecGEL" not in by.index:
            continue
        others = by.drop(index="FedRecGEL")
        if others.empty:
            continue
        best = others["HR@10-mean"].idxmax()
        ratio = None
        if stats is not None and dataset in set(stats["dataset"]):
            ratio = float(stats.set_index("dataset").loc[dataset, "users/items"])
        gains.append(
            {
                "dataset": dataset,
                "users/items": ratio,
                "best baseline": best,
                "FedRecGEL HR@10": round(by.loc["FedRecGEL", "HR@10-mean"], 4),
                "best baseline HR@10": round(others.loc[best, "HR@10-mean"], 4),
                "difference": round(by.loc["FedRecGEL", "HR@10-mean"] - others.loc[best, "HR@10-mean"], 4),
            }
        )
    if gains:
        text.append("\n# FedRecGEL minus the best baseline (HR@10, last round), against the user-to-item ratio\n")
        text.append(markdown(pd.DataFrame(gains).sort_values("users/items")))
    unfinished = sorted(
        str(p.parent.relative_to(results / "runs" / "main"))
        for p in (results / "runs" / "main").glob("*/*/config.json")
        if not (p.parent / "summary.json").is_file()
    )
    if unfinished:
        text.append("\nNot finished (left out above): " + ", ".join(unfinished) + "\n")
    if stats is not None:
        text.append("\n# Datasets after cleaning\n")
        text.append(markdown(stats[DATASET_COLUMNS]))
    atomic_write_text(results / "main.md", "\n".join(text))
    return runs


def ablation_table(results: Path) -> None:
    runs = load_runs(results / "runs" / "ablation")
    if runs.empty:
        return
    names = {slug(v): v for v in ABLATIONS}
    runs["variant"] = runs["run"].map(names).fillna(runs["run"])
    main = load_runs(results / "runs" / "main")  # the full FedRecGEL variant is the main table's run
    if not main.empty:
        full = main[
            (main["run"] == "fedrecgel") & main["dataset"].isin(runs["dataset"]) & main["seed"].isin(runs["seed"])
        ]
        runs = pd.concat([full.assign(variant="FedRecGEL"), runs], ignore_index=True)
    summary = mean_std(runs, ["dataset", "variant"], [*METRICS, "sel-HR@10", "sel-NDCG@10"])
    rank = {v: i for i, v in enumerate(ABLATIONS)}
    summary = summary.sort_values(["dataset", "variant"], key=lambda c: c.map(rank) if c.name == "variant" else c)
    write_csv(summary, results / "ablation.csv")
    table = pd.DataFrame(
        {
            "dataset": summary["dataset"],
            "variant": summary["variant"],
            "seeds": summary["seeds"],
            **{
                m: [fmt(a, b) for a, b in zip(summary[f"{m}-mean"], summary[f"{m}-std"])]
                for m in ("HR@10", "NDCG@10", "sel-HR@10", "sel-NDCG@10")
            },
        }
    )
    atomic_write_text(
        results / "ablation.md",
        "# Ablation (Table 3): last round; sel- = round chosen on validation\n\n" + markdown(table),
    )


def sensitivity(results: Path) -> None:
    runs = load_runs(results / "runs" / "sensitivity")
    if runs.empty:
        return
    parsed = runs["run"].str.extract(r"^(rho-shared|rho-private)-([0-9.e-]+)$")
    runs["parameter"], runs["rho"] = parsed[0], parsed[1].astype(float)
    default = runs[runs["run"] == "default"]  # both rho at their defaults: a point of both curves
    extra = [default.assign(parameter=p, rho=float(METHODS["FedRecGEL"][p])) for p in ("rho-shared", "rho-private")]
    runs = pd.concat([runs[runs["run"] != "default"], *extra], ignore_index=True)
    summary = mean_std(runs, ["dataset", "parameter", "rho"], ["HR@10", "NDCG@10", "sel-HR@10", "sel-NDCG@10"])
    summary = summary.sort_values(["dataset", "parameter", "rho"])
    write_csv(summary, results / "sensitivity.csv")
    plt = pyplot()
    for dataset, part in summary.groupby("dataset"):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for axis, metric in zip(axes, ("HR@10", "NDCG@10")):
            for parameter, marker in (("rho-shared", "o"), ("rho-private", "s")):
                sub = part[part["parameter"] == parameter]
                x = np.arange(len(sub))
                axis.errorbar(
                    x,
                    sub[f"{metric}-mean"],
                    yerr=sub[f"{metric}-std"].fillna(0),
                    marker=marker,
                    capsize=3,
                    label=f"{parameter} varied",
                )
                axis.set_xticks(x, [f"{r:g}" for r in sub["rho"]])
            axis.set_xlabel("rho (the other at 0.05); server learning rate 0.01")
            axis.set_ylabel(f"{metric} (round 100)")
            axis.grid(alpha=0.3)
            axis.legend()
        fig.suptitle(f"FedRecGEL sensitivity to rho on {dataset}")
        save_figure(fig, results / f"sensitivity-{dataset}.png")


def learning_curves(results: Path, stats: pd.DataFrame | None = None) -> None:
    plt = pyplot()
    base = results / "runs" / "main"
    for dataset_dir in sorted(p for p in base.glob("*") if p.is_dir()):
        fig, axis = plt.subplots(figsize=(6.5, 4))
        plotted = 0
        for method in METHODS:
            curves = []
            for metrics_path in sorted(dataset_dir.glob(f"{method.lower()}-seed*/metrics.json")):
                if not (metrics_path.parent / "summary.json").is_file():
                    continue
                rows = [r for r in json.loads(metrics_path.read_text()) if "HR@10" in r]
                curves.append(pd.Series({r["round"]: r["HR@10"] for r in rows}))
            if not curves:
                continue
            frame = pd.concat(curves, axis=1)
            mean, std = frame.mean(axis=1), frame.std(axis=1).fillna(0)
            axis.plot(mean.index, mean.values, marker="o", label=f"{method} ({len(curves)} seeds)")
            axis.fill_between(mean.index, mean - std, mean + std, alpha=0.2)
            plotted += 1
        if not plotted:
            pyplot().close(fig)
            continue
        if stats is not None and dataset_dir.name in set(stats["dataset"]):
            floor = float(stats.set_index("dataset").loc[dataset_dir.name, "popularity HR@10"])
            axis.axhline(floor, color="grey", linestyle="--", label=f"popularity ({floor:.3f})")
        axis.set_xlabel("round")
        axis.set_ylabel("HR@10 (test, all users)")
        axis.set_title(f"{dataset_dir.name}: HR@10 per round, mean ± std over seeds")
        axis.grid(alpha=0.3)
        axis.legend()
        save_figure(fig, results / f"curves-{dataset_dir.name}.png")


def write_all(results: Path, data_dir: str) -> None:
    """Write every table and plot whose runs exist."""
    stats = dataset_stats(data_dir)
    write_csv(stats, results / "datasets.csv")
    atomic_write_text(results / "datasets.md", "# Datasets after cleaning\n\n" + markdown(stats[DATASET_COLUMNS]))
    main_table(results, stats)
    ablation_table(results)
    sensitivity(results)
    learning_curves(results, stats)
    print(f"tables and plots written to {results}")
