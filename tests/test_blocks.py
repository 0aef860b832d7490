"""Vectorized user blocks (fedrec_flwr/local/blocks.py) against the per-user clients, the reference: the same updates,
private state (embeddings, Adam moments) and evaluation on real ML-100K users, the same node reply, the same whole
serial run with block-training on and off, and the privacy check on a block-trained run."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import (
    MessageRecorder,
    assert_no_private_value_in_replies,
    dataset_dir,
    seeded_private_vectors,
    tiny_run_config,
)
from flwr.app import RecordDict

from fedrec_flwr.app.client_app import make_client_app
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.clients import fedrec, fedrecgel
from fedrec_flwr.config import make_run_config
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local import block_optim, blocks
from fedrec_flwr.local.blocks import block_kind, evaluate_block, train_block, use_blocks
from fedrec_flwr.registry import check_components, resolve
from fedrec_flwr.serial import run_serial
from fedrec_flwr.wire import Contribution

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FEDRECGEL = {"client": "fedrecgel", "rho-shared": 0.1, "rho-private": 0.02, "batch-size": 128, "learning-rate": 0.1}
FEDAU2 = {"client": "fedau2", "protected-attribute": "gender"}
CASES = {
    "fedncf": ({}, "parameters"),
    "fedncf-2-epochs-batch-64": ({"local-epochs": 2, "batch-size": 64}, "parameters"),
    "fedmf": ({"model": "mf"}, "parameters"),
    "fedmf-bpr-sgd": ({"model": "mf", "loss": "bpr", "optimizer": "sgd", "learning-rate": 0.05}, "parameters"),
    "fedrecgel-gradient": (FEDRECGEL, "gradient"),
    "fedrecgel-parameters-2-steps": ({**FEDRECGEL, "local-epochs": 2}, "parameters"),
    "fedrecgel-sgd": ({**FEDRECGEL, "optimizer": "sgd"}, "gradient"),
    # FedAU2's default arm (entropy pull on every step, frozen server h_w, local Adam) with its h_w upload
    "fedau2-dsvae": ({**FEDAU2, "adversary": "dsvae"}, "parameters"),
    "fedau2-mf-mlp-sut": (
        {**FEDAU2, "model": "mf", "adversary": "mlp", "adversary-trigger": "sut", "adversary-epsilon": 1.0},
        "parameters",
    ),
}
USERS = [0, 1, 2, 3, 4, 5, 6, 7, 12, 404]
"""Real ML-100K users (index 404 has several hundred positives: a block with very unequal users, padded)."""

RTOL, ATOL = 2e-4, 2e-6
"""float32 tolerance: the block path adds the same terms in another order (batched matrix products)."""
ADAM_ATOL = 2e-3
"""Times the learning rate, per Adam step: Adam's step ``lr * m / (sqrt(v) + eps)`` is normalised, so where an entry's
gradient is near 0 the float32 rounding of the gradient changes its step by a fraction of ``lr`` (seen: 1e-5 = lr / 1000
on one entry of 32k)."""


@pytest.fixture(scope="module")
def ml100k(tmp_path_factory):
    return {
        "dataset": "ml-100k",
        "data-dir": str(dataset_dir("ml-100k")),
        "cache-dir": str(tmp_path_factory.mktemp("cache")),
    }


def _runtime(ml100k, overrides, dtype=torch.float32):
    """The process's runtime for the config; for ``float64`` a copy with a double-precision model (the cached
    runtime's model stays as it is)."""
    runtime = get_runtime(make_run_config(**ml100k, **overrides).to_dict())
    if dtype == torch.float32:
        return runtime
    return dataclasses.replace(
        runtime, model=copy.deepcopy(runtime.model).to(dtype), loaded_shared=None, dirty_shared=set()
    )


def _shared(runtime):
    return {k: v.detach().cpu().numpy().copy() for k, v in runtime.model.shared_state().items()}


def _per_user(runtime, state, shared, config):
    cls = resolve("client", runtime.config.client)
    return [cls(runtime, u, state).fit_named(shared, config) for u in USERS]


