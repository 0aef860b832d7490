"""Leave-one-out ranking metrics: HR@K and NDCG@K with ties counted against the model.

Protocol (He et al. 2017, "Neural Collaborative Filtering", Sec. 4.1): each user's held-out item is ranked among
itself and 99 sampled non-interacted items. Rank convention here: the 0-based rank of the target is the number of
OTHER candidates whose score is ``>=`` the target's. A model that scores every candidate alike thus gets the worst
rank (C-1), whatever the target's position in the list — a constant model cannot score HR@10 > 0 by luck of order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

DEFAULT_KS: tuple[int, ...] = (5, 10, 20)


def _as_numpy(scores) -> np.ndarray:
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().to("cpu", torch.float64).numpy()
    return np.asarray(scores, dtype=np.float64)


def _check_ks(ks: Iterable[int]) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"ks must be a non-empty sequence of positive ints, got {ks!r}")
    return tuple(int(k) for k in ks)


def rank_of_target(scores, target_index: int) -> int:
    """0-based rank of candidate ``target_index``: the number of other candidates scored ``>=`` it (ties against).

    Args:
        scores: ``(C,)`` float scores (numpy array, list or tensor; higher = better).
        target_index: position of the target in ``scores``.
    Returns:
        int in ``[0, C-1]``.
    Raises:
        ValueError: ``scores`` is not 1-D / is empty, contains NaN, or ``target_index`` is out of range.
    """
    values = _as_numpy(scores)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"rank_of_target: scores must be a non-empty 1-D array, got shape {values.shape}")
    if np.isnan(values).any():
        raise ValueError(f"rank_of_target: scores contain NaN at position {int(np.flatnonzero(np.isnan(values))[0])}")
    if not (0 <= int(target_index) < values.size):
        raise ValueError(f"rank_of_target: target_index {target_index} out of range for {values.size} candidates")
    return int((values >= values[int(target_index)]).sum()) - 1


def hit_ratio_at_k(rank: int, k: int) -> float:
    """HR@K for one user: 1.0 if the 0-based ``rank`` is ``< k``, else 0.0."""
    return 1.0 if rank < k else 0.0


def ndcg_at_k(rank: int, k: int) -> float:
    """NDCG@K for one user with one relevant item: ``1 / log2(rank + 2)`` if 0-based ``rank < k`` else 0.

    With a single relevant item the ideal DCG is 1, so NDCG = DCG (Järvelin & Kekäläinen 2002, "Cumulated gain-based
    evaluation of IR techniques"; protocol of He et al. 2017, Sec. 4.1). 1-based rank 1, 2, 3, 10, 11 at K=10 give
    1, 0.6309, 0.5, 0.2891, 0.
    """
    return 1.0 / math.log2(rank + 2) if rank < k else 0.0


def ranking_metrics(scores, target_index: int, ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """``{"HR@k": ..., "NDCG@k": ...}`` for each k in ``ks``, for one user's ``(C,)`` candidate scores.

    Raises:
        ValueError: as :func:`rank_of_target`, or invalid ``ks``.
    """
    ks = _check_ks(ks)
    rank = rank_of_target(scores, target_index)
    out: dict[str, float] = {}
    for k in ks:
        out[f"HR@{k}"] = hit_ratio_at_k(rank, k)
        out[f"NDCG@{k}"] = ndcg_at_k(rank, k)
    return out


def ranks_batch(scores, target_index: int | np.ndarray = 0) -> np.ndarray:
    """Vectorised :func:`rank_of_target`: ``(U,)`` int64 0-based ranks for ``(U, C)`` scores.

    ``target_index`` is one position for all rows, or a ``(U,)`` int array of per-row positions.

    Raises:
        ValueError: ``scores`` not 2-D / empty, NaN anywhere, or a target index out of range.
    """
    values = _as_numpy(scores)
    if values.ndim != 2 or values.shape[1] == 0:
        raise ValueError(f"ranks_batch: scores must have shape (U, C) with C >= 1, got {values.shape}")
    if np.isnan(values).any():
        row, col = np.argwhere(np.isnan(values))[0]
        raise ValueError(f"ranks_batch: scores contain NaN at row {row}, column {col}")
    num_rows, num_cands = values.shape
    targets = np.broadcast_to(np.asarray(target_index, dtype=np.int64), (num_rows,))
    if num_rows and (targets.min() < 0 or targets.max() >= num_cands):
        raise ValueError(f"ranks_batch: target index out of range for {num_cands} candidates")
    target_scores = values[np.arange(num_rows), targets][:, None]
    return (values >= target_scores).sum(axis=1).astype(np.int64) - 1


def ranking_metrics_batch(
    scores, target_index: int | np.ndarray = 0, ks: Sequence[int] = DEFAULT_KS
) -> dict[str, np.ndarray]:
    """Per-user metrics for ``(U, C)`` scores: ``{"HR@k": (U,) float64, "NDCG@k": (U,) float64, ...}``.

    Same definitions as :func:`ranking_metrics`, row by row. Raises ``ValueError`` as :func:`ranks_batch`.
    """
    ks = _check_ks(ks)
    ranks = ranks_batch(scores, target_index)
    out: dict[str, np.ndarray] = {}
    for k in ks:
        hit = ranks < k
        out[f"HR@{k}"] = hit.astype(np.float64)
        out[f"NDCG@{k}"] = np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0)
    return out


def mean_metrics(per_user: dict[str, np.ndarray]) -> dict[str, float]:
    """Mean over users of each per-user metric array (as returned by :func:`ranking_metrics_batch`).

    Raises:
        ValueError: no metrics at all, or an array is empty (there would be no users to average).
    """
    if not per_user:
        raise ValueError("mean_metrics: no metrics to average (empty mapping)")
    out = {}
    for key, values in per_user.items():
        if len(values) == 0:
            raise ValueError(f"mean_metrics: no users for {key}")
        out[key] = float(np.mean(values))
    return out
