"""Measure the README's FedRecGEL example exactly as a user would run it.

The README's example is ``bash experiments/quickstart.sh`` (``flwr run``: the package defaults, one user per SuperNode)
with FedRecGEL's keys and the settings the tuning protocol chose on MovieLens-100K's validation item
(``results/selection-ml-100k.json``). This runs the same run config through :func:`fedrec_flwr.serial.run_serial`
(the same ServerApp, strategy and ClientApp, bit-identical to the Ray simulation ``flwr run`` uses; one user per node
as the quickstart) and prints HR@10 / NDCG@10 at every evaluated round next to the popularity ranking of the same
split (the default one: no validation item held out).

    python -m experiments.tuning.readme_example 30    # rounds
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def example_overrides(rounds: int) -> dict:
    """The README example's run-config overrides: FedRecGEL's keys and its tuned server rate and rho-shared."""
    setting = json.loads((RESULTS / "selection-ml-100k.json").read_text())["FedRecGEL"]["setting"]
    return {
        "client": "fedrecgel",
        "strategy": "server-optimizer",
        "learning-rate": 0.1,
        "batch-size": 128,
        "server-learning-rate": setting["server-learning-rate"],
        "rho-shared": setting["rho-shared"],
        "num-server-rounds": rounds,
    }


def main(argv: list[str]) -> None:
    from experiments.common import quiet_flower
    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.baselines import evaluate_popularity
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.serial import run_serial

    quiet_flower()
    overrides = example_overrides(int(argv[0]) if argv else 30)
    print(
        "bash experiments/quickstart.sh "
        + " ".join(f"\"{k}='{v}'\"" if isinstance(v, str) else f'"{k}={v:g}"' for k, v in overrides.items()),
        flush=True,
    )
    data = os.environ.get("FEDREC_DATA_DIR", "")
    extra = {"data-dir": str(Path(data) / "ml-100k")} if data else {}
    with tempfile.TemporaryDirectory() as tmp:
        config = make_run_config(**overrides, **extra, **{"results-dir": tmp, "run-name": "readme-example"})
        popularity = evaluate_popularity(load_split_for(config), config.k_values)
        started = time.time()
        rows = json.loads((run_serial(config) / "metrics.json").read_text())
    for row in rows:
        if "HR@10" in row:
            print(
                f"round {row['round']:4d} | HR@10 {row['HR@10']:.4f} | NDCG@10 {row['NDCG@10']:.4f} | "
                f"train loss {row['train-loss']:.4f}",
                flush=True,
            )
    print(
        f"popularity on the same split: HR@10 {popularity['HR@10']:.4f} | NDCG@10 {popularity['NDCG@10']:.4f}; "
        f"users-per-node {config.users_per_node}; {time.time() - started:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