def _tolerance(cfg, dtype):
    """``(rtol, atol)`` of a block-vs-per-user comparison: 1e-9 in float64; in float32 :data:`RTOL` / :data:`ATOL`,
    and for Adam :data:`ADAM_ATOL` times the learning rate per local epoch."""
    if dtype == torch.float64:
        return 1e-7, 1e-9
    return RTOL, ATOL if cfg.optimizer == "sgd" else max(ATOL, ADAM_ATOL * cfg.learning_rate * cfg.local_epochs)


def _assert_updates_equal(a, b, rtol, atol):
    assert a.num_examples == b.num_examples and a.is_gradient == b.is_gradient
    assert a.aggregation_weight == b.aggregation_weight
    assert a.loss == pytest.approx(b.loss, rel=max(rtol, 1e-6))
    for key in a.dense:
        np.testing.assert_allclose(a.dense[key], b.dense[key], rtol=rtol, atol=atol, err_msg=key)
    for key in a.rows:
        np.testing.assert_array_equal(a.rows[key][0], b.rows[key][0])
        np.testing.assert_allclose(a.rows[key][1], b.rows[key][1], rtol=rtol, atol=atol, err_msg=key)


def _assert_states_equal(a: RecordDict, b: RecordDict, rtol, atol):
    assert sorted(a) == sorted(b)
    for key in a:
        arrays_a, arrays_b = {k: v.numpy() for k, v in a[key].items()}, {k: v.numpy() for k, v in b[key].items()}
        assert sorted(arrays_a) == sorted(arrays_b), key
        for name in arrays_a:
            assert arrays_a[name].shape == arrays_b[name].shape and arrays_a[name].dtype == arrays_b[name].dtype
            np.testing.assert_allclose(arrays_a[name], arrays_b[name], rtol=rtol, atol=atol, err_msg=f"{key} {name}")


@pytest.mark.parametrize(
    ("case", "dtype"),
    [(case, torch.float64) for case in CASES] + [("fedmf", torch.float32), ("fedmf-bpr-sgd", torch.float32)],
)
def test_block_training_gives_the_per_user_updates_and_private_state(ml100k, case, dtype):
    """Two rounds on real users: every user's upload (dense values, item rows, weight, example count, loss) and its
    private records after each round (embeddings; FedRecGEL's Adam moments and step) agree, and so does the node's
    packed reply (``#rows`` / ``#sum`` / ``#count``).

    Both paths run in float64 for every case (agreement to 1e-9: the same examples, order and arithmetic), and in
    float32 (the deployed dtype) for FedMF. In float32, NCF's ReLU tower makes agreement elementwise a matter of luck:
    an example whose pre-activation lies within float32 rounding of 0 takes the other branch in one path (seen once
    in 10 users x 2 rounds: a gradient entry off by 6e-4); the whole-run test below compares NCF runs in float32."""
    overrides, upload = CASES[case]
    runtime = _runtime(ml100k, overrides, dtype)
    cls = resolve("client", runtime.config.client)
    assert block_kind(cls, runtime.config) == ("sam" if "fedrecgel" in case else "plain")
    shared = _shared(runtime)
    cfg = runtime.config
    rtol, atol = _tolerance(cfg, dtype)
    per_user_state, block_state = RecordDict(), RecordDict()
    for server_round in (1, 2):
        config = {"server-round": server_round, "upload": upload}
        reference = _per_user(runtime, per_user_state, shared, config)
        updates = train_block(runtime, cls, USERS, block_state, shared, config)
        for a, b in zip(reference, updates, strict=True):
            _assert_updates_equal(a, b, rtol, atol)
        _assert_states_equal(per_user_state, block_state, rtol, atol)
        packed = []
        for batch in (reference, updates):
            contribution = Contribution(runtime.layout)
            for update in batch:
                contribution.add_user(update.dense, update.rows, update.aggregation_weight, update.loss)
            packed.append(contribution.pack())
        assert sorted(packed[0]) == sorted(packed[1])
        for key in packed[0]:
            np.testing.assert_allclose(packed[0][key], packed[1][key], rtol=rtol, atol=atol * len(USERS), err_msg=key)
    if "fedrecgel" in case and runtime.config.optimizer == "adam":
        assert float(block_state[f"user-opt:{USERS[0]}"]["0/step"].numpy()) == 2.0 * runtime.config.local_epochs


