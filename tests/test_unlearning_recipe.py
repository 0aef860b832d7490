"""The default unlearning recipe: ``unlearning = "auto"`` picks rollback when the run stored its contributions and
HF-KCU otherwise, and ``unlearning-post-check = "auto"`` checks an approximate step when the run holds out a
validation item. The resolved values are what the validated config (and so ``config.json``) records."""

from __future__ import annotations

import pytest

from fedrec_flwr.config import make_run_config
from fedrec_flwr.unlearning.settings import resolve_post_check, resolve_unlearning


@pytest.mark.parametrize(
    ("forget_users", "forget_fraction", "history", "expected"),
    [
        ("", 0.0, "off", "none"),  # nobody to forget: no phase
        (" , ", 0.0, "float32", "none"),
        ("3,17", 0.0, "off", "hfkcu"),
        ("", 0.01, "off", "hfkcu"),
        ("3", 0.0, "float32", "rollback"),
        ("", 0.05, "float16", "rollback"),
    ],
)
def test_auto_resolves_to_the_recipe(forget_users, forget_fraction, history, expected):
    assert resolve_unlearning("auto", forget_users, forget_fraction, history) == expected


@pytest.mark.parametrize("method", ["none", "retrain", "continue", "hfkcu", "gradient-ascent", "rollback"])
def test_an_explicit_method_is_kept(method):
    assert resolve_unlearning(method, "3", 0.0, "float32") == method


@pytest.mark.parametrize(
    ("method", "holdout", "expected"),
    [("hfkcu", True, "on"), ("gradient-ascent", True, "on"), ("hfkcu", False, "off"), ("rollback", True, "off")],
)
def test_auto_post_check_checks_approximate_steps_with_a_validation_item(method, holdout, expected):
    assert resolve_post_check("auto", method, holdout) == expected
    assert resolve_post_check("off", method, holdout) == "off"


def test_the_validated_config_records_the_resolved_recipe():
    plain = make_run_config(unlearning="auto", forget_users="3,17", unlearning_post_check="auto")
    assert (plain.unlearning, plain.unlearning_post_check) == ("hfkcu", "off")
    assert plain.to_dict()["unlearning"] == "hfkcu"
    checked = make_run_config(
        unlearning="auto", forget_users="3", unlearning_post_check="auto", holdout_validation=True
    )
    assert (checked.unlearning, checked.unlearning_post_check) == ("hfkcu", "on")
    stored = make_run_config(
        unlearning="auto",
        forget_users="3",
        unlearning_history="float32",
        unlearning_post_check="auto",
        holdout_validation=True,
    )
    assert (stored.unlearning, stored.unlearning_post_check) == ("rollback", "off")
    nobody = make_run_config(unlearning="auto", unlearning_post_check="auto")
    assert (nobody.unlearning, nobody.unlearning_post_check) == ("none", "off")


def test_the_rollback_keys_are_inert_for_another_method():
    # the recipe's rollback keys have non-zero defaults; a run that forgets with HF-KCU must not trip on them
    config = make_run_config(
        unlearning="hfkcu", forget_users="3", rollback_calibration_every=20, rollback_tuning_rounds=5
    )
    assert config.unlearning == "hfkcu"
