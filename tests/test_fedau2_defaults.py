"""FedAU²'s package defaults: ``client = "fedau2"`` with a ``protected-attribute`` and nothing else trains against a
linear ``h_w`` (``adversary = "auto"``) under SecAgg+ with the adaptive weight and the ``"aggregate"`` class prior; the
``"published"`` prior is kept as a choice."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import tiny_run_config

from experiments.fedau2.methods import ARMS, CLASS_PRIORS, DSVAE_ARM, DSVAE_DEFAULTS, PACKAGE_DEFAULTS_ARM, PROTOCOL
from fedrec_flwr.adversary import class_prior_text, parse_class_prior
from fedrec_flwr.adversary.prior import MESSAGE_PRIOR_KEY, aggregate_shares, round_prior_text
from fedrec_flwr.attributes import PUBLISHED_CLASS_COUNTS, encode_attribute, published_class_prior
from fedrec_flwr.config import FIRST_RELEASE_ADVERSARY, default_mapping, make_run_config
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.adversary import AUTO_ADVERSARY, resolve_adversary

PUBLISHED = {"adversary-class-prior": "published"}


def test_fedau2_with_a_protected_attribute_gets_the_secure_adaptive_linear_adversary():
    config = make_run_config(**{"dataset": "ml-100k", "client": "fedau2", "protected-attribute": "gender"})
    assert config.adversary == AUTO_ADVERSARY == "mlp" and config.adversary_hidden == 0
    assert config.adversary_training == "server" and config.secure_aggregation == "secagg+"
    assert config.adversary_weight_rule == "adaptive" and config.adversary_class_prior == "aggregate"
    assert config.adversary_objective == "entropy" and config.adversary_trigger == "always"
    assert default_mapping()["adversary"] == "auto"


@pytest.mark.parametrize(
    "client, attribute, adversary, expected",
    [
        ("fedau2", "gender", "auto", "mlp"),
        ("fedau2-gel", "age", "auto", "mlp"),
        ("fedau2", "", "auto", "none"),  # nothing to protect
        ("fedrec", "gender", "auto", "none"),  # a client that never trains against an adversary
        ("fedau2", "gender", "dsvae", "dsvae"),  # an explicit choice is kept
        ("fedau2", "gender", "none", "none"),
    ],
)
def test_auto_resolves_by_client_and_attribute(client, attribute, adversary, expected):
    assert resolve_adversary(adversary, client, attribute) == expected
    config = make_run_config(
        **{"dataset": "ml-100k", "client": client, "protected-attribute": attribute, "adversary": adversary}
    )
    assert config.adversary == expected


def test_secure_aggregation_and_the_adaptive_rule_are_inert_without_an_adversary():
    config = make_run_config(**{"dataset": "ml-100k", "client": "fedrec"})
    assert config.adversary == "none" and config.secure_aggregation == "secagg+"  # nothing reads them


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"secure-aggregation": "off", "adversary-class-prior": ""}, "adversary-weight-rule"),
        ({"adversary-weight-rule": "fixed", "adversary-class-prior": ""}, "secure-aggregation"),
        ({"adversary-weight-rule": "fixed", "secure-aggregation": "off"}, "adversary-class-prior.*aggregate"),
    ],
)
def test_a_per_client_adversary_refuses_each_server_side_default_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_run_config(
            **{
                "dataset": "ml-100k",
                "client": "fedau2",
                "protected-attribute": "gender",
                "adversary-training": "per-client",
                **overrides,
            }
        )


def test_aggregate_shares_are_add_one_smoothed_counts_and_reach_the_client_through_the_message():
    assert [float(v) for v in aggregate_shares([2.0, 6.0]).split(",")] == [0.3, 0.7]
    assert [float(v) for v in aggregate_shares([0.0, 0.0, 1.0]).split(",")] == [0.25, 0.25, 0.5]
    config = make_run_config(**{"dataset": "ml-100k", "client": "fedau2", "protected-attribute": "gender"})
    assert class_prior_text(config) == ""  # nothing static
    assert round_prior_text(config, {}) == ""  # round 1: no counts yet
    text = round_prior_text(config, {MESSAGE_PRIOR_KEY: aggregate_shares([2, 6])})
    torch.testing.assert_close(parse_class_prior(text, 2), torch.log(torch.tensor([0.3, 0.7])))
    published = make_run_config(
        **{"dataset": "ml-100k", "client": "fedau2", "protected-attribute": "gender", **PUBLISHED}
    )
    assert round_prior_text(published, {MESSAGE_PRIOR_KEY: "0.5,0.5"}) == class_prior_text(published)


def test_the_server_step_counts_classes_sends_their_shares_and_checkpoints_them():
    from fedrec_flwr.adversary.adaptive import statistics_length
    from fedrec_flwr.strategies.adversary import CLASS_COUNTS_STATE, AdversaryServerStep

    step = AdversaryServerStep(["adversary.head.bias"], aggregate_prior_classes=2)
    assert step.wants_statistics and step.train_config() == {}  # before any count
    stats = np.zeros(statistics_length(2))
    stats[:2] = [3.0000004, 5.9999996]  # the users block, with a quantization residue
    step.count_classes(stats)
    step.count_classes(stats)
    assert step.class_counts.tolist() == [6.0, 12.0]
    assert step.train_config() == {MESSAGE_PRIOR_KEY: aggregate_shares([6, 12])}
    saved = step.state_arrays()
    assert saved[CLASS_COUNTS_STATE].tolist() == [6.0, 12.0]
    fresh = AdversaryServerStep(["adversary.head.bias"], aggregate_prior_classes=2)
    fresh.load_state_arrays(None, saved)
    assert fresh.class_counts.tolist() == [6.0, 12.0]
    assert not AdversaryServerStep(["adversary.head.bias"]).wants_statistics


def test_the_dsvae_arm_keeps_the_keys_its_committed_runs_used():
    """The comparison arm: DSVAE with a fixed eps 0.1, the published prior and uploads in the clear; every key it sets
    differs from the first release's or is a key the first release lacked, and the package defaults arm sets none."""
    arm = {**PROTOCOL, **ARMS[DSVAE_ARM]}
    assert arm["adversary"] == "dsvae" and arm["secure-aggregation"] == "off"
    assert arm["adversary-weight-rule"] == "fixed" and arm["adversary-epsilon"] == 0.1
    assert set(DSVAE_DEFAULTS) == set(FIRST_RELEASE_ADVERSARY)
    assert all(value is None for key, value in ARMS[PACKAGE_DEFAULTS_ARM].items() if key != "client")


