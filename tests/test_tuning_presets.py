"""The tuning presets (``experiments/tuning/grid.py``): the public FedRecGEL code's wider NCF, declared by run-config
keys only, builds that code's layer shapes, and the block path trains it like the model itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
import test_blocks
import torch
from conftest import tiny_run_config
from test_blocks import _runtime, ml100k  # noqa: F401 - ml100k is a fixture

from experiments.tuning import grid as G
from fedrec_flwr.config import make_run_config
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.models import build_model
from fedrec_flwr.serial import run_serial

PUBLIC = "FedRecGEL, public NCF"


def test_the_public_ncf_preset_has_the_public_codes_layer_shapes():
    """FedRecGEL's ``models/fedrecgel.py`` at its defaults (factor_num 32, num_layers 3): GMF 32, MLP embeddings 128,
    Linear(256, 128), (128, 64), (64, 32), output Linear(64, 1); the preset is the base method's config plus its keys,
    and its folder setting takes the preset's rho-shared over the selected one (the rates stay the selection's)."""
    overrides = G.run_overrides(
        PUBLIC, G.preset_setting(PUBLIC, {"rho-shared": 0.05, "server-learning-rate": 0.01}), "ml-100k", 0, 100
    )
    assert overrides["client"] == "fedrecgel" and overrides["rho-shared"] == 0.02
    assert overrides["server-learning-rate"] == 0.01
    cfg = make_run_config(**overrides)
    model = build_model(
        cfg.model,
        1,
        7,
        embedding_dim=cfg.embedding_dim,
        mlp_layers=cfg.mlp_layer_sizes,
        mlp_embedding_dim=cfg.mlp_embedding_dim,
    )
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        "user_embedding_gmf.weight": (1, 32),
        "user_embedding_mlp.weight": (1, 128),
        "item_embedding_gmf.weight": (7, 32),
        "item_embedding_mlp.weight": (7, 128),
        "mlp.0.weight": (128, 256),
        "mlp.0.bias": (128,),
        "mlp.2.weight": (64, 128),
        "mlp.2.bias": (64,),
        "mlp.4.weight": (32, 64),
        "mlp.4.bias": (32,),
        "output.weight": (1, 64),
        "output.bias": (1,),
    }
    default = build_model("ncf", 1, 7, embedding_dim=32, mlp_layers=(64, 32, 16))  # 0 = embedding-dim: unchanged
    assert default.mlp_embedding_dim == 32 and tuple(default.item_embedding_mlp.weight.shape) == (7, 32)
    with pytest.raises(KeyError, match="unknown method or preset"):
        G.method_config("FedRecGEL, wide")
    with pytest.raises(ConfigError, match="mlp-embedding-dim"):
        make_run_config(**{**overrides, "mlp-embedding-dim": -1})


def test_block_path_gradients_of_the_wider_ncf_equal_the_models(ml100k):  # noqa: F811 - the fixture
    """With MLP embeddings wider than the GMF ones, the block path's batched forward pass (which splits the first
    tower layer at the MLP width) gives every user's loss and gradient as the model itself does (float64; the check
    of ``tests/test_blocks.py``, run on this architecture)."""
    overrides = {"embedding-dim": 8, "mlp-embedding-dim": 24, "mlp-layers": "16,8"}
    runtime = _runtime(ml100k, overrides, torch.float64)
    assert runtime.model.mlp_embedding_dim == 24 and runtime.model.embedding_dim == 8
    test_blocks.test_batched_forward_gradients_equal_vmap_of_the_model(ml100k, overrides)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"client": "fedrecgel", "strategy": "server-optimizer", "rho-private": 0.02, "mlp-embedding-dim": 12}],
    ids=["fedncf", "fedrecgel-wide"],
)
def test_a_sparser_evaluation_schedule_trains_the_same_model(tmp_path, overrides):
    """The protocol's sparser evaluation on a large dataset (``grid.EVAL_EVERY``) is sound: training
    does not depend on when the server evaluates (users are drawn from (seed, round)), so evaluating every round or
    only after the last one gives the same final model and the same last-round metrics."""
    every = run_serial(tiny_run_config(tmp_path / "every", eval_every=1, num_server_rounds=4, **overrides))
    last = run_serial(tiny_run_config(tmp_path / "last", eval_every=4, num_server_rounds=4, **overrides))
    a, b = np.load(every / "final_arrays.npz"), np.load(last / "final_arrays.npz")
    assert set(a.files) == set(b.files)
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    rows = [[r for r in json.loads((f / "metrics.json").read_text()) if "HR@10" in r] for f in (every, last)]
    assert [r["round"] for r in rows[1]] == [4] and len(rows[0]) == 4
    assert rows[0][-1]["HR@10"] == rows[1][-1]["HR@10"] and rows[0][-1]["NDCG@5"] == rows[1][-1]["NDCG@5"]


def test_amazon_video_evaluates_every_50_rounds_and_keeps_the_rounds_the_protocol_reads():
    """Only the datasets listed in ``grid.EVAL_EVERY`` change the interval, and it divides both budgets, so round
    100 and round 300 are evaluated."""
    assert G.run_overrides("FedNCF", G.default_setting("FedNCF"), "amazon-video", 0, 300)["eval-every"] == 50
    assert G.run_overrides("FedNCF", G.default_setting("FedNCF"), "ml-100k", 0, 300)["eval-every"] == 10
    assert all(G.GRID_ROUNDS % e == 0 and G.LONG_ROUNDS % e == 0 for e in G.EVAL_EVERY.values())
