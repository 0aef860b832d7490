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

from experiments.common import fmt, markdown, mean_std, pyplot, save_figure, slug, write_csv
from experiments.hfkcu.analysis import mean_kl, membership, parameter_gap
from experiments.hfkcu.methods import ABLATIONS, DATASETS, FORGET_SETS, MODELS
from experiments.hfkcu.run import SEED as _SEED
from experiments.hfkcu.run import base_config
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


def _mia(runtime, records, arrays, users, seed: int = _SEED) -> float:
    try:
        return membership(runtime, records, arrays, users, seed)["auc"]
    except ValueError as err:  # a diverged model (e.g. gradient ascent): no attack to score
        print(f"membership inference skipped: {err}")
        return float("nan")


def collect(results: Path, data_dir: str, seed: int = _SEED) -> pd.DataFrame:
    """One row per (dataset, model, forget set, model variant) with every measure of the module docstring, for the runs
    of training seed ``seed`` under ``results``."""
    from fedrec_flwr.app.runtime import get_runtime

    rows = []
    for dataset in DATASETS:
        for model in MODELS:
            folder = results / "runs" / dataset / model
            phase_file = folder / "original" / "phase.json"
            if not phase_file.is_file():
                continue
            if not (folder / "original" / "private-records.npz").is_file():  # npz files are not committed
                print(f"skipped {folder}: its arrays (npz, never committed) are not on this machine")
                continue
            phase = json.loads(phase_file.read_text())
            runtime = get_runtime(base_config(dataset, model, data_dir, folder, "original", seed=seed).to_dict())
            for set_name in FORGET_SETS:
                users = np.asarray(phase["forget-sets"][set_name], dtype=np.int64)
                records = _records(folder / "original" / "private-records.npz", users)
                retrain_dir = folder / f"retrain-{slug(set_name)}"
                retrain = (
                    json.loads((retrain_dir / "retrain.json").read_text())
                    if (retrain_dir / "retrain.json").is_file()
                    else None
                )
                ref_arrays, ref_scores = _load_npz(retrain_dir / "retrained.npz") if retrain else (None, None)
                base = {"dataset": dataset, "model": model, "forget-set": set_name, "forgotten": int(users.size)}
                if retrain:
                    rows.append(
                        {
                            **base,
                            "variant": "retrained (gold standard)",
                            "HR@10": retrain["HR@10"],
                            "NDCG@10": retrain["NDCG@10"],
                            "seconds": retrain["train-seconds"],
                            "kl": 0.0,
                            "parameter-gap": 0.0,
                            "mia-auc": _mia(runtime, records, ref_arrays, users, seed),
                        }
                    )
                for row in phase["rows"]:
                    if row["forget-set"] != set_name:
                        continue
                    arrays, scores = _load_npz(
                        folder / "original" / "variants" / slug(set_name) / f"{slug(row['variant'])}.npz"
                    )
                    out = {
                        **base,
                        "variant": row["variant"],
                        "HR@10": row["HR@10"],
                        "NDCG@10": row["NDCG@10"],
                        "seconds": row["seconds"] if row["variant"] != "original" else float("nan"),
                        "mia-auc": _mia(runtime, records, arrays, users, seed),
                        "messages": row.get("messages"),
                        "affected-users": row.get("affected-users"),
                        "cg-iterations": row.get("cg-iterations"),
                        "cg-residual": row.get("cg-residual"),
                        "cg-negative-curvature": row.get("cg-negative-curvature"),
                        "scale": row.get("scale"),
                        "relative-update": row.get("relative-update"),
                        "MB-sent": row["bytes-sent"] / 1e6 if "bytes-sent" in row else float("nan"),
                        "cg-termination": row.get("cg-termination"),
                    }
                    if retrain:
                        out["kl"] = mean_kl(scores, ref_scores)
                        out["parameter-gap"] = parameter_gap(arrays, ref_arrays)
                    rows.append(out)
                if retrain:
                    for row in rows:
                        if row["dataset"] == dataset and row["model"] == model and row["forget-set"] == set_name:
                            row["retrain-seconds"] = retrain["train-seconds"]
                            row["speedup"] = (
                                retrain["train-seconds"] / row["seconds"]
                                if row["seconds"] and row["seconds"] == row["seconds"]
                                else float("nan")
                            )
                            row["HR@10-gap-points"] = 100 * (row["HR@10"] - retrain["HR@10"])
    return pd.DataFrame(rows)


