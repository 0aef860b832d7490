"""History-based unlearning in whole serial runs: ``unlearning-history`` stores each user's contributions on the
server (never sent to a client, only its size in the results), ``unlearning = "rollback"`` replays them without the
forgotten users, the post-check falls back to it, and the keys' relations are one-line config errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import MessageRecorder, tiny_run_config

from fedrec_flwr.app.client_app import make_client_app
from fedrec_flwr.app.preflight import preflight
from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.serial import run_serial
from fedrec_flwr.state.checkpoint import load_checkpoint
from fedrec_flwr.strategies.history_recording import ContributionLog
from fedrec_flwr.unlearning.history import CONTRIBUTIONS
from fedrec_flwr.wire import sample_users

PHASE = 2
TRAINED = set(sample_users(0, 1, 24, 0.5).tolist()) | set(sample_users(0, 2, 24, 0.5).tolist())
NEVER_TRAINED = tuple(sorted(set(range(24)) - TRAINED))[:2]
FORGET = tuple(sorted(TRAINED))[:2]
GROUP = tuple(u for u in sorted(TRAINED) if u % 3 == 0)
"""The trained users who prefer the tiny dataset's first item group (its items are theirs, up to negatives)."""


def _config(folder, **overrides):
    overrides = {"unlearn_round": PHASE, "unlearning_history": "float64", **overrides}
    return RunConfig.from_mapping(tiny_run_config(folder, **overrides)).to_dict()


def _run(config, recorder=None):
    seen = {}

    def on_round(view):
        log = view.strategy.contribution_log
        if view.server_round == 1 and log is not None:
            seen["start"] = {k: v.copy() for k, v in log.start.items()}
        if view.server_round == PHASE:
            seen["after"] = {k: v.numpy().copy() for k, v in view.arrays.items()}

    app = make_client_app(config, mods=[recorder]) if recorder else None
    folder = run_serial(config, client_app=app, on_round=on_round)
    with np.load(folder / "before-unlearning.npz") if (folder / "before-unlearning.npz").exists() else _empty() as d:
        seen["before"] = {k: d[k] for k in d.files}
    return folder, seen


class _empty:
    files = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_rollback_restores_the_rows_only_the_forgotten_users_touched(tmp_path):
    config = _config(
        tmp_path,
        unlearning="rollback",
        forget_users=",".join(map(str, GROUP)),
        num_train_negatives=1,
        rollback_tuning_rounds=0,  # plain rollback: the rows are compared with the replay alone
    )
    recorder = MessageRecorder(tmp_path / "messages")
    folder, seen = _run(config, recorder)
    train = [r for r in recorder.records() if r["type"] == "train" and r["round"] <= PHASE]
    report = json.loads((folder / "unlearning.json").read_text())
    assert report["method"] == "rollback" and report["history-rounds"] == [1, 2]
    assert report["history-deleted-contributions"] > 0
    keys = [k[: -len("#rows")] for k in train[0]["reply-arrays"]["arrays"] if k.endswith("#rows")]
    checked = 0
    for key in keys:
        by_forgotten = {
            int(i) for r in train if set(r["users"]) & set(GROUP) for i in r["reply-arrays"]["arrays"][key + "#rows"]
        }
        by_others = {
            int(i)
            for r in train
            if not set(r["users"]) & set(FORGET)
            for i in r["reply-arrays"]["arrays"][key + "#rows"]
        }
        only = np.array(sorted(by_forgotten - by_others), dtype=np.int64)
        checked += only.size
        np.testing.assert_allclose(seen["after"][key][only], seen["start"][key][only], atol=1e-6, err_msg=key)
        if only.size:  # the forgotten users had moved them
            assert not np.allclose(seen["before"][key][only], seen["start"][key][only])
    # on the tiny data every touched row is shared (negative samples), so ``checked`` may be 0; the phase must still
    # have removed the forgotten users' share of the shared rows
    assert checked >= 0 and any(not np.array_equal(seen["after"][k], seen["before"][k]) for k in seen["before"])
    summary = json.loads((folder / "summary.json").read_text())
    assert set(summary["unlearning-history"]) == {
        "dtype",
        "bytes",
        "rounds",
        "users",
        "bytes-per-round",
        "bytes-per-user",
    }


def test_rollback_of_users_who_never_trained_gives_the_trained_model_back(tmp_path):
    # plain rollback (no tuning rounds after it, which the recipe's default adds): nothing to replay, nothing changes
    config = _config(
        tmp_path, unlearning="rollback", forget_users=",".join(map(str, NEVER_TRAINED)), rollback_tuning_rounds=0
    )
    folder, seen = _run(config)
    assert json.loads((folder / "unlearning.json").read_text())["history-deleted-contributions"] == 0
    for key, value in seen["before"].items():
        np.testing.assert_array_equal(seen["after"][key], value, err_msg=key)


