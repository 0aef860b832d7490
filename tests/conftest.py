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
            pytest.fail(
                f"{SHARED_DATA_ENV}={os.environ[SHARED_DATA_ENV]} is set, but the dataset folder {path} does "
                "not exist (fix the variable or unset it to skip the real-data tests)",
                pytrace=False,
            )
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
def write_tiny_dataset(
    folder: Path, num_users: int = 24, num_items: int = 60, per_user: int = 12, seed: int = 0
) -> Path:
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
    mapping.update(
        {
            "dataset": "generic",
            "generic-file": str(write_tiny_dataset(folder)),
            "cache-dir": str(folder / "cache"),
            "num-test-negatives": 20,
            "ks": "5,10",
            "embedding-dim": 8,
            "mlp-layers": "16,8",
            "num-server-rounds": 3,
            "fraction-train": 0.5,
            "eval-every": 1,
            "results-dir": str(folder / "results"),
            "run-name": "run",
            "round-timeout": 600.0,  # an upper bound only; a loaded 2-core machine can take minutes to start Ray actors
        }
    )
    mapping.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return mapping


class MessageRecorder:
    """A Flower client mod that pickles every reply a client sends, with the node's state before (``state-before``)
    and after (``state``) the handler (the state is test-harness evidence only: it never travels)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, message, context, call_next):
        import pickle
        import uuid

        before = _state_arrays(context)
        reply = call_next(message, context)
        record = {
            "type": message.metadata.message_type,
            "round": (dict(message.content["config"]).get("server-round") if "config" in message.content else None),
            "users": (list(message.content["config"].get("users", [])) if "config" in message.content else []),
            "partition-id": context.node_config.get("partition-id"),
            "reply-arrays": {
                name: {k: v.numpy() for k, v in rec.items()} for name, rec in reply.content.array_records.items()
            }
            if not reply.has_error()
            else {},
            "reply-metrics": {name: dict(rec) for name, rec in reply.content.metric_records.items()}
            if not reply.has_error()
            else {},
            "reply-configs": {name: dict(rec) for name, rec in reply.content.config_records.items()}
            if not reply.has_error()
            else {},
            "error": reply.error.reason if reply.has_error() else None,
            "state-before": before,
            "state": _state_arrays(context),
        }
        (self.folder / f"{uuid.uuid4().hex}.pkl").write_bytes(pickle.dumps(record))
        return reply

    def records(self) -> list[dict]:
        import pickle

        return [pickle.loads(p.read_bytes()) for p in sorted(self.folder.glob("*.pkl"))]


def simulate(
    run_config: dict,
    *,
    num_supernodes: int | None = None,
    num_cpus: int = 2,
    cpus_per_client: float = 1,
    recorder: MessageRecorder | None = None,
) -> Path:
    """Run the ServerApp and ClientApp in-process with Flower's simulation engine; returns the results folder."""
    import os

    from flwr.simulation import run_simulation

    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.app.server_app import make_server_app

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if num_supernodes is None:
        from fedrec_flwr.launch import num_supernodes_for

        num_supernodes = num_supernodes_for(run_config)
    run_simulation(
        make_server_app(run_config),
        make_client_app(run_config, mods=[recorder] if recorder else None),
        num_supernodes=num_supernodes,
        backend_config={
            "client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
            "init_args": {"num_cpus": num_cpus, "num_gpus": 0, "include_dashboard": False},
        },
    )
    return Path(run_config["results-dir"]) / run_config["run-name"]


def _state_arrays(context) -> dict:
    return {k: {n: a.numpy() for n, a in rec.items()} for k, rec in context.state.array_records.items()}


PRIVATE_RECORD = r"^[A-Za-z][A-Za-z-]*:\d+$"
"""``context.state`` keys of a user's private records (``user:<u>``, ``user-opt:<u>``, ...; fedrec_flwr.state.client_state)."""
UPLOADED_BY_PROTOCOL = ("user-rows:",)
"""Per-user records whose values the method uploads by design: PFedRec's fine-tuned item rows ARE its item upload
(Zhang et al. 2023, Alg. 1), so they are not secrets from the server. Its private score function (``user:``) is."""


