"""Where the simulation process's time goes per round: timers around Flower 1.42's own link-state, grid and backend
functions and our strategy's, for one ``bench_simulation.py`` case (the cost per message).

Flower's in-process simulation (``run_simulation``, the engine ``flwr run`` uses) keeps the ServerApp, the link state,
the thread that polls every node for messages (``add_messages_to_queue``) and the Ray backend's worker threads in one
process; this wraps their functions with wall-clock timers (by monkeypatching, in this process only) and prints, per
function, calls, total and mean time. Run by hand (not a test)::

    OMP_NUM_THREADS=1 FEDREC_DATA_DIR=../shared/data .venv/bin/python experiments/bench/driver_timers.py [bare+model]

(no argument: our app). The case is ML-100K, 100 sampled users of 943 one-user nodes, 4 rounds; our app's counts
include its identify query to all 943 nodes.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding each call's wall time to ``TIMES[label]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TIMES[label].append(time.perf_counter() - started)

    setattr(owner, name, wrapper)


def main(argv: list[str]) -> int:
    import bench_simulation
    import flwr.compat.client.run_info_store as run_info
    import flwr.server.superlink.fleet.vce.backend.raybackend as raybackend
    import flwr.server.superlink.linkstate.in_memory_linkstate as linkstate
    import flwr.superlink.grid.inmemory_grid as grid

    import fedrec_flwr.strategies.item_fedavg as item_fedavg

    timed(item_fedavg.ItemEmbeddingFedAvg, "configure_train", "strategy.configure_train")
    timed(item_fedavg.ItemEmbeddingFedAvg, "aggregate_train", "strategy.aggregate_train")
    for name in ("send_and_receive", "push_messages", "pull_messages"):
        timed(grid.InMemoryGrid, name, f"grid.{name}")
    for name in (
        "store_message_ins",
        "get_message_ins",
        "store_message_res",
        "get_message_res",
        "delete_messages",
        "_check_stored_messages",
    ):
        timed(linkstate.InMemoryLinkState, name, f"state.{name}")
    timed(raybackend.RayBackend, "process_message", "backend.process_message")
    timed(run_info.DeprecatedRunInfoStore, "update_context", "context.update")
    app = argv[0] if argv else None
    load = os.getloadavg()
    row = bench_simulation.run_case("ml-100k", 100, 1, 4, os.environ.get("FEDREC_DATA_DIR", "../shared/data"), app)
    print(row, f"load {load[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    for label, values in sorted(TIMES.items()):
        mean = 1000 * sum(values) / len(values)
        print(f"{label:32s} calls {len(values):8d}  total {sum(values):8.2f} s  mean {mean:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
