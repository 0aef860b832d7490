"""Tables and plots of the FedAU² experiments, from the finished runs under ``results/runs/``.

Writes to ``experiments/fedau2/results/``: ``main-<attribute>.csv`` / ``.md`` (one row per recommender and arm:
HR@10, NDCG@10, the relative HR@10 change against the original model, attribute inference AUC / balanced accuracy /
macro-F1 with logistic regression and an MLP, and the server's iDLG / DLG label recovery rates against chance),
``tradeoff.png`` (HR@10 against attacker AUC, FedMF / gender, across eps and arms) and ``stability.png`` (attacker AUC
per round, with and without SUT). Every file is written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import fmt, markdown, mean_std, pyplot, save_figure, slug, write_csv
from experiments.fedau2.methods import ARMS, ATTRIBUTES, AUDIT_SEED, DIAGNOSTICS_ARMS, EPSILONS, MODELS
from fedrec_flwr.adversary import DIAGNOSTICS_FILE
from fedrec_flwr.io import atomic_write_text

METRICS = ("HR@10", "NDCG@10")
ATTACK_COLUMNS = (
    "logreg-auc",
    "logreg-balanced-accuracy",
    "logreg-macro-f1",
    "mlp-auc",
    "mlp-balanced-accuracy",
    "mlp-macro-f1",
)


def load_runs(folder: Path) -> pd.DataFrame:
    """One row per (finished run, attacked attribute) under ``folder/<model>/<run>/``."""
    arms = {slug(a): a for a in ARMS}
    rows = []
    for attack_path in sorted(folder.glob("*/*/attack.json")):
        run = attack_path.parent
        attack = json.loads(attack_path.read_text())
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text())["run-config"]
        name = run.name.rsplit("-seed", 1)[0]
        trained_on = config.get("protected-attribute") or ""
        base = name[: -len(trained_on) - 1] if trained_on and name.endswith("-" + trained_on) else name
        for attribute in ATTRIBUTES:
            if trained_on and attribute != trained_on:
                continue  # an adversarial arm is reported against the attribute it unlearned
            row = {
                "model": run.parent.name,
                "arm": arms.get(base, base),
                "attribute": attribute,
                "seed": config["seed"],
                "epsilon": config.get("adversary-epsilon"),
                "seconds": summary.get("total-seconds"),
            }
            row.update({m: summary["final"].get(m) for m in METRICS})
            for classifier in ("logreg", "mlp"):
                result = attack["attribute-inference"].get(f"{attribute}/{classifier}", {})
                for metric in ("auc", "balanced-accuracy", "macro-f1"):
                    row[f"{classifier}-{metric}"] = result.get(metric)
            leakage = attack.get("label-leakage") or {}
            row.update(
                {
                    k: leakage.get(k)
                    for k in (
                        "idlg-recovery",
                        "dlg-recovery",
                        "chance-uniform",
                        "chance-majority",
                        "idlg-attacks",
                        "dlg-attacks",
                        "idlg-linked-recovery",
                    )
                }
            )
            rows.append(row)
    return pd.DataFrame(rows)


def unchanged_model(arm: str) -> str:
    """The arm an arm's HR@10 change is measured against: ``"original (FedRecGEL client)"`` for arms on
    ``client = "fedau2-gel"`` (FedRecGEL's SAM client without the adversary), ``"original"`` for every other arm
    (``"original (FedRecGEL client)"`` included, so the table shows what FedRecGEL's client costs against FedNCF's)."""
    return "original (FedRecGEL client)" if ARMS.get(arm, {}).get("client") == "fedau2-gel" else "original"


def paired_change(runs: pd.DataFrame, metric: str = "HR@10") -> dict[tuple[str, str], float]:
    """Relative change (%) of ``metric`` of every (model, arm) against its :func:`unchanged_model`, paired by seed.

    ``runs`` has one row per (model, arm, seed) of one attribute (columns ``model``, ``arm``, ``seed``, ``metric``).
    The change is ``100 * (mean_s arm[s] / mean_s unchanged[s] - 1)`` over the seeds ``s`` both ran, so a single-seed
    arm is compared with the unchanged model of that seed, not with its mean over other seeds (ours: a ratio of
    means, the table's own means restricted to the shared seeds). NaN where no seed is shared. Returns
    ``{(model, arm): change}``."""
    values = runs.groupby(["model", "arm", "seed"])[metric].mean()
    out = {}
    for (model, arm), arm_values in values.groupby(level=["model", "arm"]):
        seeds = arm_values.index.get_level_values("seed")
        reference = unchanged_model(arm)
        if (model, reference) not in values.index.droplevel("seed"):
            out[(model, arm)] = np.nan
            continue
        base = values.loc[(model, reference)]
        shared = sorted(set(seeds) & set(base.index))
        if not shared:
            out[(model, arm)] = np.nan
            continue
        mine = arm_values.droplevel(["model", "arm"]).loc[shared].mean()
        out[(model, arm)] = 100.0 * (mine / base.loc[shared].mean() - 1.0)
    return out


def main_tables(results: Path) -> pd.DataFrame:
    runs = load_runs(results / "runs" / "main")
    if runs.empty:
        return runs
    for attribute, part in runs.groupby("attribute", sort=False):
        summary = mean_std(part, ["model", "arm"], [*METRICS, *ATTACK_COLUMNS])
        # one user per node (seed 0): every upload is one user's; an arm without a seed-0 run (the secured defaults,
        # whose server guesses from each round's sum whatever the node size) is scored over the seeds it ran
        has_audit = part.groupby(["model", "arm"])["seed"].transform(lambda seeds: (seeds == AUDIT_SEED).any())
        audited = part[(part["seed"] == AUDIT_SEED) | ~has_audit]
        leakage = (
            audited.groupby(["model", "arm"], sort=False)[
                ["idlg-recovery", "dlg-recovery", "chance-uniform", "chance-majority", "idlg-linked-recovery"]
            ]
            .mean()
            .reset_index()
        )
        summary = summary.merge(leakage, on=["model", "arm"], how="left")
        order = {a: i for i, a in enumerate(ARMS)}
        summary = summary.sort_values(["model", "arm"], key=lambda c: c.map(order) if c.name == "arm" else c)
        change = paired_change(part)
        summary["HR@10-change-%"] = [change.get((m, a), np.nan) for m, a in zip(summary["model"], summary["arm"])]
        write_csv(summary, results / f"main-{attribute}.csv")

        def cell(column: str, row, digits: int = 3) -> str:
            return fmt(row[f"{column}-mean"], row[f"{column}-std"], digits)

        def rate(value) -> str:
            return "-" if value is None or value != value else f"{value:.2f}"

        table = pd.DataFrame(
            {
                "model": summary["model"],
                "arm": summary["arm"],
                "HR@10": [cell("HR@10", r, 4) for _, r in summary.iterrows()],
                "NDCG@10": [cell("NDCG@10", r, 4) for _, r in summary.iterrows()],
                "ΔHR@10": ["-" if v != v else f"{v:+.1f}%" for v in summary["HR@10-change-%"]],
                "AUC (LR)": [cell("logreg-auc", r) for _, r in summary.iterrows()],
                "AUC (MLP)": [cell("mlp-auc", r) for _, r in summary.iterrows()],
                "\\|AUC − 0.5\\| (LR / MLP)": [
                    f"{abs(r['logreg-auc-mean'] - 0.5):.3f} / {abs(r['mlp-auc-mean'] - 0.5):.3f}"
                    for _, r in summary.iterrows()
                ],
                "bal. acc. (LR)": [cell("logreg-balanced-accuracy", r) for _, r in summary.iterrows()],
                "F1 (LR)": [cell("logreg-macro-f1", r) for _, r in summary.iterrows()],
                "iDLG": [rate(v) for v in summary["idlg-recovery"]],
                "DLG": [rate(v) for v in summary["dlg-recovery"]],
                "iDLG, linked": [rate(v) for v in summary["idlg-linked-recovery"]],
                "seeds": summary["seeds"],
            }
        )
        chance = part[["chance-uniform", "chance-majority"]].dropna()
        note = ""
        if not chance.empty:
            note = (
                f"Chance label recovery: {chance['chance-uniform'].iloc[0]:.2f} (uniform guess), "
                f"{chance['chance-majority'].iloc[0]:.2f} (always the majority class).\n\n"
            )
        atomic_write_text(
            results / f"main-{attribute}.md",
            f"# FedAU² on MovieLens-100K, protected attribute: {attribute}\n\n"
            "Mean ± std over seeds; attacks: 5 random halves per run (attacker knows half the users' "
            f"attribute); iDLG/DLG: share of the server's label guesses that are right (seed 0 runs, one "
            f"user per node); iDLG, linked: share of users whose label iDLG reads from the mean of all "
            f"their uploads (train replies and adversary-gradient queries; runs that record every "
            f"upload). ΔHR@10: against the arm's unchanged model (`original`; `original (FedRecGEL "
            f"client)` for `fedau2-gel` arms), paired by seed: both means over the seeds both ran "
            f"(`report.paired_change`).\n\n{note}" + markdown(table),
        )
    return runs


TRADEOFF_POINTS = {
    "original": "no defence (original)",
    "DP b=0.02": "DP noise b = 0.02",
    "DP b=0.1": "DP noise b = 0.1",
    "FedAU2": "FedAU2, per-client h_w (as first implemented)",
}
"""Arms shown as points in ``tradeoff.png`` (name in the tables -> legend label); the package-default arms are added
in :func:`tradeoff_plot` (their names live in :mod:`experiments.fedau2.methods`)."""


def _change_points(runs: pd.DataFrame, model: str, arms) -> list[tuple[str, float, float, float, int]]:
    """``(arm, mean LR AUC, its std over seeds, HR@10 change % paired by seed, seeds)`` of each of ``arms`` with
    runs of ``model`` against gender (``runs``: one row per run, :func:`load_runs`)."""
    part = runs[(runs["model"] == model) & (runs["attribute"] == "gender")]
    change = paired_change(part)
    out = []
    for arm in arms:
        mine = part[part["arm"] == arm]
        if mine.empty:
            continue
        auc = mine.groupby("seed")["logreg-auc"].mean()
        out.append(
            (
                arm,
                float(auc.mean()),
                float(auc.std()) if auc.size > 1 else 0.0,
                change.get((model, arm), np.nan),
                int(auc.size),
            )
        )
    return out


def _eps_curve(sweep: pd.DataFrame, original: pd.DataFrame) -> pd.DataFrame:
    """Mean LR AUC and HR@10 change (%) per eps of a sweep's runs (FedMF, gender), each against the original of
    its own seeds."""
    rows = []
    for eps, part in sweep.groupby("epsilon"):
        seeds = sorted(set(part["seed"]) & set(original["seed"]))
        if not seeds:
            continue
        base = original[original["seed"].isin(seeds)]["HR@10"].mean()
        rows.append(
            {
                "epsilon": eps,
                "logreg-auc": part["logreg-auc"].mean(),
                "change": 100.0 * (part[part["seed"].isin(seeds)]["HR@10"].mean() / base - 1.0),
            }
        )
    return pd.DataFrame(rows)


def tradeoff_plot(results: Path, main: pd.DataFrame, selection: pd.DataFrame | None = None) -> None:
    """``tradeoff.png``: recommendation quality against gender leakage, one panel per model on the test items
    (HR@10 change against the original model of the same seeds, paired by seed; attacker AUC by logistic
    regression, mean ± std over seeds) for the main arms and, on FedMF, the eps sweeps of the first release's FedAU²
    and of the server-trained arm; and a third panel with the eps sweep the FedNCF default eps was chosen on
    (validation item of seed :data:`~experiments.fedau2.methods.SELECTION_SEED`, ``select-eps.md``), where the
    AUC falls with eps. Also writes ``tradeoff-server.csv`` (the server arm's sweep per model)."""
    from experiments.fedau2.methods import CHOSEN_ARM, DSVAE_STREAM_ARM, NCF_SERVER_ARM, SERVER_ARM

    labels = {
        **TRADEOFF_POINTS,
        DSVAE_STREAM_ARM: "DSVAE, fixed eps 0.1, clear uploads",
        CHOSEN_ARM: "mlp, fixed eps 0.1, published prior",
    }
    sweeps = load_runs(results / "runs" / "tradeoff-server")
    curves = []
    for model, arm in (("FedMF", SERVER_ARM), ("FedNCF", NCF_SERVER_ARM)):
        swept = sweeps[sweeps["model"] == model] if not sweeps.empty else sweeps
        if not main.empty:  # eps = 1: the arm's main-table runs of the same seeds
            same = main[(main["model"] == model) & (main["attribute"] == "gender") & (main["arm"] == arm)]
            if not swept.empty:
                same = same[same["seed"].isin(swept["seed"].unique())]
            swept = pd.concat([swept, same]) if not swept.empty else same
        curves.append(swept)
    every = pd.concat([c for c in curves if not c.empty]) if any(not c.empty for c in curves) else curves[0]
    if not every.empty:
        write_csv(
            every.groupby(["model", "epsilon"])[["HR@10", "logreg-auc", "mlp-auc"]]
            .agg(["mean", "count"])
            .reset_index(),
            results / "tradeoff-server.csv",
        )  # one arm per model (methods: SERVER_ARM ...)
    if main.empty:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 6.2))
    colors = {label: f"C{i}" for i, label in enumerate(labels.values())}  # the sweeps below take C7-C9
    for axis, model in zip(axes[:2], MODELS):
        axis.axvspan(0.45, 0.55, color="green", alpha=0.08)
        axis.axhline(-5.0, color="grey", linestyle="--", linewidth=0.8)
        for arm, auc, std, change, seeds in _change_points(main, model, labels):
            # the reference point (no defence) as a larger hollow square on top, so an arm at the same spot
            # (FedMF's DSVAE arm) shows inside it instead of hiding it
            style = (
                dict(markersize=11, markerfacecolor="none", markeredgewidth=1.8, zorder=5) if arm == "original" else {}
            )
            axis.errorbar(
                auc, change, xerr=std, fmt="s", color=colors[labels[arm]], capsize=3, label=labels[arm], **style
            )
            if seeds < 3:  # the main arms ran seeds 0-2; say where fewer did
                axis.annotate(
                    f"{seeds} seed{'s' * (seeds > 1)}",
                    (auc, change),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(5, 3),
                )
        if model == "FedMF":
            gender = main[(main["model"] == "FedMF") & (main["attribute"] == "gender")]
            original = gender[gender["arm"] == "original"]
            first = load_runs(results / "runs" / "tradeoff")
            first = (
                pd.concat([first, gender[gender["arm"] == "FedAU2"]])
                if not first.empty
                else gender[gender["arm"] == "FedAU2"]
            )
            for sweep, marker, color, label, offset in (
                (first, "o-", "C8", "FedAU2 as first implemented, across eps", (3, -9)),
                (curves[0], "^-", "C9", "server-trained h_w, entropy arm, across eps (seed 1)", (5, 3)),
            ):
                curve = _eps_curve(sweep, original) if not sweep.empty else pd.DataFrame()
                if curve.empty:
                    continue
                axis.plot(curve["logreg-auc"], curve["change"], marker, color=color, alpha=0.6, label=label)
                for _, row in curve.iterrows():
                    axis.annotate(
                        f"{row['epsilon']:g}",
                        (row["logreg-auc"], row["change"]),
                        fontsize=7,
                        textcoords="offset points",
                        xytext=offset,
                        color=color,
                    )
        axis.set_title(f"{model}, test items", fontsize=10)
        axis.set_xlabel("gender attacker AUC (logistic regression)")
        axis.set_ylabel("HR@10 change vs original (%)")
    axis = axes[2]
    chosen = (
        selection[
            (selection["model"] == "FedNCF")
            & (selection["attribute"] == "gender")
            & (selection["embedding-step"] == "local")
        ]
        if selection is not None and not selection.empty
        else pd.DataFrame()
    )
    if not chosen.empty:
        seed = int(chosen["seed"].min())
        curve = chosen[chosen["seed"] == seed].sort_values("epsilon")
        axis.axvspan(0.45, 0.55, color="green", alpha=0.08, label="attacker AUC within 0.05 of 0.5")
        axis.axhline(-5.0, color="grey", linestyle="--", linewidth=0.8, label="5% HR@10 loss")
        axis.plot(
            curve["logreg-auc"],
            curve["val-HR@10-change-%"],
            "o-",
            color="C7",
            label="FedNCF default arm across eps (validation item)",
        )
        for _, row in curve.iterrows():
            axis.annotate(
                f"eps {row['epsilon']:g}" + (" (chosen)" if row["chosen"] else ""),
                (row["logreg-auc"], row["val-HR@10-change-%"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 3),
            )
        axis.set_title(f"FedNCF: eps sweep on the validation item (seed {seed})", fontsize=10)
        axis.set_xlabel("gender attacker AUC (logistic regression)")
        axis.set_ylabel("validation HR@10 change vs original (%)")
    handles, names = [], []
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            if name not in names:
                handles.append(handle)
                names.append(name)
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        "FedAU² on MovieLens-100K: recommendation quality against gender leakage (target: green band, "
        "above the dashed line)",
        fontsize=11,
    )
    save_figure(fig, results / "tradeoff.png", rect=(0, 0.14, 1, 0.96))


def stability_plot(results: Path) -> None:
    frames = []
    for path in sorted((results / "runs" / "main").glob("*/*/stability.csv")):
        frame = pd.read_csv(path)
        if frame.empty:
            continue
        config = json.loads((path.parent / "config.json").read_text())["run-config"]
        if (config.get("protected-attribute") or "gender") != "gender":
            continue
        arms = {slug(a): a for a in ARMS}
        base = path.parent.name.rsplit("-seed", 1)[0].removesuffix("-gender")
        frame["model"], frame["arm"] = path.parent.parent.name, arms.get(base, base)
        frames.append(frame)
    if not frames:
        return
    data = pd.concat(frames)
    shown = (
        "original",
        "adversarial (constant eps)",
        "FedAU2 w/o SUT",
        "FedAU2 w/o DSVAE",
        "FedAU2",
        "FedAU2, entropy objective (ours)",
        *[a for a in ARMS if a.startswith("FedAU2-server")],
    )
    metrics = (("auc", "attacker AUC"), ("balanced-accuracy", "attacker balanced accuracy"))
    plt = pyplot()
    fig, axes = plt.subplots(len(metrics), len(MODELS), figsize=(11, 7.5), sharex=True, squeeze=False)
    for row, (metric, label) in enumerate(metrics):
        for column, model in enumerate(MODELS):
            axis = axes[row][column]
            for arm in shown:
                part = data[(data["model"] == model) & (data["arm"] == arm)]
                if part.empty:
                    continue
                curve = part.groupby("round")[metric].agg(["mean", "std"]).reset_index()
                axis.plot(curve["round"], curve["mean"], marker=".", label=arm)
                axis.fill_between(
                    curve["round"],
                    curve["mean"] - curve["std"].fillna(0),
                    curve["mean"] + curve["std"].fillna(0),
                    alpha=0.15,
                )
            axis.axhline(0.5, color="grey", linestyle=":")
            axis.set_title(f"{model}: gender attacker during training")
            axis.set_ylabel(f"{label} (logistic regression)")
            if row == len(metrics) - 1:
                axis.set_xlabel("round")
    for axis in axes[0]:
        if axis.lines:
            axis.legend(fontsize=7)
    save_figure(fig, results / "stability.png")


def diagnostics_plot(results: Path, seed: int = 1) -> None:
    """``adversary-diagnostics.png``: the global ``h_w`` per round (FedMF / gender, ``seed``) for
    :data:`~experiments.fedau2.methods.DIAGNOSTICS_ARMS`: its share of users predicted "M", its balanced accuracy
    over all users, and the SUT's trigger rate per class (a collapsed adversary: share 1, balanced accuracy 0.5,
    trigger rate 1 for M and 0 for F)."""
    curves = {}
    for arm in DIAGNOSTICS_ARMS:
        name = f"{slug(arm)}-gender-seed{seed}"
        for table in ("main", "diagnostics"):
            path = results / "runs" / table / "FedMF" / name / DIAGNOSTICS_FILE
            if path.is_file():
                curves[arm] = pd.read_csv(path)
    if not curves:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for index, (arm, frame) in enumerate(curves.items()):
        color = f"C{index}"
        label = "FedAU2, per-client h_w (as first implemented)" if arm == "FedAU2" else arm
        axes[0].plot(frame["round"], frame["predicted-share-1"], color=color, label=label)
        axes[1].plot(frame["round"], frame["balanced-accuracy"], color=color, label=label)
        axes[2].plot(frame["round"], frame["trigger-rate-1"], color=color, label=f"{label}: M")
        axes[2].plot(frame["round"], frame["trigger-rate-0"], color=color, linestyle="--", label=f"{label}: F")
    for axis, title in zip(
        axes,
        (
            "share of users h_w predicts M",
            "h_w balanced accuracy (all users)",
            "h_w right per class = SUT trigger rate (solid M, dashed F)",
        ),
    ):
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("round")
        axis.set_ylim(-0.02, 1.02)
    axes[1].axhline(0.5, color="grey", linestyle=":")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"FedMF / ML-100K / gender, seed {seed}: the global adversary h_w per round", fontsize=11)
    save_figure(fig, results / "adversary-diagnostics.png")


