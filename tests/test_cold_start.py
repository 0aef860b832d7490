"""A SuperNode runs every message in a fresh ``flwr-clientapp`` process (flwr 1.42), so what the ClientApp imports and
builds is paid per message. These check, in fresh interpreters, that the ClientApp's path stays lean."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedrec_flwr.launch import PROJECT_ROOT

HEAVY = ("sklearn", "matplotlib", "pandas", "experiments", "scipy")
"""Packages no ClientApp message needs (classifiers and AUC, plots, CSV parsing, experiment code)."""


def _loaded_after(code: str) -> list[str]:
    """The :data:`HEAVY` packages and ``torch._dynamo`` that a fresh interpreter has loaded after running ``code``."""
    probe = (
        f"import sys\n{code}\nimport json\n"
        f"top = {{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r})\n"
        "print(json.dumps(sorted(top | ({'torch._dynamo'} & set(sys.modules)))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=600, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_client_app_loads_no_sklearn_matplotlib_pandas_or_experiments():
    assert _loaded_after("import fedrec_flwr.app.client_app") == []


def test_building_a_model_does_not_import_torch_dynamo():
    """``torch.nn.utils.skip_init`` (meta-device init) imported ``torch._dynamo``: ~1.5-4 s of every runtime build."""
    assert (
        _loaded_after(
            "from fedrec_flwr.models import build_model\n"
            "build_model('ncf', num_users=1, num_items=30, embedding_dim=8, mlp_layers=(16, 8), seed=1)"
        )
        == []
    )


@pytest.mark.parametrize(
    ("users_per_node", "block_training", "expected"), [(4, "auto", []), (1, "auto", []), (1, "off", ["torch._dynamo"])]
)
def test_a_train_message_from_the_cached_split_stays_lean(tmp_path, users_per_node, block_training, expected):
    """A whole train message through the ClientApp (tiny data, split cached beforehand as the ServerApp's identify
    round leaves it) loads none of the heavy packages either, also for one user under the default ``block-training``
    (the block path's own Adam); the per-user reference path (``off``) creates a ``torch.optim`` optimizer, which
    imports ``torch._dynamo`` (``Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo``)."""
    from conftest import tiny_run_config

    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.config import RunConfig

    mapping = tiny_run_config(tmp_path, users_per_node=users_per_node, block_training=block_training)
    load_split_for(RunConfig.from_mapping(mapping))  # writes the cache the child then reads
    code = f"""
import json
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedrec_flwr.app.client_app import app
from fedrec_flwr.app.runtime import build_shared_model, get_runtime
from fedrec_flwr.wire import ARRAYS, CONFIG
run_config = json.loads({json.dumps(json.dumps(mapping))})
runtime = get_runtime(run_config)
model = build_shared_model(runtime.config, runtime.split.num_items)
arrays = ArrayRecord({{k: Array(v.detach().numpy()) for k, v in model.shared_state().items()}})
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 2
message = Message(RecordDict({{ARRAYS: arrays, CONFIG: ConfigRecord({{"server-round": 1, "run": "t"}})}}),
                  dst_node_id=1, message_type="train")
message.metadata.__dict__["_message_id"] = "m1"
context = Context(run_id=1, node_id=1, node_config={{"partition-id": 0}}, state=RecordDict(), run_config=run_config)
reply = app(message, context)
assert not reply.has_error(), reply.error
assert reply.content["metrics"]["num-users"] == {users_per_node}
"""
    assert _loaded_after(code) == expected
