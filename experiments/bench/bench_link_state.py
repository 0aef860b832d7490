"""Benchmark: one sweep of Flower's simulation engine over its link state, Flower's own lookup against
``fast-link-state`` (fedrec_flwr/app/flower_patches.py), for a few numbers of nodes and stored messages.

Run by hand (not a test)::

    .venv/bin/python experiments/bench/bench_link_state.py --cases 943:32 943:943 1227:32 8072:32

A case is ``nodes:stored``: a link state built as ``flwr.simulation.run_simulation`` builds it, with ``stored``
messages already delivered to the last ``stored`` nodes (in flight: their replies not yet pulled), then one sweep
as ``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue`` makes it: ``get_message_ins(node, limit=1)``
for every node in turn, which finds nothing new. It prints the milliseconds of that sweep for each lookup (the
median of ``--repeats``). The engine waits 0.1 s between sweeps and a sweep hands out at most the messages stored,
so with a window of ``W`` messages (``max-in-flight``) the engine can start at most ``W`` messages per
``0.1 s + sweep``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def sweep_ms(nodes: int, stored: int, method, repeats: int) -> float:
    """Median milliseconds of one sweep over ``nodes`` nodes with ``stored`` delivered messages, by ``method``."""
    from fedrec_flwr.app import flower_patches

    state, ids = flower_patches.simulation_link_state(nodes)
    for i in range(stored):
        message = flower_patches.store_message(state, f"m{i}", ids[nodes - 1 - i % nodes], 1)
        message.metadata.delivered_at = "delivered"
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for node in ids:
            method(state, node_id=node, limit=1)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["943:32", "943:943", "1227:32", "8072:32"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import logging
    import os

    from flwr.supercore.task_identity import TaskIdentity

    from fedrec_flwr.app import flower_patches

    logging.getLogger("flwr").setLevel(logging.WARNING)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # Message(...) needs an identity
    print(f"load average {os.getloadavg()}")
    print("| nodes | stored messages | Flower's lookup, ms a sweep | fast-link-state, ms a sweep | ratio |")
    print("|---|---|---|---|---|")
    for case in args.cases:
        nodes, stored = (int(v) for v in case.split(":"))
        flower = sweep_ms(nodes, stored, flower_patches.ORIGINAL_GET_MESSAGE_INS, args.repeats)
        ours = sweep_ms(nodes, stored, flower_patches.get_message_ins_by_destination, args.repeats)
        print(f"| {nodes} | {stored} | {flower:.1f} | {ours:.1f} | {flower / ours:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
