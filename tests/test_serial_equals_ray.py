"""The in-process serial grid (fedrec_flwr.serial) and Flower's Ray simulation give bit-identical runs, for each
client family: one Ray run per family (2 client actors, so replies arrive in any order), compared exactly.

Every other whole-run test uses the serial grid (same apps, strategy and clients; only transport differs), so this is
the one place CI pays for Ray. FedAU²'s and HF-KCU's identity tests still live in test_adversary.py and
test_unlearning.py (owned with those methods)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import simulate, tiny_run_config, without_timings

from fedrec_flwr.serial import run_serial

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FEDRECGEL = {
    "client": "fedrecgel",
    "strategy": "server-optimizer",
    "learning-rate": 0.1,
    "batch-size": 16,
    "server-learning-rate": 0.01,
    "rho-shared": 0.1,
    "rho-private": 0.05,
}
PFEDREC = {
    "model": "pfedrec",
    "client": "pfedrec",
    "optimizer": "sgd",
    "learning-rate": 0.1,
    "item-aggregation": "selected",
}
FAMILIES = {"fedrec": {}, "fedrecgel": FEDRECGEL, "pfedrec": PFEDREC}
RAY_ONLY = {"fedrec": {"max_in_flight": 2}, "pfedrec": {"fast_link_state": False}}
"""The Ray run of one family keeps at most two messages in flight (fedrec_flwr.app.message_window; the auto window is
larger than these tiny rounds): the window changes when messages are sent, never what comes back. Another runs on
Flower's own link-state lookup (the others on fedrec_flwr/app/flower_patches.py's, the default): the same runs either
way."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def ray_and_serial(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    overrides = dict(users_per_node=5, num_server_rounds=2, **FAMILIES[request.param])
    ray = simulate(
        tiny_run_config(folder / "ray", **overrides, **RAY_ONLY.get(request.param, {})), num_cpus=2, cpus_per_client=1
    )  # 2 actors
    serial = run_serial(tiny_run_config(folder / "serial", **overrides))
    return ray, serial


def test_final_arrays_are_bit_identical(ray_and_serial):
    ray, serial = ray_and_serial
    with np.load(ray / "final_arrays.npz") as a, np.load(serial / "final_arrays.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_metrics_are_identical(ray_and_serial):
    ray, serial = ray_and_serial
    rows = without_timings(json.loads((ray / "metrics.json").read_text()))
    assert [r["round"] for r in rows] == [1, 2]
    assert rows == without_timings(json.loads((serial / "metrics.json").read_text()))


def test_config_json_records_the_window_each_run_used(ray_and_serial, request):
    ray, serial = ray_and_serial
    family = request.node.callspec.params["ray_and_serial"]
    ray_window = json.loads((ray / "config.json").read_text())["messages-in-flight"]
    # the family run with max-in-flight 2 records it; the others the auto window (at least 32) of Flower's engine
    assert ray_window == 2 if "max_in_flight" in RAY_ONLY.get(family, {}) else ray_window >= 32
    assert json.loads((serial / "config.json").read_text())["messages-in-flight"] == "all"  # no window on run_serial


def test_config_json_records_the_link_state_lookup_and_the_patch_is_undone(ray_and_serial, request):
    from fedrec_flwr.app import flower_patches

    ray, serial = ray_and_serial
    family = request.node.callspec.params["ray_and_serial"]
    lookup = json.loads((ray / "config.json").read_text())["link-state-lookup"]
    assert lookup == ("Flower's own" if family == "pfedrec" else "by destination (fast-link-state)")
    assert json.loads((serial / "config.json").read_text())["link-state-lookup"] == "none (no simulation link state)"
    assert not flower_patches.active()  # the ServerApp put Flower's method back when it ended
