"""Attribute inference from user embeddings (the attack FedAU² defends against).

Protocol (FedAU², arXiv:2511.22872, Sec. 5.1, "attribute inference attack"; details ours): after training, an attacker
who knows the protected attribute of a random half of the users (stratified) fits a classifier on their user
embeddings and predicts the other half. Repeated over ``splits`` random halves; the mean and standard deviation of
each metric are reported. Classifiers and metrics are scikit-learn's:

* ``"logreg"``: standardised features + ``LogisticRegression`` (multinomial for > 2 classes);
* ``"mlp"``: standardised features + ``MLPClassifier`` (one hidden layer of 100; early stopping on a stratified 10%
  of the known users when every class has enough of them to stratify, see :func:`_classifier`).

Splits (ours): per class, ``round(train_fraction * n_c)`` users, clipped to ``[1, n_c - 1]``, are known to the attacker
and the rest are held out, so every class appears in both halves whatever its size (scikit-learn's
``StratifiedShuffleSplit`` may leave a rare class out of one half, and the multi-class AUC then fails).

Metrics: ROC AUC (binary: of the positive class; > 2 classes: one-vs-rest, macro-averaged), balanced accuracy and
macro-F1. An attacker that knows nothing scores AUC 0.5 and balanced accuracy ``1 / C``.

The embeddings come from :func:`collect_user_embeddings`, which reads the simulated nodes' private state after the run:
an evaluation-only path that no message of the training protocol takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from fedrec_flwr.errors import DataError
from fedrec_flwr.state.client_state import STATE_PREFIX

CLASSIFIERS = ("logreg", "mlp")


@dataclass(frozen=True)
class AttributeAttackResult:
    """Mean and standard deviation over the random splits of each metric.

    Attributes:
        classifier: ``"logreg"`` or ``"mlp"``. splits: how many random halves.
        auc / balanced_accuracy / macro_f1: ``(mean, std)``.
        per_split: metric name -> ``(splits,)`` values.
    """

    classifier: str
    splits: int
    auc: tuple[float, float]
    balanced_accuracy: tuple[float, float]
    macro_f1: tuple[float, float]
    per_split: Mapping[str, np.ndarray]

    def as_row(self, prefix: str = "") -> dict[str, float]:
        """Flat ``{"<prefix>auc": mean, "<prefix>auc-std": std, ...}``."""
        out = {}
        for name, (mean, std) in (
            ("auc", self.auc),
            ("balanced-accuracy", self.balanced_accuracy),
            ("macro-f1", self.macro_f1),
        ):
            out[f"{prefix}{name}"], out[f"{prefix}{name}-std"] = mean, std
        return out


def _classifier(name: str, seed: int, train_labels: np.ndarray | None = None):
    """The attack's classifier. The MLP stops early on a stratified 10% validation share of the known users only when
    that share can hold every class and leave each class a training user (scikit-learn's stratified split refuses
    otherwise); else it trains its ``max_iter`` epochs (ours: rare classes must not crash the attack)."""
    if name == "logreg":
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    if name == "mlp":
        early = True
        if train_labels is not None:
            _, counts = np.unique(train_labels, return_counts=True)
            n, k = len(train_labels), len(counts)
            validation = int(np.ceil(0.1 * n))
            early = bool(counts.min() >= 2 and validation >= k and n - validation >= k)
        return make_pipeline(
            StandardScaler(),
            MLPClassifier(hidden_layer_sizes=(100,), max_iter=500, early_stopping=early, random_state=seed),
        )
    raise ValueError(f"unknown attack classifier {name!r}; use one of {CLASSIFIERS}")


def attribute_inference(
    embeddings: np.ndarray,
    labels: np.ndarray,
    *,
    classifier: str = "logreg",
    splits: int = 5,
    train_fraction: float = 0.5,
    seed: int = 0,
    test_labels: np.ndarray | None = None,
) -> AttributeAttackResult:
    """Train an attribute classifier on a random half of the users and score it on the other half.

    Args:
        embeddings: ``(U, D)`` float user embeddings (rows of users the attacker targets).
        labels: ``(U,)`` int class labels in ``[0, C)``.
        classifier: ``"logreg"`` or ``"mlp"``.
        splits: number of random stratified splits (>= 1).
        train_fraction: share of users whose attribute the attacker knows.
        seed: fixes the splits and the MLP's initialisation.
        test_labels: ``(U,)`` labels the held-out half is scored against (default ``labels``); for sanity checks,
            e.g. scoring against swapped classes gives ``1 - AUC``.

    Returns:
        :class:`AttributeAttackResult`.

    Raises:
        DataError: shapes disagree, the embeddings hold NaN/Inf, fewer than 2 classes, a class with < 2 users (the
            message names the class: it cannot be in both halves), or ``test_labels`` has a class ``labels`` lacks.
        ValueError: unknown classifier, ``splits`` < 1 or ``train_fraction`` outside (0, 1).
    """
    if isinstance(splits, bool) or not isinstance(splits, (int, np.integer)) or splits < 1:
        raise ValueError(f"attribute_inference: splits must be an int >= 1, got {splits!r}")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"attribute_inference: train_fraction must be in (0, 1), got {train_fraction!r}")
    x = np.asarray(embeddings, dtype=np.float64)
    y = np.asarray(labels)
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
        raise DataError(f"attribute_inference: embeddings {x.shape} and labels {y.shape} do not match")
    if not np.isfinite(x).all():
        raise DataError("attribute_inference: embeddings contain NaN or Inf")
    y_test = y if test_labels is None else np.asarray(test_labels)
    if y_test.shape != y.shape:
        raise DataError(f"attribute_inference: test_labels {y_test.shape} and labels {y.shape} do not match")
    classes, counts = np.unique(y, return_counts=True)
    if len(classes) < 2:
        raise DataError(f"attribute_inference: need >= 2 classes, got {classes.tolist()}")
    if counts.min() < 2:
        rare = classes[counts < 2].tolist()  # Python values: the message shows 9, not np.int64(9)
        raise DataError(
            f"attribute_inference: class {rare[0]!r} has {int(counts.min())} user; every class needs >= 2 "
            f"(one known to the attacker, one held out); classes with < 2 users: {rare}"
        )
    unknown = np.setdiff1d(np.unique(y_test), classes)
    if unknown.size:
        raise DataError(f"attribute_inference: test_labels has class {unknown[0].item()!r}, which labels lacks")
    scores: dict[str, list[float]] = {"auc": [], "balanced-accuracy": [], "macro-f1": []}
    for index, (train, test) in enumerate(stratified_halves(y, splits, train_fraction, seed)):
        model = _classifier(classifier, seed + index, y[train]).fit(x[train], y[train])
        proba = model.predict_proba(x[test])
        predicted = model.classes_[proba.argmax(axis=1)]
        truth = y_test[test]
        if len(classes) == 2:
            auc = roc_auc_score(truth, proba[:, 1])
        else:
            auc = roc_auc_score(truth, proba, multi_class="ovr", average="macro", labels=model.classes_)
        # every class is in both halves (stratified_halves), so the AUC is over all classes
        scores["auc"].append(float(auc))
        scores["balanced-accuracy"].append(float(balanced_accuracy_score(truth, predicted)))
        scores["macro-f1"].append(float(f1_score(truth, predicted, average="macro")))
    summary = {k: (float(np.mean(v)), float(np.std(v))) for k, v in scores.items()}
    return AttributeAttackResult(
        classifier,
        splits,
        summary["auc"],
        summary["balanced-accuracy"],
        summary["macro-f1"],
        {k: np.asarray(v) for k, v in scores.items()},
    )


def stratified_halves(labels: np.ndarray, splits: int, train_fraction: float, seed: int):
    """Yield ``splits`` pairs ``(train, test)`` of index arrays: per class ``c`` with ``n_c >= 2`` users,
    ``clip(round(train_fraction * n_c), 1, n_c - 1)`` random users go to ``train`` and the rest to ``test``, from
    ``np.random.default_rng([seed, split])``; so every class is in both halves. Indices are sorted."""
    y = np.asarray(labels)
    classes = np.unique(y)
    members = [np.flatnonzero(y == c) for c in classes]
    for split in range(int(splits)):
        rng = np.random.default_rng([int(seed), split])
        train, test = [], []
        for index in members:
            k = int(np.clip(round(train_fraction * len(index)), 1, len(index) - 1))
            chosen = rng.permutation(index)
            train.append(chosen[:k])
            test.append(chosen[k:])
        yield np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def collect_user_embeddings(
    states: Iterable, private_keys: Iterable[str], num_users: int, prefix: str = STATE_PREFIX
) -> tuple[np.ndarray, np.ndarray]:
    """Read every user's private embedding from nodes' ``context.state`` (evaluation only: simulation, after a run).

    Args:
        states: the nodes' state ``RecordDict`` objects (e.g. ``[c.state for c in grid.contexts.values()]`` of a
            :class:`fedrec_flwr.serial.SerialGrid`).
        private_keys: the model's private keys in order (``ModelLayout.private_keys``); their row 0 is concatenated,
            the layout :func:`fedrec_flwr.adversary.user_vector` gives the adversary.
        num_users: ``U``.
        prefix: the state key prefix of a user's record (:data:`fedrec_flwr.clients.fedrec.STATE_PREFIX`).

    Returns:
        ``(embeddings (U, D) float32, present (U,) bool)``: rows of users that never trained (no record) are zero and
        ``present`` is False for them.
    """
    keys = list(private_keys)
    rows: dict[int, np.ndarray] = {}
    for state in states:
        for name in state.keys():
            if not name.startswith(prefix):
                continue
            record = state[name]
            if not isinstance(record, ArrayRecord):
                continue
            missing = [k for k in keys if k not in record]
            if missing:
                raise DataError(
                    f"collect_user_embeddings: state record {name!r} has no {missing[0]!r} "
                    f"(its keys: {sorted(record.keys())}); pass the model's ModelLayout.private_keys"
                )
            rows[int(name[len(prefix) :])] = np.concatenate([record[k].numpy().reshape(-1) for k in keys])
    if not rows:
        return np.zeros((num_users, 0), dtype=np.float32), np.zeros(num_users, dtype=bool)
    dim = len(next(iter(rows.values())))
    out = np.zeros((num_users, dim), dtype=np.float32)
    present = np.zeros(num_users, dtype=bool)
    for user, row in rows.items():
        out[user], present[user] = row, True
    return out, present
