"""Named recipes from the validation-tuned tables: ``fedrecgel-tuned`` on a dataset is FedRecGEL with the rates the
tuning protocol selected on that dataset's validation item.

Source of every value: ``experiments/tuning/grid.py`` (the protocol, each method's configuration, the named variants)
and ``experiments/tuning/results/selection-<dataset>.json`` (the setting selected per dataset, on val-HR@10 at round
100, seed 0); the test figures :func:`table_row` shows come from ``main-<dataset>.csv`` / ``preset-<dataset>.csv``
beside them. Nothing here is typed in by hand: re-running the tuning rewrites what a preset means.

A preset is a mapping of run-config keys; ``fedrec run --preset NAME`` puts it under the ``--run-config`` file and the
``key=value`` words (both override it). The recipe keeps the protocol's keys that shaped the table (100 rounds, a
validation item held out, every user evaluated every 10 rounds, all users of a dataset on one node), not the seed or
the dataset, which the run chooses.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedrec_flwr.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RESULTS = PROJECT_ROOT / "experiments" / "tuning" / "results"
SUFFIX = "-tuned"


@dataclass(frozen=True)
class Preset:
    """One named recipe: ``method`` (a method of ``grid.METHODS`` or a variant of ``grid.PRESETS``) and the base
    method whose selection it uses."""

    name: str
    method: str
    base: str


def _grid():
    """``experiments.tuning.grid`` of this checkout (the tuning protocol lives in its ``experiments/``)."""
    if str(PROJECT_ROOT) not in sys.path:
        sys.path.append(str(PROJECT_ROOT))
    try:
        from experiments.tuning import grid
    except ImportError as err:
        raise ConfigError(
            f"presets need the checkout's experiments/tuning (not found from {PROJECT_ROOT}: {err})"
        ) from None
    return grid


def slug(method: str) -> str:
    """``"FedRecGEL w/o SAM"`` -> ``"fedrecgel-wo-sam-tuned"``."""
    return re.sub(r"[^a-z0-9]+", "-", method.lower().replace("w/o", "wo")).strip("-") + SUFFIX


def presets() -> dict[str, Preset]:
    """Every preset by name: one per tuned method, one per named variant of a tuned method."""
    grid = _grid()
    found = {slug(m): Preset(slug(m), m, m) for m in grid.METHODS}
    found.update({slug(name): Preset(slug(name), name, base) for name, (base, _) in grid.PRESETS.items()})
    return found


def datasets() -> list[str]:
    """The datasets with a selection table (``selection-<dataset>.json``), sorted."""
    return sorted(p.name[len("selection-") : -len(".json")] for p in RESULTS.glob("selection-*.json"))


def _lookup(name: str) -> Preset:
    known = presets()
    if name not in known:
        import difflib

        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"preset {name!r}: no such preset; {hint}known: {', '.join(sorted(known))} (`fedrec presets` lists them)"
        )
    return known[name]


def selection(base: str, dataset: str) -> dict[str, Any]:
    """The selection record of method ``base`` on ``dataset`` (``setting``, ``name``, ``selected-on``).

    Raises:
        ConfigError: no table for that dataset or method.
    """
    path = RESULTS / f"selection-{dataset}.json"
    if not path.is_file():
        raise ConfigError(
            f"dataset {dataset!r}: the presets are tuned on {', '.join(datasets())} only (no "
            f"{path.relative_to(PROJECT_ROOT)}); give the keys yourself or tune them "
            "(experiments/tuning)"
        )
    table = json.loads(path.read_text(encoding="utf-8"))
    if base not in table:
        raise ConfigError(f"{path.relative_to(PROJECT_ROOT)} has no selection for {base!r}")
    return table[base]


def setting(name: str, dataset: str) -> dict[str, Any]:
    """The tuned keys of preset ``name`` on ``dataset``: its base method's selection, with a variant's own value of
    a key the selection varies (``grid.preset_setting``). Raises as :func:`resolve`."""
    grid = _grid()
    preset = _lookup(name)
    chosen = dict(selection(preset.base, dataset)["setting"])
    return grid.preset_setting(preset.method, chosen) if preset.method in grid.PRESETS else chosen


def resolve(name: str, dataset: str) -> dict[str, Any]:
    """The run-config keys of preset ``name`` on ``dataset`` (without ``dataset`` and ``seed``).

    Raises:
        ConfigError: an unknown preset (with the close match), or a dataset without a selection table.
    """
    grid = _grid()
    keys = grid.run_overrides(_lookup(name).method, setting(name, dataset), dataset, 0, grid.GRID_ROUNDS)
    return {k: v for k, v in keys.items() if k not in ("dataset", "seed")}


def table_row(name: str, dataset: str, round_: int = 100) -> dict[str, str] | None:
    """The preset's row of ``main-<dataset>.csv`` (or ``preset-<dataset>.csv``) at ``round_``: test HR@K / NDCG@K
    means over ``seeds`` seeds, as written there; ``None`` without one."""
    preset = _lookup(name)
    for table in ("main", "preset"):
        path = RESULTS / f"{table}-{dataset}.csv"
        if path.is_file():
            with open(path, newline="", encoding="utf-8") as handle:
                for row in csv.DictReader(handle):
                    if row.get("method") == preset.method and row.get("round") == str(round_):
                        return row
    return None
