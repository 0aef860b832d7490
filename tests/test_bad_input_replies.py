"""Bad input, cases 9-12 (numbered across the tests/test_bad_input_*.py files): values in Flower records, clients'
own metrics, a node silent during evaluation, and state that a resume would lose. In-process runs
(:mod:`fedrec_flwr.serial`) on tiny generated data."""

from __future__ import annotations

import csv
import json
import logging

import numpy as np
import pytest
import torch

from fedrec_flwr.app.client_app import RecordValueError, UserMetrics, metric_record, record_number
from fedrec_flwr.clients.fedrec import FedRecClient
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.serial import run_serial
from fedrec_flwr.wire import sample_users
from tests.conftest import tiny_run_config

HERE = "tests.test_bad_input_replies"


class NumpyScalarClient(FedRecClient):
    """A plug-in whose results are numpy scalars (case 9): loss ``np.float32``, examples ``np.int64``."""

    def fit_named(self, shared, config):
        update = super().fit_named(shared, config)
        update.loss = np.float32(update.loss)
        update.num_examples = np.int64(update.num_examples)
        update.metrics = {"extra-metric": np.float32(1.5)}
        return update

    def evaluate_named(self, shared, config):
        return {k: np.float32(v) for k, v in super().evaluate_named(shared, config).items()}


class StringMetricClient(FedRecClient):
    def fit_named(self, shared, config):
        update = super().fit_named(shared, config)
        update.metrics = {"note": "fine"}
        return update


class UserIndexMetricClient(FedRecClient):
    """Case 10: every user weighs 1 and reports its index and a constant."""

    def fit_named(self, shared, config):
        update = super().fit_named(shared, config)
        update.weight = 1.0
        update.metrics = {"extra-metric": 1.5, "user-index": float(self.user)}
        return update


def _rows(folder):
    with open(folder / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _tiny(tmp_path, **overrides):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    return tiny_run_config(tmp_path, model="mf", **overrides)


def test_record_values_are_converted_or_refused_by_key_and_client_class():
    assert (
        record_number(np.float32(0.25), "k", None) == 0.25 and type(record_number(np.float32(0.25), "k", None)) is float
    )
    assert type(record_number(np.int64(3), "k", None)) is int and record_number(np.bool_(True), "k", None) == 1
    assert record_number(torch.tensor(2.5), "k", None) == 2.5 and record_number(np.array([4]), "k", None) == 4
    record = metric_record({"a": np.float16(0.5), "b": np.arange(3), "c": [1, np.float64(2.5)]}, None)
    assert dict(record) == {"a": 0.5, "b": [0, 1, 2], "c": [1.0, 2.5]}
    for bad in ("abc", None, np.zeros(2).reshape(1, 2)):
        with pytest.raises(RecordValueError, match=rf"client {__name__}:StringMetricClient: metric 'loss' = "):
            record_number(bad, "loss", StringMetricClient)


def test_a_numpy_scalar_in_a_reply_is_converted(tmp_path):
    """Case 9: ``np.float32`` in a NumPyClient's results made every train reply fail (``RoundFailed``)."""
    folder = run_serial(_tiny(tmp_path, client=f"{HERE}:NumpyScalarClient", num_server_rounds=2))
    rows = _rows(folder)
    assert [int(r["round"]) for r in rows] == [1, 2]
    assert all(float(r["num-failures"]) == 0 and np.isfinite(float(r["train-loss"])) for r in rows)
    assert all(float(r["extra-metric"]) == 1.5 and 0 <= float(r["HR@10"]) <= 1 for r in rows)


def test_a_value_no_record_can_hold_names_the_key_and_the_client(tmp_path):
    from fedrec_flwr.strategies.item_fedavg import RoundFailed

    with pytest.raises(RoundFailed) as caught:
        run_serial(_tiny(tmp_path, client=f"{HERE}:StringMetricClient", num_server_rounds=1))
    assert f"client {HERE}:StringMetricClient: metric 'note' = 'fine' (str) is not a number" in str(caught.value)


def test_user_update_metrics_reach_metrics_csv_as_weighted_means(tmp_path):
    """Case 10: ``UserUpdate.metrics`` were dropped; now each is the weighted mean over the round's trained users
    (weights: the users' aggregation weights, 1 here), whatever their grouping into nodes."""
    for upn in (1, 4):
        config = _tiny(
            tmp_path / f"upn{upn}", client=f"{HERE}:UserIndexMetricClient", num_server_rounds=2, users_per_node=upn
        )
        rows = _rows(run_serial(config))
        for row in rows:
            users = sample_users(0, int(row["round"]), 24, 0.5)
            assert float(row["extra-metric"]) == 1.5
            assert float(row["user-index"]) == pytest.approx(users.mean(), abs=1e-12)
    metrics = UserMetrics()
    metrics.add({"m": 1.0}, 3.0, None)
    metrics.add({"m": np.float32(5.0)}, 1.0, None)
    assert metrics.means() == {"m": 2.0}
    with pytest.raises(RecordValueError, match="report different UserUpdate.metrics keys"):
        metrics.add({"other": 1.0}, 1.0, None)
    with pytest.raises(RecordValueError, match="key 'train-loss' is reserved"):
        UserMetrics().add({"train-loss": 1.0}, 1.0, None)


def test_a_node_silent_during_evaluation_is_logged_and_counted(tmp_path, task_identity, caplog):
    """Case 11: only ``eval-users`` dropped; now the node is named, with the users it left out, and counted."""
    from flwr.app import Context, RecordDict

    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.app.server_app import main
    from fedrec_flwr.serial import SerialGrid

    class SilentInEvaluation(SerialGrid):
        silent = 1002

        def send_and_receive(self, messages, *, timeout=None):
            replies = list(super().send_and_receive(messages, timeout=timeout))
            return [
                m
                for m in replies
                if not (m.metadata.message_type == "evaluate" and int(m.metadata.src_node_id) == self.silent)
            ]

    config = _tiny(tmp_path, users_per_node=6, num_server_rounds=2)
    grid = SilentInEvaluation(make_client_app(config), 4, config)
    caplog.set_level(logging.WARNING, logger="fedrec_flwr.strategies")
    folder = main(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=config))
    rows = json.loads((folder / "metrics.json").read_text())
    assert [r["eval-users"] for r in rows] == [18, 18] and [r["eval-failures"] for r in rows] == [1, 1]
    assert (
        "round 1: evaluation failed on node 1002 (6 users not evaluated: 12..17): no reply within round-timeout"
        in caplog.text
    )
    assert json.loads((folder / "summary.json").read_text())["evaluation-failures"] == {"1002": 2}


