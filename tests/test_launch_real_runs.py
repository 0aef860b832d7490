"""The launcher on real `flwr run`s (tiny generated data, 2 SuperNodes, Ray simulation): two runs at once in one Flower
home, a bystander and the launcher's parent that share `FLWR_HOME`, a `timeout` wrapper, a run that fails inside the
ServerApp, and Ctrl-C. Each run starts its own SuperLink on free ports, so these tests never collide with others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import write_tiny_dataset

from fedrec_flwr.launch import PROJECT_ROOT, RECORD_FILE, processes_with_env

BOOM = '''
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg


class Boom(ItemEmbeddingFedAvg):
    """Passes the launcher's preflight (it builds fine); fails inside the ServerApp, in round 1."""

    def configure_train(self, *args, **kwargs):
        raise ConfigError("boom: this strategy refuses to train")
'''


def _overrides(tmp_path: Path, name: str, **more) -> list[str]:
    data = write_tiny_dataset(tmp_path / "data")
    pairs = {
        "dataset": "generic",
        "generic-file": str(data),
        "cache-dir": str(tmp_path / "cache"),
        "num-test-negatives": 20,
        "ks": "5,10",
        "embedding-dim": 8,
        "mlp-layers": "16,8",
        "num-server-rounds": 2,
        "fraction-train": 0.5,
        "eval-every": 1,
        "users-per-node": 12,
        "results-dir": str(tmp_path / "results"),
        "run-name": name,
        "round-timeout": 600.0,
        **more,
    }
    return [f"{k}={v}" for k, v in pairs.items()]


def _launcher(tmp_path, name, **more):
    return [
        sys.executable,
        "-m",
        "fedrec_flwr.launch",
        "run",
        "--federation-config",
        "client-resources-num-cpus=1",
        *_overrides(tmp_path, name, **more),
    ]


def _left_in(homes) -> list[int]:
    """Processes still running with one of these Flower homes (everything a run started has one)."""
    return sorted({p for home in homes for p in processes_with_env("FLWR_HOME", str(home))})


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


# 107 s on a loaded 2-core machine (35 s of CPU): the one real-run check of issues 16 and 22 that CI runs
def test_two_runs_at_once_spare_bystanders_and_a_failed_run_exits_non_zero(tmp_path):
    """Run A (a plug-in strategy from plugins/ with its own key; wrapped in `timeout`, under a shell, beside a
    `sleep`, all with the same FLWR_HOME) finishes with status 0 while run B starts in the same checkout: B gets its own Flower home and ports, its ServerApp fails, and
    B exits non-zero with the ServerApp's error as its last line. Nothing either run started is left."""
    home = (tmp_path / "home").resolve()
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "boom_strategy.py").write_text(BOOM)
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]),
    }
    bystander = subprocess.Popen(["sleep", "600"], env=env)
    command_a = " ".join(
        f"'{c}'"
        for c in _launcher(tmp_path, "a", strategy="plugins.server_lr:ServerLrItemFedAvg", **{"server-lr": 0.3})
    )
    run_a = subprocess.Popen(
        ["bash", "-c", f"timeout 900 nice -n 5 {command_a}; echo parent-alive $?"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=PROJECT_ROOT,
    )
    try:
        _wait_for(lambda: (home / RECORD_FILE).is_file() or run_a.poll() is not None, 300, "run A's SuperLink")
        run_b = subprocess.run(
            ["nice", "-n", "5", *_launcher(tmp_path, "b", strategy="boom_strategy:Boom")],
            env=env,
            capture_output=True,
            text=True,
            cwd=PROJECT_ROOT,
            timeout=900,
        )
        output_a, _ = run_a.communicate(timeout=900)
    finally:
        run_a.kill()
        alive = bystander.poll() is None
        bystander.kill()
        bystander.wait()
    assert "parent-alive 0" in output_a, output_a[-3000:]
    assert (tmp_path / "results" / "a" / "summary.json").is_file(), output_a[-3000:]
    assert "round    2 | HR@10" in output_a
    recorded = json.loads((tmp_path / "results" / "a" / "config.json").read_text())["run-config"]
    assert recorded["strategy"] == "plugins.server_lr:ServerLrItemFedAvg" and recorded["server-lr"] == 0.3
    assert run_b.returncode != 0
    last = run_b.stderr.strip().splitlines()[-1]
    assert run_b.returncode == 1  # a run that started and failed (2: refused before the start)
    assert "boom: this strategy refuses to train" in run_b.stderr.strip().splitlines()[-2] + last, run_b.stderr
    assert f"FLWR_HOME={home / 'concurrent-1'}" in run_b.stderr, run_b.stderr[:2000]
    assert alive, "a process that merely shared FLWR_HOME was ended"
    assert _left_in([home, home / "concurrent-1"]) == []


@pytest.mark.slow  # 92 s on a loaded 2-core machine
def test_ctrl_c_stops_the_run_its_superlink_and_ray(tmp_path):
    """SIGINT to the launcher's process group (what Ctrl-C in a terminal sends) after round 1: exit 130, no process
    of the run left (SuperLink, simulation, Ray daemons), and the round-1 checkpoint stays for resume-from."""
    home = tmp_path / "home"
    env = {**os.environ, "FLWR_HOME": str(home)}
    launcher = subprocess.Popen(
        ["nice", "-n", "5", *_launcher(tmp_path, "c", **{"num-server-rounds": 5000, "checkpoint-every": 1})],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=PROJECT_ROOT,
        start_new_session=True,
        # as from a terminal: pytest may run with SIGINT ignored (a background job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        _wait_for(lambda: any("round    1 |" in line for line in lines) or launcher.poll() is not None, 600, "round 1")
        ray = [p for p in _left_in([home]) if "raylet" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert ray, "no Ray process to check (the run ended early?):\n" + "".join(lines)[-3000:]
        os.killpg(launcher.pid, signal.SIGINT)
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    reader.join(timeout=10)
    output = "".join(lines)
    assert launcher.returncode == 130, output[-3000:]
    assert "stopped" in output
    _wait_for(lambda: _left_in([home]) == [], 30, "the run's processes to end")
    assert (tmp_path / "results" / "c" / "checkpoint.npz").is_file()


@pytest.mark.slow  # a real run; the launcher itself refuses a wrong --num-supernodes before starting (test_launch_cli)
def test_too_many_supernodes_in_a_plain_run_print_one_error_not_a_traceback_per_node(tmp_path):
    """8 SuperNodes for 2 partitions, past the launcher's check (as a plain `flwr run` would start it): the extra nodes
    answer the identify query with an error reply, not a raised exception, so the whole log holds the ServerApp's
    traceback only, and the run's last line names the partition out of range."""
    from fedrec_flwr.config import default_mapping
    from fedrec_flwr.launch import flwr_run, parse_override

    overrides = dict(parse_override(pair, default_mapping()) for pair in _overrides(tmp_path, "too-many"))
    done = flwr_run(
        overrides,
        num_supernodes=8,
        check=False,
        flwr_home=tmp_path / "home",
        capture=True,
        verbose=True,
        federation_config={"client-resources-num-cpus": 1},
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1
    assert done.stdout.count("Traceback") == 1 and len(lines) < 80, done.stdout[-4000:]
    assert "is out of range" in lines[-2] and "partition ids run 0..1" in lines[-2]