MAIN_COLUMNS = [
    "variant",
    "HR@10",
    "NDCG@10",
    "HR@10-gap-points",
    "kl",
    "parameter-gap",
    "seconds",
    "speedup",
    "mia-auc",
]


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
    poison_report(results)
    level_report(results)
    precond_report(results)
    precond_report(results, "poison", "poison-precond.md")
    margin_report(results)
    speed_report(results)
    forget_report(results, data_dir)
    frame = collect(results, data_dir)
    if frame.empty:
        print("no finished runs of `main` with their arrays here (main.md left as it is)")
        return
    ablations = frame["variant"].isin(ABLATIONS)
    main = frame[~ablations]
    write_csv(main, results / "main.csv")
    lines = [
        "# HF-KCU: unlearning against retraining (seed 0; generated by `python -m experiments.hfkcu.run report`)",
        "",
        "Time: phase wall time; retrained: its 100 rounds' training time. Speedup = retraining time / time. "
        "KL and parameter gap are against the retrained model. MIA AUC: membership inference on the forgotten "
        "users (0.5 = undetectable).",
        "",
    ]
    for (dataset, model, set_name), block in main.groupby(["dataset", "model", "forget-set"], sort=False):
        lines += [
            f"## {dataset}, {model}, forget {set_name} ({int(block['forgotten'].iloc[0])} users)",
            "",
            markdown(_table(block)),
            "",
        ]
    atomic_write_text(results / "main.md", "\n".join(lines))
    if ablations.any():
        ablation = frame[
            ablations
            | (
                (
                    frame["variant"].isin(
                        ["HF-KCU distributed CG", "HF-KCU local CG (Alg. 1)", "retrained (gold standard)", "original"]
                    )
                )
                & frame.set_index(["dataset", "forget-set"]).index.isin(
                    frame[ablations].set_index(["dataset", "forget-set"]).index.unique()
                )
            )
        ]
        write_csv(ablation, results / "ablation.csv")
        lines = ["# HF-KCU ablations (generated by `python -m experiments.hfkcu.run report`)", ""]
        for (dataset, model, set_name), block in ablation.groupby(["dataset", "model", "forget-set"], sort=False):
            extra = block[
                ["variant", "cg-iterations", "cg-residual", "cg-negative-curvature", "scale", "relative-update"]
            ].copy()
            lines += [
                f"## {dataset}, {model}, forget {set_name}",
                "",
                markdown(_table(block)),
                "",
                markdown(extra.fillna("-")),
                "",
            ]
        atomic_write_text(results / "ablation.md", "\n".join(lines))
    plot(main, results)
    print(f"wrote {results / 'main.md'}")


DEFAULT_VARIANT = "HF-KCU distributed (default)"
LINE_SEARCH_VARIANT = "HF-KCU distributed, line search on L_R"
MARGIN_VARIANT = "HF-KCU distributed, membership margin"
ACCEPTANCE_VARIANTS = (DEFAULT_VARIANT, LINE_SEARCH_VARIANT, MARGIN_VARIANT)
"""The variants whose acceptance is tabulated side by side: the fixed trust radius, the line search and the
membership-margin step."""
ACCEPT = {"closed": 0.70, "overshoot": 0.10, "hr-points": 1.0, "speedup": 10.0}
"""The poisoning acceptance at the defaults: close >= 70% of the original -> retrained gap in target percentile, never
overshoot past retrained by more than 10% of the gap, HR@10 within 1 point of retrained, >= 10x faster."""


def _poison_rows(folder: Path) -> list[dict]:
    rows = []
    for original in sorted(folder.glob("*/*/fakes-*/seed-*/original")):
        setting = original.parent
        dataset, model = setting.parts[-4], setting.parts[-3]
        fakes, seed = int(setting.parts[-2].split("-")[1]), int(setting.parts[-1].split("-")[1])
        retrain_file = setting / "retrain-fake-users" / "retrain.json"
        phase_file = original / "phase.json"
        if not (phase_file.is_file() and retrain_file.is_file()):
            continue
        retrain = json.loads(retrain_file.read_text())
        variants = json.loads(phase_file.read_text())["rows"]
        for extra in sorted(original.glob("*.json")):
            if extra.name not in ("phase.json", "summary.json", "metrics.json", "config.json"):
                data = json.loads(extra.read_text())  # replays: {"rows": [...]}; other diagnostics are skipped
                rows_of = data.get("rows", []) if isinstance(data, dict) else []
                variants += [r for r in rows_of if isinstance(r, dict) and r.get("variant", "original") != "original"]
        first: dict[str, dict] = {}  # a variant replayed twice (in replay.json and a by-name replay) counts once:
        # phase.json's row, else the first replay file's in name order (the same phase; only its seconds differ)
        for row in variants:
            first.setdefault(row["variant"], row)
        variants = list(first.values())
        base = {"dataset": dataset, "model": model, "fakes": fakes, "seed": seed}
        before = next(r for r in variants if r["variant"] == "original")
        gap = before["target-percentile"] - retrain["target-percentile"]
        for row in variants + [
            {**retrain, "variant": "retrained without fake users", "seconds": retrain["train-seconds"]}
        ]:
            value = row["target-percentile"]
            rows.append(
                {
                    **base,
                    "variant": row["variant"],
                    "target-percentile": value,
                    "exposure": row["exposure"],
                    "HR@10": row["HR@10"],
                    "NDCG@10": row["NDCG@10"],
                    "closed": (before["target-percentile"] - value) / gap if gap else float("nan"),
                    "overshoot": max(retrain["target-percentile"] - value, 0.0) / gap if gap else float("nan"),
                    "HR@10-minus-retrained": 100 * (row["HR@10"] - retrain["HR@10"]),
                    "seconds": row["seconds"] if row["variant"] != "original" else float("nan"),
                    "speedup": retrain["train-seconds"] / row["seconds"] if row.get("seconds") else float("nan"),
                    "messages": row.get("messages", float("nan")),
                    "MB-sent": row.get("bytes-sent", float("nan")) / 1e6,
                    "MB-received": row.get("bytes-received", float("nan")) / 1e6,
                    "preconditioner-MB": (
                        row.get("preconditioner-bytes-sent", float("nan"))
                        + row.get("preconditioner-bytes-received", float("nan"))
                    )
                    / 1e6,
                    "cg-iterations": row.get("cg-iterations", float("nan")),
                    "termination": row.get("cg-termination", ""),
                    "line-search": (
                        f"{row['line-search-step']:.3g} ({row['line-search-termination']}, "
                        f"{row['line-search-rounds']} rounds)"
                        if "line-search-step" in row
                        else ""
                    ),
                    "margin": (
                        f"{row['margin-step']:.3g} ({row['margin-termination']}, {row['margin-rounds']} "
                        f"rounds, {row.get('margin-dominated-items', 0)} dominated)"
                        if "margin-step" in row
                        else ""
                    ),
                    "dropped": row.get("local-cg-dropped", float("nan")),
                }
            )
    return rows


