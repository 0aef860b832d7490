"""Tables and curves of the tuning protocol, from whatever runs have finished.

Writes to ``experiments/tuning/results/``:

* ``grid-<dataset>.csv/.md``: every grid point's validation HR@10 / NDCG@10 at round 100 (seed 0) and the selection;
* ``main-<dataset>.csv/.md``: the tuned methods at round 100 and 300 (mean ± std over seeds, test metrics), the
  centralized MF and NCF at the epoch chosen on validation, popularity, and the random ranker's expected value;
  then paired-by-seed differences (SAM on - off; best federated - popularity) and the share of the
  popularity-to-centralized-NCF gap the best federated method closes;
* ``preset-<dataset>.csv/.md``: each preset (e.g. the public FedRecGEL code's wider NCF) beside its base method,
  paired by seed;
* ``curves-<dataset>.png``: test HR@10 per round of the 300-round runs, with popularity and centralized NCF drawn,
  on the full range and zoomed to the curves from round 50 on.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import fmt, markdown, pyplot, save_figure, slug, write_csv
from experiments.tuning import grid as G
from experiments.tuning.selection import row_at_round, select_epoch
from fedrec_flwr.io import atomic_write_text

KS = (5, 10, 20)
METRICS = tuple(f"{m}@{k}" for k in KS for m in ("HR", "NDCG"))


def random_ranker(num_candidates: int, ks=KS) -> dict[str, float]:
    """Expected HR@K / NDCG@K of a uniformly random ranking of the target among ``num_candidates`` items (exact:
    the target's rank is uniform on 1..C, so HR@K = K / C and NDCG@K = sum_{r<=K} 1 / (C log2(r + 1)))."""
    out = {}
    for k in ks:
        out[f"HR@{k}"] = min(k, num_candidates) / num_candidates
        out[f"NDCG@{k}"] = float(
            sum(1.0 / np.log2(r + 1) for r in range(1, min(k, num_candidates) + 1)) / num_candidates
        )
    return out


def selection_of(results: Path, dataset: str) -> dict:
    path = results / f"selection-{dataset}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def federated_rows(results: Path, dataset: str, method: str, setting: dict, rounds: int) -> list[dict]:
    """One row per seed: the test metrics at round ``rounds`` (the last) of the selected setting's run with that
    budget; seeds whose run has not reached it are left out (the table's ``seeds`` column counts the others)."""
    rows = []
    base = results / "runs" / dataset / slug(method) / f"r{rounds}"
    for seed in G.SEEDS:
        folder = base / f"{G.setting_name(setting)}-seed{seed}"
        if not (folder / "metrics.json").is_file():
            continue
        row = row_at_round(json.loads((folder / "metrics.json").read_text()), rounds)
        if row is not None:
            rows.append({"seed": seed, **{m: row[m] for m in METRICS}, "val-HR@10": row.get("val-HR@10")})
    return rows


def popularity_rows(dataset: str, data_dir: str) -> list[dict]:
    from experiments.tuning.run import split_of
    from fedrec_flwr.baselines import evaluate_popularity

    rows = []
    for seed in G.SEEDS:
        split = split_of(dataset, seed, data_dir)
        rows.append({"seed": seed, **evaluate_popularity(split, KS, "test")})
    return rows


def centralized_rows(results: Path, dataset: str, model: str) -> list[dict]:
    """One row per seed: the test metrics at the epoch chosen on validation, from the run with the largest epoch
    budget (``e<epochs>/seed<k>/``) that has finished."""
    runs: dict[int, tuple[int, Path]] = {}
    for path in (results / "runs" / dataset / f"centralized-{model}").glob("e*/seed*/summary.json"):
        seed, budget = int(path.parent.name[4:]), int(path.parent.parent.name[1:])
        if seed not in runs or budget > runs[seed][0]:
            runs[seed] = (budget, path.parent)
    rows = []
    for seed, (budget, folder) in sorted(runs.items()):
        best = select_epoch(json.loads((folder / "metrics.json").read_text()))
        rows.append({"seed": seed, "epoch": best["epoch"], "budget": budget, **{m: best[m] for m in METRICS}})
    return rows


def summarise(name: str, rows: list[dict], extra: str = "") -> dict:
    frame = pd.DataFrame(rows)
    out = {"method": name, "seeds": len(rows), "setting": extra}
    for m in METRICS:
        values = frame[m].to_numpy(float) if rows else np.array([])
        out[m] = fmt(values.mean(), values.std(ddof=1) if len(values) > 1 else float("nan")) if len(values) else "-"
        out[f"{m}-mean"] = values.mean() if len(values) else np.nan
    return out


def paired(a: list[dict], b: list[dict], key: str = "HR@10") -> str:
    """``mean ± std (n) [per-seed]`` of the per-seed difference a - b over the seeds both have."""
    bs = {r["seed"]: r[key] for r in b}
    diffs = [(r["seed"], r[key] - bs[r["seed"]]) for r in a if r["seed"] in bs]
    if not diffs:
        return "-"
    values = np.array([d for _, d in diffs])
    spread = f" ± {values.std(ddof=1):.4f}" if len(values) > 1 else ""
    return f"{values.mean():+.4f}{spread} (n={len(values)}; " + ", ".join(f"s{s}: {d:+.4f}" for s, d in diffs) + ")"


def grid_table(results: Path, dataset: str) -> None:
    selection = selection_of(results, dataset)
    rows = []
    for method, record in selection.items():
        for point in record["grid"]:
            name = G.setting_name(point["setting"])
            failed = point.get("failed", False)
            rows.append(
                {
                    "method": method,
                    "stage": point["stage"] + 1,
                    "setting": name,
                    "val-HR@10": "failed" if failed else round(point["val-HR@10"], 4),
                    "val-NDCG@10": "failed" if failed else round(point["val-NDCG@10"], 4),
                    "selected": "yes" if name == record["name"] else "",
                }
            )
    if not rows:
        return
    frame = pd.DataFrame(rows)
    write_csv(frame, results / f"grid-{dataset}.csv")
    atomic_write_text(
        results / f"grid-{dataset}.md",
        f"# {dataset}: tuning grid (seed {G.GRID_SEED}, round {G.GRID_ROUNDS}; validation item only)\n\n"
        + markdown(frame),
    )


def main_table(results: Path, dataset: str, data_dir: str) -> None:
    selection = selection_of(results, dataset)
    per: dict[tuple[str, int], list[dict]] = {}
    table = []
    for rounds in (G.GRID_ROUNDS, G.LONG_ROUNDS):
        for method in G.METHODS:
            if method not in selection:
                continue
            rows = federated_rows(results, dataset, method, selection[method]["setting"], rounds)
            per[(method, rounds)] = rows
            if rows:
                table.append({"round": rounds, **summarise(method, rows, selection[method]["name"])})
    for model, name in (("mf", "centralized MF"), ("ncf", "centralized NCF")):
        rows = centralized_rows(results, dataset, model)
        per[(name, 0)] = rows
        if rows:
            epochs = ",".join(f"{r['epoch']}/{r['budget']}" for r in rows)
            table.append(
                {
                    "round": "-",
                    **summarise(name, rows, f"Adam 0.001, batch 1024; epoch chosen on val / budget: {epochs}"),
                }
            )
    pop = popularity_rows(dataset, data_dir)
    per[("popularity", 0)] = pop
    table.append({"round": "-", **summarise("popularity", pop, "train counts")})
    table.append(
        {"round": "-", **summarise("random (expected)", [random_ranker(100)], "exact expectation"), "seeds": "-"}
    )
    frame = pd.DataFrame(table)
    write_csv(
        frame[["round", "method", "seeds", "setting", *(f"{m}-mean" for m in METRICS)]], results / f"main-{dataset}.csv"
    )
    text = [
        f"# {dataset}: test HR@K / NDCG@K, mean ± std over seeds (settings chosen on the validation item)\n",
        markdown(frame[["round", "method", "seeds", *METRICS, "setting"]]),
    ]
    lines = []
    for rounds in (G.GRID_ROUNDS, G.LONG_ROUNDS):
        gel, off = per.get(("FedRecGEL", rounds), []), per.get(("FedRecGEL w/o SAM", rounds), [])
        if gel and off:
            lines.append(f"| {rounds} | FedRecGEL - FedRecGEL w/o SAM (does SAM help?) | {paired(gel, off)} |")
        fed = [(m, per[(m, rounds)]) for m in G.METHODS if per.get((m, rounds))]
        if fed:
            best, rows = max(fed, key=lambda mr: np.mean([r["val-HR@10"] for r in mr[1]]))
            lines.append(f"| {rounds} | {best} (best federated on validation) - popularity | {paired(rows, pop)} |")
            others = [(m, r) for m, r in fed if m not in ("FedRecGEL", "FedRecGEL w/o SAM")]
            if per.get(("FedRecGEL", rounds)) and others:
                base, brows = max(others, key=lambda mr: np.mean([r["val-HR@10"] for r in mr[1]]))
                lines.append(
                    f"| {rounds} | FedRecGEL - {base} (best baseline on validation) | "
                    f"{paired(per[('FedRecGEL', rounds)], brows)} |"
                )
            ncf = per.get(("centralized NCF", 0), [])
            if ncf:
                gap = np.mean([r["HR@10"] for r in ncf]) - np.mean([r["HR@10"] for r in pop])
                got = np.mean([r["HR@10"] for r in rows]) - np.mean([r["HR@10"] for r in pop])
                lines.append(
                    f"| {rounds} | share of the popularity -> centralized NCF gap ({gap:+.4f}) closed by "
                    f"{best} | {got / gap:.2f} |"
                    if gap
                    else ""
                )
    if lines:
        text.append("\n# Paired-by-seed differences of test HR@10 (mean ± std over seeds, per seed)\n")
        text.append(
            "| round | comparison | value |\n|---|---|---|\n" + "\n".join(line for line in lines if line) + "\n"
        )
    atomic_write_text(results / f"main-{dataset}.md", "\n".join(text))
    curves(results, dataset, selection, pop, per.get(("centralized NCF", 0), []))


def preset_table(results: Path, dataset: str) -> None:
    """``preset-<dataset>.md/.csv``: each preset of :data:`grid.PRESETS` beside its base method, at round 100 and 300
    (test metrics, mean ± std over the finished seeds), and the paired-by-seed difference preset - base of HR@10 and
    NDCG@10. Nothing is written when no preset run has finished."""
    selection = selection_of(results, dataset)
    table, lines = [], []
    for preset, (base, keys) in G.PRESETS.items():
        if base not in selection:
            continue
        setting = G.preset_setting(preset, selection[base]["setting"])
        extra = ", ".join(f"{k}={v}" for k, v in keys.items() if k not in setting)
        for rounds in (G.GRID_ROUNDS, G.LONG_ROUNDS):
            ours = federated_rows(results, dataset, base, selection[base]["setting"], rounds)
            theirs = federated_rows(results, dataset, preset, setting, rounds)
            if not theirs:
                continue
            table.append({"round": rounds, **summarise(base, ours, selection[base]["name"])})
            table.append({"round": rounds, **summarise(preset, theirs, f"{G.setting_name(setting)}; {extra}")})
            for key in ("HR@10", "NDCG@10"):
                lines.append(f"| {rounds} | {preset} - {base}, {key} | {paired(theirs, ours, key)} |")
    if not table:
        return
    frame = pd.DataFrame(table)
    write_csv(
        frame[["round", "method", "seeds", "setting", *(f"{m}-mean" for m in METRICS)]],
        results / f"preset-{dataset}.csv",
    )
    atomic_write_text(
        results / f"preset-{dataset}.md",
        f"# {dataset}: presets beside their base method (test, mean ± std over seeds; the base's rates "
        "selected on the validation item)\n\n"
        + markdown(frame[["round", "method", "seeds", *METRICS, "setting"]])
        + "\n# Paired-by-seed differences (preset - base; mean ± std over seeds, per seed)\n\n"
        + "| round | comparison | value |\n|---|---|---|\n"
        + "\n".join(lines)
        + "\n",
    )


ZOOM_FROM_ROUND = 50
"""The zoomed panel of ``curves-<dataset>.png`` fits its y-axis to the curves from this round on (and to the
popularity and centralized lines): the early rounds and the random ranker would otherwise set the scale, and on
FilmTrust every tuned method lies within 0.02 HR@10 of popularity."""


def zoom_limits(
    curves: list[pd.Series],
    levels: list[float],
    from_round: int = ZOOM_FROM_ROUND,
    pad: float = 0.08,
    floor: float | None = None,
) -> tuple[float, float]:
    """y-limits ``(low, high)`` holding every curve's values at rounds >= ``from_round`` (each curve a Series indexed
    by round; a curve with no such round contributes its last value) and every level in ``levels``, widened by
    ``pad`` of that range on each side (at least 0.005, so a flat curve still gets an axis). Curve values below
    ``floor`` are left out (the caller names those curves on the panel), so one far-off method cannot flatten the
    others. Raises ``ValueError`` when there is nothing to fit."""
    values = list(levels)
    for curve in curves:
        late = curve[curve.index >= from_round].dropna()
        values.extend(late.tolist() if len(late) else curve.dropna().tolist()[-1:])
    if floor is not None:
        values = [v for v in values if v >= floor] + [v for v in levels if v < floor]
    if not values:
        raise ValueError("zoom_limits: no curve values and no levels to fit")
    low, high = float(min(values)), float(max(values))
    margin = max(pad * (high - low), 0.005)
    return low - margin, high + margin


def curves(results: Path, dataset: str, selection: dict, pop: list[dict], ncf: list[dict]) -> None:
    """Test HR@10 per round (mean ± std over the finished seeds of the longest budget of each tuned method) on two
    panels: every round on the full data range, and a zoom on rounds >= :data:`ZOOM_FROM_ROUND` scaled to the
    curves, popularity and centralized NCF (:func:`zoom_limits`; a method further below popularity than the
    popularity-to-centralized headroom, at least 0.01, is named on the zoom instead of setting its scale)."""
    plt = pyplot()
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(12, 4.6))
    drawn: list[pd.Series] = []
    last: dict[str, float] = {}
    for method in G.METHODS:
        if method not in selection:
            continue
        for rounds in (G.LONG_ROUNDS, G.GRID_ROUNDS):
            base = results / "runs" / dataset / slug(method) / f"r{rounds}"
            series = []
            for seed in G.SEEDS:
                path = base / f"{selection[method]['name']}-seed{seed}" / "metrics.json"
                if (path.parent / "summary.json").is_file():  # finished runs only
                    rows = [r for r in json.loads(path.read_text()) if "HR@10" in r]
                    series.append(pd.Series({r["round"]: r["HR@10"] for r in rows}))
            if series:
                frame = pd.concat(series, axis=1)
                mean, std = frame.mean(axis=1), frame.std(axis=1).fillna(0)
                for axis in (full, zoom):
                    color = f"C{list(G.METHODS).index(method)}"  # one colour per method on every dataset's plot
                    axis.plot(
                        mean.index,
                        mean.values,
                        marker=".",
                        color=color,
                        label=f"{method} ({len(series)} seeds, {rounds} rounds)",
                    )
                    axis.fill_between(mean.index, mean - std, mean + std, alpha=0.15, color=color)
                drawn.extend([mean - std, mean + std])
                last[method] = float(mean.iloc[-1])
                break
    if not drawn:
        plt.close(fig)
        return
    levels = []
    for rows, label, style in ((pop, "popularity", "--"), (ncf, "centralized NCF", ":")):
        if rows:
            value = float(np.mean([r["HR@10"] for r in rows]))
            levels.append(value)
            for axis in (full, zoom):
                axis.axhline(value, color="black", linestyle=style, label=f"{label} ({value:.3f})")
    full.axhline(0.1, color="grey", linestyle="-.", label="random (0.100)")
    # a method more than the popularity-to-centralized headroom below popularity is left below the zoom's axis
    floor = levels[0] - max(abs(levels[1] - levels[0]), 0.01) if len(levels) == 2 else None
    low, high = zoom_limits(drawn, levels, floor=floor)
    zoom.set_ylim(low, high)
    below = [f"{m} (last {v:.3f})" for m, v in last.items() if v < low]
    if below:
        zoom.text(0.02, 0.02, "below the axis: " + ", ".join(below), transform=zoom.transAxes, fontsize=7)
    zoom.set_xlim(left=ZOOM_FROM_ROUND - 5)
    full.set_title(f"{dataset}: tuned methods, mean ± std over seeds")
    zoom.set_title(f"zoom: rounds >= {ZOOM_FROM_ROUND}, y scaled to the curves")
    for axis in (full, zoom):
        axis.set_xlabel("round")
        axis.set_ylabel("test HR@10 (all users)")
        axis.grid(alpha=0.3)
    full.legend(fontsize=7)
    save_figure(fig, results / f"curves-{dataset}.png")


def write_all(results: Path, datasets, data_dir: str) -> None:
    for dataset in datasets:
        grid_table(results, dataset)
        main_table(results, dataset, data_dir)
        preset_table(results, dataset)
    print(f"tables written to {results}", flush=True)
