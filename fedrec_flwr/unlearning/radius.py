"""HF-KCU's trust radius from the item rows the forgotten users dominate, and a row mask for the step.

**Why.** The strategy's radius is ``trust-radius * ||theta_S||`` with ``S`` every item row the forgotten users'
influence gradient touches: their training positives *and* their fixed negative sample (``num-train-negatives`` per
positive). The negative sample is random, so ``S`` grows with the number of forgotten users (1,751 rows with 100 fake
users against 661 with 20 on FilmTrust), and so does the radius, while what has to be undone sits on the few rows the
forgotten users pushed (a promoted target item). At such a radius the FedMF step moves popular rows, held in place by
hundreds of genuine users, as far as the poisoned ones.

**The rule.** With ``n_F(j)`` and ``n_R(j)`` the forgotten and remaining users' training positives of item ``j``
(positives only: never the negative samples), the forgotten share is ``s(j) = n_F(j) / (n_F(j) + n_R(j))`` (0 for
an item nobody rated), the dominated rows are ``D = {j : s(j) >= threshold, n_F(j) > 0}`` (threshold 0.5: at least
half of the item's raters are forgotten; :func:`fedrec_flwr.unlearning.margin.dominated_items` is the strict
majority ``n_F > n_R``), and

    radius = factor * ||theta[D]||     (Frobenius norm over every item table's rows in D).

No dominated row: the radius is 0 and the mask empty (nothing the forgotten users hold alone; the caller skips the
step or falls back to another rule). :func:`mask_step` zeroes a step outside ``D``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["DominatedRows", "dominated_rows", "forgotten_share", "mask_step", "positive_counts"]

DEFAULT_THRESHOLD = 0.5
"""Forgotten share of an item's positives from which its row counts as dominated."""

DEFAULT_FACTOR = 0.015
"""The radius' multiple of the dominated rows' norm (the run config's ``trust-radius`` default)."""


@dataclass(frozen=True)
class DominatedRows:
    """The rows the forgotten users dominate and the radius they give.

    Attributes:
        rows: ``(n,)`` int64 sorted dominated item rows.
        mask: ``(I,)`` bool, True on ``rows``.
        share: ``(I,)`` float64 forgotten share of each item's positives.
        radius: ``factor * ||theta[rows]||`` (0 when ``rows`` is empty).
        norm: ``||theta[rows]||``.
    """

    rows: np.ndarray
    mask: np.ndarray
    share: np.ndarray
    radius: float
    norm: float


def positive_counts(positives: Iterable[np.ndarray], num_items: int) -> np.ndarray:
    """``(I,)`` float64 number of users with each item among their training positives (each user's list counted
    once per item)."""
    counts = np.zeros(int(num_items), dtype=np.float64)
    for items in positives:
        items = np.unique(np.asarray(items, dtype=np.int64))
        if items.size and (items.min() < 0 or items.max() >= num_items):
            raise ValueError(f"positive items must be in [0, {num_items})")
        counts[items] += 1.0
    return counts


def forgotten_share(remaining_counts: np.ndarray, forgotten_counts: np.ndarray) -> np.ndarray:
    """``(I,)`` float64 ``n_F / (n_F + n_R)`` per item (0 where both are 0).

    Raises:
        ValueError: the count vectors differ in shape or hold a negative count.
    """
    n_r = np.asarray(remaining_counts, dtype=np.float64)
    n_f = np.asarray(forgotten_counts, dtype=np.float64)
    if n_r.shape != n_f.shape or n_r.ndim != 1:
        raise ValueError(f"count vectors must be 1-d and alike, got {n_r.shape} and {n_f.shape}")
    if (n_r < 0).any() or (n_f < 0).any():
        raise ValueError("counts must be >= 0")
    total = n_r + n_f
    return np.divide(n_f, total, out=np.zeros_like(total), where=total > 0)


def dominated_rows(
    theta_items: Mapping[str, np.ndarray],
    remaining_counts: np.ndarray,
    forgotten_counts: np.ndarray,
    *,
    factor: float = DEFAULT_FACTOR,
    threshold: float = DEFAULT_THRESHOLD,
) -> DominatedRows:
    """The dominated rows and the trust radius (module docstring).

    Args:
        theta_items: item key -> ``(I, d)`` the current item tables (all of the model's tables).
        remaining_counts / forgotten_counts: ``(I,)`` training positives per item of the remaining / forgotten users
            (:func:`positive_counts`; the ``unlearn_counts`` query's node totals).
        factor: the radius' multiple of the rows' norm (> 0).
        threshold: the forgotten share from which a row is dominated, in (0, 1].

    Raises:
        ValueError: ``factor`` <= 0, ``threshold`` outside (0, 1], no item table, or a table whose row count is not
            the counts' length.
    """
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor!r}")
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    if not theta_items:
        raise ValueError("dominated_rows needs the item tables")
    share = forgotten_share(remaining_counts, forgotten_counts)
    mask = (share >= threshold) & (np.asarray(forgotten_counts) > 0)
    rows = np.flatnonzero(mask).astype(np.int64)
    total = 0.0
    for key, table in theta_items.items():
        table = np.asarray(table, dtype=np.float64)
        if table.shape[0] != share.size:
            raise ValueError(f"item table '{key}' has {table.shape[0]} rows, the counts {share.size}")
        total += float(np.sum(table[rows] ** 2))
    norm = float(np.sqrt(total))
    return DominatedRows(rows=rows, mask=mask, share=share, radius=factor * norm, norm=norm)


def mask_step(step: Mapping[str, np.ndarray], mask: np.ndarray, item_keys: Iterable[str]) -> dict[str, np.ndarray]:
    """``step`` (full arrays by shared key) with every item table's rows outside ``mask`` set to zero; dense keys are
    copied unchanged (the mask is over item rows)."""
    item_keys = set(item_keys)
    mask = np.asarray(mask, dtype=bool)
    out = {}
    for key, value in step.items():
        value = np.array(value, copy=True)
        if key in item_keys:
            if value.shape[0] != mask.size:
                raise ValueError(f"'{key}' has {value.shape[0]} rows, the mask {mask.size}")
            value[~mask] = 0
        out[key] = value
    return out
