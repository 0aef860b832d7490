"""`flwr run` on an existing Ray cluster: a Ray head and a second Ray node, each with one CPU, both on this machine.

This is the "beyond one machine" path of the simulation: the SuperLink's simulation process joins the cluster given
by ``RAY_ADDRESS`` (``flwr_run(..., ray_address=...)``) instead of starting its own Ray, and Flower's actor pool puts
one client actor on every CPU of the cluster (``client-resources-num-cpus=1``). The test checks, from the cluster's
own records (the GCS actor table and task events), that client actors ran messages on *both* nodes, and that the run
gives exactly the metrics and final parameters of the same config run in one process (the serial grid, which is
bit-identical to Flower's single-machine simulation).

Ray's own ``ray stop`` ends every Ray process of the machine, including other users' clusters, so the test never calls
it: each ``ray start`` runs in a session of its own, and every process of those sessions (Ray's daemons change their
process group, never their session) is ended by PID, whether the test passes or fails; the test checks that none is
left. (A marker variable in their environment is not enough: a Ray process that sets a long process title, such as
``ray::DashboardAgent``, overwrites the start of its ``/proc/<pid>/environ``.)
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import dataset_dir, without_timings

from fedrec_flwr.launch import alive, flwr_env, flwr_run, processes_with_env, superlink_pids

RAY = Path(sys.executable).with_name("ray")
MARKER = "FEDREC_TEST_RAY_CLUSTER"  # the test's cluster starts with MARKER=<token> in its environment


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Runs in a separate interpreter (a short-lived Ray driver): which node each client actor and each client task ran on.
_QUERY = r"""
import collections, json, sys
import ray
from ray.core.generated import common_pb2, gcs_service_pb2, gcs_service_pb2_grpc
import grpc

address = sys.argv[1]
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
nodes = {n["NodeID"]: n["NodeName"] for n in ray.nodes()}
actors = [{"class": a["ActorClassName"], "node": nodes.get(a["Address"]["NodeID"]), "pid": a["Pid"],
           "state": a["State"], "job": a["JobID"]} for a in ray._private.state.actors().values()]
ray.shutdown()
# Task events reported by every worker to the GCS (what `ray list tasks` shows; that needs the dashboard, which needs
# packages this environment does not install).
stub = gcs_service_pb2_grpc.TaskInfoGcsServiceStub(grpc.insecure_channel(address))
reply = stub.GetTaskEvents(gcs_service_pb2.GetTaskEventsRequest(limit=100000), timeout=60)
tasks = collections.Counter()
for event in reply.events_by_task:
    node = event.task_info.node_id or event.state_updates.node_id
    finished = common_pb2.TaskStatus.FINISHED in event.state_updates.state_ts_ns
    tasks[f"{event.task_info.func_or_class_name}|{nodes.get(node.hex(), node.hex())}|{finished}"] += 1
