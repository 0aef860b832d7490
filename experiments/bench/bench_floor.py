"""Benchmark: a block-mode ``flwr run`` against its compute floor, measured back to back.

The *compute floor* (:func:`run_floor`) is one process, without Flower's transport, that runs the same vectorized
steps as a block-mode run: it loads the same split (:func:`fedrec_flwr.app.preflight.preflight`), builds the same initial
model and the configured strategy (:func:`fedrec_flwr.app.preflight.build_strategy`), and every round

* asks the strategy for its round plan (``configure_train``: the seeded users grouped by node, the train config);
* trains each node's users as one block (:func:`fedrec_flwr.local.blocks.train_block`, with one ``RecordDict`` of private
  state per node, as ``context.state``) and sums them into the node's contribution
  (:class:`fedrec_flwr.wire.Contribution`, what the ClientApp packs into its reply);
* aggregates with the strategy's own ``aggregate_arrays`` (for FedRecGEL the server optimizer's step);
* on evaluation rounds evaluates each node's users as one batched call (:func:`fedrec_flwr.local.blocks.evaluate_block`) and
  averages the metrics over the users.

It skips what is transport or bookkeeping only: messages, the encoding of arrays, reply validation, the results
folder. Its final arrays equal ``run_serial``'s with ``block-training = "on"`` (``tests/test_bench_floor.py``).

Then the same config runs as ``python -m fedrec_flwr.launch run`` (the README's launcher: a local SuperLink and
Flower's Ray simulation, one SuperNode per ``users-per-node`` users) with ``block-training = "on"``, and optionally
(``--per-user``) in-process with ``block-training = "off"`` (``run_serial``, the per-user reference path; its model
equals a ``flwr run``'s, ``tests/test_serial_equals_ray.py``) for its HR@10. Printed: both wall times (whole process,
and the round loop alone), their ratio, and every path's final HR@10.

Run by hand (not a test), e.g.::

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench/bench_floor.py --rounds 100 --users-per-node 100 --per-user

The default method is FedRecGEL as the README's example runs it (``client = "fedrecgel"``, ``strategy =
"server-optimizer"``, learning rate 0.1, batch 128, server rate 0.03, rho-shared 0.02) on ML-100K, 10% of users per
round, every user evaluated every round (``eval-every = 1``, ``fraction-evaluate = 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FEDRECGEL = {
    "client": "fedrecgel",
    "strategy": "server-optimizer",
    "model": "ncf",
    "learning-rate": 0.1,
    "batch-size": 128,
    "server-learning-rate": 0.03,
    "rho-shared": 0.02,
}
"""FedRecGEL as the README's ``flwr run`` example runs it (section Methods)."""


