"""Properties of whole federated runs in Flower's simulation engine, on tiny generated data (fast).

Privacy (no client message carries a user embedding), private state across rounds, exactness of users-per-node,
and determinism across the number of client actors. The end-to-end run on real MovieLens-100K through `flwr run` is
in test_flwr_run_end_to_end.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import MessageRecorder, simulate, tiny_run_config, without_timings
from fedrec_flwr.wire import ModelLayout, sample_users

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recorded")
    config = tiny_run_config(folder, fraction_train=0.5, num_server_rounds=3)
    recorder = MessageRecorder(folder / "messages")
    results = simulate(config, recorder=recorder)
    return config, recorder.records(), results


def _layout(config):
    from fedrec_flwr.runtime import get_runtime

    return get_runtime(config).layout


def test_run_writes_its_results_folder(recorded_run):
    config, _, results = recorded_run
    for name in ("config.json", "metrics.csv", "metrics.json", "final_arrays.npz", "summary.json", "learning_curves.png"):
        assert (results / name).is_file(), name
    rows = json.loads((results / "metrics.json").read_text())
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["HR@10"] <= 1.0 for r in rows)
    assert json.loads((results / "config.json").read_text())["tie-rule"] == config["tie-rule"]


def test_no_client_message_carries_a_user_embedding(recorded_run):
    config, records, _ = recorded_run
    layout: ModelLayout = _layout(config)
    train = [r for r in records if r["type"] == "train"]
    assert train, "no train replies recorded"
    # every user embedding that ever existed on any node, as rows
    private_rows = [row for r in records for rec in r["state"].values() for arr in rec.values() for row in np.atleast_2d(arr)]
    assert private_rows
    for record in records:
        assert not record["error"], record["error"]
        for name, arrays in record["reply-arrays"].items():
            for key, array in arrays.items():
                assert key.split("#")[0] not in layout.private_keys, key
                if record["type"] == "train":
                    assert key in layout.reply_keys(), key
                flat = np.atleast_2d(array).astype(np.float64)
                for row in private_rows:
                    if flat.shape[-1] == row.shape[-1]:
                        assert not np.isclose(flat, row, rtol=0, atol=1e-7).all(axis=-1).any(), (
                            f"reply array {key} contains a user embedding")
        if record["type"] != "train":
            assert not record["reply-arrays"], "evaluate/query replies carry metrics only"


def test_embedding_changes_only_when_sampled_and_evaluate_sees_the_last_train(recorded_run):
    config, records, _ = recorded_run
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
    one = simulate(tiny_run_config(tmp_path / "a", users_per_node=1))
    ten = simulate(tiny_run_config(tmp_path / "b", users_per_node=10))
    a, b = np.load(one / "final_arrays.npz"), np.load(ten / "final_arrays.npz")
    assert set(a.files) == set(b.files)
    for key in a.files:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    ma, mb = json.loads((one / "metrics.json").read_text()), json.loads((ten / "metrics.json").read_text())
    for ra, rb in zip(ma, mb, strict=True):
        assert ra["HR@10"] == pytest.approx(rb["HR@10"], abs=1e-9)


def test_same_seed_same_metrics_with_one_and_two_actors(tmp_path):
    one = simulate(tiny_run_config(tmp_path / "a"), num_cpus=2, cpus_per_client=2)  # 1 actor
    two = simulate(tiny_run_config(tmp_path / "b"), num_cpus=2, cpus_per_client=1)  # 2 actors
    strip = without_timings
    assert strip(json.loads((one / "metrics.json").read_text())) == strip(json.loads((two / "metrics.json").read_text()))
    a, b = np.load(one / "final_arrays.npz"), np.load(two / "final_arrays.npz")
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize(("num_supernodes", "message"), [(20, "needs exactly 24"), (30, "out of range")])
def test_num_supernodes_that_does_not_match_the_users_fails_at_start(tmp_path, num_supernodes, message):
    from fedrec_flwr.errors import ConfigError

    config = tiny_run_config(tmp_path)
    with pytest.raises(ConfigError, match=message):
        simulate(config, num_supernodes=num_supernodes)
    assert not (tmp_path / "results" / "run" / "metrics.json").exists()  # stopped before any training
