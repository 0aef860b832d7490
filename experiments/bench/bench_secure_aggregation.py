"""Benchmark: the cost of FedAU²'s secure aggregation (``secure-aggregation = "secagg+"`` against ``"off"``) per round,
in seconds and bytes, at one user per node and at 100 users per node, in one run.

Every case trains FedAU² at the package defaults (``client = "fedau2"``, ``protected-attribute = "gender"``: a linear
``h_w`` with 20 server steps a round, the adaptive weight and the ``"aggregate"`` prior) on MovieLens-100K with 10% of
the users per round and no evaluation (``eval-every`` past the last round), through the serial engine (one process: the nodes' work is serial, so a
round's seconds are the sum of every node's work and the server's; on real nodes the node work runs in parallel).
Bytes are the protobuf sizes of every message's content the server sends and receives (``RecordDict`` as Flower
serialises it; message metadata and transport framing not included), summed over the round. The median over the
``--rounds`` rounds is reported; round 1 is included (no warm-up is skipped: each round runs the same protocol).

Run by hand (not a test), e.g.::

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench/bench_secure_aggregation.py --data-dir ../shared/data \
        --rounds 2 --json experiments/bench/results/secure-aggregation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
from flwr.common.serde import recorddict_to_proto

CASES = ((1, "off"), (1, "secagg+"), (100, "off"), (100, "secagg+"))
"""(users-per-node, secure-aggregation): 943 one-user nodes, and 10 nodes of 100 users."""


def _size(message) -> int:
    return recorddict_to_proto(message.content).ByteSize() if message.has_content() else 0


def run_case(data_dir: Path, users_per_node: int, secure: str, rounds: int) -> dict:
    """One case: ``{users-per-node, secure-aggregation, nodes, round-seconds, bytes-down, bytes-up}`` (medians)."""
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.serial import SerialGrid, run_serial

    counted = {"down": 0, "up": 0}
    push, pull = SerialGrid.push_messages, SerialGrid.pull_messages

    def counting_push(self, messages):
        messages = list(messages)
        counted["down"] += sum(_size(m) for m in messages)
        return push(self, messages)

    def counting_pull(self, message_ids):
        replies = list(pull(self, message_ids))
        counted["up"] += sum(_size(m) for m in replies)
        return replies

    per_round: list[tuple[int, int]] = []

    def on_round(view) -> None:
        per_round.append((counted["down"], counted["up"]))
        counted["down"] = counted["up"] = 0

    with tempfile.TemporaryDirectory() as folder:
        config = make_run_config(
            dataset="ml-100k",
            data_dir=str(data_dir / "ml-100k"),
            client="fedau2",
            protected_attribute="gender",
            secure_aggregation=secure,
            users_per_node=users_per_node,
            num_server_rounds=rounds,
            fraction_train=0.1,
            eval_every=rounds + 1,  # never evaluated
            results_dir=folder,
            run_name="bench",
        )
        SerialGrid.push_messages, SerialGrid.pull_messages = counting_push, counting_pull
        started = time.perf_counter()
        try:
            out = run_serial(config, on_round=on_round)
        finally:
            SerialGrid.push_messages, SerialGrid.pull_messages = push, pull
        wall = time.perf_counter() - started
        metrics = pd.read_csv(out / "metrics.csv")
    nodes = -(-943 // users_per_node)
    return {
        "users-per-node": users_per_node,
        "secure-aggregation": secure,
        "nodes": nodes,
        "rounds": rounds,
        "round-seconds": float(statistics.median(metrics["seconds"].dropna())),
        "bytes-down": int(statistics.median(d for d, _ in per_round)) if per_round else None,
        "bytes-up": int(statistics.median(u for _, u in per_round)) if per_round else None,
        "wall-seconds": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True, help="folder holding ml-100k/")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    for users_per_node, secure in CASES:
        row = run_case(args.data_dir, users_per_node, secure, args.rounds)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        from fedrec_flwr.io import atomic_write_json

        atomic_write_json(args.json, rows)


if __name__ == "__main__":
    main()
