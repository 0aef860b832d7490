"""Faults in a running federation, in-process (SerialGrid): a SuperNode that dies mid-run, one that restarts with a
new node id and rejoins, and what ``client-state-dir`` keeps across the restart. (Real processes: test_deployment.)"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from fedrec_flwr.serial import run_serial
from tests.conftest import tiny_run_config, without_timings

ROUNDS = 5


def _run(folder, *, on_round=None, **overrides):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    settings = {
        "model": "mf",
        "users_per_node": 6,
        "num_server_rounds": ROUNDS,
        "fraction_train": 0.5,
        "min_train_fraction": 0.5,
        **overrides,
    }
    config = tiny_run_config(folder, **settings)
    result, grid = run_serial(config, on_round=on_round, return_grid=True)
    rows = json.loads((result / "metrics.json").read_text())
    return result, grid, rows


def _final(result):
    data = np.load(result / "final_arrays.npz")
    return {k: data[k] for k in data.files}


def _restart_node_after(round_: int, restarted: dict):
    """An on_round hook that kills node 1001 (partition 1) after ``round_`` and starts it again at once."""

    def hook(view):
        if view.server_round == round_:
            old = view.grid.stop_node(1001)
            restarted["old-state-keys"] = len(old.state)
            restarted["new"] = view.grid.start_node(1)

    return hook


@pytest.mark.parametrize("state_dir", [True, False], ids=["client-state-dir", "memory-only"])
def test_a_restarted_supernode_rejoins_and_with_client_state_dir_loses_no_user(tmp_path, state_dir):
    reference, _, reference_rows = _run(tmp_path / "ref")
    restarted: dict = {}
    extra = {"client_state_dir": str(tmp_path / "device")} if state_dir else {}
    result, grid, rows = _run(tmp_path / "restart", on_round=_restart_node_after(2, restarted), **extra)
    new = restarted["new"]
    assert 1001 not in grid.contexts and new in grid.contexts
    assert grid.contexts[new].node_config["partition-id"] == 1
    assert all(r["num-failures"] == 0 for r in rows), "the new node took over partition 1 before round 3"
    assert grid.messages_delivered > 0
    same_model = all(np.array_equal(a, b) for a, b in zip(_final(reference).values(), _final(result).values()))
    if state_dir:
        # the users of the restarted node reloaded their embeddings from their files: the run is unchanged
        assert same_model
        assert without_timings(rows) == without_timings(reference_rows)
    else:
        # without files the restart lost partition 1's trained embeddings (they start again from the seed)
        assert restarted["old-state-keys"] > 0
        assert not same_model


def test_a_dead_supernode_costs_only_its_replies_and_training_goes_on(tmp_path, caplog):
    def kill(view):
        if view.server_round == 2:
            view.grid.stop_node(1002)

    with caplog.at_level("WARNING", logger="fedrec_flwr.strategies.item_fedavg"):
        result, grid, rows = _run(tmp_path / "kill", on_round=kill, fraction_train=1.0)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert [r["num-failures"] for r in rows] == [0, 0, 1, 1, 1]  # every later round lost node 1002's reply
    assert all(r["num-replies"] == 3 for r in rows[2:])
    assert all(r["eval-users"] == 18 for r in rows[2:])  # its 6 users cannot be evaluated either
    assert "node 1002 failed" in caplog.text and "Node Unavailable" in caplog.text
    assert (result / "summary.json").is_file()
    assert json.loads((result / "summary.json").read_text())["client-failures"] == {"1002": 3}


def test_a_round_with_too_few_live_nodes_fails_loudly(tmp_path):
    from fedrec_flwr.strategies.item_fedavg import RoundFailed

    def kill_three(view):
        if view.server_round == 1:
            for node in (1001, 1002, 1003):
                view.grid.stop_node(node)

    with pytest.raises(RoundFailed, match="round 2: 1 valid replies of 4 sampled nodes"):
        _run(tmp_path / "fail", on_round=kill_three, fraction_train=1.0)


def test_a_node_without_its_data_stops_the_run_at_start_naming_node_and_file(tmp_path, task_identity):
    """A SuperNode whose data folder lacks the dataset's files answers the identify query with the loader's error,
    and the ServerApp stops before any training with a message naming the node and the missing file."""
    from flwr.app import Context, RecordDict

    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.app.server_app import main
    from fedrec_flwr.errors import ConfigError
    from fedrec_flwr.serial import SerialGrid

    good = tiny_run_config(tmp_path, users_per_node=24)
    broken = {**good, "generic-file": str(tmp_path / "missing" / "tiny.csv")}  # what the node sees
    grid = SerialGrid(make_client_app(broken), 1, broken)
    server = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=good)
    with pytest.raises(ConfigError, match=r"node 1000 cannot serve this run: .*missing/tiny.csv"):
        main(grid, server)
    assert not (tmp_path / "results" / "run" / "metrics.csv").exists()


def test_identify_answers_a_runtime_that_cannot_be_built_with_one_error_reply(tmp_path, task_identity):
    """Under plain ``flwr run`` no launcher preflight runs: a run config the node cannot build its runtime from (here
    FedAU² with a protected attribute the generic dataset does not have) must come back as one error reply naming the
    key, not as an exception (which Ray prints as a whole actor traceback per node)."""
    from flwr.app import Context, Message, RecordDict

    from fedrec_flwr.app.client_app import identify
    from fedrec_flwr.wire import IDENTIFY

    config = {**tiny_run_config(tmp_path), "client": "fedau2", "adversary": "mlp", "protected-attribute": "gender"}
    message = Message(RecordDict(), dst_node_id=1, message_type=f"query.{IDENTIFY}")
    message.metadata.__dict__["_message_id"] = "m1"
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config=config)
    reply = identify(message, context)
    assert reply.has_error()
    assert "protected-attribute" in reply.error.reason