def test_the_first_release_adversary_keys_are_a_package_constant_of_valid_run_config_values():
    """``FIRST_RELEASE_ADVERSARY`` lives in the package (``fedrec_flwr.config``: tests and the README rely on it, and
    the package cannot import ``experiments``); the experiments' old name is the same object, and every key is a
    run-config key whose value the config takes as given."""
    from experiments.fedau2 import methods

    assert methods.FIRST_RELEASE_ADVERSARY is FIRST_RELEASE_ADVERSARY
    config = make_run_config(**FIRST_RELEASE_ADVERSARY).to_dict()
    assert {key: config[key] for key in FIRST_RELEASE_ADVERSARY} == FIRST_RELEASE_ADVERSARY
    assert all(PROTOCOL[key] == value for key, value in FIRST_RELEASE_ADVERSARY.items())


@pytest.mark.parametrize("attribute", ["gender", "age"])
def test_published_prior_equals_the_shares_the_experiments_pass_explicitly(attribute):
    config = make_run_config(**{"dataset": "ml-100k", "protected-attribute": attribute, **PUBLISHED})
    published = parse_class_prior(class_prior_text(config), len(PUBLISHED_CLASS_COUNTS["ml-100k", attribute]))
    explicit = parse_class_prior(CLASS_PRIORS[attribute], len(PUBLISHED_CLASS_COUNTS["ml-100k", attribute]))
    np.testing.assert_allclose(published.exp().numpy(), explicit.exp().numpy(), atol=1e-4)


def test_published_counts_are_the_real_user_file(ml100k_dir):
    """The table is MovieLens-100K's ``u.user`` counted by :func:`encode_attribute` (classes in its order)."""
    from fedrec_flwr.data.loaders import locate_source, read_interactions

    raw = read_interactions(locate_source("ml-100k", ml100k_dir, download=False))
    attributes = {name: raw.attributes[name].to_numpy() for name in raw.attributes.columns}
    for (dataset, attribute), counts in PUBLISHED_CLASS_COUNTS.items():
        assert dataset == "ml-100k"
        labels = encode_attribute(attributes, attribute)
        assert labels.classes == tuple(counts), attribute
        assert labels.class_counts().tolist() == list(counts.values()), attribute


def test_published_prior_without_published_shares_falls_back_to_none_and_says_so(tmp_path, caplog):
    from fedrec_flwr.clients.fedau2 import FedAU2Client

    attributes = tmp_path / "attributes.csv"
    attributes.write_text("user,gender\n" + "".join(f"u{u},{'FM'[u % 3 == 0]}\n" for u in range(24)))
    config = make_run_config(
        **tiny_run_config(
            tmp_path,
            client="fedau2",
            adversary="dsvae",
            protected_attribute="gender",
            generic_attributes_file=str(attributes),
            adversary_class_prior="published",
        )
    )
    assert config.adversary_class_prior == "published" and class_prior_text(config) == ""
    with caplog.at_level(logging.WARNING, logger="fedrec_flwr.adversary"):
        FedAU2Client.check_config(config)
    assert any("no published class shares" in r.getMessage() and "'generic'" in r.getMessage() for r in caplog.records)


def test_published_prior_refuses_a_split_whose_classes_differ():
    config = make_run_config(**{"dataset": "ml-100k", "protected-attribute": "age", **PUBLISHED})
    with pytest.raises(ConfigError, match="adversary-class-prior.*published.*'<18'"):
        class_prior_text(config, classes=("18-24", "25-34", "35-44", "45-49", "50-55", "56+"))
    assert published_class_prior("filmtrust", "gender") is None


def test_an_attribute_of_a_generic_dataset_without_an_attributes_file_is_refused_before_any_prior_warning(
    tmp_path, caplog
):
    """'generic' without 'generic-attributes-file' has no user attributes: the run config refuses the protected
    attribute itself, so FedAU²'s "no published class shares" warning (about a prior it would never use) is not
    printed before the error."""
    with caplog.at_level(logging.WARNING):
        with pytest.raises(
            ConfigError, match="'protected-attribute' = 'gender': the dataset 'generic' has no user attributes"
        ):
            make_run_config(
                **tiny_run_config(tmp_path, client="fedau2", adversary="dsvae", protected_attribute="gender")
            )
    assert not any("published class shares" in r.getMessage() for r in caplog.records)
