"""The default results folder name says what kind of run it holds."""

from __future__ import annotations

from fedrec_flwr.config import make_run_config


def test_default_results_folder_says_the_run_unlearned():
    from fedrec_flwr.app.server_app import default_run_name

    plain = default_run_name(make_run_config(run_name=""))
    unlearned = default_run_name(make_run_config(run_name="", unlearning="retrain", forget_users="0"))
    assert "unlearn" not in plain and "-unlearn-retrain-" in unlearned