def run_floor(run_config: Mapping[str, Any]) -> dict:
    """The compute floor of a block-mode run (see the module docstring), in this process.

    Args:
        run_config: a complete kebab-case run config (``block-training`` must not be ``"off"``; every message takes
            the block path here, as with ``"on"``).

    Returns:
        ``{"rows": [{"round", "seconds", "train-loss", <metrics>}, ...], "arrays": {key: (shape) float32},
        "load-seconds": data and model set-up, "loop-seconds": the rounds}``; metrics are means over the evaluated
        users (as the strategy's ``aggregate_evaluate`` weights its nodes' means by their users).

    Raises:
        ConfigError / DataError: what :func:`~fedrec_flwr.app.preflight.preflight` finds.
        ValueError: the configured client has no block path, or ``block-training = "off"``.
    """
    from flwr.supercore.task_identity import TaskIdentity

    started = time.perf_counter()
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # the strategy builds Flower Messages
    try:
        return _floor(run_config, started)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _floor(run_config: Mapping[str, Any], started: float) -> dict:
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from fedrec_flwr.app.preflight import _block_topology, build_strategy, preflight
    from fedrec_flwr.app.runtime import build_shared_model
    from fedrec_flwr.local.blocks import block_kind, evaluate_block, train_block
    from fedrec_flwr.registry import resolve
    from fedrec_flwr.wire import ARRAYS, CONFIG, GRADIENT_USERS, METRICS, NUM_EXAMPLES, Contribution

    plan = preflight(run_config, with_data=True)
    config, runtime = plan.config, plan.runtime
    cls = resolve("client", config.client)
    if config.block_training == "off" or block_kind(cls, config) is None:
        raise ValueError(
            f"the compute floor runs the block path: client {config.client!r} with block-training "
            f"{config.block_training!r} has none"
        )
    topology = _block_topology(config, runtime.split.num_users)  # node id = partition id, as the floor's own nodes
    model = build_shared_model(config, runtime.split.num_items)
    strategy = build_strategy(config, runtime.layout, topology)
    arrays = ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in model.shared_state().items()})
    states: dict[int, RecordDict] = {}
    rows: list[dict] = []
    loaded = time.perf_counter()
    for server_round in range(1, config.num_server_rounds + 1):
        round_start = time.perf_counter()
        shared = {k: v.numpy() for k, v in arrays.items()}
        accepted, loss_sum, examples = [], 0.0, 0.0
        for message in strategy.configure_train(server_round, arrays, ConfigRecord({}), None):
            message_config = dict(message.content[CONFIG])
            users = [int(u) for u in message_config["users"]]
            state = states.setdefault(int(message.metadata.dst_node_id), RecordDict())
            contribution = Contribution(runtime.layout)
            gradients = 0
            for update in train_block(runtime, cls, users, state, shared, message_config):
                contribution.add_user(update.dense, update.rows, update.aggregation_weight, update.loss)
                gradients += int(update.is_gradient)
            metrics = {
                NUM_EXAMPLES: float(contribution.num_examples),
                "num-users": contribution.num_users,
                "train-loss": float(contribution.mean_loss),
                GRADIENT_USERS: gradients,
            }
            accepted.append(
                RecordDict(
                    {
                        ARRAYS: ArrayRecord({k: Array(v) for k, v in contribution.pack().items()}),
                        METRICS: MetricRecord(metrics),
                    }
                )
            )
            loss_sum += contribution.mean_loss * contribution.num_examples
            examples += contribution.num_examples
        arrays = strategy.aggregate_arrays(accepted)
        row = {"round": server_round, "train-loss": loss_sum / examples}
        evaluations = list(strategy.configure_evaluate(server_round, arrays, ConfigRecord({}), None))
        if evaluations:
            shared = {k: v.numpy() for k, v in arrays.items()}
            results: list[dict[str, float]] = []
            for message in evaluations:
                state = states.setdefault(int(message.metadata.dst_node_id), RecordDict())
                results += evaluate_block(
                    runtime,
                    [int(u) for u in message.content[CONFIG]["users"]],
                    state,
                    shared,
                    dict(message.content[CONFIG]),
                )
            row.update({key: float(np.mean([r[key] for r in results])) for key in results[0]})
            row["eval-users"] = len(results)
        row["seconds"] = round(time.perf_counter() - round_start, 3)
        rows.append(row)
    finished = time.perf_counter()
    return {
        "rows": rows,
        "arrays": {k: v.numpy() for k, v in arrays.items()},
        "load-seconds": loaded - started,
        "loop-seconds": finished - loaded,
    }


def run_config_for(args: argparse.Namespace, work: Path, name: str, **extra: Any) -> dict:
    """The benchmark's kebab-case run config (defaults from ``pyproject.toml`` plus the method and the protocol)."""
    from fedrec_flwr.config import default_mapping

    mapping = default_mapping()
    mapping.update(FEDRECGEL)
    mapping.update(
        {
            "dataset": args.dataset,
            "data-dir": str(Path(args.data_root) / args.dataset),
            "num-server-rounds": args.rounds,
            "fraction-train": args.fraction_train,
            "fraction-evaluate": 1.0,
            "eval-every": 1,
            "users-per-node": args.users_per_node,
            "seed": args.seed,
            "block-training": "on",
            "results-dir": str(work),
            "run-name": name,
        }
    )
    mapping.update(extra)
    return mapping


def _overrides(mapping: Mapping[str, Any]) -> list[str]:
    """``key=value`` arguments of the launcher for the keys that differ from ``pyproject.toml``'s defaults."""
    from fedrec_flwr.config import default_mapping

    defaults = default_mapping()
    return [f"{k}={json.dumps(v)}" for k, v in mapping.items() if defaults.get(k) != v]


def _in_subprocess(function: str, mapping: Mapping[str, Any], out: Path) -> float:
    """Run ``function`` (``floor`` / ``serial``) on ``mapping`` in a fresh Python process (so each path pays its own
    imports and data loading, as a ``flwr run`` does); returns the process's wall seconds."""
    spec = json.dumps({"function": function, "config": dict(mapping), "out": str(out)})
    started = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--child", spec], check=True, cwd=ROOT)
    return time.perf_counter() - started


