"""Shared fixtures: where the real datasets are, and Flower's process identity for building messages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA_ENV = "FEDREC_SHARED_DATA"
SHARED_DATA = Path(os.environ.get(SHARED_DATA_ENV) or Path(__file__).resolve().parents[2] / "shared" / "data")
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def dataset_dir(name: str) -> Path:
    """The real dataset folder ``$FEDREC_SHARED_DATA/<name>`` (default ``../shared/data/<name>``).

    A missing folder FAILS the test when ``FEDREC_SHARED_DATA`` is set (the machine claims to have the data: a wrong
    path must not turn the end-to-end, split and deployment tests into silent skips); only with the variable unset
    is the test skipped, with the reason. ``.ci/run`` sets it."""
    path = SHARED_DATA / name
    if not path.is_dir():
        if os.environ.get(SHARED_DATA_ENV):
            pytest.fail(f"{SHARED_DATA_ENV}={os.environ[SHARED_DATA_ENV]} is set, but the dataset folder {path} does "
                        "not exist (fix the variable or unset it to skip the real-data tests)", pytrace=False)
        pytest.skip(f"real dataset folder {path} not found ({SHARED_DATA_ENV} unset)")
    return path


SLOW_TESTS_ENV = "FEDREC_SLOW_TESTS"
"""Set to 1 to also run the tests marked ``slow`` (real-process deployments with faults and TLS, a Ray cluster:
about 15 more minutes on 2 cores), which CI's 30-minute budget leaves out."""


def pytest_collection_modifyitems(config, items):
    if os.environ.get(SLOW_TESTS_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"real-process test of several minutes: run with {SLOW_TESTS_ENV}=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ml100k_dir() -> Path:
    return dataset_dir("ml-100k")


@pytest.fixture
def task_identity():
    """Flower's per-process identity, which ``Message(...)`` needs outside a running app."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield TaskIdentity
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


# ------------------------------------------------------------------------------------------ tiny generated data
def write_tiny_dataset(folder: Path, num_users: int = 24, num_items: int = 60, per_user: int = 12, seed: int = 0) -> Path:
    """A small interactions CSV with structure (users prefer one of three item groups), for fast simulations."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lines = ["user,item,rating,timestamp"]
    for user in range(num_users):
        group = user % 3
        pool = np.arange(num_items)[np.arange(num_items) % 3 == group]
        items = rng.choice(pool, size=min(per_user, len(pool)), replace=False)
        for t, item in enumerate(items):
            lines.append(f"u{user},i{item},5,{1000 + t}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_run_config(folder: Path, **overrides):
    """Run-config mapping for the tiny generated dataset (fast: small model, few negatives)."""
    from fedrec_flwr.config import default_mapping

    mapping = default_mapping()
    mapping.update({
        "dataset": "generic", "generic-file": str(write_tiny_dataset(folder)), "cache-dir": str(folder / "cache"),
        "num-test-negatives": 20, "ks": "5,10", "embedding-dim": 8, "mlp-layers": "16,8", "num-server-rounds": 3,
        "fraction-train": 0.5, "eval-every": 1, "results-dir": str(folder / "results"), "run-name": "run",
        "round-timeout": 600.0,  # an upper bound only; a loaded 2-core machine can take minutes to start Ray actors
    })
    mapping.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return mapping


class MessageRecorder:
    """A Flower client mod that pickles every reply a client sends, with the node's private state after the handler
    (the state is test-harness evidence only: it never travels)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, message, context, call_next):
        import pickle
        import uuid

        reply = call_next(message, context)
        record = {
            "type": message.metadata.message_type,
            "round": (dict(message.content["config"]).get("server-round") if "config" in message.content else None),
            "users": (list(message.content["config"].get("users", [])) if "config" in message.content else []),
            "partition-id": context.node_config.get("partition-id"),
            "reply-arrays": {
                name: {k: v.numpy() for k, v in rec.items()} for name, rec in reply.content.array_records.items()
            } if not reply.has_error() else {},
            "reply-metrics": {
                name: dict(rec) for name, rec in reply.content.metric_records.items()
            } if not reply.has_error() else {},
            "reply-configs": {
                name: dict(rec) for name, rec in reply.content.config_records.items()
            } if not reply.has_error() else {},
            "error": reply.error.reason if reply.has_error() else None,
            "state": {k: {n: a.numpy() for n, a in rec.items()} for k, rec in context.state.array_records.items()},
        }
        (self.folder / f"{uuid.uuid4().hex}.pkl").write_bytes(pickle.dumps(record))
        return reply

    def records(self) -> list[dict]:
        import pickle

        return [pickle.loads(p.read_bytes()) for p in sorted(self.folder.glob("*.pkl"))]


def simulate(run_config: dict, *, num_supernodes: int | None = None, num_cpus: int = 2, cpus_per_client: float = 1,
             recorder: MessageRecorder | None = None) -> Path:
    """Run the ServerApp and ClientApp in-process with Flower's simulation engine; returns the results folder."""
    import os

    from flwr.simulation import run_simulation

    from fedrec_flwr.client_app import make_client_app
    from fedrec_flwr.server_app import make_server_app

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if num_supernodes is None:
        from fedrec_flwr.launch import num_supernodes_for

        num_supernodes = num_supernodes_for(run_config)
    run_simulation(
        make_server_app(run_config),
        make_client_app(run_config, mods=[recorder] if recorder else None),
        num_supernodes=num_supernodes,
        backend_config={"client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
                        "init_args": {"num_cpus": num_cpus, "num_gpus": 0, "include_dashboard": False}},
    )
    return Path(run_config["results-dir"]) / run_config["run-name"]


def assert_no_private_value_in_replies(records, layout, private_rows) -> None:
    """No recorded reply (a :class:`MessageRecorder` record) carries a private key, or any array row equal to one of
    ``private_rows`` (every private row ever stored on a node), to 1e-7."""
    import numpy as np

    assert len(private_rows) > 0
    for record in records:
        assert not record["error"], record["error"]
        for arrays in record["reply-arrays"].values():
            for key, array in arrays.items():
                assert key.split("#")[0] not in layout.private_keys, key
                flat = np.atleast_2d(array).astype(np.float64)
                for row in private_rows:
                    if flat.shape[-1] == row.shape[-1]:
                        assert not np.isclose(flat, row, rtol=0, atol=1e-7).all(axis=-1).any(), key


TIMING_KEYS = ("seconds", "train-seconds")
"""Metric columns that measure wall time (differ between otherwise identical runs)."""


def without_timings(rows):
    """``metrics.json`` rows without their wall-time columns, to compare two runs' metrics exactly."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]
