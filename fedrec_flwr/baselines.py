"""Non-federated reference points: item popularity and a centralized model trained on all users at once.

* Popularity ranks candidates by their number of training interactions (the usual most-popular baseline).
* :func:`train_centralized` trains one model holding every user's embedding on all training interactions — the
  ceiling a federated run of the same model and protocol should approach.

Both are evaluated with the leave-one-out protocol of :mod:`fedrec_flwr.metrics` (target among its 99 sampled
negatives, ties counted against the model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer, evaluate_users
from fedrec_flwr.metrics import DEFAULT_KS, mean_metrics, ranking_metrics_batch
from fedrec_flwr.models import RecModel, build_model
from fedrec_flwr.seeding import TAG_SHUFFLE, torch_generator

if TYPE_CHECKING:  # pragma: no cover
    from fedrec_flwr.data import Split

log = logging.getLogger(__name__)


def _eval_targets(split: Split, which: str) -> tuple[np.ndarray, np.ndarray]:
    """``(targets (U,), negatives (U, C-1))`` of the test or validation protocol.

    Raises:
        ConfigError: ``which`` is not ``"test"``/``"val"``, or ``"val"`` on a split without a validation item.
    """
    if which == "test":
        return np.asarray(split.test_items), np.asarray(split.test_negatives)
    if which == "val":
        if split.val_items is None or split.val_negatives is None:
            raise ConfigError(
                f"which='val' but the {split.dataset} split has no validation item (load it with holdout_validation=True)"
            )
        return np.asarray(split.val_items), np.asarray(split.val_negatives)
    raise ConfigError(f"which must be 'test' or 'val', got {which!r}")


def popularity_scores(split: Split) -> np.ndarray:
    """``(I,)`` float64 popularity of each item = its number of training interactions (``split.train_counts()``)."""
    return np.asarray(split.train_counts(), dtype=np.float64)


def evaluate_popularity(split: Split, ks: Sequence[int] = DEFAULT_KS, which: str = "test") -> dict[str, float]:
    """Mean HR@k / NDCG@k over all users of ranking each user's candidates by popularity.

    Ties count against the baseline: a target with the same count as a negative ranks below it.

    Returns:
        ``{"HR@k": float, "NDCG@k": float, ...}``.
    Raises:
        ConfigError: bad ``which`` (see :func:`evaluate_model`).
    """
    targets, negatives = _eval_targets(split, which)
    candidates = np.concatenate([targets[:, None], negatives], axis=1)
    scores = popularity_scores(split)[candidates]
    return mean_metrics(ranking_metrics_batch(scores, 0, ks))


def evaluate_model(
    model: RecModel, split: Split, ks: Sequence[int] = DEFAULT_KS, which: str = "test"
) -> dict[str, float]:
    """Mean HR@k / NDCG@k over all users of a model holding every user's row (``model.num_users == split.num_users``).

    All users' ``(U, C)`` candidate scores are computed in large batches on the model's device.

    Raises:
        ConfigError: ``which`` invalid or ``"val"`` without a validation item.
        ValueError: the model's tables do not match the split's sizes.
    """
    if model.num_users != split.num_users or model.num_items != split.num_items:
        raise ValueError(
            f"model has {model.num_users} users x {model.num_items} items but the split has "
            f"{split.num_users} x {split.num_items}"
        )
    targets, negatives = _eval_targets(split, which)
    users = np.arange(split.num_users, dtype=np.int64)
    return mean_metrics(evaluate_users(model, users, targets, negatives, ks))


@dataclass
class CentralizedResult:
    """Outcome of :func:`train_centralized`.

    Attributes:
        model: the trained model (all users' rows), on the training device.
        history: one dict per epoch: ``epoch`` (1-based), ``loss`` (mean training loss), ``seconds`` (training
            time of the epoch) and, on evaluated epochs, ``HR@k`` / ``NDCG@k`` for the evaluation ``ks``.
    """

    model: RecModel
    history: list[dict] = field(default_factory=list)


def train_centralized(
    split: Split,
    model_name: str = "ncf",
    *,
    epochs: int = 20,
    batch_size: int = 1024,
    learning_rate: float = 0.001,
    optimizer: str = "adam",
    num_train_negatives: int = 4,
    loss: str = "bce",
    embedding_dim: int = 32,
    mlp_layers: Sequence[int] = (64, 32, 16),
    weight_decay: float = 0.0,
    seed: int = 0,
    device: str = "cpu",
    eval_every: int = 1,
    eval_which: str = "test",
    ks: Sequence[int] = DEFAULT_KS,
    progress: Callable[[dict], None] | None = None,
) -> CentralizedResult:
    """Train one model on every user's training interactions (the non-federated ceiling).

    Each epoch resamples negatives with ``sample_train_negatives(split, user, epoch, num_train_negatives, seed)``,
    shuffles all users' examples together with ``torch_generator(seed, TAG_SHUFFLE, epoch)`` and runs
    :class:`~fedrec_flwr.local.training.LocalTrainer` mini-batches over them. The model is built by
    ``build_model(model_name, split.num_users, split.num_items, embedding_dim=..., seed=seed)``.

    Args:
        split: the dataset split (all users).
        eval_every: evaluate on ``eval_which`` every this many epochs (and after the last one).
        eval_which: ``"test"``, ``"val"`` (use ``"val"`` to tune hyper-parameters) or ``"both"`` (test metrics
            under their names and validation metrics prefixed ``val-``, as a federated run's rows: an epoch chosen
            on ``val-`` keys then reports its test metrics).
        progress: called with each epoch's history dict.
        Other arguments: as :class:`~fedrec_flwr.local.training.LocalTrainConfig`.
    Returns:
        :class:`CentralizedResult`.
    Raises:
        ConfigError: invalid hyper-parameters, model name or ``eval_which``.
        FloatingPointError: training diverged (see :meth:`LocalTrainer.train`).
    """
    from fedrec_flwr.data import sample_train_negatives

    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"epochs must be an int >= 1, got {epochs!r}")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ConfigError(f"eval_every must be an int >= 1, got {eval_every!r}")
    for which in ("test", "val") if eval_which == "both" else (eval_which,):
        _eval_targets(split, which)  # fail early on a bad eval_which
    cfg = LocalTrainConfig(
        local_epochs=1,
        batch_size=batch_size,
        learning_rate=learning_rate,
        num_train_negatives=num_train_negatives,
        loss=loss,
        optimizer=optimizer,
        weight_decay=weight_decay,
        device=device,
    )
    model = build_model(
        model_name, split.num_users, split.num_items, embedding_dim=embedding_dim, mlp_layers=mlp_layers, seed=seed
    )
    trainer = LocalTrainer(model, cfg)
    k = num_train_negatives
    counts = np.diff(np.asarray(split.train_indptr))
    users_pos = np.repeat(np.arange(split.num_users, dtype=np.int64), counts)
    positives = np.asarray(split.train_items, dtype=np.int64)
    history: list[dict] = []
    for epoch in range(epochs):
        start = time.perf_counter()
        negatives = np.concatenate(
            [
                np.asarray(sample_train_negatives(split, u, epoch, k, seed), dtype=np.int64)
                for u in range(split.num_users)
            ]
        )
        if negatives.size != positives.size * k:
            raise RuntimeError(
                f"sample_train_negatives returned {negatives.size} negatives, expected {positives.size * k}"
            )
        generator = torch_generator(seed, TAG_SHUFFLE, epoch)
        if loss == "bpr":
            # Positive j of the concatenated users' lists is paired with negatives[j*k:(j+1)*k] (same user).
            value, _ = trainer.fit_pairs(np.repeat(users_pos, k), np.repeat(positives, k), negatives, generator, 1)
        else:
            users = np.concatenate([users_pos, np.repeat(users_pos, k)])
            items = np.concatenate([positives, negatives])
            labels = np.concatenate([np.ones(positives.size, np.float32), np.zeros(negatives.size, np.float32)])
            value, _ = trainer.fit_examples(users, items, labels, generator, 1)
        record: dict = {"epoch": epoch + 1, "loss": value, "seconds": time.perf_counter() - start}
        if (epoch + 1) % eval_every == 0 or epoch + 1 == epochs:
            if eval_which == "both":
                record.update(evaluate_model(model, split, ks, "test"))
                record.update({f"val-{k}": v for k, v in evaluate_model(model, split, ks, "val").items()})
            else:
                record.update(evaluate_model(model, split, ks, eval_which))
        log.info("centralized %s epoch %d: %s", model_name, epoch + 1, record)
        history.append(record)
        if progress is not None:
            progress(record)
    return CentralizedResult(model=model, history=history)
