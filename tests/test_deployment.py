"""Real Flower deployment on loopback: one ``flower-superlink`` and several ``flower-supernode`` processes.

The deployed runs must give exactly the model of the in-process serial run of the same config (which is
bit-identical to the Ray simulation, ``tests/test_method_clients.py``): transport, process layout and node ids change,
the arithmetic does not. Every test ends all the processes it started and checks that none is left.

An idle SuperNode polls every 3 s and starts one ClientApp process per message, so these runs are short. The tests
marked ``slow`` (TLS with SuperNode auth, a SuperNode without node config, a SuperNode killed mid-round) take several
minutes each and run only with ``FEDREC_SLOW_TESTS=1`` (tests/conftest.py); measured on a loaded 2-core machine:
equality 256 s, TLS 224 s, no node config 103 s, killed SuperNode 295 s, wrapper checks 24 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedrec_flwr.config import make_run_config
from fedrec_flwr.launch import group_members, processes_with_env
from fedrec_flwr.launch.deploy import Deployment, DeploymentError, app_snapshot, free_port, make_node_keys
from fedrec_flwr.serial import run_serial
from fedrec_flwr.state.client_state import ClientStateStore
from tests.conftest import without_timings, write_tiny_dataset

BASE = {"model": "mf", "users-per-node": 315, "fraction-train": 0.1, "seed": 0}
"""ml-100k's 943 users on 3 SuperNodes (partition ids 0..2)."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One processed-split cache for the module (the serial run fills it, the deployed ClientApps read it)."""
    return tmp_path_factory.mktemp("deploy-cache")


def _overrides(ml100k_dir, cache_dir, **keys) -> dict:
    return {"data-dir": str(ml100k_dir), "cache-dir": str(cache_dir), **BASE, **keys}


def _serial(tmp_path, overrides):
    return run_serial(make_run_config(**overrides, **{"results-dir": str(tmp_path / "serial"), "run-name": "serial"}))


def _assert_same_run(deployed, serial) -> None:
    """Same metrics (all but wall-time columns) and same final shared arrays as the serial run."""
    rows = without_timings(json.loads((deployed / "metrics.json").read_text()))
    expected = without_timings(json.loads((serial / "metrics.json").read_text()))
    assert [r["round"] for r in rows] == [r["round"] for r in expected]
    for row, want in zip(rows, expected):
        assert row.keys() == want.keys()
        for key in want:
            assert row[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), (row["round"], key)
    with np.load(deployed / "final_arrays.npz") as got, np.load(serial / "final_arrays.npz") as want:
        assert sorted(got.files) == sorted(want.files)
        for name in want.files:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-7, err_msg=name)


def _assert_nothing_left(deployment: Deployment) -> None:
    left = deployment.leftover() + processes_with_env("FLWR_HOME", str(deployment.home))
    assert not left, f"processes left running: {left}"


@pytest.fixture(scope="module")
def three_supernodes(tmp_path_factory):
    """One insecure loopback deployment with 3 SuperNodes, shared by the tests below that use it (the last one
    kills and restarts a SuperNode); every process it started is ended, and checked, at the end of the module."""
    root = tmp_path_factory.mktemp("three-supernodes")
    # a snapshot of the app: its FAB builds at once (`flwr run .` walks .venv/ too; the last test submits the
    # checkout itself)
    deployment = Deployment(root / "deploy", num_supernodes=3, project=app_snapshot(root / "app"))
    with deployment:
        yield deployment
    _assert_nothing_left(deployment)


def test_deployed_run_equals_serial_simulation(tmp_path, ml100k_dir, cache_dir, three_supernodes):
    """3 SuperNodes (insecure loopback), 2 rounds, evaluation after round 2: same metrics and model as serial."""
    overrides = _overrides(ml100k_dir, cache_dir, **{"num-server-rounds": 2, "eval-every": 2})
    serial = _serial(tmp_path, overrides)
    outcome = three_supernodes.run(
        {**overrides, "results-dir": str(tmp_path / "deployed"), "run-name": "deployed"}, timeout=900
    )

    assert "ml-100k: 943 users on 3 nodes" in outcome.output
    assert "round    2 | HR@10" in outcome.output
    rows = outcome.metrics()
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["num-failures"] == 0 and r["num-replies"] == 3 for r in rows)
    assert rows[-1]["eval-users"] == 943
    _assert_same_run(outcome.folder, serial)
    final, want = outcome.summary()["final"], json.loads((serial / "summary.json").read_text())["final"]
    print(
        f"deployed HR@10 {final['HR@10']!r} NDCG@10 {final['NDCG@10']!r}; serial HR@10 {want['HR@10']!r} "
        f"NDCG@10 {want['NDCG@10']!r}; per-round seconds {[r['seconds'] for r in rows]}"
    )
    assert (final["HR@10"], final["NDCG@10"]) == (want["HR@10"], want["NDCG@10"])


