"""Server checkpoints and ``resume-from``: a run killed mid-round (SIGKILL, in another process) and resumed from its
last checkpoint ends with the same model and metrics as an uninterrupted run; bad resumes are refused clearly."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.serial import run_serial
from fedrec_flwr.state.checkpoint import CHECKPOINT_FILE, Checkpoint, load_checkpoint, save_checkpoint
from fedrec_flwr.wire import sample_users
from tests.conftest import PROJECT_ROOT, tiny_run_config, without_timings

# Runs the config in argv[1] serially and SIGKILLs its own process after the second train message of round argv[2]:
# some users have trained (and saved their state) in that round, the others not, and nothing gets to clean up.
KILLED_RUN = """
import json, os, signal, sys
from fedrec_flwr.app.client_app import make_client_app
from fedrec_flwr.serial import run_serial

config, kill_round, seen = json.loads(sys.argv[1]), int(sys.argv[2]), []

def kill_mid_round(message, context, call_next):
    reply = call_next(message, context)
    if message.metadata.message_type == "train" and message.content["config"]["server-round"] == kill_round:
        seen.append(1)
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    return reply

run_serial(config, client_app=make_client_app(config, mods=[kill_mid_round]))
"""


def run_killed(config: dict, kill_round: int) -> subprocess.CompletedProcess:
    """Run ``config`` serially in a child process that :data:`KILLED_RUN` SIGKILLs in round ``kill_round``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.run(
        [sys.executable, "-c", KILLED_RUN, json.dumps(config), str(kill_round)],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


CASES = {
    "fedmf": {"model": "mf"},
    # the server's Adam moments must survive the restart too
    "fedrecgel-server-adam": {
        "client": "fedrecgel",
        "strategy": "server-optimizer",
        "learning_rate": 0.1,
        "server_learning_rate": 0.01,
    },
}


def _config(folder, run_name, **extra):
    return tiny_run_config(
        folder,
        users_per_node=4,
        num_server_rounds=6,
        eval_every=2,
        fraction_train=0.5,
        checkpoint_every=2,
        client_state_dir=str(folder / "device"),
        run_name=run_name,
        **extra,
    )


def _final(result):
    with np.load(result / "final_arrays.npz") as data:
        return {k: data[k].copy() for k in data.files}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_killed_mid_round_resumes_to_the_same_result(tmp_path, case):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    uninterrupted = run_serial(_config(tmp_path, "whole", **CASES[case]))

    config = _config(tmp_path, "killed", **CASES[case])
    done = run_killed(config, 4)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    folder = tmp_path / "results" / "killed"
    assert not (folder / "summary.json").exists()
    checkpoint = load_checkpoint(folder)
    assert checkpoint.server_round == 2 and [r["round"] for r in checkpoint.rows] == [1, 2]
    assert checkpoint.sampler == {"seed": 0, "next-round": 3}
    assert [r["round"] for r in json.loads((folder / "metrics.json").read_text())] == [1, 2, 3]
    assert not any(k.startswith("user") for k in checkpoint.arrays), "the server never stores a user's parameters"
    if case.startswith("fedrecgel"):
        assert any(k.startswith("optimizer-0/") for k in checkpoint.strategy_arrays)

    resumed = run_serial({**config, "resume-from": str(folder)})
    assert resumed == folder
    rows = json.loads((folder / "metrics.json").read_text())
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert without_timings(rows) == without_timings(json.loads((uninterrupted / "metrics.json").read_text()))
    header = (folder / "metrics.csv").read_text().splitlines()[0]
    assert header == (uninterrupted / "metrics.csv").read_text().splitlines()[0], "the same columns, in order"
    whole, again = _final(uninterrupted), _final(folder)
    assert whole.keys() == again.keys()
    for key in whole:
        np.testing.assert_array_equal(whole[key], again[key], err_msg=key)


def test_a_checkpoint_keeps_the_order_of_each_metrics_rows_keys(tmp_path):
    """The manifest is written with sorted keys; the rows come back in the order the run recorded them (a resumed
    run's metrics.csv then has an uninterrupted run's columns), and a checkpoint without ``row-columns`` (older
    format) keeps the sorted order."""
    rows = [
        {"round": 1, "seconds": 0.5, "train-loss": 0.6, "num-replies": 3},
        {"round": 2, "seconds": 0.4, "train-loss": 0.5, "num-replies": 3, "HR@10": 0.3, "HR@5": 0.2},
    ]
    checkpoint = Checkpoint(server_round=2, run_name="r", run_config={}, arrays={"w": np.zeros(2)}, rows=rows)
    save_checkpoint(tmp_path, checkpoint)
    assert [list(r) for r in load_checkpoint(tmp_path).rows] == [list(r) for r in rows]
    with np.load(tmp_path / "checkpoint.npz") as data:
        files = {k: data[k] for k in data.files}
    manifest = json.loads(str(files["__manifest__"]))
    del manifest["row-columns"]
    files["__manifest__"] = np.array(json.dumps(manifest, sort_keys=True))
    np.savez(tmp_path / "checkpoint.npz", **files)
    assert [list(r) for r in load_checkpoint(tmp_path).rows] == [sorted(r) for r in rows]


def test_resume_refuses_a_different_config_a_missing_and_a_damaged_checkpoint(tmp_path):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = _config(tmp_path, "base", model="mf")
    folder = run_serial({**config, "num-server-rounds": 2})
    changed = {**config, "num-server-rounds": 2, "learning-rate": 0.5, "resume-from": str(folder)}
    with pytest.raises(ConfigError, match=r"learning-rate: [0-9.]+ -> 0.5"):
        run_serial(changed)
    with pytest.raises(ConfigError, match="no checkpoint at"):
        run_serial({**config, "resume-from": str(tmp_path / "nowhere")})
    (folder / CHECKPOINT_FILE).write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ConfigError, match=f"checkpoint {folder / CHECKPOINT_FILE} is unreadable"):
        run_serial({**config, "num-server-rounds": 2, "resume-from": str(folder)})
    text = tmp_path / "notes.txt"
    text.write_text("round 2 went fine\n")
    with pytest.raises(
        ConfigError,
        match=r"notes.txt is unreadable \(ValueError: not an .npz archive: a file "
        r"starting with b'roun'",
    ):
        run_serial({**config, "num-server-rounds": 2, "resume-from": str(text)})