def _child(spec: str) -> int:
    job = json.loads(spec)
    started = time.perf_counter()
    if job["function"] == "floor":
        result = run_floor(job["config"])
        payload = {
            "rows": result["rows"],
            "load-seconds": result["load-seconds"],
            "loop-seconds": result["loop-seconds"],
        }
    else:
        from fedrec_flwr.serial import run_serial

        folder = run_serial(job["config"])
        rows = json.loads((folder / "metrics.json").read_text())
        payload = {"rows": rows, "loop-seconds": sum(r["seconds"] for r in rows), "folder": str(folder)}
    payload["process-seconds"] = time.perf_counter() - started
    Path(job["out"]).write_text(json.dumps(payload))
    return 0


def _final(rows: list[dict], key: str = "HR@10") -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return values[-1] if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="ml-100k")
    parser.add_argument(
        "--data-root", default=os.environ.get("FEDREC_SHARED_DATA", str(ROOT.parent / "shared" / "data"))
    )
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--fraction-train", type=float, default=0.1)
    parser.add_argument("--users-per-node", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--per-user",
        action="store_true",
        help="also run the per-user path (block-training off, in-process) for its HR@10",
    )
    parser.add_argument("--skip-flwr", action="store_true", help="the floor (and --per-user) only")
    parser.add_argument("--out", default=None, help="write the summary here as JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child)

    work = Path(tempfile.mkdtemp(prefix="fedrec-floor-"))
    summary: dict[str, Any] = {
        "dataset": args.dataset,
        "rounds": args.rounds,
        "fraction-train": args.fraction_train,
        "users-per-node": args.users_per_node,
        "seed": args.seed,
        "method": FEDRECGEL,
        "load-before": os.getloadavg()[0],
    }
    floor_config = run_config_for(args, work, "floor")
    seconds = _in_subprocess("floor", floor_config, work / "floor.json")
    floor = json.loads((work / "floor.json").read_text())
    summary["floor"] = {
        "wall-seconds": round(seconds, 1),
        "loop-seconds": round(floor["loop-seconds"], 1),
        "load-seconds": round(floor["load-seconds"], 1),
        "HR@10": _final(floor["rows"]),
        "NDCG@10": _final(floor["rows"], "NDCG@10"),
        "load-after": os.getloadavg()[0],
    }
    print(
        f"floor: {seconds:.1f} s wall ({floor['loop-seconds']:.1f} s of rounds), HR@10 {_final(floor['rows'])}",
        flush=True,
    )
    if not args.skip_flwr:
        flwr_config = run_config_for(args, work, "flwr")
        env = {**os.environ, "FLWR_HOME": str(work / "flwr-home")}
        command = [sys.executable, "-m", "fedrec_flwr.launch", "run", *_overrides(flwr_config)]
        print("$", " ".join(command[1:]), flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env)
        seconds = time.perf_counter() - started
        rows = json.loads((work / "flwr" / "metrics.json").read_text())
        loop = sum(r["seconds"] for r in rows)
        summary["flwr"] = {
            "wall-seconds": round(seconds, 1),
            "loop-seconds": round(loop, 1),
            "returncode": done.returncode,
            "HR@10": _final(rows),
            "NDCG@10": _final(rows, "NDCG@10"),
            "rounds-completed": len(rows),
            "load-after": os.getloadavg()[0],
        }
        summary["ratio-wall"] = round(seconds / summary["floor"]["wall-seconds"], 2)
        summary["ratio-loop"] = round(loop / floor["loop-seconds"], 2)
        print(
            f"flwr run: {seconds:.1f} s wall ({loop:.1f} s of rounds), HR@10 {_final(rows)}; "
            f"ratio {summary['ratio-wall']}x wall, {summary['ratio-loop']}x rounds",
            flush=True,
        )
    if args.per_user:
        serial_config = run_config_for(args, work, "per-user", **{"block-training": "off"})
        seconds = _in_subprocess("serial", serial_config, work / "per-user.json")
        serial = json.loads((work / "per-user.json").read_text())
        summary["per-user"] = {
            "wall-seconds": round(seconds, 1),
            "loop-seconds": round(serial["loop-seconds"], 1),
            "HR@10": _final(serial["rows"]),
            "NDCG@10": _final(serial["rows"], "NDCG@10"),
            "load-after": os.getloadavg()[0],
        }
        print(
            f"per-user (run_serial, block-training off): {seconds:.1f} s wall, HR@10 {_final(serial['rows'])}",
            flush=True,
        )
    print(json.dumps(summary, indent=1))
    if args.out:
        from fedrec_flwr.io import atomic_write_json

        atomic_write_json(Path(args.out), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
