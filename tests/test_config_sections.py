"""RunConfig is composed of sections, each declaring the keys of its groups of [tool.flwr.app.config], and the
built-in datasets are one DatasetSpec each, from which every other table of dataset facts is read."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import PROJECT_ROOT

from fedrec_flwr import attributes, config_reference
from fedrec_flwr.config import DATASETS, RunConfig, make_run_config
from fedrec_flwr.data import download
from fedrec_flwr.data.config import DataSection
from fedrec_flwr.data.datasets import DATASET_SPECS, GENERIC
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.adversary import AdversarySection
from fedrec_flwr.sections.deployment import DeploymentSection
from fedrec_flwr.sections.federation import FederationSection
from fedrec_flwr.sections.training import TrainingSection

SECTION_GROUPS = {
    DataSection: {"data"},
    TrainingSection: {"model and local training"},
    AdversarySection: {'attribute unlearning (FedAU2, client = "fedau2")'},
    FederationSection: {"federation"},
    DeploymentSection: {"deployment, faults and checkpoints", "output"},
}


def _keys(cls) -> list[str]:
    return [f.metadata["key"] for f in dataclasses.fields(cls) if f.metadata.get("key")]


def test_each_section_declares_exactly_the_keys_of_its_groups():
    by_group: dict[str, list[str]] = {}
    for item in config_reference.entries(PROJECT_ROOT / "pyproject.toml"):
        by_group.setdefault(item.group, []).append(item.name)
    for section, groups in SECTION_GROUPS.items():
        expected = [key for group in by_group if group in groups for key in by_group[group]]
        assert sorted(_keys(section)) == sorted(expected), section


def test_run_config_inherits_every_section_and_declares_no_key_twice():
    keys = _keys(RunConfig)
    assert len(keys) == len(set(keys))
    inherited = [key for section in SECTION_GROUPS for key in _keys(section)]
    assert set(inherited) <= set(keys)
    own = set(keys) - set(inherited)
    assert "unlearning" in own and "krylov-mode" in own and "embedding-dim" not in own


def test_a_sections_choices_are_checked_and_listed_in_the_reference():
    with pytest.raises(ConfigError, match="'block-training' = 'sometimes': must be one of"):
        make_run_config(block_training="sometimes")
    with pytest.raises(ConfigError, match="'dsvae-noise-stream' = 'never': must be one of"):
        make_run_config(dsvae_noise_stream="never")
    assert config_reference.entry("dataset").allowed == DATASETS
    assert config_reference.entry("krylov-solver").allowed == ("steihaug", "cg")


def test_a_sections_own_check_runs_when_the_config_is_built():
    with pytest.raises(ConfigError, match="'evaluate-validation' = true needs 'holdout-validation' = true"):
        make_run_config(evaluate_validation=True, holdout_validation=False)
    with pytest.raises(ConfigError, match="'device' = 'tpu'"):
        make_run_config(device="tpu")
    config = make_run_config(ks="1,5", mlp_layers="8,4")
    assert (config.k_values, config.mlp_layer_sizes) == ((1, 5), (8, 4))


def test_the_dataset_list_download_tables_and_attribute_facts_come_from_the_specs():
    assert DATASETS == (*DATASET_SPECS, GENERIC)
    assert download.URLS == {name: spec.url for name, spec in DATASET_SPECS.items()}
    assert download.SHA256 == {name: dict(spec.sha256) for name, spec in DATASET_SPECS.items()}
    assert attributes.DATASET_ATTRIBUTES == {name: spec.attributes for name, spec in DATASET_SPECS.items()}
    assert attributes.PUBLISHED_CLASS_COUNTS[("ml-100k", "gender")] == {"F": 273, "M": 670}
    for name, spec in DATASET_SPECS.items():
        assert spec.name == name
        assert set(spec.files) <= set(spec.sha256), name
        assert next(iter(spec.sha256)) == spec.files[0], name  # the file that marks the dataset folder
        assert set(spec.published_class_counts) <= set(spec.attributes), name
    assert [n for n, s in DATASET_SPECS.items() if s.fedrecgel_timestamps is not None] == ["filmtrust"]