def test_checkpoints_are_off_by_default_and_a_new_run_keeps_an_interrupted_ones(tmp_path):
    """No checkpoint unless checkpoint-every is set; a new run of the same run-name never deletes an interrupted
    run's checkpoint (it is refused, pointing to resume-from), and clears its other partial files only."""
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = tiny_run_config(tmp_path, num_server_rounds=2, run_name="plain")
    folder = tmp_path / "results" / "plain"
    folder.mkdir(parents=True)
    (folder / CHECKPOINT_FILE).write_bytes(b"interrupted")
    with pytest.raises(ConfigError, match=r"holds an interrupted run's checkpoint .*resume-from="):
        run_serial(config)
    assert (folder / CHECKPOINT_FILE).read_bytes() == b"interrupted"
    (folder / CHECKPOINT_FILE).unlink()
    (folder / "metrics.csv").write_text("round\n1\n")
    run_serial(config)
    assert not (folder / CHECKPOINT_FILE).exists()
    assert (folder / "metrics.csv").read_text() != "round\n1\n"


def test_a_moved_results_folder_resumes_with_its_new_results_dir(tmp_path):
    """The results folder of an interrupted run, moved (e.g. to another disk), resumes in its new place with the new
    ``results-dir``: the folder is the checkpoint's, so ``results-dir`` may differ; other keys still may not."""
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = {**_config(tmp_path, "moved", model="mf"), "num-server-rounds": 2}
    folder = run_serial(config)
    (folder / "summary.json").unlink()  # as if killed after its last checkpoint
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    folder.rename(moved)
    resumed = run_serial({**config, "results-dir": str(moved.parent), "resume-from": str(moved)})
    assert resumed == moved and (moved / "summary.json").is_file()
    assert not folder.exists()