def private_vectors(records, extra=()) -> list:
    """Every private vector a node ever held: each row (last axis, length >= 2, not all zero) of each floating array of
    each per-user record (:data:`PRIVATE_RECORD`, except :data:`UPLOADED_BY_PROTOCOL`) in the state before and after
    every recorded handler, plus ``extra`` vectors (e.g. :func:`seeded_private_vectors`). Deduplicated; float64."""
    import re

    import numpy as np

    out = [np.asarray(v, np.float64).ravel() for v in extra]
    for record in records:
        for state in (record.get("state-before", {}), record["state"]):
            for key, arrays in state.items():
                if not re.match(PRIVATE_RECORD, key) or key.startswith(UPLOADED_BY_PROTOCOL):
                    continue
                for array in arrays.values():
                    array = np.asarray(array)
                    if array.dtype.kind == "f" and array.ndim >= 1 and array.shape[-1] >= 2:
                        out.extend(array.reshape(-1, array.shape[-1]).astype(np.float64))
    unique = {(len(v), v.tobytes()): v for v in out if len(v) >= 2 and np.abs(v).max() > 0}
    return list(unique.values())


def seeded_private_vectors(run_config) -> list:
    """Each user's private vectors as its client initialises them on its first visit (from the run seed), before any
    training stores them in ``context.state``."""
    import numpy as np
    from flwr.app import RecordDict

    from fedrec_flwr.app.runtime import get_runtime
    from fedrec_flwr.registry import resolve

    runtime = get_runtime(run_config)
    cls = resolve("client", runtime.config.client)
    out = []
    for user in range(runtime.split.num_users):
        cls(runtime, user, RecordDict()).load_private()
        for value in runtime.model.private_state().values():
            value = value.detach().cpu().numpy().astype(np.float64)
            out.extend(value.reshape(-1, value.shape[-1]))
    return out


def find_vector(haystack, needles, rel: float = 1e-3):
    """Index of the first of ``needles`` (1-D float vectors) found in ``haystack`` as a contiguous slice of its
    flattening or of its transpose's (a row, a column, part of a concatenation), each element within ``rel`` times
    the needle's largest magnitude; ``None`` if none is."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    array = np.asarray(haystack)
    if array.dtype.kind not in "fiu" or array.size == 0:
        return None
    array = array.astype(np.float64)
    flats = [array.ravel()] + ([np.swapaxes(array, -1, -2).ravel()] if array.ndim >= 2 else [])
    by_length: dict[int, list[int]] = {}
    for index, needle in enumerate(needles):
        by_length.setdefault(len(needle), []).append(index)
    for length, indices in by_length.items():
        for start in range(0, len(indices), 256):
            chunk = indices[start : start + 256]
            group = np.stack([needles[i] for i in chunk])
            tol = rel * np.abs(group).max(axis=1)
            for flat in flats:
                if flat.size < length:
                    continue
                windows = sliding_window_view(flat, length)
                # candidates by the first element, then the whole vector
                w, n = np.nonzero(np.abs(windows[:, :1] - group[None, :, 0]) <= tol[None, :])
                hit = np.abs(windows[w] - group[n]).max(axis=1) <= tol[n]
                if hit.any():
                    return chunk[int(n[np.argmax(hit)])]
    return None


def assert_no_private_value_in_replies(records, layout, private_rows=None, *, extra=()) -> None:
    """No recorded reply (a :class:`MessageRecorder` record) carries a private key, or, in any array or list-valued
    metric/config entry, a private vector as a row, a column or any contiguous slice, exactly or within 0.1 % of its
    scale (:func:`find_vector`). Private vectors: ``private_rows`` if given, else :func:`private_vectors` of the
    records (state before and after every handler); plus ``extra`` (e.g. :func:`seeded_private_vectors`)."""
    import numpy as np

    rows = [
        np.asarray(r, np.float64).ravel()
        for r in (private_rows if private_rows is not None else private_vectors(records))
    ] + [np.asarray(v, np.float64).ravel() for v in extra]
    rows = [r for r in rows if len(r) >= 2 and np.abs(r).max() > 0]  # scalars and zero vectors carry nothing
    assert len(rows) > 0
    for record in records:
        assert not record["error"], record["error"]
        values = {f"array {key}": array for arrays in record["reply-arrays"].values() for key, array in arrays.items()}
        for kind in ("reply-metrics", "reply-configs"):
            values.update(
                {
                    f"{kind} {key}": value
                    for rec in record[kind].values()
                    for key, value in rec.items()
                    if isinstance(value, (list, tuple, np.ndarray))
                }
            )
        for arrays in record["reply-arrays"].values():
            for key in arrays:
                assert key.split("#")[0] not in layout.private_keys, key
        for name, value in values.items():
            found = find_vector(value, rows)
            assert found is None, (
                f"{record['type']} reply of partition {record['partition-id']} (round "
                f"{record['round']}): {name} contains private vector {rows[found]}"
            )


TIMING_KEYS = ("seconds", "train-seconds")
"""Metric columns that measure wall time (differ between otherwise identical runs)."""


def without_timings(rows):
    """``metrics.json`` rows without their wall-time columns, to compare two runs' metrics exactly."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]
