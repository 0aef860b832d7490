"""Real-data pipeline: load raw interactions, build leave-one-out splits, sample negatives (numpy/pandas only).

Typical use::

    from fedrec_flwr.data import load_split, sample_train_negatives
    split = load_split("ml-100k", "../shared/data/ml-100k")
    negatives = sample_train_negatives(split, user=0, round=1, num_per_positive=4, seed=0)
"""

from fedrec_flwr.data.cache import load_split, read_split, save_split
from fedrec_flwr.data.datasets import DATASET_SPECS, DATASETS, DatasetSpec
from fedrec_flwr.data.download import SHA256, URLS, download_dataset
from fedrec_flwr.data.loaders import (
    GenericSource,
    Interactions,
    default_cache_dir,
    load_interactions,
    load_item_titles,
)
from fedrec_flwr.data.split import (
    FORMAT_VERSION,
    TAG_ORDER,
    TAG_TEST_NEG,
    TAG_TIE,
    TAG_TRAIN_NEG,
    TAG_VAL_NEG,
    TIE_RULES,
    Split,
    preprocess,
    sample_train_negatives,
)

__all__ = [
    "DATASETS",
    "DATASET_SPECS",
    "FORMAT_VERSION",
    "SHA256",
    "TAG_ORDER",
    "TAG_TEST_NEG",
    "TAG_TIE",
    "TAG_TRAIN_NEG",
    "TAG_VAL_NEG",
    "TIE_RULES",
    "URLS",
    "DatasetSpec",
    "GenericSource",
    "Interactions",
    "Split",
    "default_cache_dir",
    "download_dataset",
    "load_interactions",
    "load_item_titles",
    "load_split",
    "preprocess",
    "read_split",
    "sample_train_negatives",
    "save_split",
]
