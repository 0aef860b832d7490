"""The resume checks of server checkpoints (fedrec_flwr.state.checkpoint) and of the clients' state files
(fedrec_flwr.state.client_state), case by case on hand-made checkpoints and files: which config changes refuse a resume
(also a key only the new run sets), a round past the run's end, a file of another format, and which users count as
having no state for a resume after round ``t`` (a version of round ``t`` itself is state)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.state.checkpoint import MAY_DIFFER, Checkpoint, check_resumable, load_checkpoint, save_checkpoint
from fedrec_flwr.state.client_state import ClientStateStore

CONFIG = {"num-server-rounds": 5, "seed": 0, "learning-rate": 0.1}


def _checkpoint(**changes) -> Checkpoint:
    return Checkpoint(
        **{"server_round": 3, "run_name": "r", "run_config": dict(CONFIG), "arrays": {"w": np.arange(3.0)}, **changes}
    )


def test_a_resume_with_the_same_config_or_only_may_differ_keys_changed_is_accepted():
    check_resumable(_checkpoint(), dict(CONFIG))
    check_resumable(_checkpoint(), {**CONFIG, **{key: "x" for key in MAY_DIFFER}})
    check_resumable(_checkpoint(server_round=5), dict(CONFIG))  # the last round: nothing left, but not past it


@pytest.mark.parametrize(
    "new",
    [{**CONFIG, "seed": 1}, {**CONFIG, "dataset": "ml-1m"}, {k: v for k, v in CONFIG.items() if k != "learning-rate"}],
)
def test_a_resume_with_a_changed_added_or_removed_key_is_refused_naming_it(new):
    with pytest.raises(ConfigError, match="resume-from") as error:
        check_resumable(_checkpoint(), new)
    (key,) = {k for k in set(CONFIG) | set(new) if CONFIG.get(k) != new.get(k)}
    assert key in str(error.value)


def test_a_checkpoint_past_the_runs_last_round_is_refused():
    with pytest.raises(ConfigError, match="past num-server-rounds"):
        check_resumable(_checkpoint(server_round=6), dict(CONFIG))


def test_a_checkpoint_of_another_format_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, _checkpoint())
    assert load_checkpoint(tmp_path).server_round == 3
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    manifest = json.loads(str(arrays["__manifest__"]))
    manifest["format"] = manifest["format"] + 1
    arrays["__manifest__"] = np.array(json.dumps(manifest))
    np.savez(path, **arrays)
    with pytest.raises(ConfigError, match="format"):
        load_checkpoint(path)


def _state(user: int, value: float) -> RecordDict:
    return RecordDict({f"user:{user}": ArrayRecord({"w": Array(np.full(2, value, np.float32))})})


def test_for_a_resume_after_round_t_a_version_of_round_t_is_state_and_a_later_one_is_not(tmp_path):
    store = ClientStateStore(tmp_path)
    store.save(1, _state(1, 1.0), 3, durable_round=0)  # exactly the checkpoint's round
    store.save(2, _state(2, 1.0), 4, durable_round=0)  # only after it
    store.save(3, _state(3, 1.0), 1, durable_round=0)  # before it
    damaged, absent = store.resume_problems([1, 2, 3, 4], resume_round=3)
    assert damaged == [] and absent == [2, 4]  # user 4 has no file at all
