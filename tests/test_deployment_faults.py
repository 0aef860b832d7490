"""Faults on real Flower processes: a SuperNode killed (SIGKILL) mid-round costs only its reply,
the run goes on, and when it is started again (a new node id) it rejoins with its users' private state, which it
keeps in files (``client-state-dir``). The in-process versions of these scenarios, with exact model comparisons, are
in test_fault_tolerance.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time


from pathlib import Path

from fedrec_flwr.client_state import ClientStateStore
from fedrec_flwr.deploy import Deployment
from fedrec_flwr.launch import _group_members
from tests.conftest import write_tiny_dataset

ROUNDS = 5


def _rows(folder):
    try:
        return json.loads((folder / "metrics.json").read_text())
    except (OSError, ValueError):
        return []


def _running_clientapp(pid: int) -> bool:
    """Whether SuperNode ``pid``'s process group runs a ClientApp process now (it is handling a message)."""
    for member in _group_members(pid):
        try:
            if b"flwr-clientapp" in Path(f"/proc/{member}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def test_a_supernode_killed_mid_round_costs_its_reply_then_rejoins_with_its_users_state(tmp_path):
    results, state_dir = tmp_path / "results", tmp_path / "client-state"
    overrides = {
        "dataset": "generic", "generic-file": str(write_tiny_dataset(tmp_path / "data", num_users=24)),
        "cache-dir": str(tmp_path / "cache"), "results-dir": str(results), "run-name": "faults", "model": "mf",
        "embedding-dim": 8, "num-test-negatives": 20, "ks": "5,10", "users-per-node": 8,
        "num-server-rounds": ROUNDS, "fraction-train": 1.0, "eval-every": ROUNDS, "min-train-fraction": 0.5,
        "round-timeout": 180.0, "client-state-dir": str(state_dir),  # an upper bound: a dead node is
        # reported by the SuperLink once its heartbeats stop (about 30 s), long before this
    }
    folder = results / "faults"
    outcome: dict = {}
    with Deployment(tmp_path / "deploy", num_supernodes=3) as deployment:
        def run():
            try:
                outcome["result"] = deployment.run(overrides, timeout=900)
            except Exception as err:  # noqa: BLE001 - reported below
                outcome["error"] = err

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        victim = next(p for p in deployment.processes if p.name == "supernode-1")
        deadline = time.monotonic() + 600
        while runner.is_alive() and time.monotonic() < deadline and not (
                _rows(folder) and _running_clientapp(victim.process.pid)):
            time.sleep(0.05)
        assert _rows(folder) and runner.is_alive(), f"round 2 never started: {outcome}"
        killed_after = len(_rows(folder))
        os.killpg(victim.process.pid, signal.SIGKILL)  # the SuperNode and its ClientApp process, mid-round
        while len(_rows(folder)) < killed_after + 1 and runner.is_alive():
            time.sleep(0.2)  # the round completes without it
        deployment.start_supernode(1, name="supernode-1-restarted")
        runner.join(timeout=900)
        assert not runner.is_alive(), "the run did not finish"
    assert deployment.leftover() == [], "every process the test started is ended"
    assert "error" not in outcome, str(outcome.get("error"))[-4000:]
    output = outcome["result"].output

    rows = _rows(folder)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    failures = [int(r["num-failures"]) for r in rows]
    assert failures[0] == 0 and failures[killed_after] == 1, failures  # the round it died in lost its reply
    assert failures[-1] == 0, f"the restarted node trains its users again: {failures}"
    assert rows[-1]["eval-users"] == 24, "every user, those of the restarted node included, was evaluated"
    assert f"round {killed_after + 1}: node " in output and " failed: " in output
    assert "joined: partition-id 1, users 8..15" in output
    # the users' private state lives in the devices' files, one per user, none in the server's folder
    files = sorted((state_dir / "faults").glob("user-*.npz"))
    assert [p.name for p in files] == sorted(f"user-{u}.npz" for u in range(24))
    versions = ClientStateStore(state_dir / "faults").read_versions(8)
    assert max(versions) == ROUNDS, "partition 1's first user trained in the last round, after the restart"
    assert not any(p.name.startswith("user-") for p in folder.iterdir())
