"""Benchmark of vectorized user blocks against the per-user loop, side by side in one run.

1. Local training of k users on one node (ML-100K, round 1, fresh private state): the per-user sequential loop (each
   user's ``NumPyClient.fit_named``, as a node without blocks runs them) against one vectorized block
   (:func:`fedrec_flwr.local.blocks.train_block`), for k = 1, 10, 50, 100, 943 and FedNCF / FedRecGEL, and the block with
   ``vmap`` + autograd and the per-user Adam formula (``block_engine.GRADIENTS = "vmap"``, ``block_optim.FUSED_ADAM = False``, as first built); also evaluation of
   the 943 users (per-user ``evaluate_named`` against :func:`fedrec_flwr.local.blocks.evaluate_block`).
2. Per message through the ClientApp in this process (one user per node): ours against a bare ClientApp that only
   decodes the same arrays, and ours with the arrays decoded per message as before.
3. Whole in-process federated rounds (:func:`fedrec_flwr.serial.run_serial`, FedNCF, every one of the 943 users
   sampled each round): ``users-per-node = 50`` (block path) against ``users-per-node = 1`` (per-user path: one
   message per user), mean wall time of the training rounds.

Usage (prints a markdown table; the load average at the start and end is printed too)::

    OMP_NUM_THREADS=1 FEDREC_DATA_DIR=/path/to/data nice -n 5 python experiments/bench/bench_blocks.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from flwr.app import RecordDict

from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.config import make_run_config
from fedrec_flwr.local import block_engine, block_optim
from fedrec_flwr.local.blocks import evaluate_block, train_block
from fedrec_flwr.registry import resolve
from fedrec_flwr.serial import run_serial

METHODS = {
    "FedNCF": {"client": "fedrec"},
    "FedRecGEL": {"client": "fedrecgel", "strategy": "server-optimizer", "batch-size": 128, "learning-rate": 0.1},
}
BLOCK_SIZES = (1, 10, 50, 100, 943)


def _shared(runtime):
    return {k: v.detach().cpu().numpy().copy() for k, v in runtime.model.shared_state().items()}


def bench_local(method: str, sizes=BLOCK_SIZES) -> list[dict]:
    """Seconds to train the first k users: sequential per-user clients and one block."""
    runtime = get_runtime(make_run_config(dataset="ml-100k", **METHODS[method]).to_dict())
    cls = resolve("client", runtime.config.client)
    shared = _shared(runtime)
    config = {"server-round": 1, "upload": "gradient" if method == "FedRecGEL" else "parameters"}
    rows = []
    train_block(runtime, cls, [0, 1], RecordDict(), shared, config)  # warm-up (first vmap call, allocator)
    cls(runtime, 0, RecordDict()).fit_named(shared, config)
    for k in sizes:
        users = list(range(min(k, runtime.split.num_users)))
        state = RecordDict()
        start = time.perf_counter()
        for user in users:
            cls(runtime, user, state).fit_named(shared, config)
        sequential = time.perf_counter() - start
        state = RecordDict()
        start = time.perf_counter()
        train_block(runtime, cls, users, state, shared, config)
        block = time.perf_counter() - start
        saved = block_engine.GRADIENTS, block_optim.FUSED_ADAM
        block_engine.GRADIENTS, block_optim.FUSED_ADAM = "vmap", False  # the block path as first built: vmap + autograd
        try:
            start = time.perf_counter()
            train_block(runtime, cls, users, RecordDict(), shared, config)
            autograd = time.perf_counter() - start
        finally:
            block_engine.GRADIENTS, block_optim.FUSED_ADAM = saved
        rows.append(
            {
                "method": method,
                "k": len(users),
                "sequential-s": sequential,
                "block-s": block,
                "block-autograd-s": autograd,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_evaluation() -> dict:
    runtime = get_runtime(make_run_config(dataset="ml-100k").to_dict())
    cls = resolve("client", runtime.config.client)
    shared, state = _shared(runtime), RecordDict()
    users = list(range(runtime.split.num_users))
    start = time.perf_counter()
    for user in users:
        cls(runtime, user, state).evaluate_named(shared, {"split": "test"})
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    evaluate_block(runtime, users, state, shared, {"split": "test"})
    return {"k": len(users), "sequential-s": sequential, "block-s": time.perf_counter() - start}


def bench_messages(count: int = 100) -> dict:
    """Milliseconds per message through the ClientApp in this process, one user per node (FedNCF, ML-100K): train and
    evaluate with the shared arrays decoded once per ArrayRecord (ours, now) and decoded per message with
    ``Array.numpy()`` (before), and a bare ClientApp that decodes the same arrays and replies one metric."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.supercore.task_identity import TaskIdentity

    from fedrec_flwr.app import client_app as ours
    from fedrec_flwr.wire import ARRAYS, CONFIG, METRICS

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    config = make_run_config(dataset="ml-100k").to_dict()
    runtime = get_runtime(config)
    arrays = ArrayRecord({k: Array(v) for k, v in _shared(runtime).items()})
    bare = ClientApp()

    @bare.train()
    def _bare(message, context):  # what any ClientApp does with the arrays: decode them, reply
        _ = {k: a.numpy() for k, a in message.content[ARRAYS].items()}
        return Message(RecordDict({METRICS: MetricRecord({"num-examples": 1.0})}), reply_to=message)

    def run(app, kind: str) -> float:
        contexts = [
            Context(
                run_id=1,
                node_id=1000 + u,
                node_config={"partition-id": u, "num-partitions": 943},
                state=RecordDict(),
                run_config=config,
            )
            for u in range(count)
        ]

        def send(user: int, rnd: int):
            msg = Message(
                RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({"server-round": rnd})}),
                1000 + user,
                kind,
                group_id=str(rnd),
            )
            msg.metadata.__dict__.update(_message_id=f"{kind}-{user}-{rnd}", _src_node_id=1)
            reply = app(msg, contexts[user])
            assert not reply.has_error(), reply.error

        send(0, 1)
        start = time.perf_counter()
        for user in range(count):
            send(user, 2)
        return 1000 * (time.perf_counter() - start) / count

    app = ours.make_client_app(config)
    out = {"bare-train-ms": run(bare, "train")}
    for kind in ("train", "evaluate"):
        out[f"ours-{kind}-ms"] = run(app, kind)
    decode = ours.shared_arrays
    ours.shared_arrays = lambda message: {k: a.numpy() for k, a in message.content[ARRAYS].items()}
    try:
        for kind in ("train", "evaluate"):
            out[f"before-{kind}-ms"] = run(app, kind)
    finally:
        ours.shared_arrays = decode
    return out