BAND = 0.05
"""The target band: attacker AUC within 0.05 of 0.5."""


def select_epsilon(results: Path) -> pd.DataFrame:
    """Eps of :data:`~experiments.fedau2.methods.NCF_SERVER_ARM` chosen on the validation item, per model,
    from the ``select-eps`` runs (seed :data:`~experiments.fedau2.methods.SELECTION_SEED`, ``holdout-validation``).

    The rule, fixed before those runs: among the eps whose attacker AUCs on the run's protected attribute (logistic
    regression and MLP, mean over 5 halves; one-vs-rest for age) are both within :data:`BAND` of 0.5, the one with the
    highest validation HR@10 at round 100 (ties: the smaller eps); if none is, the one whose larger distance
    ``|AUC - 0.5|`` is smallest. Chosen per model, protected attribute (``protected-attribute`` of the run's config;
    gender where absent), pull's step (``adversary-embedding-optimizer``: the local Adam, or its own SGD step in
    :data:`~experiments.fedau2.methods.SGD_PULL_ARM`) and seed; the original model's run (no adversary, attacked on every attribute) is the
    reference row of every attribute with a run of the arm. Test items are not read: the table ``select-eps.md`` has
    validation metrics and attacker AUCs only. Writes ``select-eps.csv`` / ``.md``; returns the table (column
    ``chosen``)."""
    runs = []
    for summary_path in sorted((results / "runs" / "select-eps").glob("*/*/summary.json")):
        run = summary_path.parent
        if not (run / "attack.json").is_file():
            continue
        config = json.loads((run / "config.json").read_text())["run-config"]
        runs.append((run, config, config["client"] == "fedrec"))

    def variant(config) -> tuple[str, str]:
        return config.get("protected-attribute", "gender"), config.get("adversary-embedding-optimizer", "local")

    variants = {run.parent.name: set() for run, _, _ in runs}
    for run, config, original in runs:
        if not original:
            variants[run.parent.name].add(variant(config))
    rows = []
    for run, config, original in runs:
        final = json.loads((run / "summary.json").read_text())["final"]
        attack = json.loads((run / "attack.json").read_text())["attribute-inference"]
        for attribute, step in sorted(variants[run.parent.name]) if original else [variant(config)]:
            rows.append(
                {
                    "model": run.parent.name,
                    "attribute": attribute,
                    "embedding-step": step,
                    "seed": config["seed"],
                    "epsilon": 0.0 if original else config["adversary-epsilon"],
                    "val-HR@10": final.get("val-HR@10"),
                    "val-NDCG@10": final.get("val-NDCG@10"),
                    "logreg-auc": attack[f"{attribute}/logreg"]["auc"],
                    "mlp-auc": attack[f"{attribute}/mlp"]["auc"],
                }
            )
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    order = {"gender": 0, "age": 1}
    table = table.sort_values(
        ["model", "attribute", "embedding-step", "seed", "epsilon"],
        key=lambda c: c.map(order) if c.name == "attribute" else c,
    ).reset_index(drop=True)
    table["distance"] = (table[["logreg-auc", "mlp-auc"]] - 0.5).abs().max(axis=1)
    reference = ["model", "attribute", "embedding-step", "seed"]
    original = table[table["epsilon"] == 0.0].set_index(reference)["val-HR@10"]
    table["val-HR@10-change-%"] = [
        100.0 * (row["val-HR@10"] / original.get(tuple(row[reference]), np.nan) - 1.0) for _, row in table.iterrows()
    ]
    table["chosen"] = False
    for _, part in table[table["epsilon"] > 0].groupby(reference):
        inside = part[part["distance"] <= BAND]
        best = (
            inside.sort_values(["val-HR@10", "epsilon"], ascending=[False, True]).index[0]
            if not inside.empty
            else part.sort_values(["distance", "epsilon"]).index[0]
        )
        table.loc[best, "chosen"] = True
    write_csv(table, results / "select-eps.csv")
    shown = pd.DataFrame(
        {
            "model": table["model"],
            "attribute": table["attribute"],
            "pull's step": ["SGD" if e == "sgd" else "local Adam" for e in table["embedding-step"]],
            "seed": table["seed"],
            "eps": ["0 (original)" if e == 0 else f"{e:g}" for e in table["epsilon"]],
            "val HR@10": [f"{v:.4f}" for v in table["val-HR@10"]],
            "val ΔHR@10": [f"{v:+.1f}%" for v in table["val-HR@10-change-%"]],
            "val NDCG@10": [f"{v:.4f}" for v in table["val-NDCG@10"]],
            "AUC (LR)": [f"{v:.3f}" for v in table["logreg-auc"]],
            "AUC (MLP)": [f"{v:.3f}" for v in table["mlp-auc"]],
            "chosen": ["**chosen**" if c else "" for c in table["chosen"]],
        }
    )
    from experiments.fedau2.methods import NCF_SERVER_ARM, SGD_PULL_ARM

    atomic_write_text(
        results / "select-eps.md",
        "# FedAU²: eps chosen on the validation item\n\n"
        f"Arm: `{NCF_SERVER_ARM}` (pull's step: local Adam) or `{SGD_PULL_ARM}` (SGD) at each "
        "eps, trained against the row's attribute (the original "
        "model's row is the same run for every attribute, attacked on each); `holdout-validation = "
        "true` (each user's second-latest interaction held out as a validation item, ranked against 99 "
        "negatives at round 100). Rule (fixed before the runs, `report.select_epsilon`): among the eps "
        f"with both attacker AUCs on the row's attribute (one-vs-rest for age) within {BAND} of 0.5, "
        "the highest validation HR@10 (if none is, the closest to the band: then **chosen** meets no "
        "target); no test item is read. Grids: `methods.SELECTION_GRIDS` (age with the local Adam pull: "
        "only eps 0.3 ran, `methods.SELECTION_EPSILONS_BY_ATTRIBUTE`). The SGD pull against age ran on seeds 3 "
        "and 4: its choice is `select-eps-robust.md`'s two-seed rule "
        "(`report.robust_choice`); **chosen** here is the single-seed rule per seed, for the record."
        "\n\n" + markdown(shown),
    )
    return table