print(json.dumps({"nodes": sorted(nodes.values()), "actors": actors, "tasks": dict(tasks)}))
"""


class LocalRayCluster:
    """A Ray head (``ray start --head``) and one more node (``ray start --address``) on loopback, one CPU each.

    Every port is a free one (never Ray's defaults, which another cluster on this machine may hold), the dashboard is
    off, and each node has its own short temp dir (Ray's socket paths must stay under ~107 characters).
    """

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.root = Path(tempfile.mkdtemp(prefix="fr-ray-", dir="/tmp"))
        self.address = f"127.0.0.1:{_free_port()}"
        self.env = dict(
            os.environ,
            **{MARKER: self.token},
            RAY_USAGE_STATS_ENABLED="0",
            RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
            PYTHONWARNINGS="ignore::DeprecationWarning",
        )
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env["PATH"] = os.pathsep.join([str(RAY.parent), self.env.get("PATH", "")])
        self.env.pop("RAY_ADDRESS", None)
        self.sessions: set[int] = set()  # the session of each `ray start`: every process of the node stays in it

    def _start(self, name: str, *args: str) -> None:
        command = [
            str(RAY),
            "start",
            *args,
            "--node-name",
            name,
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            "1",
            "--num-gpus",
            "0",
            "--temp-dir",
            str(self.root / name),
            "--disable-usage-stats",
            "--node-manager-port",
            str(_free_port()),
            "--object-manager-port",
            str(_free_port()),
            "--dashboard-agent-listen-port",
            str(_free_port()),
            "--dashboard-agent-grpc-port",
            str(_free_port()),
            "--runtime-env-agent-port",
            str(_free_port()),
            "--metrics-export-port",
            str(_free_port()),
        ]
        with subprocess.Popen(
            command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        ) as process:
            self.sessions.add(process.pid)
            try:
                stdout, stderr = process.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
        assert process.returncode == 0, f"{' '.join(command)}\n{stdout[-2000:]}\n{stderr[-3000:]}"

    def start(self) -> None:
        self._start(
            "head",
            "--head",
            "--port",
            self.address.rsplit(":", 1)[1],
            "--include-dashboard=false",
            "--ray-client-server-port",
            str(_free_port()),
        )
        self._start("worker", "--address", self.address)

    def query(self) -> dict:
        """Nodes, client actors and task counts (``name|node|finished``) from the cluster's GCS."""
        done = subprocess.run(
            [sys.executable, "-c", _QUERY, self.address],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def processes(self) -> list[int]:
        """Running processes of this cluster: those of its ``ray start`` sessions, and any with its marker."""
        found = set(processes_with_env(MARKER, self.token))
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3]) in self.sessions:
                        found.add(int(proc.name))
                except (OSError, IndexError, ValueError):
                    continue
        found.discard(os.getpid())
        return sorted(pid for pid in found if alive(pid))

    def stop(self, timeout: float = 20.0) -> list[int]:
        """End every process of this cluster (SIGTERM, then SIGKILL after ``timeout``); returns any still running."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.processes():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.processes():
                time.sleep(0.2)
            if not self.processes():
                break
        shutil.rmtree(self.root, ignore_errors=True)
        return self.processes()


@pytest.fixture
def ray_cluster():
    cluster = LocalRayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        leftover = cluster.stop()
        assert not leftover, f"Ray processes left running: {leftover}"


@pytest.mark.slow
def test_flwr_run_on_a_two_node_ray_cluster_matches_one_process(tmp_path, ray_cluster):
    data = dataset_dir("filmtrust")
    started = time.monotonic()
    before = ray_cluster.query()
    assert before["nodes"] == ["head", "worker"], before
    assert len(ray_cluster.processes()) >= 6, "the cluster's processes are not found: stop() could not end them"

    overrides = {
        "dataset": "filmtrust",
        "data-dir": str(data),
        "cache-dir": str(tmp_path / "cache"),
        "model": "mf",
        "users-per-node": 100,
        "num-server-rounds": 2,
        "eval-every": 2,
        "learning-rate": 0.05,
        "seed": 0,
    }
    results = tmp_path / "results"
    ports = {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}
    flwr_home = tmp_path / "flwr-home"
    try:
        done = flwr_run(
            {**overrides, "results-dir": str(results), "run-name": "cluster"},
            flwr_home=flwr_home,
            env_extra=ports,
            capture=True,
            timeout=900,
            ray_address=ray_cluster.address,
            federation_config={"client-resources-num-cpus": 1},
        )
    finally:
        env = flwr_env(flwr_home, ports)
        leftover = superlink_pids(env) + processes_with_env("FLWR_HOME", str(flwr_home))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert not leftover, f"processes left running: {leftover}"
    folder = results / "cluster"
    rows = json.loads((folder / "metrics.json").read_text())
    assert [r["round"] for r in rows] == [1, 2], output[-3000:]
    assert all(r["num-failures"] == 0 for r in rows)
    assert rows[-1]["eval-users"] == 1227  # every FilmTrust user evaluated after the last round

    # Where the clients ran: one client actor per node (1 CPU each), and each ran client messages.
    after = ray_cluster.query()
    actors = [a for a in after["actors"] if a["class"] == "ClientAppActor"]
    assert sorted(a["node"] for a in actors) == ["head", "worker"], after["actors"]
    runs = collections.Counter()
    for key, count in after["tasks"].items():
        name, node, finished = key.split("|")
        if name == "ClientAppActor.run":
            assert finished == "True", after["tasks"]
            runs[node] += count
    assert set(runs) == {"head", "worker"} and min(runs.values()) > 0, after["tasks"]
    # one task per message: the identify query (13 nodes), the train and evaluate messages of every round
    assert sum(runs.values()) == 13 + sum(r["num-replies"] for r in rows) + 13, (runs, rows)
    print(
        f"client actors: {sorted((a['node'], a['pid']) for a in actors)}; ClientAppActor.run tasks per node: "
        f"{dict(runs)}"
    )

    # The same config in one process gives the same metrics and the same final parameters, bit for bit.
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    serial = run_serial(make_run_config(**overrides, results_dir=str(results), run_name="serial"))
    assert without_timings(rows) == without_timings(json.loads((serial / "metrics.json").read_text()))
    a, b = np.load(folder / "final_arrays.npz"), np.load(serial / "final_arrays.npz")
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    final = json.loads((folder / "summary.json").read_text())["final"]
    print(
        f"cluster run: HR@10 {final['HR@10']:.4f}, NDCG@10 {final['NDCG@10']:.4f}, "
        f"{time.monotonic() - started:.0f} s after the cluster started"
    )
