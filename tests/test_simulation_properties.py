"""Properties of whole federated runs on tiny generated data (fast), in the in-process serial grid (the same apps,
strategy and clients as Flower's Ray simulation, which gives bit-identical runs: test_serial_equals_ray.py).

Privacy (no client message carries a user embedding), private state across rounds, exactness of users-per-node,
the reported metrics against a recomputation, and config errors at start. The end-to-end run on real MovieLens-100K
through `flwr run` is in test_flwr_run_end_to_end.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import (
    MessageRecorder,
    assert_no_private_value_in_replies,
    private_vectors,
    seeded_private_vectors,
    tiny_run_config,
)
from flwr.app import Context, RecordDict

from fedrec_flwr.app.client_app import make_client_app
from fedrec_flwr.registry import resolve
from fedrec_flwr.serial import run_serial
from fedrec_flwr.wire import ModelLayout, sample_users

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recorded")
    config = tiny_run_config(folder, fraction_train=0.5, num_server_rounds=3)
    recorder = MessageRecorder(folder / "messages")
    results, grid = run_serial(config, client_app=make_client_app(config, mods=[recorder]), return_grid=True)
    return config, recorder.records(), results, grid


def _runtime(config):
    from fedrec_flwr.app.runtime import get_runtime

    return get_runtime(config)


def test_run_writes_its_results_folder_and_the_metrics_of_its_final_model(recorded_run):
    config, _, results, grid = recorded_run
    for name in (
        "config.json",
        "metrics.csv",
        "metrics.json",
        "final_arrays.npz",
        "summary.json",
        "learning_curves.png",
    ):
        assert (results / name).is_file(), name
    rows = json.loads((results / "metrics.json").read_text())
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert json.loads((results / "config.json").read_text())["tie-rule"] == config["tie-rule"]
    # the last round's HR@10 / NDCG@10, recomputed from the final shared arrays and each user's private state on its
    # node (trained, or seeded if never sampled) by scoring the candidates and ranking with ties against
    runtime = _runtime(config)
    split, model, cls = runtime.split, runtime.model, resolve("client", config["client"])
    with np.load(results / "final_arrays.npz") as final:
        shared = {k: final[k] for k in final.files}
    candidates = np.concatenate([split.test_items[:, None], split.test_negatives], axis=1)
    ranks = []
    for user in range(split.num_users):
        cls(runtime, user, grid.contexts[1000 + user].state).load_private()
        model.load_shared_state(shared)
        model.eval()
        with torch.no_grad():
            logits = model(torch.zeros(candidates.shape[1], dtype=torch.int64), torch.as_tensor(candidates[user]))
        logits = logits.numpy().astype(np.float64)
        ranks.append(int((logits >= logits[0]).sum()) - 1)
    ranks = np.array(ranks)
    assert rows[-1]["eval-users"] == split.num_users == 24
    assert rows[-1]["HR@10"] == pytest.approx(np.mean(ranks < 10), abs=1e-12)
    assert rows[-1]["NDCG@10"] == pytest.approx(np.mean(np.where(ranks < 10, 1 / np.log2(ranks + 2), 0)), abs=1e-12)


def test_no_client_message_carries_a_user_embedding(recorded_run):
    config, records, _, _ = recorded_run
    layout: ModelLayout = _runtime(config).layout
    train = [r for r in records if r["type"] == "train"]
    assert train, "no train replies recorded"
    assert len(private_vectors(records)) >= 2 * 12  # both NCF tables of every trained user, at least
    assert_no_private_value_in_replies(records, layout, extra=seeded_private_vectors(config))
    for record in records:
        if record["type"] == "train":
            assert set(record["reply-arrays"]["arrays"]) <= set(layout.reply_keys())
        else:
            assert not record["reply-arrays"], "evaluate/query replies carry metrics only"


def test_a_handler_changes_only_its_own_users_records(recorded_run):
    _, records, _, _ = recorded_run
    for record in records:
        mine = {f"user:{u}" for u in record["users"]}
        before, after = record["state-before"], record["state"]
        for key in set(before) | set(after):
            if key in mine and record["type"] == "train":
                continue
            assert key in before and key in after, (record["type"], key)
            assert all(np.array_equal(before[key][n], after[key][n]) for n in before[key]), (record["type"], key)


def test_embedding_changes_only_when_sampled_and_evaluate_sees_the_last_train(recorded_run):
    config, records, _, _ = recorded_run
    num_users = max(int(r["partition-id"]) for r in records) + 1
    last: dict[int, dict] = {}
    for rnd in (1, 2, 3):
        sampled = set(sample_users(config["seed"], rnd, num_users, config["fraction-train"]).tolist())
        trained = {r["partition-id"]: r for r in records if r["type"] == "train" and r["round"] == rnd}
        assert set(trained) == sampled
        for user, record in trained.items():
            state = record["state"][f"user:{user}"]
            if user in last:  # trained again: it moved
                assert any(not np.array_equal(state[k], last[user][k]) for k in state)
            last[user] = state
        for record in (r for r in records if r["type"] == "evaluate" and r["round"] == rnd):
            user = record["partition-id"]
            key = f"user:{user}"
            if user in last:  # bit-identical to what its last train produced
                assert all(np.array_equal(record["state"][key][k], last[user][k]) for k in last[user])
            else:  # never trained: nothing stored
                assert key not in record["state"]


def test_users_per_node_1_and_10_give_the_same_model(tmp_path):
    one = run_serial(tiny_run_config(tmp_path / "a", users_per_node=1))
    ten = run_serial(tiny_run_config(tmp_path / "b", users_per_node=10))
    a, b = np.load(one / "final_arrays.npz"), np.load(ten / "final_arrays.npz")
    assert set(a.files) == set(b.files)
    for key in a.files:  # a node sums its users' contributions first: equal up to float32 summation order
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    ma, mb = json.loads((one / "metrics.json").read_text()), json.loads((ten / "metrics.json").read_text())
    for ra, rb in zip(ma, mb, strict=True):
        assert ra["HR@10"] == pytest.approx(rb["HR@10"], abs=1e-9)


@pytest.mark.parametrize(("num_nodes", "message"), [(20, "needs exactly 24"), (30, "out of range")])
def test_a_number_of_nodes_that_does_not_match_the_users_fails_at_start(tmp_path, task_identity, num_nodes, message):
    """As with ``num-supernodes`` in Flower's simulation: the ServerApp's identify phase refuses the federation."""
    from fedrec_flwr.app.server_app import main
    from fedrec_flwr.errors import ConfigError
    from fedrec_flwr.serial import SERVER_NODE_ID, SerialGrid

    config = tiny_run_config(tmp_path)
    grid = SerialGrid(make_client_app(config), num_nodes, config)
    context = Context(run_id=1, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(), run_config=config)
    with pytest.raises(ConfigError, match=message):
        main(grid, context, config)
    assert not (tmp_path / "results" / "run" / "metrics.json").exists()  # stopped before any training