ROBUST_BAND = 0.04
"""The AUC band for the mean validation AUCs of several seeds: :data:`BAND` (0.05) less a 0.01 margin."""
ROBUST_MIN_CHANGE = -4.0
"""The bound on the mean validation HR@10 change (%): the 5% target less a 1-point margin."""


def robust_choice(
    table: pd.DataFrame, seeds, band: float = ROBUST_BAND, min_change: float = ROBUST_MIN_CHANGE
) -> pd.DataFrame:
    """Ours: eps chosen on the validation items of several seeds, with safety margins.

    ``table`` is :func:`select_epsilon`'s (one row per model, attribute, pull's step, seed and eps; eps 0 = the
    original model; columns ``val-HR@10``, ``logreg-auc``, ``mlp-auc``); ``seeds`` the validation seeds. Per model,
    attribute and pull's step, and per eps > 0 with a finished run on **every** seed in ``seeds`` (an eps missing on a
    seed is not eligible; the original must have run on every seed too):

    * ``mean-logreg-auc`` / ``mean-mlp-auc``: the mean over ``seeds`` of each attacker's AUC; ``distance`` the larger
      of their two ``|mean - 0.5|``;
    * ``val-HR@10-change-%``: ``100 * (mean_s val HR@10 / mean_s original's val HR@10 - 1)`` over ``seeds`` (a ratio
      of means paired by seed, as :func:`paired_change`).

    Rule: among the eps with ``distance <= band`` and ``val-HR@10-change-% >= min_change``, the highest mean
    validation HR@10 (ties: the smaller eps); ``meets-rule`` is then True. If none: among the eps with
    ``val-HR@10-change-% >= min_change``, the smallest ``distance`` (the strongest pull the HR@10 margin allows),
    else the highest mean validation HR@10; ``meets-rule`` False (the choice is then not expected to meet the
    targets). Test items are never read (``table`` has validation metrics only).

    Why (ours): one validation seed (3) alone chose eps 10 (:func:`select_epsilon`), and on the test seeds 0-2 that eps's LR AUC
    was about 0.03 above seed 3's, enough to leave the band. A seed's AUC moves that much from seed to seed, so the
    rule reads the mean over two validation seeds (3, 4; none a test seed), which halves one seed's deviation, and
    keeps a margin of 0.01 on the AUC band and of 1 point on the HR@10 loss, about that halved deviation (0.015) and
    the validation-to-test HR@10 shift of the single-seed choice (-2.4% vs -2.2%) plus the spread of one seed's
    HR@10 change. These margins were fixed before the runs of eps 15 and 20 and of seed 4, knowing the single-seed choice's published test
    outcome (that is what the rule responds to); the eps itself is ranked on validation items only.

    Returns one row per (model, attribute, embedding-step, epsilon) with the per-seed AUCs (``logreg-auc-seed<k>``,
    ``mlp-auc-seed<k>``), the means, ``distance``, ``val-HR@10-change-%``, ``meets-rule`` and ``chosen``; empty if no
    group has the original on every seed."""
    seeds = sorted(int(s) for s in seeds)
    group = ["model", "attribute", "embedding-step"]
    rows = []
    if table.empty:
        return pd.DataFrame(rows)
    for key, part in table[table["seed"].isin(seeds)].groupby(group):
        original = part[part["epsilon"] == 0.0].set_index("seed")
        if sorted(original.index) != seeds:
            continue
        for eps, runs in part[part["epsilon"] > 0].groupby("epsilon"):
            runs = runs.set_index("seed")
            if sorted(runs.index) != seeds:
                continue
            row = dict(
                zip(group, key),
                epsilon=float(eps),
                seeds=len(seeds),
                **{
                    "mean-val-HR@10": runs["val-HR@10"].mean(),
                    "original-val-HR@10": original["val-HR@10"].mean(),
                    "mean-logreg-auc": runs["logreg-auc"].mean(),
                    "mean-mlp-auc": runs["mlp-auc"].mean(),
                },
            )
            for seed in seeds:
                row[f"val-HR@10-seed{seed}"] = runs.loc[seed, "val-HR@10"]
                row[f"logreg-auc-seed{seed}"] = runs.loc[seed, "logreg-auc"]
                row[f"mlp-auc-seed{seed}"] = runs.loc[seed, "mlp-auc"]
            rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    out["val-HR@10-change-%"] = 100.0 * (out["mean-val-HR@10"] / out["original-val-HR@10"] - 1.0)
    out["distance"] = (out[["mean-logreg-auc", "mean-mlp-auc"]] - 0.5).abs().max(axis=1)
    out["meets-rule"] = (out["distance"] <= band) & (out["val-HR@10-change-%"] >= min_change)
    out["chosen"] = False
    for _, part in out.groupby(group):
        inside = part[part["meets-rule"]]
        kept = part[part["val-HR@10-change-%"] >= min_change]
        if not inside.empty:
            best = inside.sort_values(["mean-val-HR@10", "epsilon"], ascending=[False, True]).index[0]
        elif not kept.empty:
            best = kept.sort_values(["distance", "epsilon"]).index[0]
        else:
            best = part.sort_values(["mean-val-HR@10", "epsilon"], ascending=[False, True]).index[0]
        out.loc[best, "chosen"] = True
    return out.sort_values([*group, "epsilon"]).reset_index(drop=True)


