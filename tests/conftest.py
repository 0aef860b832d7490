"""Shared fixtures: where the real datasets are, and Flower's process identity for building messages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(os.environ.get("FEDREC_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def dataset_dir(name: str) -> Path:
    """The real dataset folder ``../shared/data/<name>``, or skip the test with the reason."""
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"real dataset folder {path} not found (set FEDREC_SHARED_DATA)")
    return path


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