def poison_report(results: Path) -> None:
    """``poison.csv`` / ``poison.md`` (every setting, variant and seed; mean ± std over seeds) and
    ``poison-acceptance.md`` (the :data:`ACCEPT` criteria for the default variant, per setting)."""
    rows = _poison_rows(results / "runs" / "poison")
    if not rows:
        return
    frame = pd.DataFrame(rows)
    write_csv(frame, results / "poison.csv")
    keys = ["dataset", "model", "fakes", "variant"]
    columns = [
        "target-percentile",
        "closed",
        "overshoot",
        "HR@10",
        "HR@10-minus-retrained",
        "seconds",
        "speedup",
        "MB-sent",
    ]
    summary = mean_std(frame, keys, columns)
    shown = summary[keys + ["seeds"]].copy()
    for column in columns:
        digits = 1 if column in ("seconds", "speedup", "MB-sent", "HR@10-minus-retrained") else 3
        shown[column] = [fmt(m, s, digits) for m, s in zip(summary[f"{column}-mean"], summary[f"{column}-std"])]
    lines = [
        "# Poisoning removal (generated by `python -m experiments.hfkcu.run report`)",
        "",
        "Fake users rate one unpopular target item and the 10 most popular items. target-percentile: the mean "
        "share of a genuine user's never-rated items that the target outscores (0.5 = an average item); closed: "
        "(original - variant) / (original - retrained) of it; overshoot: how far below the retrained value, as "
        "a share of that gap; HR@10 of the genuine users; seconds: phase wall time (retrained: its 100 rounds' "
        "training time); speedup over retraining; MB sent by the server in the phase (every query re-sends "
        "the model). Mean ± std over the seeds run.",
        "",
        markdown(shown),
    ]
    atomic_write_text(results / "poison.md", "\n".join(lines))

    accept, met = [], {}
    for (dataset, model, fakes, seed), block in frame.groupby(["dataset", "model", "fakes", "seed"], sort=True):
        for variant in ACCEPTANCE_VARIANTS:
            chosen = block[block["variant"] == variant]
            if chosen.empty:
                continue
            row = chosen.iloc[0]
            checks = {
                "closed": row["closed"] >= ACCEPT["closed"],
                "overshoot": row["overshoot"] <= ACCEPT["overshoot"],
                "hr": abs(row["HR@10-minus-retrained"]) <= ACCEPT["hr-points"],
                "speedup": row["speedup"] >= ACCEPT["speedup"],
            }
            counts = met.setdefault(variant, {"settings": 0, "all": 0, **{k: 0 for k in checks}})
            counts["settings"] += 1
            counts["all"] += int(all(checks.values()))
            for key, ok in checks.items():
                counts[key] += int(ok)
            accept.append(
                {
                    "dataset": dataset,
                    "model": model,
                    "fakes": fakes,
                    "seed": seed,
                    "variant": variant,
                    "original": f"{block[block['variant'] == 'original'].iloc[0]['target-percentile']:.3f}",
                    "retrained": f"{block[block['variant'].str.startswith('retrained')].iloc[0]['target-percentile']:.3f}",
                    "unlearned": f"{row['target-percentile']:.3f}",
                    "closed >= 0.70": f"{row['closed']:.2f} {'yes' if checks['closed'] else 'NO'}",
                    "overshoot <= 0.10": f"{row['overshoot']:.2f} {'yes' if checks['overshoot'] else 'NO'}",
                    "|HR@10 - retrained| <= 1 pt": f"{row['HR@10-minus-retrained']:+.2f} "
                    f"{'yes' if checks['hr'] else 'NO'}",
                    "speedup >= 10x": f"{row['speedup']:.1f} {'yes' if checks['speedup'] else 'NO'}",
                    "solve ended by": row["termination"],
                    "line search": row.get("line-search", "") or row.get("margin", ""),
                }
            )
    if accept:
        summary_lines = [
            f"- {variant!r}: all four criteria met in {c['all']} of {c['settings']} settings (closed "
            f"{c['closed']}, overshoot {c['overshoot']}, HR@10 {c['hr']}, speedup {c['speedup']})"
            for variant, c in met.items()
        ]
        atomic_write_text(
            results / "poison-acceptance.md",
            "\n".join(
                [
                    "# Poisoning acceptance per setting (generated)",
                    "",
                    f"Variants: {', '.join(repr(v) for v in ACCEPTANCE_VARIANTS)}. {DEFAULT_VARIANT!r} is the fixed trust "
                    'radius (`line-search = "none"`, the run config\'s defaults); the line search chooses the multiple of '
                    "the same trust-region step that minimises the remaining users' summed training loss "
                    '(`line-search = "remaining-loss"`); the membership margin scales it until the forgotten users\' mean '
                    'margin on the items they dominate reaches 0 (`line-search = "membership-margin"`, `poison-margin.md`). '
                    "Speedup: retraining's training seconds over the phase's wall "
                    "seconds, both on the same shared 2-core machine, but not at the same load: replayed phases "
                    "(`replay*.json`) ran when the replay did, and the machine's load varied 2-6x while they ran; "
                    "`runs/poison-retime/*/retrain-rate.json` compares both arms with retraining at one load. line search: "
                    "the chosen multiple and how the search ended. Step rules tried after this table (a loss level, the share "
                    "of data: `poison-level.md`) and FedNCF's faster solves (`cg-iterations` 1-2, `curvature-sample`: "
                    "`runs/poison-retime/*/FedNCF/fakes-100/seed-0/retime-{capped,sampled}*.json`) did not change the "
                    "default; see `../README.md`.",
                    "",
                    *summary_lines,
                    "",
                    markdown(pd.DataFrame(accept).fillna("")),
                ]
            ),
        )