def write_robust_choice(results: Path, table: pd.DataFrame) -> pd.DataFrame:
    """``select-eps-robust.csv`` / ``.md``: :func:`robust_choice` over
    :data:`~experiments.fedau2.methods.SGD_PULL_SELECTION_SEEDS` for the SGD pull against age (the other arms'
    choices stay single-seed, :func:`select_epsilon`). Returns the table (empty: nothing written)."""
    from experiments.fedau2.methods import SGD_PULL_ARM, SGD_PULL_SELECTION_SEEDS

    if table.empty:
        return table
    part = table[(table["attribute"] == "age") & (table["embedding-step"] == "sgd")]
    robust = robust_choice(part, SGD_PULL_SELECTION_SEEDS)
    if robust.empty:
        return robust
    write_csv(robust, results / "select-eps-robust.csv")
    seeds = list(SGD_PULL_SELECTION_SEEDS)
    shown = pd.DataFrame(
        {
            "model": robust["model"],
            "eps": [f"{e:g}" for e in robust["epsilon"]],
            **{f"val HR@10 seed {s}": [f"{v:.4f}" for v in robust[f"val-HR@10-seed{s}"]] for s in seeds},
            "mean val ΔHR@10": [f"{v:+.1f}%" for v in robust["val-HR@10-change-%"]],
            **{
                f"AUC LR / MLP seed {s}": [
                    f"{a:.3f} / {b:.3f}" for a, b in zip(robust[f"logreg-auc-seed{s}"], robust[f"mlp-auc-seed{s}"])
                ]
                for s in seeds
            },
            "mean AUC (LR)": [f"{v:.3f}" for v in robust["mean-logreg-auc"]],
            "mean AUC (MLP)": [f"{v:.3f}" for v in robust["mean-mlp-auc"]],
            "meets rule": ["yes" if m else "no" for m in robust["meets-rule"]],
            "chosen": ["**chosen**" if c else "" for c in robust["chosen"]],
        }
    )
    atomic_write_text(
        results / "select-eps-robust.md",
        "# FedAU²: the SGD pull's eps against age, chosen on two validation seeds\n\n"
        f"Arm: `{SGD_PULL_ARM}`; validation seeds {', '.join(map(str, seeds))} (`select-eps`, "
        "`holdout-validation = true`). Rule (ours, fixed before the runs of eps 15 and 20 and of seed 4, "
        f"`report.robust_choice`): among the eps run on every validation seed whose mean LR and mean MLP "
        f"AUCs (age, one-vs-rest) are both within {ROBUST_BAND} of 0.5 and whose validation HR@10 change "
        f"(ratio of the means over the seeds, against the original of the same seeds) is >= "
        f"{ROBUST_MIN_CHANGE:g}%, the highest mean validation HR@10; if none, the smallest AUC distance "
        "among those within the HR@10 margin (`meets rule` no: not expected to meet the targets). No "
        "test item is read.\n\n" + markdown(shown),
    )
    return robust


