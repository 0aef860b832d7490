"""Benchmark of HF-KCU's building block: curvature-vector products of users' influence losses (the exact Hessian
and the Gauss-Newton matrix, ``--curvature``).

Prints, for MF and NCF on MovieLens-100K (users with their initial embeddings; the cost does not depend on values):
milliseconds per product for one user at a time and for a node's users batched into one pass
(:func:`fedrec_flwr.unlearning.influence.influence_objective`), and the resident memory (RSS) after every 100 of N products, to
show that it stays flat (no graph or tensor is kept between products).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench/bench_krylov.py --data-root ../shared/data --products 500 \
        --curvature hessian,gauss-newton
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch
from flwr.app import Context, RecordDict


def rss_mib() -> float:
    """Current resident memory of this process (MiB), from /proc (Linux), else the peak."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:  # pragma: no cover
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    from fedrec_flwr.app.client_app import make_client
    from fedrec_flwr.app.runtime import get_runtime
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.unlearning.influence import influence_objective
    from fedrec_flwr.unlearning.krylov import curvature_vector_product

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--products", type=int, default=500)
    parser.add_argument("--node-users", type=int, default=100)
    parser.add_argument("--curvature", default="hessian,gauss-newton", help="comma-separated: hessian, gauss-newton")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | curvature | mode | users per pass | ms per pass | ms per user | RSS MiB after each 100 passes |")
    print("|---|---|---|---|---|---|---|")
    for model in ("mf", "ncf"):
        runtime = get_runtime(
            make_run_config(dataset="ml-100k", data_dir=f"{args.data_root}/ml-100k", model=model).to_dict()
        )
        shared = {k: v.numpy() for k, v in runtime.model.shared_state().items()}
        context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
        clients = [make_client(runtime, u, context) for u in range(args.node_users)]
        direction = {k: np.random.default_rng(0).normal(size=v.shape) for k, v in shared.items()}
        runs = [
            (curvature, mode, groups)
            for curvature in args.curvature.split(",")
            for mode, groups in (("one user", [[c] for c in clients]), ("node batch", [clients]))
        ]
        for curvature, mode, groups in runs:
            memory, started, passes = [], time.perf_counter(), 0
            while passes < args.products:
                for group in groups:
                    with influence_objective(runtime, group, shared) as (loss_fn, params, items):
                        vector = {
                            k: torch.as_tensor(
                                direction[k][items] if k in runtime.layout.item_keys else direction[k], dtype=p.dtype
                            )
                            for k, p in params.items()
                        }
                        curvature_vector_product(loss_fn, params, vector, curvature)
                    passes += 1
                    if passes % 100 == 0:
                        memory.append(f"{rss_mib():.0f}")
                    if passes >= args.products:
                        break
            elapsed = (time.perf_counter() - started) * 1000
            users = len(groups[0])
            print(
                f"| {model} | {curvature} | {mode} | {users} | {elapsed / passes:.1f} | {elapsed / passes / users:.2f} | "
                f"{' '.join(memory)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
