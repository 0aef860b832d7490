"""The calibrated benchmark's frontier: each method's client cost against its distance to the retrained band.

:func:`distance_to_band` turns a model's metrics into one number, how far the worst of its judged metrics lies
outside the band of the retraining seeds (0: inside); :func:`plot_frontiers` draws one PNG per (dataset, model,
attack) from ``recipe.csv``'s rows: x the client user-epochs a method cost (symmetric log: rollback costs none),
y that distance, one point per seed, and retraining's 10 / 25 / 50 / 100-round budgets joined by a line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import pyplot, save_figure, slug

DISTANCE_FLOOR = 1e-3
"""Smallest spread a distance is measured in: a band whose standard deviation is below it (exposure@10 is 0 on every
retraining seed of every setting) counts distances in units of 0.001, about one genuine user's share of ML-100K's
943 (one user more or less with the target in the top 10 is a distance of about 1)."""


def distance_to_band(
    metrics: Mapping[str, float], target: Mapping, keys: Sequence[str], upper_only: Sequence[str] = ()
) -> float:
    """How far outside its band the worst of ``keys`` lies, in units of the band's standard deviation (at least
    :data:`DISTANCE_FLOOR`): ``max_k max(0, low_k - v_k, v_k - high_k) / max(std_k, floor)``; a key of
    ``upper_only`` counts only its excess above ``high``. 0 means inside the band on every key (the ``inside-band``
    verdict of :func:`experiments.hfkcu.band.inside_band`); ``target[k]`` is a :class:`~experiments.hfkcu.band.Band`.
    A NaN metric gives ``inf``."""
    worst = 0.0
    for k in keys:
        value, b = float(metrics[k]), target[k]
        if not np.isfinite(value):
            return float("inf")
        excess = value - b.high if k in upper_only else max(b.low - value, value - b.high)
        worst = max(worst, max(0.0, excess) / max(b.std, DISTANCE_FLOOR))
    return float(worst)


def plot_frontiers(frame: pd.DataFrame, folder: Path, default: str) -> list[Path]:
    """One ``frontier-<dataset>-<model>-<attack>.png`` under ``folder`` per (dataset, model, attack) of ``frame``
    (``recipe.csv``'s rows with ``distance-to-band``); ``default`` is the default recipe's method, drawn larger.
    Returns the paths written."""
    plt = pyplot()
    written = []  # one colour per method, the same in every figure (methods sorted by name)
    judged = frame[frame["user-epochs"].notna()]
    for (dataset, model, attack), block in judged.groupby(["dataset", "model", "attack"], sort=True):
        fig, axis = plt.subplots(figsize=(7.4, 4.6))
        retrain = block[block["method"].str.startswith("retrain ")]
        if not retrain.empty:
            points = (
                retrain.assign(rounds=retrain["method"].str.split().str[1].astype(int))
                .groupby("rounds")[["user-epochs", "distance-to-band"]]
                .mean()
            )
            axis.plot(points["user-epochs"], points["distance-to-band"], "k--", marker="*", ms=9, label="retraining")
            for rounds, row in points.iterrows():
                axis.annotate(f"{rounds}", (row["user-epochs"], row["distance-to-band"]), fontsize=7)
        methods = block[~block["method"].str.startswith("retrain ")].groupby("method", sort=True)
        colours = plt.get_cmap("tab20")
        for index, (method, rows) in enumerate(methods):
            big = method == default
            axis.scatter(
                rows["user-epochs"],
                rows["distance-to-band"],
                color=colours(index % 20),
                s=90 if big else 30,
                marker="D" if big else "o",
                label=f"{method} (default recipe)" if big else method,
                alpha=0.85,
            )
        axis.set_xscale("symlog", linthresh=10.0)
        axis.set_yscale("symlog", linthresh=1.0)
        axis.axhline(0.0, color="green", linewidth=0.8)
        axis.set_xlabel("client user-epochs (symmetric log)")
        axis.set_ylabel("distance to the retrained band (std units; 0 = inside)")
        axis.set_title(f"{dataset}, {model}, {attack}: one point per seed")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        path = folder / f"frontier-{slug(f'{dataset}-{model}-{attack}')}.png"
        save_figure(fig, path)
        written.append(path)
    return written