ONE_USER_CASES = {**CASES, "fedncf-sgd": ({"optimizer": "sgd"}, "parameters")}


@pytest.mark.parametrize(
    ("case", "dtype"),
    [
        ("fedncf-sgd", torch.float32),
        ("fedncf", torch.float64),
        ("fedmf", torch.float32),
        ("fedrecgel-gradient", torch.float32),
        ("fedrecgel-parameters-2-steps", torch.float32),
        ("fedau2-mf-mlp-sut", torch.float32),
        ("fedau2-dsvae", torch.float64),
    ],
)
def test_one_user_messages_on_the_block_path_equal_the_per_user_path(ml100k, case, dtype):
    """The default ``auto`` trains a one-user message (one user per node) on the block path; ``off`` keeps the
    per-user client. On real ML-100K users, one message each, two rounds: every upload and the private records after
    each round agree within float32 tolerance (float32, the deployed dtype), or to 1e-9 in float64.

    FedNCF with Adam is compared in float64 only: in float32 its round-2 item rows differed by up to 1.5e-4 (0.015 x
    the learning rate) on 6 of 32,704 entries, in a column whose gradient is near 0, where Adam's normalised step turns
    the float32 rounding of the gradient (and of the round-1 embedding it depends on) into a visible step difference;
    with SGD the same users agree to 1.5e-8 (``fedncf-sgd``); FedRecGEL's NCF with Adam passes in float32 (at its
    learning rate 0.1, so at ten times FedNCF's absolute tolerance)."""
    overrides, upload = ONE_USER_CASES[case]
    runtime = _runtime(ml100k, overrides, dtype)
    cls = resolve("client", runtime.config.client)
    assert use_blocks(cls, runtime.config, 1) and not use_blocks(cls, runtime.config.replace(block_training="off"), 1)
    shared, cfg = _shared(runtime), runtime.config
    rtol, atol = _tolerance(cfg, dtype)
    per_user_state, block_state = RecordDict(), RecordDict()
    for server_round in (1, 2):
        config = {"server-round": server_round, "upload": upload}
        for user in USERS:
            reference = cls(runtime, user, per_user_state).fit_named(shared, config)
            (update,) = train_block(runtime, cls, [user], block_state, shared, config)
            _assert_updates_equal(reference, update, rtol, atol)
        _assert_states_equal(per_user_state, block_state, rtol, atol)


@pytest.mark.parametrize("case", ["fedncf", "fedmf", "fedrecgel-gradient", "fedau2-dsvae"])
def test_block_evaluation_gives_the_per_user_metrics(ml100k, case):
    """After a round of training (and for a user never trained: its seeded embedding), one batched scoring call gives
    each user's HR@K / NDCG@K as its own client does, for the test and the validation item."""
    overrides, upload = CASES[case]
    runtime = _runtime(ml100k, overrides)
    cls = resolve("client", runtime.config.client)
    shared, state = _shared(runtime), RecordDict()
    train_block(runtime, cls, USERS[:6], state, shared, {"server-round": 1, "upload": upload})
    users = USERS + list(range(850, 943))  # the last 93 never trained
    reference = [cls(runtime, u, state).evaluate_named(shared, {"split": "test"}) for u in users]
    batched = evaluate_block(runtime, users, state, shared, {"split": "test"})
    assert batched == reference
    assert sum(r["HR@10"] for r in reference) > 0
    with pytest.raises(ValueError, match="holdout-validation"):
        evaluate_block(runtime, users, state, shared, {"split": "val"})