@pytest.mark.slow
def test_deployed_run_with_tls_and_supernode_auth(tmp_path, ml100k_dir, cache_dir):
    """TLS on every SuperLink API and CLI-managed SuperNode authentication: registered nodes train (same result
    as serial), a node with an unregistered key is refused."""
    overrides = _overrides(ml100k_dir, cache_dir, **{"num-server-rounds": 1, "eval-every": 1})
    serial = _serial(tmp_path, overrides)

    deployment = Deployment(
        tmp_path / "deploy", num_supernodes=3, tls=True, auth=True, project=app_snapshot(tmp_path / "app")
    )
    with deployment:
        intruder = deployment.start_supernode(0, make_node_keys(tmp_path / "intruder", "key"), name="intruder")
        outcome = deployment.run(
            {**overrides, "results-dir": str(tmp_path / "deployed"), "run-name": "deployed"}, timeout=900
        )
        deadline = time.monotonic() + 120
        while intruder.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        superlink_log = deployment.superlink.tail(100_000)
        node_logs = [p.tail(100_000) for p in deployment.processes if p.name.startswith("supernode-")]
    _assert_nothing_left(deployment)

    assert "Uvicorn running on https://" in superlink_log  # TLS on the one port of Fleet, Control and Runtime APIs
    cli_config = (deployment.home / "config.toml").read_text()
    assert "root-certificates" in cli_config and "insecure" not in cli_config
    assert len(deployment.node_ids) == 3  # the ids `flwr supernode register` gave are the ones that joined
    assert sorted(f"SuperNode ID: {i}" in log for log in node_logs for i in deployment.node_ids).count(True) == 3
    # refused at activation: the SuperNode exits (its SuperExec child retries until the deployment ends it)
    assert intruder.process.returncode not in (None, 0), intruder.tail()
    assert "Failed to activate SuperNode" in intruder.tail(100_000)
    assert "Attempted to register SuperNode with public key" in superlink_log
    _assert_same_run(outcome.folder, serial)