def test_users_whose_node_failed_every_round_before_the_checkpoint_are_not_reported_missing(tmp_path, caplog):
    """The resume check recomputed "users who trained" on each node from the seeded sampler, so a user whose node
    failed every round it was sampled in (no reply, no state file) was reported missing and the resume refused. The
    server now records the users whose replies it accepted (the checkpoint's ``trained-users``) and only those count."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.state.checkpoint import TRAINED_KEY

    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = {
        **_config(tmp_path, "failing", model="mf"),
        "num-server-rounds": 3,
        "eval-every": 3,
        "min-train-fraction": 0.1,
    }

    def partition_1_fails_to_train(message, context, call_next):
        if message.metadata.message_type == "train" and int(context.node_config["partition-id"]) == 1:
            raise RuntimeError("this node's device is off")
        return call_next(message, context)

    folder = run_serial(config, client_app=make_client_app(config, mods=[partition_1_fails_to_train]))
    (folder / "summary.json").unlink()  # as if killed after the checkpoint of round 2
    sampled = set(sample_users(0, 1, 24, 0.5).tolist()) | set(sample_users(0, 2, 24, 0.5).tolist())
    lost = sorted(u for u in sampled if 4 <= u < 8)  # partition 1 serves users 4..7
    assert lost, "the seed must sample a user of partition 1 for the test to mean anything"
    trained = load_checkpoint(folder).strategy_arrays[TRAINED_KEY]
    assert sorted(np.flatnonzero(trained).tolist()) == sorted(sampled - set(lost))
    state = tmp_path / "device" / "failing"
    assert not any((state / f"user-{u}.npz").exists() for u in lost)
    caplog.set_level(logging.WARNING, logger="fedrec_flwr")
    assert run_serial({**config, "resume-from": str(folder)}) == folder  # not refused
    assert "loses the clients' private state" not in caplog.text
    assert [r["round"] for r in json.loads((folder / "metrics.json").read_text())] == [1, 2, 3]


def test_a_resume_with_damaged_or_deleted_client_state_files_is_refused_before_round_one(tmp_path, caplog):
    """A user's state file replaced by garbage, or deleted although the user trained before the checkpoint, made the
    resumed run fail that user's node every round it was sampled (or silently restart the user): each node now
    checks its users' files when identified, and the server refuses the resume naming node and files, unless
    ``resume-resets-client-state`` accepts restarting exactly those users."""
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = {**_config(tmp_path, "damaged", model="mf"), "num-server-rounds": 3, "eval-every": 3}
    folder = run_serial(config)
    (folder / "summary.json").unlink()  # as if killed after the checkpoint of round 2
    resume = {**config, "resume-from": str(folder)}
    trained = sorted(set(sample_users(0, 1, 24, 0.5).tolist()) | set(sample_users(0, 2, 24, 0.5).tolist()))
    state = tmp_path / "device" / "damaged"
    garbage, deleted = state / f"user-{trained[0]}.npz", state / f"user-{trained[1]}.npz"
    assert garbage.is_file() and deleted.is_file()
    kept = deleted.read_bytes()

    garbage.write_text("garbage\n")
    with pytest.raises(
        ConfigError,
        match=rf"resuming after round 2 .*node \d+ \(partition-id \d\) has unreadable or "
        rf"non-finite state files: {garbage}; users \[{trained[0]}\] restart .*Restore these "
        r"files .*'resume-resets-client-state' = true",
    ):
        run_serial(resume)
    deleted.unlink()
    with pytest.raises(
        ConfigError,
        match=rf"has no state file of round <= 2 for users whose training the server "
        rf"accepted in rounds 1..2: {deleted}",
    ):
        run_serial(resume)
    deleted.write_bytes(kept)
    garbage.unlink()
    with pytest.raises(ConfigError, match=rf"users \[{trained[0]}\] restart"):
        run_serial(resume)  # the garbage file deleted is a missing one
    assert [r["round"] for r in json.loads((folder / "metrics.json").read_text())] == [1, 2, 3], "nothing ran"

    garbage.write_text("garbage\n")
    deleted.unlink()
    caplog.set_level(logging.WARNING, logger="fedrec_flwr")
    assert run_serial({**resume, "resume-resets-client-state": True}) == folder
    assert f"users {trained[:2]} restart from their seeded initial state" in caplog.text
    assert garbage.with_suffix(".npz.damaged").read_text() == "garbage\n", "kept for inspection, out of the way"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary.get("evaluation-failures", {}) == {} and summary.get("client-failures", {}) == {}, summary


def test_the_client_state_check_counts_absent_files_only_for_users_the_server_saw_train(tmp_path, caplog):
    """``check_client_state`` on the nodes' facts: an absent file is lost state only for a user in the checkpoint's
    ``trained-users`` that was not forgotten since; without that array (an older checkpoint) absent files are not
    judged, and a warning says so, while damaged files are still refused."""
    from fedrec_flwr.state.checkpoint import TRAINED_KEY, Checkpoint, check_client_state

    trained = np.zeros(8, dtype=bool)
    trained[[1, 2, 5]] = True
    checkpoint = Checkpoint(
        server_round=4,
        run_name="r",
        run_config={"client-state-dir": "x"},
        arrays={},
        strategy_state={"removed-users": [5]},
        strategy_arrays={TRAINED_KEY: trained},
        client_state=True,
        folder=tmp_path,
    )
    node = {"partition-id": 0, "node": 7, "folder": str(tmp_path), "damaged": [], "absent": [0, 2, 5, 6]}
    with pytest.raises(ConfigError, match=r"node 7 \(partition-id 0\) has no state file .*user-2\.npz; users \[2\]"):
        check_client_state(checkpoint, [], accept_reset=False, state_problems=[node])  # 0, 6 never trained; 5 forgotten
    assert check_client_state(checkpoint, [], False, [{**node, "absent": [0, 5, 6]}]) is None

    older = Checkpoint(
        server_round=4,
        run_name="r",
        run_config={"client-state-dir": "x"},
        arrays={},
        client_state=True,
        folder=tmp_path,
    )
    caplog.set_level(logging.WARNING, logger="fedrec_flwr")
    package_logger = logging.getLogger("fedrec_flwr")  # the ServerApp's handler may stop propagation
    package_logger.addHandler(caplog.handler)
    try:
        assert check_client_state(older, [], False, [node]) is None
    finally:
        package_logger.removeHandler(caplog.handler)
    assert "does not record which users trained" in caplog.text
    with pytest.raises(ConfigError, match=r"has unreadable or non-finite state files: .*user-3\.npz"):
        check_client_state(older, [], False, [{**node, "damaged": [3]}])
