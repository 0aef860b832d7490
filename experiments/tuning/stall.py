"""Diagnostic of FedMF's ln 2 plateau: the train loss of rounds 1-10 and HR@10 (validation / test) every
10 rounds, for a learning rate and an initialisation std of the embedding tables.

    python -m experiments.tuning.stall 0.01 0.01     # learning rate, init std (the old defaults)
    python -m experiments.tuning.stall 0.01 0.1 0.3  # ... several stds

The init std is not a run-config key (the models use N(0, 0.01^2), He et al. 2017); for this diagnostic only it is
changed by replacing the default of :func:`fedrec_flwr.models.base.init_embedding` in this process. Protocol: the
tuning protocol's (:data:`experiments.tuning.grid.PROTOCOL`), FedMF, seed 0, ML-100K, 100 rounds. Runs go to a
temporary folder; the printed lines are the result (``results/stall-ml-100k.txt``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> None:
    from experiments.common import quiet_flower
    from experiments.tuning.grid import METHODS, PROTOCOL
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.models import base
    from fedrec_flwr.serial import run_serial

    quiet_flower()
    rate, stds = float(argv[0]), [float(v) for v in argv[1:]] or [0.01]
    data_dir = os.environ.get("FEDREC_DATA_DIR", "")
    for std in stds:
        base.init_embedding.__wrapped__.__defaults__ = (std,)  # torch.no_grad() wraps it
        with tempfile.TemporaryDirectory() as tmp:
            overrides = {
                **PROTOCOL,
                **METHODS["FedMF"],
                "learning-rate": rate,
                "dataset": "ml-100k",
                "results-dir": tmp,
                "run-name": "stall",
            }
            if data_dir:
                overrides["data-dir"] = str(Path(data_dir) / "ml-100k")
            rows = json.loads((run_serial(make_run_config(**overrides)) / "metrics.json").read_text())
        print(
            f"learning-rate {rate:g} init-std {std:g} | train loss rounds 1-10:",
            " ".join(f"{r['train-loss']:.3f}" for r in rows[:10]),
            "| val/test HR@10:",
            " ".join(f"r{r['round']} {r['val-HR@10']:.3f}/{r['HR@10']:.3f}" for r in rows if "val-HR@10" in r),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