def test_block_path_selection_and_its_config_key(ml100k):
    """Only a class's own declaration counts; ``block-training = "on"`` is refused for a client without a block path;
    ``auto`` (the default) takes the block path for a single user too; ``off`` is the per-user reference."""
    config = make_run_config(**ml100k)
    assert block_kind(fedrec.FedRecClient, config) == "plain"
    assert block_kind(fedrecgel.FedRecGELClient, config.replace(client="fedrecgel")) == "sam"
    assert block_kind(resolve("client", "pfedrec"), config.replace(model="pfedrec", client="pfedrec")) is None
    fedau2 = resolve("client", "fedau2")
    assert block_kind(fedau2, config.replace(client="fedau2")) == "plain"  # no adversary
    default_arm = config.replace(client="fedau2", adversary="dsvae", protected_attribute="gender")
    assert block_kind(fedau2, default_arm) == "plain"
    for per_user in (
        {"adversary_objective": "reverse"},
        {"adversary_embedding_optimizer": "sgd"},
        {
            "adversary_training": "per-client",
            "secure_aggregation": "off",
            "adversary_weight_rule": "fixed",
            "adversary_class_prior": "",
        },
        {"user_embedding_noise": 0.1},
    ):
        assert block_kind(fedau2, default_arm.replace(**per_user)) is None, per_user
    assert block_kind(resolve("client", "fedau2-gel"), default_arm.replace(client="fedau2-gel")) is None

    class PlugIn(fedrec.FedRecClient):  # inherits no block support: it may override hooks the block path skips
        pass

    assert block_kind(PlugIn, config) is None and not use_blocks(PlugIn, config, 10)
    assert config.block_training == "auto"
    assert use_blocks(fedrec.FedRecClient, config, 10) and use_blocks(fedrec.FedRecClient, config, 1)
    assert use_blocks(fedrec.FedRecClient, config.replace(block_training="on"), 1)
    assert not use_blocks(PlugIn, config.replace(block_training="on"), 1)
    for users in (1, 10):
        assert not use_blocks(fedrec.FedRecClient, config.replace(block_training="off"), users)
    assert not use_blocks(fedrec.FedRecClient, config, 10, {"proximal-mu": 0.1})  # FedProx: per user
    assert use_blocks(fedrec.FedRecClient, config, 10, {"proximal-mu": 0.0})
    with pytest.raises(ConfigError, match="block-training"):
        check_components(config.replace(model="pfedrec", client="pfedrec", block_training="on"))
    with pytest.raises(ConfigError, match="block-training"):
        make_run_config(**ml100k, block_training="yes")