def bench_rounds(users_per_node: int, rounds: int, folder: Path) -> float:
    """Mean seconds of a training round (``train-seconds`` of metrics.json) with every user sampled."""
    config = make_run_config(
        dataset="ml-100k",
        fraction_train=1.0,
        num_server_rounds=rounds,
        eval_every=1000,
        users_per_node=users_per_node,
        results_dir=str(folder),
        run_name=f"upn{users_per_node}",
    )
    results = run_serial(config)
    rows = json.loads((results / "metrics.json").read_text())
    return sum(float(r["train-seconds"]) for r in rows) / len(rows), rows[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="training rounds per users-per-node setting")
    parser.add_argument("--sizes", default=",".join(map(str, BLOCK_SIZES)), help="block sizes k")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    print(f"load average at start: {load_start}", flush=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    local = [row for method in METHODS for row in bench_local(method, sizes)]
    evaluation = bench_evaluation()
    print(json.dumps({"evaluation": evaluation}), flush=True)
    messages = bench_messages()
    print(json.dumps({"messages": messages}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rounds = {upn: bench_rounds(upn, args.rounds, Path(tmp)) for upn in (1, 50)}
    load_end = os.getloadavg()
    print(
        "\n| method | k | sequential per user (ms) | block per user (ms) | sequential per node (s) | block per node (s) "
        "| ratio | block with vmap + autograd, per user (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in local:
        print(
            f"| {r['method']} | {r['k']} | {1000 * r['sequential-s'] / r['k']:.2f} | {1000 * r['block-s'] / r['k']:.2f}"
            f" | {r['sequential-s']:.3f} | {r['block-s']:.3f} | {r['sequential-s'] / r['block-s']:.1f}x "
            f"| {1000 * r['block-autograd-s'] / r['k']:.2f} |"
        )
    e = evaluation
    print(
        f"\nevaluation of {e['k']} users (FedNCF): per-user {1000 * e['sequential-s'] / e['k']:.2f} ms/user, block "
        f"{1000 * e['block-s'] / e['k']:.3f} ms/user, ratio {e['sequential-s'] / e['block-s']:.1f}x"
    )
    m = messages
    print(
        f"\nper message in-process, 1 user per node (FedNCF): bare ClientApp (decode arrays, reply) "
        f"{m['bare-train-ms']:.2f} ms; ours train {m['ours-train-ms']:.2f} ms (arrays decoded per message as before: "
        f"{m['before-train-ms']:.2f}), evaluate {m['ours-evaluate-ms']:.2f} ms (before: {m['before-evaluate-ms']:.2f})"
    )
    (t1, m1), (t50, m50) = rounds[1], rounds[50]
    print(
        f"\nrun_serial, FedNCF, 943 sampled users per round, {args.rounds} rounds: users-per-node = 1: {t1:.2f} s "
        f"per training round; users-per-node = 50: {t50:.2f} s; ratio {t1 / t50:.1f}x"
    )
    print(
        f"last round: train-loss {m1['train-loss']:.6f} vs {m50['train-loss']:.6f}; HR@10 {m1['HR@10']:.6f} vs "
        f"{m50['HR@10']:.6f}"
    )
    print(
        f"\nload average at start {load_start}, at end {load_end}; torch threads 1; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


if __name__ == "__main__":
    main()
