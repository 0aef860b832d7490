"""Protected user attributes as class labels (pure NumPy; no Flower).

A split's raw attributes (:attr:`fedrec_flwr.data.Split.attributes`: MovieLens-100K's ``gender`` and ``age``, or the
columns of a generic attributes file) become integer class labels here, once, for the adversary of attribute
unlearning (:mod:`fedrec_flwr.adversary`) and for the attacks that measure it (:mod:`fedrec_flwr.attacks`).

* A numeric column named ``age`` is bucketed with MovieLens-1M's official age groups (``AGE_BUCKETS``: under 18,
  18-24, 25-34, 35-44, 45-49, 50-55, 56+), the grouping attribute-unlearning papers use for MovieLens ages.
* Any other column is categorical: its distinct values, sorted, are the classes (at most ``MAX_CLASSES``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedrec_flwr.data.datasets import DATASET_SPECS
from fedrec_flwr.errors import ConfigError

AGE_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("<18", -np.inf, 18),
    ("18-24", 18, 25),
    ("25-34", 25, 35),
    ("35-44", 35, 45),
    ("45-49", 45, 50),
    ("50-55", 50, 56),
    ("56+", 56, np.inf),
)
"""MovieLens-1M's age groups: ``(name, lower bound inclusive, upper bound exclusive)`` in years."""

MAX_CLASSES = 32
"""A categorical attribute with more distinct values than this is refused (bucket it first)."""

PUBLISHED_CLASS_COUNTS: dict[tuple[str, str], dict[str, int]] = {
    (name, attribute): dict(counts)
    for name, spec in DATASET_SPECS.items()
    for attribute, counts in spec.published_class_counts.items()
}
"""Users per class of each attribute in a dataset's published user file: ``(dataset, attribute) -> {class: users}``,
classes in :func:`encode_attribute`'s order, from each dataset's
:attr:`~fedrec_flwr.data.datasets.DatasetSpec.published_class_counts` (MovieLens-100K: the 943 users of GroupLens'
``u.user``, its ages bucketed by :data:`AGE_BUCKETS`). They are the dataset's public statistics, the same for every
user, so a prior built from them reveals nothing about any user of a run; they are never counted from a federation
(``adversary-class-prior = "published"``)."""

DATASET_ATTRIBUTES: dict[str, tuple[str, ...]] = {name: spec.attributes for name, spec in DATASET_SPECS.items()}
"""The user attributes each named dataset's reader returns (:attr:`~fedrec_flwr.data.datasets.DatasetSpec.attributes`:
MovieLens-100K's ``u.user`` columns; the other three have none), known without the data, so a ``protected-attribute``
they lack is refused with the run config (:meth:`fedrec_flwr.config.RunConfig.from_mapping`), before any component's
check runs. ``generic``'s come from its attributes file, checked when the split is loaded (:func:`encode_attribute`)."""


def check_attribute_name(name: str, available, dataset: str | None = None) -> None:
    """Refuse a ``protected-attribute`` that is not among the dataset's user attributes ``available``.

    Args:
        name: the run-config value of ``protected-attribute``.
        available: the attribute names the dataset has.
        dataset: the run-config value of ``dataset``, named in the message when given.

    Raises:
        ConfigError: naming the key and value (and the dataset) and listing the attributes the dataset has (or saying
            it has none).
    """
    if name in available:
        return
    which = f"the dataset {dataset!r}" if dataset else "the dataset"
    if not available:
        having = ", ".join(f"{key!r} ({', '.join(names)})" for key, names in DATASET_ATTRIBUTES.items() if names)
        raise ConfigError(
            f"run-config key 'protected-attribute' = {name!r}: {which} has no user attributes "
            f"(datasets with user attributes: {having}; for dataset = 'generic', give them in "
            "'generic-attributes-file')"
        )
    raise ConfigError(
        f"run-config key 'protected-attribute' = {name!r}: {which}'s user attributes are {sorted(available)}"
    )


def published_class_prior(dataset: str, attribute: str, classes: tuple[str, ...] | None = None) -> str | None:
    """The published class shares of ``attribute`` in ``dataset`` as ``adversary-class-prior`` text
    (``"0.2895,0.7105"``-style, in :func:`encode_attribute`'s class order), from :data:`PUBLISHED_CLASS_COUNTS`;
    ``None`` when the package knows no published shares for them.

    Args:
        dataset: run-config ``dataset``.
        attribute: run-config ``protected-attribute``.
        classes: the encoded classes of the run's split, if known; they must be the table's.

    Raises:
        ConfigError: the split's classes differ from the published ones (the message says to give the shares
            explicitly or ``""``).
    """
    counts = PUBLISHED_CLASS_COUNTS.get((dataset, attribute))
    if counts is None:
        return None
    if classes is not None and tuple(classes) != tuple(counts):
        raise ConfigError(
            f"run-config key 'adversary-class-prior' = 'published': the split's classes of "
            f"{attribute!r} are {list(classes)}, the published shares' {list(counts)}; give the shares "
            f"explicitly or ''"
        )
    total = sum(counts.values())
    return ",".join(f"{n / total:.6g}" for n in counts.values())


@dataclass(frozen=True)
class AttributeLabels:
    """One protected attribute as class labels.

    Attributes:
        name: the attribute (``"gender"``, ``"age"``, ...).
        labels: ``(num_users,)`` int64 in ``[0, len(classes))``, indexed like the split's users.
        classes: class names, e.g. ``("F", "M")`` or the age groups that occur.
    """

    name: str
    labels: np.ndarray
    classes: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def class_counts(self) -> np.ndarray:
        """``(num_classes,)`` users per class."""
        return np.bincount(self.labels, minlength=self.num_classes)


def encode_attribute(attributes: dict[str, np.ndarray], name: str) -> AttributeLabels:
    """Turn one raw attribute column into class labels (see the module docstring).

    Args:
        attributes: the split's attributes, name -> ``(num_users,)`` array.
        name: the attribute to encode (run-config key ``protected-attribute``).

    Raises:
        ConfigError: the split has no such attribute (the message lists the ones it has), the attribute has fewer
            than 2 classes, or more than ``MAX_CLASSES``.
    """
    check_attribute_name(name, tuple(attributes))
    values = np.asarray(attributes[name])
    if name == "age" and values.dtype.kind in "iuf":
        bucket = np.full(values.shape, -1, dtype=np.int64)
        for index, (_, low, high) in enumerate(AGE_BUCKETS):
            bucket[(values >= low) & (values < high)] = index
        present = np.unique(bucket)
        labels = np.searchsorted(present, bucket).astype(np.int64)
        classes = tuple(AGE_BUCKETS[i][0] for i in present)
    else:
        text = values.astype(str)
        names, labels = np.unique(text, return_inverse=True)
        classes = tuple(str(v) for v in names)
        labels = labels.astype(np.int64)
    if len(classes) < 2:
        raise ConfigError(
            f"run-config key 'protected-attribute' = {name!r}: every user has the same value "
            f"{classes[0]!r}; nothing to protect"
        )
    if len(classes) > MAX_CLASSES:
        raise ConfigError(
            f"run-config key 'protected-attribute' = {name!r} has {len(classes)} distinct values "
            f"(at most {MAX_CLASSES}); bucket it in the attributes file first"
        )
    return AttributeLabels(name, labels, classes)