def _crossing(steps, values, level) -> float | None:
    """The first ``a`` at which the piecewise-linear ``values(steps)`` crosses ``level`` (``None`` if never)."""
    for (a0, v0), (a1, v1) in zip(zip(steps, values), zip(steps[1:], values[1:])):
        if (v0 - level) * (v1 - level) <= 0 and v1 != v0:
            return a0 + (level - v0) * (a1 - a0) / (v1 - v0)
    return None


def _rating_share(results: Path, dataset: str, fakes: int, target_seed: int) -> float:
    """The fake users' share of all ratings of the poisoned data: from the cached poisoned CSV, rebuilt from the
    dataset under ``$FEDREC_DATA_DIR`` where the cache is gone (NaN where neither is on this machine)."""
    from experiments.hfkcu.poison import FAKE_USER_BASE, poisoned_data

    cache = results.parent / ".cache"
    path = cache / f"{dataset}-poisoned-{fakes}-target{target_seed}.csv"
    if not path.is_file():
        try:
            path, _ = poisoned_data(dataset, "", fakes, target_seed, cache)
        except OSError:
            return float("nan")
    users = pd.read_csv(path, usecols=["user"])["user"].to_numpy()
    return float(np.mean(users >= FAKE_USER_BASE))


def level_report(results: Path) -> None:
    """``poison-level.md`` from ``poison-level`` (:func:`experiments.hfkcu.poison.level_probe`): for every setting
    (development and reported), the forgotten users' loss per example along the default step against the retrained
    model's level, where along the step the target reaches the retrained percentile (``a`` target, read from the
    target: a diagnostic, never a rule), and the share-of-data rule ``a = c * share^p`` fitted on the development
    settings only, with its in-sample outcome there."""
    rows = []
    for kind in ("poison-dev", "poison"):
        for path in sorted((results / "runs" / kind).glob("*/*/fakes-*/seed-*/original/level-default.json")):
            setting = path.parent.parent
            data = json.loads(path.read_text())
            along = data["along"]
            steps = [r["a"] for r in along]
            percentiles = [r["target-percentile"] for r in along]
            original, retrained = percentiles[0], data["retrained"]["target-percentile"]
            gap = original - retrained
            dataset, fakes = setting.parts[-4], int(setting.parts[-2].split("-")[1])
            seed = int(setting.parts[-1].split("-")[1])
            oracle = data.get("target-percentile-at-retrained-level")
            refs = data["references-at-0"]
            rows.append(
                {
                    "set": "dev" if kind == "poison-dev" else "reported",
                    "dataset": dataset,
                    "model": setting.parts[-3],
                    "fakes": fakes,
                    "seed": seed,
                    "rating share": _rating_share(results, dataset, fakes, 100 if kind == "poison-dev" else 0),
                    "L_F(0)": along[0]["forgotten-loss-per-example"],
                    "L_F retrained": data["retrained"]["forgotten-loss-per-example"],
                    "L_R per example": refs["remaining-loss-per-example"],
                    "held-out positive (test items; diagnostic)": refs["remaining-held-out-positive-loss"],
                    "a at retrained L_F": data.get("retrained-level-multiple"),
                    "closed there": (original - oracle) / gap if oracle is not None and gap else float("nan"),
                    "a at L_F = L_R per example": _crossing(
                        steps, [r["forgotten-loss-per-example"] for r in along], refs["remaining-loss-per-example"]
                    ),
                    "a target (reads the target)": _crossing(steps, percentiles, retrained),
                    "closed at a = 1 (default)": (original - percentiles[steps.index(1.0)]) / gap
                    if gap
                    else float("nan"),
                    "_steps": steps,
                    "_percentiles": percentiles,
                    "_gap": gap,
                }
            )
    if not rows:
        return
    dev = [
        r
        for r in rows
        if r["set"] == "dev"
        and r["model"] == "FedMF"
        and r["a target (reads the target)"]
        and r["rating share"] == r["rating share"]
    ]
    fit_lines = []
    if len(dev) >= 2:
        slope, intercept = np.polyfit(
            np.log([r["rating share"] for r in dev]), np.log([r["a target (reads the target)"] for r in dev]), 1
        )
        fit_lines.append(
            f"Share-of-data rule fitted on the {len(dev)} development settings (least squares in "
            f"log-log): a = {np.exp(intercept):.2f} * share^{slope:.2f}. In-sample outcome (closed share "
            "of the gap, interpolated along each development ladder):"
        )
        for r in dev:
            a = float(np.exp(intercept) * r["rating share"] ** slope)
            pct = float(np.interp(a, r["_steps"], r["_percentiles"]))
            fit_lines.append(
                f"- {r['dataset']} {r['fakes']} fakes: a = {a:.2f}, closed "
                f"{(r['_percentiles'][0] - pct) / r['_gap']:.2f}"
            )
        fit_lines.append(
            "The same fitted rule on the reported FedMF settings (out of sample; interpolated along each "
            "ladder, not run as a phase):"
        )
        for r in rows:
            if r["set"] == "reported" and r["model"] == "FedMF" and r["rating share"] == r["rating share"]:
                a = float(np.exp(intercept) * r["rating share"] ** slope)
                pct = float(np.interp(a, r["_steps"], r["_percentiles"]))
                fit_lines.append(
                    f"- {r['dataset']} {r['fakes']} fakes seed {r['seed']}: a = {a:.2f}, closed "
                    f"{(r['_percentiles'][0] - pct) / r['_gap']:.2f}"
                )
    table = pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows])
    for column in table.columns:
        if table[column].dtype.kind == "f" or table[column].dtype == object:
            table[column] = table[column].map(
                lambda v: (
                    "-" if v is None or (isinstance(v, float) and v != v) else f"{v:.3f}" if isinstance(v, float) else v
                )
            )
    atomic_write_text(
        results / "poison-level.md",
        "\n".join(
            [
                "# Does a loss level or the share of data say how far to step? (generated)",
                "",
                "From `python -m experiments.hfkcu.run poison-level` (every cached snapshot; seed 100 = development). Along "
                "the default step x (trust radius 0.015): the forgotten users' mean influence loss per example L_F(theta + a "
                "x) (BCE over their training positives and fixed negatives); 'L_F retrained': the same at the model retrained "
                "without them (their own embeddings); 'a at retrained L_F': where along the step L_F reaches that level (an "
                "oracle level rule) and the share of the percentile gap closed there; 'a at L_F = L_R per example': the "
                "admissible reference (the remaining users' training loss per example); 'a target': where the target "
                "reaches the retrained percentile (reads the target: a diagnostic, never a rule); 'closed at a = 1': the "
                "default. rating share: the fakes' share of all ratings.",
                "",
                *fit_lines,
                "",
                markdown(table),
            ]
        ),
    )


