"""The built-in datasets, one module each, and their registry.

Each module (:mod:`~fedrec_flwr.data.datasets.movielens`, :mod:`~fedrec_flwr.data.datasets.filmtrust`,
:mod:`~fedrec_flwr.data.datasets.lastfm`, :mod:`~fedrec_flwr.data.datasets.amazon`) holds everything the package knows
about its dataset in one :class:`DatasetSpec`: the download URL and pinned checksums, the files read and their reader,
the user attributes and their published class counts, and the split's dataset-specific procedure. The download
tables (:data:`fedrec_flwr.data.download.URLS`, :data:`~fedrec_flwr.data.download.SHA256`), the dataset list of the
run config (:data:`DATASETS`) and the attribute facts of :mod:`fedrec_flwr.attributes` are all read from
:data:`DATASET_SPECS`.
"""

from __future__ import annotations

from fedrec_flwr.data.datasets import amazon, filmtrust, lastfm, movielens
from fedrec_flwr.data.datasets.spec import DatasetSpec, Parsed

DATASET_SPECS: dict[str, DatasetSpec] = {
    spec.name: spec for spec in (movielens.SPEC, filmtrust.SPEC, lastfm.SPEC, amazon.SPEC)
}
"""The built-in datasets by run-config name, in the order the documentation lists them."""

GENERIC = "generic"
"""The value of ``dataset`` for a user's own CSV/TSV file (:mod:`fedrec_flwr.data.generic`)."""

DATASETS: tuple[str, ...] = (*DATASET_SPECS, GENERIC)
"""The values of ``dataset``: the built-in datasets of :data:`DATASET_SPECS` and ``generic``."""

__all__ = ["DATASETS", "DATASET_SPECS", "GENERIC", "DatasetSpec", "Parsed"]
