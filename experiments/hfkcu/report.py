"""Tables and plots of the HF-KCU experiments from the finished runs (``python -m experiments.hfkcu.run report``).

For every dataset, model and forget set, each model (original, every unlearning variant, retrained) gets:
HR@10 / NDCG@10 on the remaining users (federated evaluation), the mean KL divergence of its softmax over each
remaining user's 100 test candidates from the retrained model's, the normalised parameter gap to the retrained model,
its time (phase wall time; retraining: its 100 rounds' training time) and speedup over retraining, and membership
inference on the forgotten users (their training items against as many never-interacted items, scored with their
private embeddings as they were when they left: :mod:`fedrec_flwr.attacks.membership`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import markdown, pyplot, save_figure, slug, write_csv
from experiments.hfkcu.analysis import mean_kl, membership, parameter_gap
from experiments.hfkcu.methods import ABLATIONS, DATASETS, FORGET_SETS, MODELS
from experiments.hfkcu.run import SEED as _SEED, base_config
from fedrec_flwr.io import atomic_write_text


def _load_npz(path: Path) -> tuple[dict, np.ndarray]:
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files if k != "scores"}
        scores = data["scores"] if "scores" in data.files else None
    return arrays, scores


def _records(path: Path, users) -> dict:
    from flwr.app import Array, ArrayRecord

    wanted = {int(u) for u in users}
    out: dict[int, dict] = {}
    with np.load(path) as data:
        for name in data.files:
            user, key = name.split("/", 1)
            if int(user) in wanted:
                out.setdefault(int(user), {})[key] = Array(data[name])
    return {u: ArrayRecord(v) for u, v in out.items()}


def _mia(runtime, records, arrays, users) -> float:
    try:
        return membership(runtime, records, arrays, users, _SEED)["auc"]
    except ValueError as err:  # a diverged model (e.g. gradient ascent): no attack to score
        print(f"membership inference skipped: {err}")
        return float("nan")


def collect(results: Path, data_dir: str) -> pd.DataFrame:
    """One row per (dataset, model, forget set, model variant) with every measure of the module docstring."""
    from fedrec_flwr.runtime import get_runtime

    rows = []
    for dataset in DATASETS:
        for model in MODELS:
            folder = results / "runs" / dataset / model
            phase_file = folder / "original" / "phase.json"
            if not phase_file.is_file():
                continue
            phase = json.loads(phase_file.read_text())
            runtime = get_runtime(base_config(dataset, model, data_dir, folder, "original").to_dict())
            for set_name in FORGET_SETS:
                users = np.asarray(phase["forget-sets"][set_name], dtype=np.int64)
                records = _records(folder / "original" / "private-records.npz", users)
                retrain_dir = folder / f"retrain-{slug(set_name)}"
                retrain = json.loads((retrain_dir / "retrain.json").read_text()) \
                    if (retrain_dir / "retrain.json").is_file() else None
                ref_arrays, ref_scores = _load_npz(retrain_dir / "retrained.npz") if retrain else (None, None)
                base = {"dataset": dataset, "model": model, "forget-set": set_name, "forgotten": int(users.size)}
                if retrain:
                    rows.append({**base, "variant": "retrained (gold standard)", "HR@10": retrain["HR@10"],
                                 "NDCG@10": retrain["NDCG@10"], "seconds": retrain["train-seconds"], "kl": 0.0,
                                 "parameter-gap": 0.0,
                                 "mia-auc": _mia(runtime, records, ref_arrays, users)})
                for row in phase["rows"]:
                    if row["forget-set"] != set_name:
                        continue
                    arrays, scores = _load_npz(folder / "original" / "variants" / slug(set_name)
                                               / f"{slug(row['variant'])}.npz")
                    out = {**base, "variant": row["variant"], "HR@10": row["HR@10"], "NDCG@10": row["NDCG@10"],
                           "seconds": row["seconds"] if row["variant"] != "original" else float("nan"),
                           "mia-auc": _mia(runtime, records, arrays, users),
                           "messages": row.get("messages"), "affected-users": row.get("affected-users"),
                           "cg-iterations": row.get("cg-iterations"), "cg-residual": row.get("cg-residual"),
                           "cg-negative-curvature": row.get("cg-negative-curvature"), "scale": row.get("scale"),
                           "relative-update": row.get("relative-update")}
                    if retrain:
                        out["kl"] = mean_kl(scores, ref_scores)
                        out["parameter-gap"] = parameter_gap(arrays, ref_arrays)
                    rows.append(out)
                if retrain:
                    for row in rows:
                        if row["dataset"] == dataset and row["model"] == model and row["forget-set"] == set_name:
                            row["retrain-seconds"] = retrain["train-seconds"]
                            row["speedup"] = retrain["train-seconds"] / row["seconds"] \
                                if row["seconds"] and row["seconds"] == row["seconds"] else float("nan")
                            row["HR@10-gap-points"] = 100 * (row["HR@10"] - retrain["HR@10"])
    return pd.DataFrame(rows)


MAIN_COLUMNS = ["variant", "HR@10", "NDCG@10", "HR@10-gap-points", "kl", "parameter-gap", "seconds", "speedup",
                "mia-auc"]


def _table(frame: pd.DataFrame) -> pd.DataFrame:
    out = frame[[c for c in MAIN_COLUMNS if c in frame.columns]].copy()
    for column in out.columns[1:]:
        if column in ("kl", "parameter-gap"):
            out[column] = out[column].map(lambda v: "-" if v is None or v != v else f"{v:.3g}")
            continue
        digits = {"seconds": 1, "speedup": 1, "HR@10-gap-points": 1}.get(column, 4)
        out[column] = out[column].map(lambda v, d=digits: "-" if v is None or v != v else f"{v:.{d}f}")
    return out


def report(results: Path, data_dir: str) -> None:
    """Write ``main.csv`` / ``main.md``, ``ablation.*``, ``poison.*`` and the plots under ``results``."""
    frame = collect(results, data_dir)
    if frame.empty:
        print("no finished runs")
        return
    ablations = frame["variant"].isin(ABLATIONS)
    main = frame[~ablations]
    write_csv(main, results / "main.csv")
    lines = ["# HF-KCU: unlearning against retraining (seed 0; generated by `python -m experiments.hfkcu.run report`)",
             "", "Time: phase wall time; retrained: its 100 rounds' training time. Speedup = retraining time / time. "
             "KL and parameter gap are against the retrained model. MIA AUC: membership inference on the forgotten "
             "users (0.5 = undetectable).", ""]
    for (dataset, model, set_name), block in main.groupby(["dataset", "model", "forget-set"], sort=False):
        lines += [f"## {dataset}, {model}, forget {set_name} ({int(block['forgotten'].iloc[0])} users)", "",
                  markdown(_table(block)), ""]
    atomic_write_text(results / "main.md", "\n".join(lines))
    if ablations.any():
        ablation = frame[ablations | ((frame["variant"].isin(["HF-KCU distributed CG", "HF-KCU local CG (Alg. 1)",
                                                              "retrained (gold standard)", "original"]))
                                      & frame.set_index(["dataset", "forget-set"]).index.isin(
                                          frame[ablations].set_index(["dataset", "forget-set"]).index.unique()))]
        write_csv(ablation, results / "ablation.csv")
        lines = ["# HF-KCU ablations (generated by `python -m experiments.hfkcu.run report`)", ""]
        for (dataset, model, set_name), block in ablation.groupby(["dataset", "model", "forget-set"], sort=False):
            extra = block[["variant", "cg-iterations", "cg-residual", "cg-negative-curvature", "scale",
                           "relative-update"]].copy()
            lines += [f"## {dataset}, {model}, forget {set_name}", "", markdown(_table(block)), "",
                      markdown(extra.fillna("-")), ""]
        atomic_write_text(results / "ablation.md", "\n".join(lines))
    poison_report(results)
    plot(main, results)
    print(f"wrote {results / 'main.md'}")


def poison_report(results: Path) -> None:
    folder = results / "runs" / "poison"
    rows = []
    for model_dir in sorted(folder.glob("*")) if folder.is_dir() else []:
        phase_file, retrain_file = model_dir / "original" / "phase.json", model_dir / "retrain-fake-users" / "retrain.json"
        if not phase_file.is_file():
            continue
        phase = json.loads(phase_file.read_text())
        retrain = json.loads(retrain_file.read_text()) if retrain_file.is_file() else None
        for row in phase["rows"]:
            rows.append({"model": model_dir.name, "variant": row["variant"], "exposure": row["exposure"],
                         "target-percentile": row.get("target-percentile"), "HR@10": row["HR@10"],
                         "seconds": row["seconds"] if row["variant"] != "original" else None})
        if retrain:
            rows.append({"model": model_dir.name, "variant": "retrained without fake users",
                         "exposure": retrain["exposure"], "target-percentile": retrain.get("target-percentile"),
                         "HR@10": retrain["HR@10"], "seconds": retrain["train-seconds"]})
    if not rows:
        return
    frame = pd.DataFrame(rows)
    write_csv(frame, results / "poison.csv")
    shown = frame.copy()
    for column, digits in (("exposure", 3), ("target-percentile", 3), ("HR@10", 4), ("seconds", 1)):
        shown[column] = shown[column].map(lambda v, d=digits: "-" if v is None or v != v else f"{v:.{d}f}")
    atomic_write_text(results / "poison.md", "# Poisoning case study (generated by `python -m experiments.hfkcu.run "
                      "report`)\n\nExposure: share of genuine users (who never rated the target) with the target item "
                      "in their top 10 of all items they never rated; target-percentile: the mean share of those items the target "
                      "outscores (0.5 = an average item). HR@10 on the genuine users.\n\n"
                      + markdown(shown))


def plot(main: pd.DataFrame, results: Path) -> None:
    """``tradeoff.png``: HR@10 against time per method (largest forget set); ``membership.png``: attack AUC."""
    plt = pyplot()
    largest = list(FORGET_SETS)[-1]
    blocks = list(main[main["forget-set"] == largest].groupby(["dataset", "model"], sort=False))
    if not blocks:
        return
    fig, axes = plt.subplots(1, len(blocks), figsize=(4.6 * len(blocks), 4.0), squeeze=False)
    for axis, ((dataset, model), block) in zip(axes[0], blocks):
        for _, row in block.iterrows():
            if row["variant"] == "original":
                axis.axhline(row["HR@10"], color="grey", linestyle=":", label="original")
                continue
            marker = "*" if row["variant"].startswith("retrained") else "o"
            axis.scatter(max(row["seconds"], 1e-2), row["HR@10"], marker=marker, s=90 if marker == "*" else 40,
                         label=row["variant"])
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(plt.NullFormatter())
        axis.set_xlabel("seconds (log)")
        axis.set_ylabel("HR@10, remaining users")
        axis.set_title(f"{dataset}, {model}, forget {largest}")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, results / "tradeoff.png")

    fig, axes = plt.subplots(1, len(FORGET_SETS), figsize=(5.2 * len(FORGET_SETS), 4.2), squeeze=False)
    for axis, set_name in zip(axes[0], FORGET_SETS):
        block = main[main["forget-set"] == set_name].copy()
        reference = block[block["variant"].str.startswith("retrained")].set_index(["dataset", "model"])["mia-auc"]
        block["gap"] = [row["mia-auc"] - reference.get((row["dataset"], row["model"]), np.nan)
                        for _, row in block.iterrows()]
        block = block[~block["variant"].str.startswith("retrained")]
        pivot = block.pivot_table(index=["dataset", "model"], columns="variant", values="gap", sort=False)
        pivot.index = [f"{d}\n{m}" for d, m in pivot.index]
        pivot.plot.bar(ax=axis, width=0.85, legend=set_name == list(FORGET_SETS)[0])
        axis.axhline(0.0, color="black", linewidth=0.8)
        axis.set_ylabel("membership AUC minus the retrained model's")
        axis.set_title(f"forget {set_name} (0 = retrained level)")
        axis.tick_params(axis="x", rotation=0)
        axis.grid(axis="y", alpha=0.3)
    if axes[0][0].get_legend():
        axes[0][0].legend(fontsize=6)
    save_figure(fig, results / "membership.png")