def forget_report(results: Path, data_dir: str) -> None:
    """``forget.md`` / ``forget.csv``: the random forget sets (``run.py forget``), one section per seed run,
    with the same measures as ``main.md`` plus the megabytes the phase sent."""
    lines = [
        "# Random forget sets at the defaults (generated by `python -m experiments.hfkcu.run report`)",
        "",
        "As `main.md`: KL and parameter gap against the retrained model, MIA AUC = membership inference on the "
        "forgotten users (compare with the retrained model's, not 0.5); MB-sent: megabytes the server sent in "
        "the phase (every query re-sends the model).",
        "",
    ]
    frames = []
    previous = pd.read_csv(results / "forget.csv") if (results / "forget.csv").is_file() else pd.DataFrame()
    for seed_dir in sorted((results / "forget").glob("seed-*")):
        seed = int(seed_dir.name.split("-")[1])
        frame = collect(seed_dir, data_dir, seed)
        if not previous.empty:  # runs whose arrays (never committed) are not here keep their committed rows
            done = (
                set(map(tuple, frame[["dataset", "model"]].drop_duplicates().to_numpy())) if not frame.empty else set()
            )
            kept = previous[
                (previous["seed"] == seed)
                & np.array([(d, m) not in done for d, m in zip(previous["dataset"], previous["model"])])
            ]
            frame = pd.concat([kept.drop(columns="seed"), frame], ignore_index=True)
        if frame.empty:
            continue
        frame.insert(0, "seed", seed)
        frames.append(frame)
        for (dataset, model, set_name), block in frame.groupby(["dataset", "model", "forget-set"], sort=False):
            table = _table(block)
            table["MB-sent"] = (
                block["MB-sent"].map(lambda v: "-" if v != v else f"{v:.1f}") if "MB-sent" in block else "-"
            )
            lines += [
                f"## {seed_dir.name}, {dataset}, {model}, forget {set_name} ({int(block['forgotten'].iloc[0])} users)",
                "",
                markdown(table),
                "",
            ]
    if frames:
        every = pd.concat(frames)
        write_csv(every, results / "forget.csv")
        lines = lines[:4] + _forget_summary(every) + lines[4:]
        atomic_write_text(results / "forget.md", "\n".join(lines))


