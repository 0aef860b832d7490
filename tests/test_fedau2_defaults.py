"""FedAU²'s package defaults (issue 14, seventh session): the protective arm measured on MovieLens-100K, and the
``adversary-class-prior = "published"`` prior they use."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import tiny_run_config

from experiments.fedau2.methods import ARMS, CLASS_PRIORS, PROTOCOL
from fedrec_flwr.adversary import class_prior_text, parse_class_prior
from fedrec_flwr.attributes import PUBLISHED_CLASS_COUNTS, encode_attribute, published_class_prior
from fedrec_flwr.config import FIRST_RELEASE_ADVERSARY, default_mapping, make_run_config
from fedrec_flwr.errors import ConfigError

MEASURED_ARM = (
    "FedAU2-server, 20 server steps, prior, linear, entropy (ours), always, rate 0.001, eps 0.1, noise on all of h_w"
)
"""The arm whose settings the package defaults are (experiments/fedau2/README.md, items 10-13)."""


def test_package_defaults_are_the_measured_protective_arm_not_the_first_release():
    """Every adversary key the first release defaulted to SUT + reversal now defaults to the measured arm's value, so
    ``client = "fedau2"`` with ``adversary = "dsvae"`` and nothing else is the arm the README reports (the prior is
    ``"published"``, which resolves to the arm's explicit shares: next test)."""
    defaults = default_mapping()
    arm = {**PROTOCOL, **ARMS[MEASURED_ARM]}
    for key, first_release in FIRST_RELEASE_ADVERSARY.items():
        if key == "adversary-class-prior":
            assert defaults[key] == "published"
            continue
        if key == "dsvae-noise-stream":  # eighth session: the measured arm's stream was per upload; now per user
            assert defaults[key] == "per-user" and arm[key] == first_release == "per-upload"
            continue
        assert defaults[key] == arm[key], key
        assert defaults[key] != first_release, key
    assert ARMS[MEASURED_ARM]["adversary"] == "dsvae" and defaults["adversary-training"] == "server"
    assert defaults["adversary"] == "none"  # only a client that unlearns attributes reads these keys


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
    config = make_run_config(**{"dataset": "ml-100k", "protected-attribute": attribute})
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
        )
    )
    assert config.adversary_class_prior == "published" and class_prior_text(config) == ""
    with caplog.at_level(logging.WARNING, logger="fedrec_flwr.adversary"):
        FedAU2Client.check_config(config)
    assert any("no published class shares" in r.getMessage() and "'generic'" in r.getMessage() for r in caplog.records)


def test_published_prior_refuses_a_split_whose_classes_differ():
    config = make_run_config(**{"dataset": "ml-100k", "protected-attribute": "age"})
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
