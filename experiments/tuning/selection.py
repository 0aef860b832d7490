"""Choosing a setting (and a centralized model's epoch) on the validation item only.

The functions here take result rows that hold test metrics too (``HR@10``, ...) but read only the validation
columns (``val-HR@10``, ``val-NDCG@10``), so nothing is ever chosen on test items
(``tests/test_tuning_selection.py`` feeds them tables where the test metrics would choose differently).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SELECT_KEY = "val-HR@10"
TIE_KEY = "val-NDCG@10"


def _check_key(key: str) -> None:
    if not key.startswith("val-"):
        raise ValueError(f"selection must use a validation metric ('val-...'), got {key!r}")


def validation_score(row: Mapping[str, Any], key: str = SELECT_KEY) -> tuple[float, float]:
    """``(val HR@10, val NDCG@10)`` of a result row (the order used to compare settings).

    Raises:
        ValueError: ``key`` is not a validation metric, or the row has no validation metrics.
    """
    _check_key(key)
    if key not in row or TIE_KEY not in row:
        raise ValueError(
            f"result row has no {key!r} / {TIE_KEY!r} (run with holdout-validation and "
            f"evaluate-validation): keys {sorted(row)}"
        )
    return float(row[key]), float(row[TIE_KEY])


def row_at_round(rows: Sequence[Mapping[str, Any]], round_: int) -> dict | None:
    """The evaluated row of round ``round_`` of a run's ``metrics.json`` rows (``None`` if that round was not
    evaluated or not reached)."""
    for row in rows:
        if row.get("round") == round_ and "HR@10" in row:
            return dict(row)
    return None


def select_setting(results: Sequence[tuple[str, Mapping[str, Any]]], key: str = SELECT_KEY) -> str:
    """The name of the setting whose row has the best validation score (HR@10, then NDCG@10; the first listed on a
    full tie).

    Args:
        results: ``(setting name, result row)`` pairs; a row is one run's evaluated round (the grid's last round).
        key: the validation metric to maximise.
    Raises:
        ValueError: no results, or a row without validation metrics.
    """
    if not results:
        raise ValueError("no finished grid runs to select from")
    best_name, best_score = None, None
    for name, row in results:
        score = validation_score(row, key)
        if best_score is None or score > best_score:
            best_name, best_score = name, score
    return best_name


def select_epoch(history: Sequence[Mapping[str, Any]], key: str = SELECT_KEY) -> dict:
    """The evaluated epoch (row of :func:`fedrec_flwr.baselines.train_centralized`'s history with ``val-`` metrics)
    with the best validation score, the earliest on ties.

    Raises:
        ValueError: no evaluated epoch.
    """
    _check_key(key)
    evaluated = [r for r in history if key in r]
    if not evaluated:
        raise ValueError(f"no epoch has {key!r}")
    best = evaluated[0]
    for row in evaluated[1:]:
        if validation_score(row, key) > validation_score(best, key):
            best = row
    return dict(best)