def _forget_summary(frame: pd.DataFrame) -> list[str]:
    """Mean ± std over the seeds run of KL to the retrained model, membership AUC and its absolute distance to the
    retrained model's AUC of the same seed (``mia-auc-gap-to-retrained``; both should move toward the
    retrained model's), HR@10 / NDCG@10 and speedup."""
    frame = frame.copy()
    reference = frame[frame["variant"] == "retrained (gold standard)"].set_index(
        ["seed", "dataset", "model", "forget-set"]
    )["mia-auc"]
    frame["mia-auc-gap-to-retrained"] = [
        abs(
            row["mia-auc"] - reference.get((row["seed"], row["dataset"], row["model"], row["forget-set"]), float("nan"))
        )
        for _, row in frame.iterrows()
    ]
    keys = ["dataset", "model", "forget-set", "variant"]
    columns = ["kl", "mia-auc", "mia-auc-gap-to-retrained", "HR@10", "NDCG@10", "speedup"]
    summary = mean_std(frame, keys, columns)
    shown = summary[keys + ["seeds"]].copy()
    for column in columns:
        digits = {"kl": 6, "speedup": 1}.get(column, 4)
        shown[column] = [fmt(m, sd, digits) for m, sd in zip(summary[f"{column}-mean"], summary[f"{column}-std"])]
    return ["## Mean ± std over the seeds run", "", markdown(shown), ""]


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
            axis.scatter(
                max(row["seconds"], 1e-2),
                row["HR@10"],
                marker=marker,
                s=90 if marker == "*" else 40,
                label=row["variant"],
            )
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
        block["gap"] = [
            row["mia-auc"] - reference.get((row["dataset"], row["model"]), np.nan) for _, row in block.iterrows()
        ]
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


def _radius_arm(variant: str) -> tuple[str, float] | None:
    """``("euclidean" | "diagonal" | "row", radius)`` of a :data:`experiments.hfkcu.poison.DEV_PRECONDITIONED` name."""
    words = variant.replace(" (default)", "").split()
    if len(words) == 5 and words[:2] == ["steihaug", "GN"] and words[3] == "radius":
        return words[2], float(words[4])
    return None


