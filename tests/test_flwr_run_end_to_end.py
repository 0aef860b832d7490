"""End to end through `flwr run` on real MovieLens-100K: 943 per-user SuperNodes in Flower's Ray simulation.

The test gives the run its own FLWR_HOME and local SuperLink ports, and ends every process it started (the detached
SuperLink's process group: simulation and Ray) whether the run passes or fails.
"""

from __future__ import annotations

import json
import socket

from fedrec_flwr.baselines import evaluate_popularity
from fedrec_flwr.data import load_split
from fedrec_flwr.launch import flwr_env, flwr_run, processes_with_env, superlink_pids


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_flwr_run_on_movielens_beats_popularity(tmp_path, ml100k_dir):
    results = tmp_path / "results"
    ports = {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}
    overrides = {
        "data-dir": str(ml100k_dir),
        "cache-dir": str(tmp_path / "cache"),
        "results-dir": str(results),
        "run-name": "e2e",
        "num-server-rounds": 6,
        "fraction-train": 0.5,
        "eval-every": 6,
        # chosen on the validation item (val HR@10 0.506 vs popularity 0.457 after 6 rounds), never on test items
        "learning-rate": 0.03,
        "local-epochs": 3,
    }
    flwr_home = tmp_path / "flwr-home"
    try:
        done = flwr_run(overrides, num_supernodes=943, flwr_home=flwr_home, env_extra=ports, capture=True, timeout=1500)
    finally:
        env = flwr_env(flwr_home, ports)
        leftover = superlink_pids(env) + processes_with_env("FLWR_HOME", str(flwr_home))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert not leftover, f"processes left running: {leftover}"
    assert "Deprecat" not in output, "a normal run prints no deprecation warning"

    folder = results / "e2e"
    for name in (
        "config.json",
        "metrics.csv",
        "metrics.json",
        "final_arrays.npz",
        "summary.json",
        "learning_curves.png",
    ):
        assert (folder / name).is_file(), f"{name} missing; output tail:\n{output[-3000:]}"
    rows = json.loads((folder / "metrics.json").read_text())
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["num-failures"] == 0 for r in rows)
    assert rows[-1]["eval-users"] == 943  # evaluated on every user
    assert all(r["train-users"] == 472 for r in rows)  # round(0.5 * 943) sampled users trained each round
    assert "round    6 | HR@10" in output  # the progress line

    split = load_split("ml-100k", ml100k_dir, cache_dir=tmp_path / "cache")
    popularity = evaluate_popularity(split, ks=(10,))["HR@10"]
    final = json.loads((folder / "summary.json").read_text())["final"]
    print(f"flwr run: HR@10 {final['HR@10']:.4f}, NDCG@10 {final['NDCG@10']:.4f}; popularity HR@10 {popularity:.4f}")
    assert final["HR@10"] > popularity
