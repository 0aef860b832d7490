"""Strategies and clients plug in by registry name or as any importable module:Class."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_run_config
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.registry import resolve
from fedrec_flwr.serial import run_serial
from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg, Topology
from fedrec_flwr.wire import ModelLayout


def test_registry_names_and_module_class_specs_resolve():
    assert resolve("strategy", "item-fedavg") is ItemEmbeddingFedAvg
    assert resolve("strategy", "fedrec_flwr.strategies.item_fedavg:ItemEmbeddingFedAvg") is ItemEmbeddingFedAvg
    from fedrec_flwr.clients.fedrec import FedRecClient

    assert resolve("client", "fedrec") is FedRecClient


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "not a registered"),
        ("no.such.module:X", "cannot import"),
        ("fedrec_flwr.strategies.item_fedavg:Nope", "has no"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ConfigError, match=message):
        resolve("strategy", spec)


def test_example_strategy_applies_its_server_learning_rate(task_identity):
    cls = resolve("strategy", "experiments.example_strategy:ServerLrItemFedAvg")
    layout = ModelLayout({"item.weight": (2, 1), "out.weight": (1, 1)}, ("item.weight",), ("user.weight",))
    strategy = cls(layout, topology=Topology(np.array([7])), fraction_train=1.0)
    arrays = ArrayRecord(
        {"item.weight": Array(np.array([[0.0], [4.0]], np.float32)), "out.weight": Array(np.array([[2.0]], np.float32))}
    )
    (request,) = strategy.configure_train(1, arrays, ConfigRecord(), grid=None)
    reply_arrays = {
        "item.weight#rows": np.array([0]),
        "item.weight#sum": np.array([[10.0]], np.float32),
        "item.weight#count": np.array([1.0], np.float32),
        "out.weight": np.array([[4.0]], np.float32),
    }
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in reply_arrays.items()}),
            "metrics": MetricRecord({"num-examples": 3.0, "num-users": 1, "train-loss": 0.1}),
        }
    )
    new, _ = strategy.aggregate_train(1, [Message(content=content, reply_to=request)])
    np.testing.assert_allclose(new["item.weight"].numpy(), [[5.0], [4.0]])  # 0 + 0.5 * (10 - 0); row 1 untouched
    np.testing.assert_allclose(new["out.weight"].numpy(), [[3.0]])  # 2 + 0.5 * (4 - 2)


def test_a_run_with_the_plugged_in_strategy_completes(tmp_path):
    """In-process (the serial grid runs the same ServerApp and ClientApp as Flower's simulation)."""
    config = tiny_run_config(
        tmp_path, strategy="experiments.example_strategy:ServerLrItemFedAvg", num_server_rounds=2, users_per_node=6
    )
    results = run_serial(config)
    rows = json.loads((results / "metrics.json").read_text())
    assert [r["round"] for r in rows] == [1, 2]