@pytest.mark.parametrize(
    "overrides",
    [{}, {"client": "fedrecgel", "rho-private": 0.02, "strategy": "server-optimizer"}],
    ids=["fedncf", "fedrecgel"],
)
def test_serial_run_with_block_training_on_equals_off(tmp_path, overrides):
    """A whole serial run with users-per-node = 10: the final model and metrics with the block path equal the
    per-user path's up to float32 rounding; and the block-trained run's replies carry no private value."""
    recorder = MessageRecorder(tmp_path / "messages")
    on_config = tiny_run_config(tmp_path / "on", users_per_node=10, block_training="on", **overrides)
    on = run_serial(on_config, client_app=make_client_app(on_config, mods=[recorder]))
    off = run_serial(tiny_run_config(tmp_path / "off", users_per_node=10, block_training="off", **overrides))
    a, b = np.load(on / "final_arrays.npz"), np.load(off / "final_arrays.npz")
    assert set(a.files) == set(b.files)
    for key in a.files:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-6, err_msg=key)
    rows_on, rows_off = (json.loads((r / "metrics.json").read_text()) for r in (on, off))
    for ra, rb in zip(rows_on, rows_off, strict=True):
        assert ra["HR@10"] == pytest.approx(rb["HR@10"], abs=1e-9)
        assert ra["train-loss"] == pytest.approx(rb["train-loss"], rel=1e-4)
    records = recorder.records()
    assert any(r["type"] == "train" for r in records)
    assert_no_private_value_in_replies(records, get_runtime(on_config).layout, extra=seeded_private_vectors(on_config))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"loss": "bpr"}, {"model": "mf"}, {"model": "mf", "loss": "bpr"}],
    ids=["ncf-bce", "ncf-bpr", "mf-bce", "mf-bpr"],
)
def test_batched_forward_gradients_equal_vmap_of_the_model(ml100k, overrides):
    """The batched forward pass of MF / NCF (``blocks.batched_loss``, the default) gives every user's loss and, by
    autograd, every key's gradient as ``vmap`` of the process's own model does (float64, perturbed parameters so that
    no layer is at its initial value; a padded mini-batch of unequal real users; a subset of keys too)."""
    runtime = _runtime(ml100k, overrides, torch.float64)
    assert blocks.batched_model(runtime.model) == runtime.config.model
    block = blocks.Block(runtime, USERS, RecordDict())
    data = sorted((block.user_data(u, 1) for u in block.users), key=lambda d: -d.n)
    params = {**block.load_private([d.user for d in data]), **block.shared_copies(_shared(runtime), data)}
    generator = torch.Generator().manual_seed(0)
    params = {k: v + 0.1 * torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in params.items()}
    orders = [torch.randperm(d.n, generator=d.generator) for d in data]
    args = [a[:, 64:192] for a in block.padded(data, orders, max(d.n for d in data), 128)]  # a strided view
    reference, ref_values = block.autograd_gradients(params, *args)
    for keys in (None, runtime.layout.item_keys):
        grads, values = blocks.batched_gradients(runtime.model, runtime.config.loss, params, *args, keys=keys)
        assert sorted(grads) == sorted(keys or reference)
        torch.testing.assert_close(values, ref_values, rtol=1e-12, atol=1e-14)
        for key in grads:
            assert grads[key].shape == reference[key].shape, key
            torch.testing.assert_close(grads[key], reference[key], rtol=1e-10, atol=1e-14, msg=key)
    assert blocks.batched_model(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_adam_fused_equals_its_formula_and_torch_adam(dtype):
    """``BlockAdam`` with one step count per block (torch's fused kernel) and with per-user step counts (the formula)
    both follow ``torch.optim.Adam`` on each user's own parameters, over three steps of which the last moves only a
    prefix of the users."""
    generator = torch.Generator().manual_seed(1)
    k, shape = 5, (7, 3)
    start = torch.randn(k, *shape, generator=generator, dtype=dtype)
    grads = [torch.randn(k, *shape, generator=generator, dtype=dtype) for _ in range(3)]
    counts = [k, k, 3]
    results = []
    for fused in (True, False):
        params = {"w": start.clone()}
        optimizer = blocks.BlockAdam(params, lr=0.01)
        old, block_optim.FUSED_ADAM = block_optim.FUSED_ADAM, fused
        try:
            for g, count in zip(grads, counts):
                optimizer.step({"w": params["w"][:count]}, {"w": g[:count].contiguous()}, count)
        finally:
            block_optim.FUSED_ADAM = old
        results.append(params["w"])
    reference = []
    for user in range(k):
        w = torch.nn.Parameter(start[user].clone())
        optimizer = torch.optim.Adam([w], lr=0.01)
        for g, count in zip(grads, counts):
            if user < count:
                w.grad = g[user].clone()
                optimizer.step()
        reference.append(w.detach())
    tolerance = {"rtol": 1e-12, "atol": 1e-14} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-7}
    for result in results:
        torch.testing.assert_close(result, torch.stack(reference), **tolerance)


def test_all_finite_is_isfinite_all():
    """The cheap finiteness test the per-user loop and every shared-array load use (a sum first) answers exactly as
    ``torch.isfinite(t).all()``, also where finite values overflow the sum."""
    from fedrec_flwr.models.base import all_finite

    nan, inf = float("nan"), float("inf")
    for values, dtype in [
        ([1.0, 2.0], torch.float32),
        ([1.0, nan], torch.float32),
        ([inf, 1.0], torch.float64),
        ([inf, -inf], torch.float32),
        ([3e38, 3e38], torch.float32),
        ([6e4, 6e4], torch.float16),
        ([], torch.float32),
        ([-inf], torch.float16),
    ]:
        tensor = torch.tensor(values, dtype=dtype)
        assert all_finite(tensor) == bool(torch.isfinite(tensor).all()), (values, dtype)
