"""Private client state in files (``client-state-dir``): versions, pruning, atomic writes, clear errors, and the
ClientApp adapter loading and saving it so that a restarted node loses no user's state."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.state.client_state import (
    ClientStateError,
    ClientStateStore,
    _versions_to_keep,
    state_folder,
    user_record_keys,
)
from tests.conftest import tiny_run_config


def _state(user: int, value: float) -> RecordDict:
    state = RecordDict()
    state[f"user:{user}"] = ArrayRecord({"user_embedding.weight": Array(np.full((1, 4), value, dtype=np.float32))})
    state[f"user-opt:{user}"] = ArrayRecord({"0/step": Array(np.array(value, dtype=np.float32))})
    state[f"user:{user + 10}"] = ArrayRecord({"user_embedding.weight": Array(np.zeros((1, 4), np.float32))})
    return state


def test_user_record_keys_match_the_user_exactly():
    state = _state(1, 0.5)
    assert sorted(user_record_keys(state, 1)) == ["user-opt:1", "user:1"]
    assert user_record_keys(state, 11) == ["user:11"]  # ":1" is not a suffix match for user 11's keys


def test_load_picks_the_newest_version_at_or_before_the_round(tmp_path):
    store = ClientStateStore(tmp_path)
    for round_, value in ((2, 2.0), (5, 5.0), (7, 7.0)):
        store.save(1, _state(1, value), round_, durable_round=0)  # no checkpoint yet: every version is kept
    assert sorted(store.read_versions(1)) == [2, 5, 7]
    state = RecordDict()
    assert store.load(1, state, as_of=6) == 5
    assert float(state["user:1"]["user_embedding.weight"].numpy()[0, 0]) == 5.0
    assert store.load(1, state, as_of=None) == 7
    assert store.load(1, state, as_of=1) is None
    assert user_record_keys(state, 1) == []  # no version that early: the client starts from its seeded state


def test_versions_before_the_last_checkpoint_are_dropped(tmp_path):
    assert _versions_to_keep({2, 5, 7, 9}, durable_round=6, newest=9) == {5, 7, 9}
    assert _versions_to_keep({2, 5}, durable_round=-1, newest=5) == {5}
    store = ClientStateStore(tmp_path)
    for round_ in (1, 2, 3):
        store.save(4, _state(4, float(round_)), round_, durable_round=-1)
    assert sorted(store.read_versions(4)) == [3]  # without checkpoints only the newest state is kept
    store.save(4, _state(4, 4.0), 4, durable_round=3)
    store.save(4, _state(4, 6.0), 6, durable_round=3)
    assert sorted(store.read_versions(4)) == [3, 4, 6]
    store.save(4, _state(4, 9.0), 9, durable_round=6)
    assert sorted(store.read_versions(4)) == [6, 9]


def test_a_replayed_round_overwrites_its_version(tmp_path):
    store = ClientStateStore(tmp_path)
    store.save(0, _state(0, 1.0), 3, durable_round=0)
    store.save(0, _state(0, 2.0), 3, durable_round=0)
    state = RecordDict()
    store.load(0, state, as_of=3)
    assert float(state["user:0"]["user_embedding.weight"].numpy()[0, 0]) == 2.0


def test_a_damaged_or_foreign_state_file_is_a_clear_error(tmp_path):
    store = ClientStateStore(tmp_path)
    store.save(2, _state(2, 1.0), 1, durable_round=-1)
    store.path(2).rename(store.path(3))
    with pytest.raises(ClientStateError, match="user-3.npz: holds user 2"):
        store.read_versions(3)
    store.path(5).write_bytes(b"not a zip")
    with pytest.raises(
        ClientStateError,
        match="user-5.npz: unreadable client state file \\(ValueError: not an "
        "\\.npz archive: a file starting with b'not '",
    ):
        store.load(5, RecordDict(), as_of=None)
    store.path(6).write_bytes(b"")
    with pytest.raises(ClientStateError, match="user-6.npz: unreadable .*an empty file"):
        store.load(6, RecordDict(), as_of=None)


def test_state_folder_needs_a_safe_run_name(tmp_path):
    assert state_folder({}, "", {"run": "x"}) is None
    assert state_folder({}, str(tmp_path), {"run": "run-1"}) == tmp_path / "run-1"
    assert (
        state_folder({"client-state-dir": str(tmp_path / "node")}, "/elsewhere", {"run": "r"})
        == tmp_path / "node" / "r"
    )  # the device's own folder wins over the run config's
    for bad in (None, "../escape", "a/b", ""):
        with pytest.raises(ConfigError, match="client-state-dir"):
            state_folder({}, str(tmp_path), {"run": bad})


def _embeddings(grid, user_ids):
    """user -> its private embedding row, read from the nodes' in-memory state (test harness only)."""
    out = {}
    for context in grid.contexts.values():
        for user in user_ids:
            key = f"user:{user}"
            if key in context.state:
                out[user] = {k: v.numpy().copy() for k, v in context.state[key].items()}
    return out


def test_state_files_hold_exactly_what_the_memory_run_holds(tmp_path):
    """With client-state-dir, every trained user's file holds the embedding an in-memory run keeps in context.state,
    the node's memory keeps none, and the results folder holds no per-user data."""
    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    memory_folder, memory_grid = run_serial(
        tiny_run_config(tmp_path / "a", model="mf", users_per_node=6), return_grid=True
    )
    state_dir = tmp_path / "device"
    file_folder, file_grid = run_serial(
        tiny_run_config(tmp_path / "b", model="mf", users_per_node=6, client_state_dir=str(state_dir)), return_grid=True
    )
    in_memory = _embeddings(memory_grid, range(24))
    assert in_memory, "the in-memory run trained someone"
    assert _embeddings(file_grid, range(24)) == {}, "with client-state-dir the node's memory keeps no private record"
    store = ClientStateStore(state_dir / "run")
    for user, arrays in in_memory.items():
        versions = store.read_versions(user)
        newest = versions[max(versions)][f"user:{user}"]
        for key, value in arrays.items():
            np.testing.assert_array_equal(newest[key], value)
    assert sorted(p.name for p in (state_dir / "run").iterdir()) == sorted(f"user-{u}.npz" for u in in_memory)
    a, b = np.load(memory_folder / "final_arrays.npz"), np.load(file_folder / "final_arrays.npz")
    assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    assert not any(name.startswith("user_embedding") for name in b.files)


def test_the_unlearning_phase_reads_the_users_state_from_their_files(tmp_path):
    """HF-KCU's queries (gradient, Hessian-vector products) use the users' embeddings: from files, the same ones."""
    import json

    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    settings = {"model": "mf", "users_per_node": 6, "unlearning": "hfkcu", "forget_users": "0,7", "unlearn_scale": 1.0}
    memory = run_serial(tiny_run_config(tmp_path / "a", **settings))
    files = run_serial(tiny_run_config(tmp_path / "b", client_state_dir=str(tmp_path / "device"), **settings))
    reports = [json.loads((f / "unlearning.json").read_text()) for f in (memory, files)]
    assert reports[0]["update-norm"] > 0
    assert reports[0]["update-norm"] == reports[1]["update-norm"]
    a, b = np.load(memory / "final_arrays.npz"), np.load(files / "final_arrays.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a.files)
