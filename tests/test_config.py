"""The run config: declared once in pyproject.toml, validated once into RunConfig."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from fedrec_flwr.config import RunConfig, default_mapping, default_run_config, make_run_config
from fedrec_flwr.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def test_every_pyproject_key_is_typed_and_every_typed_key_is_declared():
    with open(PROJECT_ROOT / "pyproject.toml", "rb") as handle:
        declared = set(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])
    typed = {f.metadata["key"] for f in dataclasses.fields(RunConfig) if f.metadata["key"]}
    assert declared == typed
    required = {
        "dataset",
        "data-dir",
        "model",
        "client",
        "strategy",
        "num-server-rounds",
        "fraction-train",
        "fraction-evaluate",
        "eval-every",
        "local-epochs",
        "batch-size",
        "learning-rate",
        "embedding-dim",
        "num-train-negatives",
        "seed",
        "device",
        "users-per-node",
        "results-dir",
    }
    assert required <= declared


def test_defaults_validate_and_round_trip():
    config = default_run_config()
    assert config.dataset == "ml-100k" and config.k_values == (5, 10, 20) and config.mlp_layer_sizes == (64, 32, 16)
    assert RunConfig.from_mapping(config.to_dict()) == config
    assert config.replace(seed=7).seed == 7


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num-server-rounds", "ten", "num-server-rounds"),
        ("num-server-rounds", 0, ">= 1"),
        ("fraction-train", 0.0, "fraction-train"),
        ("fraction-train", 1.5, "<= 1.0"),
        ("holdout-validation", "yes", "true or false"),
        ("model", "transformer", "one of"),
        ("ks", "5,ten", "comma-separated"),
        ("ks", "5,200", "may not exceed"),
        ("device", "tpu", "device"),
        ("learning-rate", float("nan"), "finite"),
    ],
)
def test_bad_values_name_the_key(key, value, message):
    mapping = default_mapping()
    mapping[key] = value
    with pytest.raises(ConfigError, match=message) as info:
        RunConfig.from_mapping(mapping)
    assert key in str(info.value)


def test_unknown_and_missing_keys_are_errors():
    mapping = default_mapping()
    mapping["learning_rate"] = 0.1
    with pytest.raises(ConfigError, match="unknown run-config key.*learning_rate"):
        RunConfig.from_mapping(mapping)
    mapping = default_mapping()
    del mapping["seed"]
    with pytest.raises(ConfigError, match=r"\[.seed.\] missing"):
        RunConfig.from_mapping(mapping)


def test_make_run_config_accepts_snake_case():
    assert make_run_config(num_server_rounds=3, users_per_node=10).users_per_node == 10


def test_get_runtime_takes_a_validated_run_config_as_its_mapping(tmp_path):
    """``get_runtime(make_run_config(...))`` (the README's attack snippet) is the runtime of the same mapping (it
    raised AttributeError: 'RunConfig' object has no attribute 'items')."""
    from conftest import tiny_run_config

    from fedrec_flwr.app.runtime import get_runtime
    from fedrec_flwr.config import RunConfig

    mapping = tiny_run_config(tmp_path)
    assert get_runtime(RunConfig.from_mapping(mapping)) is get_runtime(RunConfig.from_mapping(mapping).to_dict())