def _supernode(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedrec_flwr.launch.deploy", "supernode", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_supernode_wrapper_refuses_bad_node_config_and_missing_superlink(ml100k_dir, cache_dir):
    """The checking wrapper fails at once, naming the key or the address, instead of starting flower-supernode."""
    with socket.socket() as server:  # something listening, for the cases that must get past the probe
        server.bind(("127.0.0.1", 0))
        server.listen()
        live = f"127.0.0.1:{server.getsockname()[1]}"

        missing = _supernode("--num-partitions", "3", "--superlink", live)
        assert missing.returncode == 2 and "'partition-id'" in missing.stderr, missing.stderr
        for bad in ("3", "-1"):
            out_of_range = _supernode("--partition-id", bad, "--num-partitions", "3", "--superlink", live)
            assert out_of_range.returncode == 2, out_of_range.stderr
            assert f"'partition-id' = {bad} is out of range" in out_of_range.stderr
        not_int = _supernode("--node-config", "partition-id=first num-partitions=3", "--superlink", live)
        assert not_int.returncode == 2 and "'partition-id' = 'first': expected an integer" in not_int.stderr
        no_partitions = _supernode("--partition-id", "0", "--superlink", live)
        assert no_partitions.returncode == 2 and "'num-partitions'" in no_partitions.stderr
        # against the dataset: 943 users with 315 per node need exactly 3 SuperNodes
        data = ["--dataset", "ml-100k", "--data-dir", str(ml100k_dir), "--cache-dir", str(cache_dir)]
        wrong_count = _supernode(
            "--partition-id", "3", "--num-partitions", "4", "--users-per-node", "315", *data, "--superlink", live
        )
        assert wrong_count.returncode == 2 and "'num-partitions' = 4" in wrong_count.stderr, wrong_count.stderr
        assert "needs exactly 3" in wrong_count.stderr

        good = _supernode(
            "--partition-id",
            "2",
            "--num-partitions",
            "3",
            "--users-per-node",
            "315",
            *data,
            "--superlink",
            live,
            "--insecure",
            "--port",
            "9999",
            "--dry-run",
        )
        assert good.returncode == 0, good.stderr
        assert "users 630..942" in good.stderr
        assert "flower-supernode --superlink " + live in good.stdout
        assert "--node-config 'partition-id=2 num-partitions=3'" in good.stdout

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    nobody = _supernode("--partition-id", "0", "--num-partitions", "3", "--superlink", dead, "--insecure")
    assert nobody.returncode == 2
    assert f"no SuperLink listening at {dead}" in nobody.stderr
    assert time.monotonic() - started < 30  # fails at once instead of retrying forever


@pytest.mark.slow
def test_supernode_without_node_config_fails_the_run_naming_partition_id(tmp_path, ml100k_dir, cache_dir):
    """A real flower-supernode started without --node-config joins; the run fails at the identify phase with the
    ClientApp's message naming 'partition-id' (the server refuses before any training). This run submits the
    checkout itself (``flwr run <project root>``), as a user would."""
    deployment = Deployment(tmp_path / "deploy", node_configs=[None])  # 1 SuperNode, no node config
    with deployment:
        with pytest.raises(DeploymentError) as failure:
            deployment.run(
                {
                    **_overrides(ml100k_dir, cache_dir, **{"users-per-node": 943, "num-server-rounds": 1}),
                    "results-dir": str(tmp_path / "deployed"),
                    "run-name": "deployed",
                },
                timeout=600,
            )
    _assert_nothing_left(deployment)
    message = str(failure.value)
    assert "cannot serve this run" in message and "node config has no 'partition-id'" in message, message[-3000:]
    assert not (tmp_path / "deployed" / "deployed" / "metrics.csv").exists()


FAULT_ROUNDS = 4


def _rows(folder):
    try:
        return json.loads((folder / "metrics.json").read_text())
    except (OSError, ValueError):
        return []


def _running_clientapp(pid: int) -> bool:
    """Whether SuperNode ``pid``'s process group runs a ClientApp process now (it is handling a message)."""
    for member in group_members(pid):
        try:
            if b"flwr-clientapp" in Path(f"/proc/{member}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


@pytest.mark.slow
def test_a_supernode_killed_mid_round_costs_its_reply_then_rejoins_with_its_users_state(tmp_path, three_supernodes):
    """A SuperNode killed (SIGKILL) mid-round costs only its reply, the run goes on, and when it is started again
    (a new node id) it rejoins with its users' private state, which it keeps in files (``client-state-dir``). The
    in-process versions, with exact model comparisons, are in test_fault_tolerance.py."""
    results, state_dir = tmp_path / "results", tmp_path / "client-state"
    overrides = {
        "dataset": "generic",
        "generic-file": str(write_tiny_dataset(tmp_path / "data", num_users=24)),
        "cache-dir": str(tmp_path / "cache"),
        "results-dir": str(results),
        "run-name": "faults",
        "model": "mf",
        "embedding-dim": 8,
        "num-test-negatives": 20,
        "ks": "5,10",
        "users-per-node": 8,
        "num-server-rounds": FAULT_ROUNDS,
        "fraction-train": 1.0,
        "eval-every": FAULT_ROUNDS,
        "min-train-fraction": 0.5,
        "round-timeout": 180.0,
        "client-state-dir": str(state_dir),  # an upper bound: a dead node is
        # reported by the SuperLink once its heartbeats stop (about 30 s), long before this
    }
    folder = results / "faults"
    outcome: dict = {}
    deployment = three_supernodes

    def run():
        try:
            outcome["result"] = deployment.run(overrides, timeout=900)
        except Exception as err:  # noqa: BLE001 - reported below
            outcome["error"] = err

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    victim = next(p for p in deployment.processes if p.name == "supernode-1")
    deadline = time.monotonic() + 600
    while (
        runner.is_alive()
        and time.monotonic() < deadline
        and not (_rows(folder) and _running_clientapp(victim.process.pid))
    ):
        time.sleep(0.05)
    assert _rows(folder) and runner.is_alive(), f"round 2 never started: {outcome}"
    killed_after = len(_rows(folder))
    os.killpg(victim.process.pid, signal.SIGKILL)  # the SuperNode and its ClientApp process, mid-round
    while len(_rows(folder)) < killed_after + 1 and runner.is_alive():
        time.sleep(0.2)  # the round completes without it
    deployment.start_supernode(1, name="supernode-1-restarted")
    runner.join(timeout=900)
    assert not runner.is_alive(), "the run did not finish"
    assert "error" not in outcome, str(outcome.get("error"))[-4000:]
    output = outcome["result"].output

    rows = _rows(folder)
    assert [r["round"] for r in rows] == list(range(1, FAULT_ROUNDS + 1))
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
    assert max(versions) == FAULT_ROUNDS, "partition 1's first user trained in the last round, after the restart"
    assert not any(p.name.startswith("user-") for p in folder.iterdir())