def test_no_message_to_a_client_and_no_results_file_carries_a_stored_contribution(tmp_path):
    incoming = []

    def spy(message, context, call_next):
        incoming.append({name: list(rec.keys()) for name, rec in message.content.array_records.items()})
        return call_next(message, context)

    config = _config(tmp_path, unlearning="rollback", forget_users="1", users_per_node=2, checkpoint_every=1)
    recorder = MessageRecorder(tmp_path / "messages")
    folder = run_serial(config, client_app=make_client_app(config, mods=[spy, recorder]))
    assert incoming and all(CONTRIBUTIONS not in m for m in incoming)
    assert all(not k.startswith(("history", "u")) for m in incoming for keys in m.values() for k in keys)
    replies = recorder.records()
    assert any(CONTRIBUTIONS in r["reply-arrays"] for r in replies if r["type"] == "train")
    assert not any(CONTRIBUTIONS in r["reply-arrays"] for r in replies if r["type"] != "train")
    for path in folder.rglob("*"):
        if path.name == "checkpoint.npz" or not path.is_file():
            continue
        if path.suffix == ".npz":
            with np.load(path) as data:
                assert not any("history" in k for k in data.files), path
        elif path.suffix in (".json", ".csv"):
            assert '"history/' not in path.read_text(), path
    # the checkpoint (server state for resume-from) holds the store, exactly
    checkpoint = load_checkpoint(folder)
    log = ContributionLog(_layout(config), "float64", "touched")
    log.load_state_arrays(checkpoint.strategy_arrays)
    again = log.state_arrays()
    stored = {k: v for k, v in checkpoint.strategy_arrays.items() if k.startswith("history")}
    assert stored.keys() == again.keys()
    for key in stored:
        np.testing.assert_array_equal(stored[key], again[key], err_msg=key)


def _layout(config):
    from fedrec_flwr.app.runtime import get_runtime

    return get_runtime(config).layout


def test_a_resumed_run_rolls_back_exactly_as_an_uninterrupted_one(tmp_path):
    import signal

    from test_checkpoint_resume import _config as resume_config
    from test_checkpoint_resume import run_killed

    extra = {"unlearning": "rollback", "unlearning_history": "float16", "forget_users": "3,10", "unlearn_round": 5}
    whole = run_serial(RunConfig.from_mapping(resume_config(tmp_path, "whole", model="mf", **extra)).to_dict())
    config = RunConfig.from_mapping(resume_config(tmp_path, "killed", model="mf", **extra)).to_dict()
    done = run_killed(config, 4)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    folder = run_serial({**config, "resume-from": str(tmp_path / "results" / "killed")})
    for name in ("final_arrays.npz", "before-unlearning.npz"):
        with np.load(whole / name) as a, np.load(folder / name) as b:
            for key in a.files:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{name}: {key}")
    reports = [json.loads((f / "unlearning.json").read_text()) for f in (whole, folder)]
    assert [r["history"] for r in reports][0] == reports[1]["history"]


@pytest.mark.parametrize("history", ["float32", "off"])
def test_a_failed_post_check_undoes_the_step_and_falls_back(tmp_path, history):
    forget = ",".join(map(str, FORGET))
    common = {"forget_users": forget, "holdout_validation": True, "unlearning_history": history}
    config = _config(
        tmp_path / "hfkcu", unlearning="hfkcu", unlearning_post_check="on", post_check_min_loss_rise=100.0, **common
    )
    folder, seen = _run(config)
    report = json.loads((folder / "unlearning.json").read_text())
    check = report["post-check"]
    assert check["passed"] is False and any("influence" in r for r in check["reasons"])
    if history == "off":
        assert check["kept"] == "none" and check["retraining-needed"] is True
        for key, value in seen["before"].items():
            np.testing.assert_array_equal(seen["after"][key], value, err_msg=key)
        return
    assert check["kept"] == "rollback" and report["fallback"]["method"] == "rollback"
    _, plain = _run(_config(tmp_path / "rollback", unlearning="rollback", **common))
    for key, value in plain["after"].items():
        np.testing.assert_array_equal(seen["after"][key], value, err_msg=key)


def test_the_dominated_radius_rule_and_its_masked_step(tmp_path):
    from fedrec_flwr.app.runtime import get_runtime
    from fedrec_flwr.unlearning.margin import positive_counts
    from fedrec_flwr.unlearning.radius import dominated_rows

    config = _config(
        tmp_path,
        model="mf",
        unlearning="hfkcu",
        unlearning_history="off",
        forget_users=",".join(map(str, FORGET)),
        krylov_radius_rule="dominated",
        krylov_masked_step=True,
    )
    folder, seen = _run(config)
    report = json.loads((folder / "unlearning.json").read_text())
    runtime = get_runtime(config)
    rest = [u for u in range(24) if u not in FORGET]
    layout = runtime.layout
    dominated = dominated_rows(
        {k: seen["before"][k] for k in layout.item_keys},
        positive_counts(runtime, rest),
        positive_counts(runtime, FORGET),
        factor=0.015,
    )
    assert report["krylov-radius-rule"] == "dominated" and report["dominated-rows"] == dominated.rows.size > 0
    assert report["trust-radius-absolute"] == pytest.approx(dominated.radius, rel=1e-6)
    for key in layout.item_keys:
        changed = np.flatnonzero(np.any(seen["after"][key] != seen["before"][key], axis=1))
        assert set(changed.tolist()) <= set(dominated.rows.tolist()), key


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"unlearning": "rollback", "unlearning_history": "off"}, "'unlearning' = 'rollback' replays"),
        ({"unlearning": "hfkcu", "krylov_masked_step": True}, "needs krylov-radius-rule = 'dominated'"),
        ({"unlearning": "hfkcu", "unlearning_post_check": "on"}, "set 'holdout-validation' = true"),
        (
            {
                "unlearning": "rollback",
                "unlearning_history": "float32",
                "unlearning_post_check": "on",
                "holdout_validation": True,
            },
            "approximate step",
        ),
        (
            {
                "unlearning_history": "float32",
                "unlearning": "hfkcu",
                "strategy": "server-optimizer",
                "client": "fedrecgel",
            },
            "not linear in the uploads",
        ),
    ],
)
def test_history_keys_refuse_inconsistent_settings_in_one_line(tmp_path, overrides, message):
    mapping = tiny_run_config(tmp_path, forget_users="1", **overrides)
    with pytest.raises(ConfigError) as err:
        preflight(RunConfig.from_mapping(mapping).to_dict())
    assert message in str(err.value) and "\n" not in str(err.value)
