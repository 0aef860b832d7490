"""FedRecGEL and PFedRec clients in whole (serial) federated runs on tiny generated data (their equivalence with
Flower's Ray simulation: test_serial_equals_ray.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import MessageRecorder, assert_no_private_value_in_replies, seeded_private_vectors, tiny_run_config
from test_serial_equals_ray import FEDRECGEL, PFEDREC

from fedrec_flwr.app.client_app import make_client_app
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.local.sam import SAMTrainer
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer
from fedrec_flwr.models import build_model
from fedrec_flwr.serial import run_serial

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _serial(folder, recorder=None, **overrides):
    config = tiny_run_config(folder, **overrides)
    mods = [recorder] if recorder else None
    return config, run_serial(config, client_app=make_client_app(config, mods=mods))


@pytest.mark.parametrize(
    ("name", "overrides", "kinds"),
    [
        ("fedrecgel", FEDRECGEL, {"user", "user-opt"}),
        ("fedrecgel-fedavg-of-updates", {**FEDRECGEL, "strategy": "item-fedavg"}, {"user", "user-opt"}),
        ("pfedrec", PFEDREC, {"user", "user-rows"}),
    ],
)
def test_no_reply_carries_private_parameters(tmp_path, name, overrides, kinds):
    """Every private record (``user:`` parameters, FedRecGEL's ``user-opt:`` Adam moments, ...) held before or after
    any handler, and each user's seeded initial parameters, appear in no reply (conftest's check)."""
    recorder = MessageRecorder(tmp_path / "messages")
    config, results = _serial(tmp_path, recorder, users_per_node=4, **overrides)
    records = recorder.records()
    assert {key.split(":")[0] for r in records for key in r["state"]} == kinds
    assert_no_private_value_in_replies(records, get_runtime(config).layout, extra=seeded_private_vectors(config))
    rows = json.loads((results / "metrics.json").read_text())
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:  # a mean of 0/1 hits over the evaluated users
        assert row["eval-users"] == 24 and row["HR@10"] * 24 == pytest.approx(round(row["HR@10"] * 24), abs=1e-9)


def test_fedrecgel_uploads_gradients_with_unit_weight_and_keeps_its_optimizer_state(tmp_path):
    recorder = MessageRecorder(tmp_path / "messages")
    _serial(tmp_path, recorder, users_per_node=1, fraction_train=1.0, **FEDRECGEL)
    train = sorted(
        (r for r in recorder.records() if r["type"] == "train"), key=lambda r: (r["partition-id"], r["round"])
    )
    assert train
    for record in train:
        assert record["reply-metrics"]["metrics"]["num-examples"] == 1.0  # each user's gradient counts once
    user0 = [r for r in train if r["partition-id"] == 0]
    steps = [float(r["state"]["user-opt:0"]["0/step"]) for r in user0]
    assert steps == [1.0, 2.0, 3.0]  # the private Adam state persists across rounds, on the node only


def test_pfedrec_evaluates_with_its_personalised_rows(tmp_path):
    from flwr.app import RecordDict

    from fedrec_flwr.clients.pfedrec import PFedRecClient

    config = tiny_run_config(tmp_path, **PFEDREC)
    runtime = get_runtime(config)
    shared = {k: v.numpy() for k, v in runtime.model.shared_state().items()}
    state = RecordDict()
    client = PFedRecClient(runtime, 0, state)
    client.fit_named(shared, {"server-round": 1})
    personal = state["user-rows:0"]
    rows, values = personal["rows"].numpy(), personal["values"].numpy()
    assert not np.allclose(values, shared["item_embedding.weight"][rows])  # fine-tuned
    client.evaluate_named(shared, {"split": "test"})
    table = runtime.model.item_embedding.weight.detach().numpy()
    np.testing.assert_array_equal(table[rows], values)  # evaluated with the personal view
    others = np.setdiff1d(np.arange(len(table)), rows)
    np.testing.assert_array_equal(table[others], shared["item_embedding.weight"][others])
    # the next user is not affected by the previous user's view
    PFedRecClient(runtime, 1, RecordDict()).evaluate_named(shared, {"split": "test"})
    np.testing.assert_array_equal(runtime.model.item_embedding.weight.detach().numpy(), shared["item_embedding.weight"])


def test_fedrecgel_with_both_rho_zero_is_a_plain_full_batch_step():
    rng = np.random.default_rng(0)
    items = rng.choice(40, size=20, replace=False).astype(np.int64)
    users = np.zeros(20, np.int64)
    labels = np.r_[np.ones(4, np.float32), np.zeros(16, np.float32)]
    models = [build_model("ncf", 1, 40, embedding_dim=8, mlp_layers=(16, 8), seed=1) for _ in range(2)]
    cfg = LocalTrainConfig(learning_rate=0.05, optimizer="sgd", batch_size=20)
    SAMTrainer(models[0], cfg, rho_shared=0, rho_private=0, update_shared=True).fit_examples(
        users, items, labels, torch.Generator().manual_seed(0)
    )
    LocalTrainer(models[1], cfg).fit_examples(users, items, labels, torch.Generator().manual_seed(0))
    for (key, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=key)


def test_pfedrec_client_needs_the_pfedrec_model(tmp_path):
    from flwr.app import RecordDict

    from fedrec_flwr.clients.pfedrec import PFedRecClient
    from fedrec_flwr.errors import ConfigError

    runtime = get_runtime(tiny_run_config(tmp_path, client="pfedrec"))
    with pytest.raises(ConfigError, match="model = 'pfedrec'"):
        PFedRecClient(runtime, 0, RecordDict())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "server-optimizer"}, "uploads parameters"),  # client = fedrec
        ({"client": "pfedrec"}, "needs model = 'pfedrec'"),
        ({**FEDRECGEL, "loss": "bpr"}, "loss = 'bce'"),
    ],
)
def test_incompatible_client_strategy_model_fail_at_start_with_one_message(tmp_path, overrides, message):
    from fedrec_flwr.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _serial(tmp_path, users_per_node=6, **overrides)
    assert not (tmp_path / "results" / "run" / "metrics.json").exists()


def test_a_finished_results_folder_is_never_overwritten(tmp_path):
    from fedrec_flwr.errors import ConfigError

    _serial(tmp_path, users_per_node=6, num_server_rounds=1)
    with pytest.raises(ConfigError, match="already holds a finished run"):
        _serial(tmp_path, users_per_node=6, num_server_rounds=1, model="mf")


def test_fedrecgel_gradient_average_does_not_depend_on_users_per_node(tmp_path):
    _, one = _serial(tmp_path / "one", users_per_node=1, **FEDRECGEL)
    _, six = _serial(tmp_path / "six", users_per_node=6, **FEDRECGEL)
    a, b = np.load(one / "final_arrays.npz"), np.load(six / "final_arrays.npz")
    for key in a.files:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