def _checkpointed_run(tmp_path, name, **overrides):
    """A 3-round run with a checkpoint after round 2, as if stopped before its summary.json (a finished run is never
    resumed), so its folder can be resumed to run round 3 again."""
    config = _tiny(tmp_path, num_server_rounds=3, checkpoint_every=2, eval_every=3, run_name=name, **overrides)
    folder = run_serial(config)
    (folder / "summary.json").unlink()
    return config, folder


def test_resume_without_client_state_files_is_refused_or_warned(tmp_path, caplog):
    """Case 12: a resume without ``client-state-dir`` silently restarted every user's embedding."""
    config, folder = _checkpointed_run(tmp_path, "memory")
    resume = {**config, "resume-from": str(folder)}
    with pytest.raises(
        ConfigError,
        match=r"run-config key 'resume-from': resuming after round 2 loses the clients' "
        r"private state: the interrupted run .* did not keep .*user embedding.*"
        r"Set 'resume-resets-client-state' = true",
    ):
        run_serial(resume)
    from fedrec_flwr.app.preflight import preflight

    with pytest.raises(ConfigError, match="did not keep its clients' private state in files"):
        preflight(resume)  # the launcher's check too: refused before Ray starts, exit 2
    # client-state-dir set only on the resumed run finds no files: the same
    with pytest.raises(ConfigError, match="did not keep its clients' private state in files"):
        run_serial({**resume, "client-state-dir": str(tmp_path / "device")})
    caplog.set_level(logging.WARNING, logger="fedrec_flwr")
    package_logger = logging.getLogger("fedrec_flwr")  # the ServerApp's handler stops propagation to the root's
    package_logger.addHandler(caplog.handler)
    try:
        assert run_serial({**resume, "resume-resets-client-state": True}) == folder
    finally:
        package_logger.removeHandler(caplog.handler)
    assert "loses the clients' private state" in caplog.text and "(resume-resets-client-state = true)" in caplog.text
    assert [r["round"] for r in json.loads((folder / "metrics.json").read_text())] == [1, 2, 3]


def test_resume_with_client_state_files_needs_no_key(tmp_path, caplog):
    config, folder = _checkpointed_run(tmp_path, "files", client_state_dir=str(tmp_path / "device"))
    whole = json.loads((folder / "metrics.json").read_text())
    caplog.set_level(logging.WARNING, logger="fedrec_flwr")
    run_serial({**config, "resume-from": str(folder)})
    assert "loses the clients' private state" not in caplog.text
    again = json.loads((folder / "metrics.json").read_text())
    assert again[-1]["HR@10"] == whole[-1]["HR@10"]


def test_other_resumable_state_survives_or_is_named(tmp_path, caplog):
    """The kind of case 12: the curious server's label-leakage records survive a resume; failure counts of node ids
    that are gone are kept and said to be so."""
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.strategies.curious import LEAKAGE_FILE, CuriousItemFedAvg
    from fedrec_flwr.wire import ModelLayout, Topology

    layout = ModelLayout(shared_shapes={}, item_keys=(), private_keys=())
    config = make_run_config()
    first = CuriousItemFedAvg(layout, topology=Topology(np.array([7, 7, 8], dtype=np.uint64)))
    first.setup_audit(config)
    first.leakage_records = [{"round": 1, "node": 7, "user": 0, "idlg-label": 1, "dlg-label": -1}]
    first.failures, first.evaluation_failures = {7: 2}, {8: 1}
    state, arrays = first.checkpoint_state()

    resumed = CuriousItemFedAvg(layout, topology=Topology(np.array([9, 9, 8], dtype=np.uint64)))
    resumed.setup_audit(config)
    resumed.attach_results(tmp_path)
    caplog.set_level(logging.WARNING, logger="fedrec_flwr.strategies")
    resumed.restore_checkpoint_state(json.loads(json.dumps(state)), arrays, None)
    assert resumed.leakage_records == first.leakage_records
    # a record from before the linked attack and the secure-sum attack (or restored from an older checkpoint) writes
    # -1 (not run) in both columns
    assert (tmp_path / LEAKAGE_FILE).read_text().splitlines()[1] == "1,7,0,1,-1,-1,-1"
    assert resumed.failures == {7: 2} and resumed.evaluation_failures == {8: 1}
    assert "resumed failure counts name node ids [7] that are not connected now" in caplog.text