def precond_report(results: Path, folder: str = "poison-dev", out_name: str = "poison-precond-dev.md") -> None:
    """``<out_name>``: the preconditioned trust-region solve (``krylov-preconditioner``) against the Euclidean one at
    the radii of :data:`experiments.hfkcu.poison.PRECONDITIONED_RADII`, per setting of ``runs/<folder>``: target
    percentile, share of the gap closed, overshoot, HR@10 against retrained, phase time and bytes; per arm the radius
    at which the target reaches the retrained percentile (interpolated along the radii; its spread across settings
    is what a single default radius must cover) and how many settings each radius meets (closed >= 0.70, overshoot
    <= 0.10, |HR@10 - retrained| <= 1 pt; speed is reported, not counted, on the development settings)."""
    rows = [r for r in _poison_rows(results / "runs" / folder) if _radius_arm(r["variant"])]
    if not rows:
        return
    frame = pd.DataFrame(rows).drop_duplicates(["dataset", "model", "fakes", "seed", "variant"])
    frame["arm"] = [_radius_arm(v)[0] for v in frame["variant"]]
    frame["radius"] = [_radius_arm(v)[1] for v in frame["variant"]]
    frame["met"] = (
        (frame["closed"] >= ACCEPT["closed"])
        & (frame["overshoot"] <= ACCEPT["overshoot"])
        & (frame["HR@10-minus-retrained"].abs() <= ACCEPT["hr-points"])
    )
    frame = frame.sort_values(["dataset", "model", "fakes", "seed", "arm", "radius"])
    settings = frame.groupby(["dataset", "model", "fakes", "seed"], sort=True)
    needed = []
    for (dataset, model, fakes, seed), block in settings:
        line = {"setting": f"{dataset} {model} {fakes} fakes seed {seed}"}
        for arm, part in sorted(block.groupby("arm"), key=lambda item: item[0] != "euclidean"):
            part = part.drop_duplicates("radius").sort_values("radius")
            closed = part["closed"].tolist()
            radii = part["radius"].tolist()
            r = _crossing(radii, closed, 1.0)
            line[f"{arm}: radius reaching retrained"] = (
                f"{r:.4f}" if r is not None else (f"> {radii[-1]}" if closed[-1] < 1 else f"< {radii[0]}")
            )
        needed.append(line)
    counts = frame.groupby(["arm", "radius"])["met"].agg(["sum", "count"]).reset_index()
    counts["settings met"] = [f"{int(s)} of {int(c)}" for s, c in zip(counts["sum"], counts["count"])]
    shown = frame[
        [
            "dataset",
            "model",
            "fakes",
            "seed",
            "arm",
            "radius",
            "target-percentile",
            "closed",
            "overshoot",
            "HR@10-minus-retrained",
            "seconds",
            "MB-sent",
            "MB-received",
            "preconditioner-MB",
            "cg-iterations",
            "termination",
            "met",
        ]
    ].copy()
    for column in ("target-percentile", "closed", "overshoot"):
        shown[column] = shown[column].map(lambda v: f"{v:.3f}")
    shown["HR@10-minus-retrained"] = shown["HR@10-minus-retrained"].map(lambda v: f"{v:+.2f}")
    for column in ("seconds", "MB-sent", "MB-received", "preconditioner-MB"):
        shown[column] = shown[column].map(lambda v: "" if v != v else f"{v:.1f}")
    atomic_write_text(
        results / out_name,
        "\n".join(
            [
                "# Preconditioned trust region (krylov-preconditioner) vs the Euclidean one (generated)",
                "",
                f'Settings: `runs/{folder}`. Arms: euclidean (`krylov-preconditioner = "none"`, the default at radius '
                "0.015), diagonal (trust region in the M-norm, M = the remaining users' Gauss-Newton diagonal, floored at "
                "1% of its mean, scaled to mean 1 over the touched entries), row (M's mean per item row). met: closed >= "
                "0.70, overshoot <= 0.10 and |HR@10 - retrained| <= 1 pt (speed is not counted here). The radius reaching "
                "retrained: where the target's closed share crosses 1, interpolated linearly between the radii tried. MB: "
                "the phase's bytes sent / received by the server (every query re-sends the model); preconditioner-MB: the "
                "`unlearn_diagonal` round's share of them (sent + received; each node replies one row-sparse sum).",
                "",
                "## Radius at which the target reaches the retrained percentile",
                "",
                markdown(pd.DataFrame(needed)),
                "",
                "## Settings met per arm and radius",
                "",
                markdown(counts[["arm", "radius", "settings met"]]),
                "",
                "## Every run",
                "",
                markdown(shown),
            ]
        ),
    )


def margin_report(results: Path) -> None:
    """``poison-margin.md``: the membership-margin step (``line-search = "membership-margin"``) against the default
    (fixed radius) on the development settings (``runs/poison-dev``, ``margin-*.json``) and on the reported ones
    (``runs/poison``), per setting: target percentile, closed share, overshoot, HR@10 against retrained, the chosen
    multiple of the default step and how the search ended, phase seconds; and how many settings each arm meets
    (closed >= 0.70, overshoot <= 0.10, |HR@10 - retrained| <= 1 pt; speed is reported, not counted: the phases ran
    at other loads than the retraining, see ``runs/poison-retime/*/retime-margin-rate.json``)."""
    tables, counts = [], []
    for folder in ("poison-dev", "poison"):
        rows = [r for r in _poison_rows(results / "runs" / folder) if r["variant"] in (DEFAULT_VARIANT, MARGIN_VARIANT)]
        if not rows:
            continue
        frame = pd.DataFrame(rows).drop_duplicates(["dataset", "model", "fakes", "seed", "variant"])
        frame["met"] = (
            (frame["closed"] >= ACCEPT["closed"])
            & (frame["overshoot"] <= ACCEPT["overshoot"])
            & (frame["HR@10-minus-retrained"].abs() <= ACCEPT["hr-points"])
        )
        frame["set"] = "development" if folder == "poison-dev" else "reported"
        tables.append(frame)
        for variant, block in frame.groupby("variant"):
            counts.append(
                {
                    "set": frame["set"].iloc[0],
                    "arm": variant,
                    "settings met": f"{int(block['met'].sum())} of {len(block)}",
                }
            )
    if not tables:
        return
    frame = pd.concat(tables).sort_values(["set", "dataset", "model", "fakes", "seed", "variant"])
    shown = frame[
        [
            "set",
            "dataset",
            "model",
            "fakes",
            "seed",
            "variant",
            "target-percentile",
            "closed",
            "overshoot",
            "HR@10-minus-retrained",
            "margin",
            "seconds",
            "MB-sent",
            "met",
        ]
    ].copy()
    for column in ("target-percentile", "closed", "overshoot"):
        shown[column] = shown[column].map(lambda v: f"{v:.3f}")
    shown["HR@10-minus-retrained"] = shown["HR@10-minus-retrained"].map(lambda v: f"{v:+.2f}")
    for column in ("seconds", "MB-sent"):
        shown[column] = shown[column].map(lambda v: "" if v != v else f"{v:.1f}")
    atomic_write_text(
        results / "poison-margin.md",
        "\n".join(
            [
                "# Membership-margin step vs the fixed radius (generated)",
                "",
                "Arms: 'HF-KCU distributed (default)' (Steihaug CG, Gauss-Newton, trust radius 0.015, `line-search = "
                '"none"`) and \'HF-KCU distributed, membership margin\' (`line-search = "membership-margin"`: the same '
                "step times the multiple a at which the forgotten users' mean logit margin on the items they dominate, over "
                "the same-popularity items they never rated, reaches 0; `fedrec_flwr/unlearning/margin.py`). margin: a, how "
                "the search ended, its query rounds and the dominated items. met: closed >= 0.70, overshoot <= 0.10, "
                "|HR@10 - retrained| <= 1 pt (speed reported, not counted). Development: seed and target 100 "
                '(`poison-dev-margin`); reported: the acceptance settings (`poison-replay --only "membership margin"`).',
                "",
                markdown(pd.DataFrame(counts)),
                "",
                markdown(shown.fillna("")),
            ]
        ),
    )


