"""The launcher ends a run that Flower 1.42 would leave hanging: a ClientApp that never returns (on Ray) keeps the
simulation's worker pool waiting after the ServerApp has ended, so plain ``flwr run`` never returns. The launcher
stops it :data:`~fedrec_flwr.launch.END_GRACE` s after the ServerApp's last line, with a non-zero status and a message
naming the silent node and its round, and leaves no process behind. One real run (tiny generated data, 2 SuperNodes,
Ray); the rest are checks of the message and the command line without a run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_tiny_dataset

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.launch import PROJECT_ROOT, parse_args, processes_with_env, still_running

HANGING_CLIENT = '''
import time

from fedrec_flwr.clients.fedrec import FedRecClient


class HangingClient(FedRecClient):
    """FedRecClient whose user 0 never returns from training in round 2 (a stuck device)."""

    def fit_named(self, shared, config):
        if self.user == 0 and int(config["server-round"]) == 2:
            time.sleep(3600)
        return super().fit_named(shared, config)
'''


def test_still_running_names_silent_nodes_by_round_and_the_processes():
    log = (
        "round    1 | train-loss 0.69\n"
        "WARNING fedrec_flwr.strategies.item_fedavg: round 2: node 4242 failed: no reply within round-timeout (20 s)\n"
        "WARNING fedrec_flwr.strategies.item_fedavg: round 2: evaluation failed on node 4242 (12 users not evaluated: 0..11): "
        "no reply within round-timeout (20 s)\n"
        "WARNING fedrec_flwr.strategies.item_fedavg: round 3: node 7 failed: the ClientApp raised ValueError\n"
    )
    text = still_running(log, [os.getpid()])
    assert "node 4242 (no reply in round 2)" in text
    assert "node 7" not in text  # it answered (with an error): not what is still running
    assert "last round line: 'round    1 | train-loss 0.69'" in text
    assert "processes " in text


def test_timeout_flag_is_parsed_and_must_be_positive():
    args, _, _ = parse_args(["run", "--timeout", "90", "num-server-rounds=2"])
    assert args.timeout == 90.0
    for bad in ("0", "-5", "abc", "nan"):  # one error line each, not argparse's usage text (fresh-user finding)
        with pytest.raises(ConfigError, match=f"--timeout {bad}: must be a positive number of seconds"):
            parse_args(["run", "--timeout", bad])


# a real run: ~2-3 min on a loaded 2-core machine (the one real-run test of the round timeout that CI runs)
def test_a_client_that_never_returns_ends_the_run_with_the_node_and_round_named(tmp_path):
    plugins = tmp_path / "pythonpath"
    plugins.mkdir()
    (plugins / "hanging_client.py").write_text(HANGING_CLIENT)
    home = (tmp_path / "home").resolve()
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]),
    }
    round_timeout = 20.0
    overrides = {
        "dataset": "generic",
        "generic-file": write_tiny_dataset(tmp_path / "data"),
        "cache-dir": tmp_path / "cache",
        "num-test-negatives": 20,
        "ks": "5,10",
        "embedding-dim": 8,
        "mlp-layers": "16,8",
        "num-server-rounds": 2,
        "fraction-train": 1.0,
        "min-train-fraction": 0.5,
        "eval-every": 1,
        "users-per-node": 12,
        "results-dir": tmp_path / "results",
        "run-name": "hang",
        "round-timeout": round_timeout,
        "client": "hanging_client:HangingClient",
    }
    command = [
        "nice",
        "-n",
        "5",
        sys.executable,
        "-m",
        "fedrec_flwr.launch",
        "run",
        "--federation-config",
        "client-resources-num-cpus=1",
        "--timeout",
        "900",
        *(f"{k}={v}" for k, v in overrides.items()),
    ]
    launcher = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=PROJECT_ROOT
    )
    lines, times = [], []
    try:
        for line in launcher.stdout:
            lines.append(line)
            times.append(time.monotonic())
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = "".join(lines)
    ended = time.monotonic()
    assert launcher.returncode == 1, output[-4000:]
    last = output.strip().splitlines()[-2]  # the error; the log's path follows
    assert re.search(r"node \d+ \(no reply in round 2\)", last), output[-4000:]
    assert "the ServerApp ended (completed)" in last
    # the run's results are complete: round 2 went on without the silent node
    assert (tmp_path / "results" / "hang" / "summary.json").is_file()
    # within round-timeout + 60 s after the last round began (round 1's line is printed once it is recorded)
    round_1 = [t for line, t in zip(lines, times) if re.match(r"\s*round\s+1 \|", line)]
    assert round_1, output[-4000:]
    print(f"returned {ended - round_1[0]:.1f} s after round 1 was recorded")
    assert ended - round_1[0] < round_timeout + 60, (ended - round_1[0], output[-4000:])
    left = processes_with_env("FLWR_HOME", str(home))
    assert left == [], [Path(f"/proc/{p}/cmdline").read_text(errors="replace") for p in left]
    assert not [p for p in processes_with_env("PYTHONPATH", env["PYTHONPATH"]) if p != launcher.pid]
