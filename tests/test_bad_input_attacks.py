"""Bad input, case 13 (numbered across the tests/test_bad_input_*.py files): the attribute attack on rare classes."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.attacks.attribute_inference import attribute_inference, stratified_halves
from fedrec_flwr.errors import DataError


def _rare_classes(seed: int = 0):
    """Six classes of 2 users and one of 30; the embedding carries the class."""
    labels = np.array([c for c in range(6) for _ in range(2)] + [6] * 30)
    x = np.random.default_rng(seed).normal(size=(len(labels), 4)) + 0.5 * labels[:, None]
    return x, labels


@pytest.mark.parametrize("classifier", ["logreg", "mlp"])
def test_rare_classes_and_a_small_train_fraction_are_scored(classifier):
    """The issue's input raised scikit-learn's "'y_true' contains labels not in parameter 'labels'"."""
    x, labels = _rare_classes()
    result = attribute_inference(x, labels, splits=3, train_fraction=0.2, classifier=classifier)
    for mean, std in (result.auc, result.balanced_accuracy, result.macro_f1):
        assert np.isfinite(mean) and np.isfinite(std)
    assert 0.0 <= result.auc[0] <= 1.0 and len(result.per_split["auc"]) == 3


@pytest.mark.parametrize("fraction", [0.01, 0.2, 0.5, 0.8, 0.99])
def test_every_class_is_in_both_halves(fraction):
    _, labels = _rare_classes()
    for seed in range(5):
        for train, test in stratified_halves(labels, 3, fraction, seed):
            assert set(labels[train]) == set(labels[test]) == set(range(7))
            assert len(np.intersect1d(train, test)) == 0 and len(train) + len(test) == len(labels)


def test_a_class_of_one_user_is_named():
    x, labels = _rare_classes()
    labels = labels.copy()
    labels[0] = 9  # class 9 has one user, class 0 is left with one
    with pytest.raises(
        DataError, match=r"class 0 has 1 user; every class needs >= 2 .* classes with < 2 users: \[0, 9\]"
    ):
        attribute_inference(x, labels, splits=1)
    with pytest.raises(DataError, match="test_labels has class 7, which labels lacks"):
        attribute_inference(*_rare_classes(), splits=1, test_labels=np.where(_rare_classes()[1] == 6, 7, 0))
