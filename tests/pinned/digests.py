"""Digests of short runs that pin every number the package computes: a refactor must leave them unchanged.

Each case is one short run on the tiny generated dataset of ``tests/conftest.py`` through the serial engine (the same
ServerApp, strategy and ClientApp as ``flwr run``). Its digest is the SHA-256 of ``final_arrays.npz``'s arrays (names,
dtypes, shapes and bytes, in name order) and of ``metrics.json`` without its wall-time columns. Beside the digests the
file keeps float64 summaries (sum, sum of squares, first values) of every array and metric, so a machine whose float32
kernels round differently (another CPU's vector width) can still be compared within a stated tolerance.

Record (before a refactor, on the reference machine)::

    PYTHONPATH=tests .venv/bin/python tests/pinned/digests.py record

``tests/test_pinned_digests.py`` re-runs every case and compares.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DIGESTS = HERE / "digests.json"

PREVIOUS_ADVERSARY = {"adversary-weight-rule": "fixed", "secure-aggregation": "off", "adversary-class-prior": ""}
"""The FedAU² cases' adversary keys whose package defaults changed after their digests were recorded (their values
then; the tiny dataset has no published prior, so the old ``"published"`` default meant ``""``)."""

CASES: dict[str, dict] = {
    "fedncf-block": {"model": "ncf", "client": "fedrec", "block-training": "auto"},
    "fedncf-per-user": {"model": "ncf", "client": "fedrec", "block-training": "off"},
    "fedmf-4-per-node": {"model": "mf", "client": "fedrec", "users-per-node": 4},
    "fedmf-4-per-node-per-user": {"model": "mf", "client": "fedrec", "users-per-node": 4, "block-training": "off"},
    "fedrecgel-block": {"model": "ncf", "client": "fedrecgel", "strategy": "server-optimizer"},
    "fedrecgel-per-user": {
        "model": "ncf",
        "client": "fedrecgel",
        "strategy": "server-optimizer",
        "block-training": "off",
    },
    "pfedrec": {"model": "pfedrec", "client": "pfedrec"},
    "fedau2-mlp": {
        "model": "mf",
        "client": "fedau2",
        "protected-attribute": "group",
        "adversary": "mlp",
        **PREVIOUS_ADVERSARY,
    },
    "fedau2-dsvae": {
        "model": "ncf",
        "client": "fedau2",
        "protected-attribute": "group",
        "adversary": "dsvae",
        **PREVIOUS_ADVERSARY,
    },
    "hfkcu": {"model": "mf", "client": "fedrec", "unlearning": "hfkcu", "forget-users": "3,17"},
    "gradient-ascent-ncf": {"model": "ncf", "client": "fedrec", "unlearning": "gradient-ascent", "forget-users": "5"},
    "flower-fedadam": {"model": "mf", "client": "fedrec", "strategy": "flwr.serverapp.strategy:FedAdam"},
    "fedmf-sgd-bpr": {
        "model": "mf",
        "client": "fedrec",
        "optimizer": "sgd",
        "loss": "bpr",
        "learning-rate": 0.5,
        "local-epochs": 2,
    },
    "curious-server": {
        "model": "ncf",
        "client": "fedau2",
        "protected-attribute": "group",
        "adversary": "mlp",
        "strategy": "curious-item-fedavg",
        **PREVIOUS_ADVERSARY,
    },
}
"""Case name -> run-config overrides on top of ``tiny_run_config`` (3 rounds, evaluated every round)."""

TIMING_KEYS = ("seconds", "train-seconds")


def _attributes_file(folder: Path) -> Path:
    """The tiny dataset's user attribute: its item group (user % 3 == 0 or not), which its interactions encode."""
    lines = ["user,group"] + [f"u{u},{'a' if u % 3 == 0 else 'b'}" for u in range(24)]
    path = folder / "attributes.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_case(name: str, folder: Path) -> Path:
    """Run case ``name`` in ``folder``; returns its results folder."""
    from conftest import tiny_run_config

    from fedrec_flwr.serial import run_serial

    overrides = dict(CASES[name])
    if "protected-attribute" in overrides:
        overrides["generic-attributes-file"] = str(_attributes_file(folder))
    mapping = tiny_run_config(folder, **{k.replace("-", "_"): v for k, v in overrides.items()})
    return Path(run_serial(mapping))


def digest(results: Path) -> dict:
    """The digest and summaries of one results folder."""
    arrays = np.load(results / "final_arrays.npz")
    h = hashlib.sha256()
    summary = {}
    for key in sorted(arrays.files):
        a = arrays[key]
        h.update(key.encode() + b"\0" + str(a.dtype).encode() + b"\0" + repr(a.shape).encode() + b"\0")
        h.update(np.ascontiguousarray(a).tobytes())
        f = a.astype(np.float64).ravel()
        summary[key] = [float(f.sum()), float((f * f).sum())] + [float(v) for v in f[:4]]
    rows = json.loads((results / "metrics.json").read_text())
    rows = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]
    metrics_text = json.dumps(rows, sort_keys=True)
    return {
        "arrays": h.hexdigest(),
        "metrics": hashlib.sha256(metrics_text.encode()).hexdigest(),
        "array-summary": summary,
        "metrics-rows": rows,
    }


def machine() -> dict:
    """What decides float32 rounding: CPU model and flags that set the vector width, torch and numpy versions."""
    import torch

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not flags:
                flags = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                isa = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma", "amx")))
                flags += " | " + " ".join(isa)
                break
    except OSError:
        flags = platform.processor()
    return {
        "cpu": flags,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch-capability": torch.backends.cpu.get_cpu_capability(),
    }


def main(argv: list[str]) -> int:
    import tempfile

    if argv[:1] != ["record"]:
        print("usage: digests.py record", file=sys.stderr)
        return 2
    out = {"machine": machine(), "cases": {}}
    for name in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out["cases"][name] = {"overrides": CASES[name], **digest(run_case(name, Path(tmp)))}
            print(name, out["cases"][name]["arrays"][:12], out["cases"][name]["metrics"][:12], flush=True)
    DIGESTS.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
