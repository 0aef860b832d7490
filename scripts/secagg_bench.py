"""Cost of :func:`fedrec_flwr.privacy.secagg.secure_sum`: wall time, bytes per node and the quantization error, with
in-process nodes running the client handlers (one process: the nodes' work is serial here, so the wall time is the
sum of every node's work plus the server's; on real nodes the node work runs in parallel). CPU seconds (process time,
all threads) are reported beside wall seconds, for a shared machine; "node" figures are per node, "server" the rest.

Bytes are the protobuf sizes of the messages' contents as :mod:`fedrec_flwr.privacy.secagg_records` packs them
(``recorddict_to_proto(...).ByteSize()``; message metadata and transport framing not included), per node and summed
over the four stages: "down" what the server sends the node, "up" what the node sends back.

Usage (from the project root)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/secagg_bench.py --nodes 10 100 [--num-shares 31] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from flwr.common.serde import recorddict_to_proto

from fedrec_flwr.privacy import secagg
from fedrec_flwr.privacy.secagg_records import to_content

# a linear h_w on FedNCF's user vector (2 * 32 = 64 entries) with 2 classes; on FedMF's (32): 32 * 2 + 2 = 66
VECTORS = {
    "h_w gradient (NCF, 130)": ({"adversary.head.weight": (2, 64), "adversary.head.bias": (2,)}, 1.0),
    "h_w gradient (MF, 66)": ({"adversary.head.weight": (2, 32), "adversary.head.bias": (2,)}, 1.0),
    "item counts (1682)": ({"counts": (1682,)}, 1.0),
}


class Nodes:
    """In-process nodes; counts each node's bytes and the time spent in node handlers."""

    def __init__(self, inputs):
        self.inputs = inputs
        self.states = {nid: {} for nid in inputs}
        self.down = dict.fromkeys(inputs, 0)
        self.up = dict.fromkeys(inputs, 0)
        self.node_seconds = 0.0
        self.node_cpu = 0.0

    def __call__(self, stage, contents):
        replies = {}
        for nid, config in contents.items():
            self.down[nid] += recorddict_to_proto(to_content(stage, config)).ByteSize()
            start, cpu = time.perf_counter(), time.process_time()
            if stage == secagg.COLLECT_MASKED_VECTORS:
                rng = np.random.default_rng([0, nid])
                reply = secagg.collect_masked_vectors(self.states[nid], config, self.inputs[nid], rng=rng)
            else:
                reply = secagg.HANDLERS[stage](self.states[nid], config, None)
            self.node_seconds += time.perf_counter() - start
            self.node_cpu += time.process_time() - cpu
            self.up[nid] += recorddict_to_proto(to_content(stage, reply)).ByteSize()
            replies[nid] = reply
        return replies


def _inputs(num_nodes, spec, name, rng):
    if name.startswith("item counts"):  # one user per node: a 0/1 vector of the user's training items
        return {1 + i: {"counts": (rng.random(spec["counts"]) < 0.06).astype(np.float64)} for i in range(num_nodes)}
    return {1 + i: {k: np.clip(0.2 * rng.standard_normal(s), -1, 1) for k, s in spec.items()} for i in range(num_nodes)}


def run(num_nodes, name, *, num_shares, threshold, quantization_range):
    spec, clip = VECTORS[name]
    inputs = _inputs(num_nodes, spec, name, np.random.default_rng(num_nodes))
    nodes = Nodes(inputs)
    start, cpu = time.perf_counter(), time.process_time()
    out = secagg.secure_sum(
        nodes,
        list(inputs),
        spec,
        threshold=threshold,
        clipping_range=clip,
        quantization_range=quantization_range,
        num_shares=num_shares,
        seed=0,
    )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    error = max(
        float(np.max(np.abs(out.arrays[k] - sum(np.clip(x[k], -clip, clip) for x in inputs.values())))) for k in spec
    )
    return {
        "vector": name,
        "nodes": num_nodes,
        "num-shares": num_shares or num_nodes,
        "threshold": threshold,
        "quantization-range": quantization_range,
        "wall-s": round(wall, 2),
        "cpu-s": round(cpu, 2),
        "node-s-per-node": round(nodes.node_seconds / num_nodes, 4),
        "server-s": round(wall - nodes.node_seconds, 2),
        "node-cpu-s-per-node": round(nodes.node_cpu / num_nodes, 4),
        "server-cpu-s": round(cpu - nodes.node_cpu, 2),
        "bytes-down-per-node": int(np.mean(list(nodes.down.values()))),
        "bytes-up-per-node": int(np.mean(list(nodes.up.values()))),
        "plain-bytes": int(sum(int(np.prod(s)) for s in spec.values()) * 4),
        "max-abs-error": error,
        "error-bound": out.error_bound,
        "clipped": out.clipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 943])
    parser.add_argument("--vectors", nargs="+", default=list(VECTORS), choices=list(VECTORS))
    parser.add_argument("--num-shares", type=int, default=None, help="SecAgg+ neighbourhood (default: every node)")
    parser.add_argument("--quantization-range", type=int, default=2**22)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for n in args.nodes:
        num_shares = args.num_shares if args.num_shares and args.num_shares < n else None
        threshold = (n if num_shares is None else num_shares) // 2 + 1
        for name in args.vectors:
            row = run(n, name, num_shares=num_shares, threshold=threshold, quantization_range=args.quantization_range)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