def protocol_check(results: Path) -> pd.DataFrame:
    """``protocol-check.csv`` / ``.md``, a diagnostic after the eps choice. Per validation
    seed, the age attacker AUCs (LR / MLP) of :data:`~experiments.fedau2.methods.PROTOCOL_CHECK_ARMS` trained with the
    test items' protocol (``runs/protocol-check/FedNCF``) next to the same seed's ``select-eps`` runs (validation
    protocol: ``holdout-validation``) of the same arms, and the HR@10 change of the arm against the original under
    each protocol (test item / validation item of that seed; seeds 3-4 are not test seeds). Returns the table (one
    row per seed and protocol; empty: nothing written)."""
    from experiments.fedau2.methods import PROTOCOL_CHECK_ARMS

    arm = PROTOCOL_CHECK_ARMS[1]
    eps = ARMS[arm]["adversary-epsilon"]
    selection = results / "runs" / "select-eps" / "FedNCF"
    selected = f"{slug(arm.rsplit(', eps', 1)[0])}-age-eps{eps:g}"  # the select-eps run name of the same arm
    rows = []
    for folder in sorted((results / "runs" / "protocol-check" / "FedNCF").glob(f"{slug(arm)}-age-seed*")):
        if not (folder / "attack.json").is_file():
            continue
        seed = int(folder.name.rsplit("-seed", 1)[1])
        pairs = {
            "test protocol": (folder, folder.parent / f"original-seed{seed}", "HR@10"),
            "validation protocol": (
                selection / f"{selected}-seed{seed}",
                selection / f"original-seed{seed}",
                "val-HR@10",
            ),
        }
        for protocol, (mine, base, metric) in pairs.items():
            if not ((mine / "attack.json").is_file() and (base / "attack.json").is_file()):
                continue
            a, b = (json.loads((p / "attack.json").read_text())["attribute-inference"] for p in (mine, base))
            hr, hr0 = (json.loads((p / "summary.json").read_text())["final"][metric] for p in (mine, base))
            rows.append(
                {
                    "seed": seed,
                    "protocol": protocol,
                    "epsilon": eps,
                    "metric": metric,
                    "HR@10": hr,
                    "HR@10-change-%": 100.0 * (hr / hr0 - 1.0),
                    "logreg-auc": a["age/logreg"]["auc"],
                    "mlp-auc": a["age/mlp"]["auc"],
                    "original-logreg-auc": b["age/logreg"]["auc"],
                    "original-mlp-auc": b["age/mlp"]["auc"],
                }
            )
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    write_csv(table, results / "protocol-check.csv")
    shown = pd.DataFrame(
        {
            "seed": table["seed"],
            "protocol": table["protocol"],
            "HR@10 (item)": [
                f"{v:.4f} ({'test' if m == 'HR@10' else 'validation'})" for v, m in zip(table["HR@10"], table["metric"])
            ],
            "ΔHR@10 vs original": [f"{v:+.1f}%" for v in table["HR@10-change-%"]],
            "AUC (LR)": [f"{v:.3f}" for v in table["logreg-auc"]],
            "AUC (MLP)": [f"{v:.3f}" for v in table["mlp-auc"]],
            "original AUC (LR / MLP)": [
                f"{a:.3f} / {b:.3f}" for a, b in zip(table["original-logreg-auc"], table["original-mlp-auc"])
            ],
        }
    )
    atomic_write_text(
        results / "protocol-check.md",
        "# FedAU²: the SGD pull at eps 10 against age, validation vs test protocol\n\n"
        f"Arm: `{arm}` and the original FedNCF on the validation seeds, trained with the test items' "
        "protocol (`protocol-check`) and with the validation protocol (`select-eps`, "
        "`holdout-validation = true`). A diagnostic after the eps choice: it chooses nothing.\n\n" + markdown(shown),
    )
    return table


def write_all(results: Path) -> None:
    selection = select_epsilon(results)
    write_robust_choice(results, selection)
    protocol_check(results)
    main = main_tables(results)
    tradeoff_plot(results, main, selection)
    stability_plot(results)
    diagnostics_plot(results)
    print(f"tables and plots written to {results}")


__all__ = ["EPSILONS", "load_runs", "robust_choice", "write_all"]