SPEED_RUNS = {
    "retrain-rate.json": "per-user training, 10 rounds timed",
    "retime-margin-run1-rate.json": "block training, loaded, run 1 (margin scored one user at a time)",
    "retime-margin-rate.json": "block training, loaded, run 2",
    "retime-repeated-rate.json": "block training, loaded, run 3 (median of 3 phases per arm)",
}
"""``runs/poison-retime`` files of :func:`speed_report` and what each run was (seed 0, 100 fakes)."""

IDLE_RUN = "block training, idle machine (median of 3 phases per arm)"
"""The ``retime-repeated`` runs of seed 1 (a setting of its own) on the otherwise idle machine."""


def speed_report(results: Path) -> None:
    """``poison-speed.md``: each arm's phase seconds against the whole retraining's training seconds measured in the
    same process right after the phases (``poison-retime``), per setting and run; repeated phases (``..., repeat
    i``) are summarised by their median. Speedup = retraining's training seconds / phase wall seconds."""
    lines = []
    for path in sorted((results / "runs" / "poison-retime").glob("*/*/fakes-*/seed-*/*.json")):
        if path.name not in SPEED_RUNS:
            continue
        data = json.loads(path.read_text())
        dataset, model = path.parts[-5], path.parts[-4]
        fakes, seed = int(path.parts[-3].split("-")[1]), int(path.parts[-2].split("-")[1])
        retrain = data["retrain-estimate-seconds"]
        arms: dict[str, list] = {}
        for name, phase in data["phases"].items():
            if "warm-up" in name or "cg-iterations" in name or "curvature-sample" in name:
                continue
            arm = "membership margin" if "margin" in name else ("line search" if "line search" in name else "default")
            arms.setdefault(arm, []).append(phase["seconds"])
        run = SPEED_RUNS[path.name] if seed == 0 else IDLE_RUN  # seed 0: the loaded machine's setting
        row = {
            "dataset": dataset,
            "model": model,
            "fakes": fakes,
            "seed": seed,
            "run": run,
            "retraining s (rounds timed)": f"{retrain:.1f} ({data['rounds-trained']})",
        }
        for arm in ("default", "membership margin", "line search"):
            if arm in arms:
                seconds = float(np.median(arms[arm]))
                row[f"{arm}: s"] = f"{seconds:.1f}" + (
                    f" ({min(arms[arm]):.1f}-{max(arms[arm]):.1f})" if len(arms[arm]) > 1 else ""
                )
                row[f"{arm}: speedup"] = f"{retrain / seconds:.1f}x"
        lines.append(row)
    if not lines:
        return
    frame = pd.DataFrame(lines).sort_values(["model", "dataset", "run"]).fillna("")
    atomic_write_text(
        results / "poison-speed.md",
        "\n".join(
            [
                "# Phase time against retraining at one load (generated)",
                "",
                "From `python -m experiments.hfkcu.run poison-retime`: each run replays the arms on the saved federation "
                "and then trains the retraining run in the same process (`--rounds` rounds, scaled to 100; the block-training "
                "runs time all 100). Retraining s: its training seconds (evaluation excluded); an arm's s: "
                "the phase's wall seconds (median and range when repeated; a discarded warm-up phase first pays the "
                "process's one-time `torch.func` import). Same 2-core machine: the loaded runs shared it with other "
                "jobs (load average 6-9, changing within a run: a phase of a few seconds varies several-fold), the idle "
                "runs did not (load 0.4-1.1, nothing else running).",
                "",
                markdown(frame),
            ]
        ),
    )
