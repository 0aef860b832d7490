"""The compute floor of experiments/bench/bench_floor.py runs the same computation as a block-mode run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_run_config

from experiments.bench.bench_floor import run_floor
from fedrec_flwr.serial import run_serial


@pytest.mark.parametrize(
    "overrides",
    [{}, {"client": "fedrecgel", "rho-private": 0.02, "strategy": "server-optimizer"}],
    ids=["fedncf", "fedrecgel"],
)
def test_floor_equals_the_serial_block_run_after_two_rounds(tmp_path, overrides):
    """The floor (block functions and the strategy's aggregation, no messages) gives run_serial's final arrays bit
    for bit with block-training = "on" and 10 users per node, and the same per-round HR@10 and train loss."""
    floor = run_floor(
        tiny_run_config(tmp_path / "floor", users_per_node=10, block_training="on", num_server_rounds=2, **overrides)
    )
    folder = run_serial(
        tiny_run_config(tmp_path / "serial", users_per_node=10, block_training="on", num_server_rounds=2, **overrides)
    )
    final = np.load(folder / "final_arrays.npz")
    assert set(final.files) == set(floor["arrays"])
    for key in final.files:
        np.testing.assert_array_equal(floor["arrays"][key], final[key], err_msg=key)
    rows = json.loads((folder / "metrics.json").read_text())
    assert [r["round"] for r in floor["rows"]] == [r["round"] for r in rows] == [1, 2]
    for mine, theirs in zip(floor["rows"], rows, strict=True):
        assert mine["HR@10"] == pytest.approx(theirs["HR@10"], abs=1e-12)
        assert mine["train-loss"] == pytest.approx(theirs["train-loss"], rel=1e-12)
        assert mine["eval-users"] == theirs["eval-users"] == 24


def test_floor_refuses_the_per_user_path(tmp_path):
    with pytest.raises(ValueError, match="block path"):
        run_floor(tiny_run_config(tmp_path, block_training="off"))
