"""Client unlearning (fedrec_flwr.strategies.unlearning, HF-KCU and its baselines) and its building blocks.

* the sign of the HF-KCU step on a convex problem where the retrained optimum is known in closed form;
* the influence objective (fedrec_flwr.unlearning.influence) against the training loss, and its batched node form;
* the row-sparse vectors of the unlearning messages (fedrec_flwr.wire.pack_sparse / unpack_sparse / SparseSum);
* the forget set and the config checks;
* whole runs (serial grid, one under Ray) for every method: files, sampling, evaluation users, privacy;
* on a trained MF model, where the Hessian is block-diagonal by item row: distributed and local CG, causal weighting,
  adaptive scale and gradient ascent against explicit numpy computations.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MessageRecorder, assert_no_private_value_in_replies, tiny_run_config, write_tiny_dataset
from flwr.app import Array, ArrayRecord, Context, RecordDict

from fedrec_flwr.app.client_app import make_client, make_client_app
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.config import RunConfig, default_mapping
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.training import LocalTrainer
from fedrec_flwr.models import build_model
from fedrec_flwr.serial import run_serial
from fedrec_flwr.strategies.unlearning import (
    ClientUnlearning,
    UnlearningSettings,
    describe_before,
    describe_unlearning,
    forget_set,
)
from fedrec_flwr.unlearning.influence import can_batch, influence_objective
from fedrec_flwr.unlearning.krylov import conjugate_gradient, gradient, hessian_vector_product
from fedrec_flwr.wire import (
    ModelLayout,
    PrivacyViolation,
    ReplyError,
    SparseSum,
    pack_sparse,
    sample_users,
    unpack_sparse,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ================================================================================================ sign and convexity
def _ridge_problem(num_users: int = 8, dim: int = 6, rows: int = 5, ridge: float = 0.05, seed: int = 0):
    """Per-user ridge-regression losses ``L_u(t) = 0.5 ||A_u t - b_u||^2 + 0.5 ridge ||t||^2`` (convex quadratics)."""
    rng = np.random.default_rng(seed)
    a = torch.as_tensor(rng.normal(size=(num_users, rows, dim)))
    b = torch.as_tensor(rng.normal(size=(num_users, rows)))

    def loss(users):
        users = list(users)

        def fn(params):
            t = params["theta"]
            residual = torch.einsum("urd,d->ur", a[users], t) - b[users]
            return 0.5 * residual.pow(2).sum() + 0.5 * ridge * len(users) * t.pow(2).sum()

        return fn

    def optimum(users):
        users = list(users)
        an, bn = a[users].numpy(), b[users].numpy()
        hessian = np.einsum("urd,ure->de", an, an) + ridge * len(users) * np.eye(dim)
        return np.linalg.solve(hessian, np.einsum("urd,ur->d", an, bn))

    return loss, optimum


def _hfkcu_step(loss, theta_star, forget, remain, damping):
    """``(H_R + damping I)^{-1} g_F`` at ``theta_star`` with CG over Hessian-vector products of a torch loss."""
    params = {"theta": torch.as_tensor(theta_star)}
    g_forget = gradient(loss(forget), params)["theta"].numpy()
    remain_loss = loss(remain)

    def matvec(v):
        return hessian_vector_product(remain_loss, params, {"theta": torch.as_tensor(v)})["theta"].numpy()

    result = conjugate_gradient(matvec, g_forget, iterations=50, damping=damping, tolerance=1e-13)
    assert result.converged and not result.negative_curvature
    return result.x, g_forget


def test_hfkcu_step_on_a_quadratic_lands_on_the_retrained_optimum_and_its_sign_matters():
    loss, optimum = _ridge_problem()
    users, forget = list(range(8)), [1, 4]
    remain = [u for u in users if u not in forget]
    theta_star, theta_retrained = optimum(users), optimum(remain)
    distance = np.linalg.norm(theta_star - theta_retrained)
    assert distance > 1e-2  # forgetting changes the optimum

    x, g_forget = _hfkcu_step(loss, theta_star, forget, remain, damping=0.0)
    # at the full optimum the remaining users' gradient is minus the forgotten users'
    remain_grad = gradient(loss(remain), {"theta": torch.as_tensor(theta_star)})["theta"].numpy()
    np.testing.assert_allclose(remain_grad, -g_forget, atol=1e-10)
    np.testing.assert_allclose(theta_star + 1.0 * x, theta_retrained, rtol=0, atol=1e-6)
    assert np.linalg.norm(theta_star - x - theta_retrained) > 1.5 * distance  # the wrong sign moves away

    previous = 0.0
    for damping in (0.01, 0.1, 1.0, 10.0):
        x_damped, _ = _hfkcu_step(loss, theta_star, forget, remain, damping=damping)
        toward = np.linalg.norm(theta_star + x_damped - theta_retrained)
        away = np.linalg.norm(theta_star - x_damped - theta_retrained)
        assert previous < toward < distance, damping  # closer than theta*, and less so with more damping
        assert away > distance, damping
        previous = toward
    for scale in (0.25, 0.5):  # a fraction of the undamped step covers that fraction of the way
        np.testing.assert_allclose(
            np.linalg.norm(theta_star + scale * x - theta_retrained), (1 - scale) * distance, rtol=1e-6
        )


# ================================================================================================ influence objective
def _influence_setup(folder: Path, model: str, loss: str, num_users: int = 5, seed: int = 0):
    """A runtime on the tiny dataset, a node context whose state holds ``num_users`` users' private records (random,
    of a realistic size), their clients, and random shared arrays."""
    mapping = RunConfig.from_mapping(tiny_run_config(folder, model=model, loss=loss, num_train_negatives=2)).to_dict()
    runtime = get_runtime(mapping)
    rng = np.random.default_rng(seed)
    context = Context(
        run_id=1,
        node_id=1000,
        node_config={"partition-id": 0, "num-partitions": 1},
        state=RecordDict(),
        run_config=mapping,
    )
    for user in range(num_users):
        record = {
            k: Array(rng.normal(scale=0.7, size=v.shape).astype(np.float32))
            for k, v in runtime.model.private_state().items()
        }
        context.state[f"user:{user}"] = ArrayRecord(record)
    shared = {k: (rng.normal(scale=0.5, size=s)).astype(np.float32) for k, s in runtime.layout.shared_shapes.items()}
    clients = [make_client(runtime, user, context) for user in range(num_users)]
    return runtime, clients, shared


@pytest.fixture
def with_weight_decay(request):
    """Set ``weight_decay`` on a runtime's local-training config for one test (it is not a run-config key)."""
    changed = []

    def set_decay(runtime, value):
        changed.append((runtime, runtime.train_config))
        runtime.train_config = dataclasses.replace(runtime.train_config, weight_decay=value)

    yield set_decay
    for runtime, saved in changed:
        runtime.train_config = saved


def _full(layout, dense, rows) -> dict[str, np.ndarray]:
    """``(dense, rows)`` (a client's expanded vector) as full float64 arrays by shared key."""
    out = {k: np.asarray(v, dtype=np.float64) for k, v in dense.items()}
    for key in layout.item_keys:
        ids, values = rows[key]
        full = np.zeros(layout.shared_shapes[key])
        np.add.at(full, np.asarray(ids, dtype=np.int64), values)
        out[key] = full
    assert set(out) == set(layout.shared_shapes)
    return out


def _reference_gradient_and_hvp(runtime, client, shared, direction):
    """The user's training loss (LocalTrainer.compute_loss over all its influence examples in one batch, plus the
    optimizer's weight decay on the dense parameters), its gradient and Hessian-vector product with plain autograd
    on the full model: independent of fedrec_flwr.unlearning.influence's compact tables and torch.func."""
    cfg = runtime.train_config
    client.load_shared(shared)
    client.load_private()
    model = runtime.model
    positives, negatives = client.influence_examples()
    if cfg.loss == "bpr":
        k = negatives.size // positives.size
        n = negatives.size
        items = np.concatenate([np.repeat(positives, k), negatives])
        labels = np.concatenate([np.ones(n), np.zeros(n)])
    else:
        items = np.concatenate([positives, negatives])
        labels = np.concatenate([np.ones(positives.size), np.zeros(negatives.size)])
    users = torch.zeros(items.size, dtype=torch.int64)
    trainer = LocalTrainer(model, cfg)
    loss = trainer.compute_loss(users, torch.as_tensor(items), torch.as_tensor(labels, dtype=torch.float32))
    named = dict(model.named_parameters())
    keys = list(runtime.layout.shared_shapes)
    for key in runtime.layout.dense_keys:
        loss = loss + 0.5 * cfg.weight_decay * named[key].pow(2).sum()
    for table in model.user_embedding_modules().values():  # the user row's L2 term is no function of theta
        loss = loss - 0.5 * cfg.weight_decay * table.weight[0].detach().pow(2).sum()
    grads = torch.autograd.grad(loss, [named[k] for k in keys], create_graph=True)
    products = torch.autograd.grad(
        grads, [named[k] for k in keys], grad_outputs=[torch.as_tensor(direction[k], dtype=torch.float32) for k in keys]
    )
    return (
        float(loss.detach()),
        {k: g.detach().double().numpy() for k, g in zip(keys, grads)},
        {k: p.double().numpy() for k, p in zip(keys, products)},
    )


def _assert_close_vectors(got, expected, rtol=2e-5, what=""):
    scale = max(float(np.abs(v).max()) for v in expected.values())
    assert scale > 0
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=rtol, atol=rtol * scale, err_msg=f"{what} {key}")


INFLUENCE_CASES = [(m, loss, d) for m in ("mf", "ncf") for loss in ("bce", "bpr") for d in (0.0, 0.05)]


@pytest.mark.parametrize(("model", "loss", "decay"), INFLUENCE_CASES)
def test_influence_objective_is_the_users_training_loss(tmp_path, with_weight_decay, model, loss, decay):
    runtime, clients, shared = _influence_setup(tmp_path, model, loss, num_users=2)
    with_weight_decay(runtime, decay)
    rng = np.random.default_rng(1)
    direction = {k: rng.normal(size=s) for k, s in runtime.layout.shared_shapes.items()}
    for client in clients:
        value, ref_grad, ref_hvp = _reference_gradient_and_hvp(runtime, client, shared, direction)
        dense, rows, got_value = client.influence_gradient(shared)
        assert got_value == pytest.approx(value, rel=1e-5)
        grad = _full(runtime.layout, dense, rows)
        _assert_close_vectors(grad, ref_grad, what="gradient")
        hvp = _full(runtime.layout, *client.influence_hvp(shared, direction))
        _assert_close_vectors(hvp, ref_hvp, what="hvp")
        # the item rows outside the user's loss are exactly 0 in both
        outside = np.setdiff1d(np.arange(runtime.split.num_items), client.influence_items())
        assert outside.size > 0
        for key in runtime.layout.item_keys:
            assert not grad[key][outside].any() and not hvp[key][outside].any()
            assert np.array_equal(rows[key][0], client.influence_items())


@pytest.mark.parametrize(("model", "loss", "decay"), INFLUENCE_CASES)
def test_batched_node_objective_equals_the_sum_of_the_users_objectives(tmp_path, with_weight_decay, model, loss, decay):
    runtime, clients, shared = _influence_setup(tmp_path, model, loss, num_users=5)
    with_weight_decay(runtime, decay)
    assert can_batch(runtime.model)
    layout = runtime.layout
    rng = np.random.default_rng(2)
    direction = {k: rng.normal(size=s) for k, s in layout.shared_shapes.items()}

    for round_shared in (shared, {k: v * 1.5 for k, v in shared.items()}):  # a new mapping is loaded, not cached
        total_grad = {k: np.zeros(s) for k, s in layout.shared_shapes.items()}
        total_hvp = {k: np.zeros(s) for k, s in layout.shared_shapes.items()}
        total_loss = 0.0
        for client in clients:
            dense, rows, value = client.influence_gradient(round_shared)
            total_loss += value
            for key, array in _full(layout, dense, rows).items():
                total_grad[key] += array
            for key, array in _full(layout, *client.influence_hvp(round_shared, direction)).items():
                total_hvp[key] += array
        with influence_objective(runtime, clients, round_shared) as (loss_fn, params, items):
            batched_value = float(loss_fn(params).detach())
            grads = gradient(loss_fn, params)
            batched_grad = _full(
                layout,
                {k: grads[k].detach().double().numpy() for k in layout.dense_keys},
                {k: (items, grads[k].detach().double().numpy()) for k in layout.item_keys},
            )
        batched_hvp = _full(layout, *clients[0].influence_hvp(round_shared, direction, group=clients))
        assert batched_value == pytest.approx(total_loss, rel=1e-5)
        _assert_close_vectors(batched_grad, total_grad, rtol=1e-5, what="gradient")
        _assert_close_vectors(batched_hvp, total_hvp, rtol=1e-5, what="hvp")


def test_influence_objective_refuses_no_users_and_unbatchable_models(tmp_path):
    runtime, clients, shared = _influence_setup(tmp_path, "mf", "bce", num_users=1)
    with pytest.raises(ValueError, match="no users"):
        with influence_objective(runtime, [], shared):
            pass
    assert can_batch(build_model("ncf", 2, 5, embedding_dim=4, mlp_layers=(8, 4)))
    assert not can_batch(build_model("pfedrec", 2, 5, embedding_dim=4))  # its private score function is no user table


def test_local_solve_of_one_user_matches_an_explicit_solve_on_its_rows(tmp_path):
    """influence_solve: rows outside the user's loss get rhs / damping; on its rows the explicit Hessian (columns of
    Hessian-vector products) is solved."""
    runtime, clients, shared = _influence_setup(tmp_path, "mf", "bce", num_users=1)
    client, layout = clients[0], runtime.layout
    items = client.influence_items()
    outside = np.setdiff1d(np.arange(runtime.split.num_items), items)[:2]
    rng = np.random.default_rng(3)
    rhs = {k: np.zeros(s) for k, s in layout.shared_shapes.items()}
    rhs["item_embedding.weight"][items[:3]] = rng.normal(size=(3, 8))
    rhs["item_embedding.weight"][outside] = rng.normal(size=(2, 8))
    damping = 0.05
    dense, rows, result = client.influence_solve(shared, rhs, iterations=200, damping=damping, tolerance=1e-7)
    assert result.converged and not result.negative_curvature
    x = _full(layout, dense, rows)["item_embedding.weight"]
    np.testing.assert_allclose(x[outside], rhs["item_embedding.weight"][outside] / damping, rtol=1e-5)
    # explicit Hessian of the user's loss on its rows, one HVP per coordinate
    d = 8
    hessian = np.zeros((items.size * d, items.size * d))
    for column in range(items.size * d):
        basis = np.zeros((runtime.split.num_items, d))
        basis[items[column // d], column % d] = 1.0
        hv = _full(layout, *client.influence_hvp(shared, {"item_embedding.weight": basis}))["item_embedding.weight"]
        hessian[:, column] = hv[items].reshape(-1)
    np.testing.assert_allclose(hessian, hessian.T, atol=1e-6)
    expected = np.linalg.solve(
        hessian + damping * np.eye(items.size * d), rhs["item_embedding.weight"][items].reshape(-1)
    )
    np.testing.assert_allclose(x[items].reshape(-1), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_local_solve_with_zero_damping_refuses_rows_the_user_never_touches(tmp_path):
    """Documented in FedRecClient.influence_solve: damping 0 with right-hand-side rows outside the user's loss is a
    singular system and raises ValueError (instead of returning CG's meaningless iterate)."""
    runtime, clients, shared = _influence_setup(tmp_path, "mf", "bce", num_users=1)
    client = clients[0]
    outside = np.setdiff1d(np.arange(runtime.split.num_items), client.influence_items())
    rhs = {k: np.zeros(s) for k, s in runtime.layout.shared_shapes.items()}
    rhs["item_embedding.weight"][client.influence_items()[0]] = 1.0
    rhs["item_embedding.weight"][outside[0]] = 1.0
    with pytest.raises(ValueError):
        client.influence_solve(shared, rhs, iterations=50, damping=0.0, tolerance=1e-8)


# ================================================================================================ sparse vectors
def _ncf_layout() -> ModelLayout:
    return ModelLayout.from_model(build_model("ncf", 3, 10, embedding_dim=4, mlp_layers=(8, 4)))


def _sparse_vector(layout, seed=0, zero_rows=(1, 4, 5)):
    rng = np.random.default_rng(seed)
    vector = {k: rng.normal(size=s) for k, s in layout.shared_shapes.items()}
    for key in layout.item_keys:
        vector[key][list(zero_rows)] = 0.0
    return vector


def test_pack_sparse_round_trip_carries_only_non_zero_rows():
    layout = _ncf_layout()
    vector = _sparse_vector(layout)
    packed = pack_sparse(vector, layout)
    expected_keys = set(layout.dense_keys) | {k + s for k in layout.item_keys for s in ("#rows", "#sum")}
    assert set(packed) == expected_keys
    for key in layout.item_keys:
        np.testing.assert_array_equal(packed[key + "#rows"], [0, 2, 3, 6, 7, 8, 9])
        assert packed[key + "#rows"].dtype == np.int64 and packed[key + "#sum"].dtype == np.float32
        assert packed[key + "#sum"].shape == (7, 4)
    back = unpack_sparse(packed, layout)
    assert set(back) == set(layout.shared_shapes)
    for key, value in vector.items():
        assert back[key].dtype == np.float64 and back[key].shape == value.shape
        np.testing.assert_array_equal(back[key], value.astype(np.float32).astype(np.float64))
    # missing keys count as zero
    empty = unpack_sparse(pack_sparse({}, layout), layout)
    assert all(not v.any() for v in empty.values())
    assert all(pack_sparse({}, layout)[k + "#rows"].size == 0 for k in layout.item_keys)


def test_sparse_sum_adds_users_vectors_row_by_row():
    layout = _ncf_layout()
    total = SparseSum(layout)
    a, b = _sparse_vector(layout, 1), _sparse_vector(layout, 2, zero_rows=(0, 2))
    for vector, weight in ((a, 1.0), (b, 0.5)):
        dense = {k: vector[k] for k in layout.dense_keys}
        rows = {}
        for key in layout.item_keys:
            ids = np.flatnonzero(np.any(vector[key] != 0, axis=1))[::-1]  # any order
            rows[key] = (ids, vector[key][ids])
        total.add(dense, rows, weight)
    assert total.count == 2
    back = unpack_sparse(total.pack(), layout)
    for key in layout.shared_shapes:
        np.testing.assert_allclose(back[key], a[key] + 0.5 * b[key], rtol=1e-6, atol=1e-6)


def _damage(packed, layout, how):
    table, dense = layout.item_keys[0], layout.dense_keys[0]
    packed = {k: v.copy() for k, v in packed.items()}
    if how == "dense-shape":
        packed[dense] = packed[dense][..., :-1]
    elif how == "sum-shape":
        packed[table + "#sum"] = packed[table + "#sum"][:-1]
    elif how == "sum-width":
        packed[table + "#sum"] = packed[table + "#sum"][:, :-1]
    elif how == "rows-2d":
        packed[table + "#rows"] = packed[table + "#rows"].reshape(1, -1)
    elif how == "rows-float":
        packed[table + "#rows"] = packed[table + "#rows"].astype(np.float32)
    elif how == "row-too-large":
        packed[table + "#rows"][-1] = layout.shared_shapes[table][0]
    elif how == "row-negative":
        packed[table + "#rows"][0] = -1
    elif how == "row-repeated":
        packed[table + "#rows"][1] = packed[table + "#rows"][0]
    elif how == "nan-dense":
        packed[dense].reshape(-1)[0] = np.nan
    elif how == "nan-sum":
        packed[table + "#sum"][0, 0] = np.nan
    elif how == "inf-sum":
        packed[table + "#sum"][0, 0] = np.inf
    elif how == "missing":
        del packed[dense]
    elif how == "unknown":
        packed["something.else"] = np.zeros(1)
    elif how == "count":
        packed[table + "#count"] = np.ones(len(packed[table + "#rows"]), dtype=np.float32)
    return packed


@pytest.mark.parametrize(
    "how",
    [
        "dense-shape",
        "sum-shape",
        "sum-width",
        "rows-2d",
        "rows-float",
        "row-too-large",
        "row-negative",
        "row-repeated",
        "nan-dense",
        "nan-sum",
        "inf-sum",
        "missing",
        "unknown",
        "count",
    ],
)
def test_unpack_sparse_rejects_malformed_vectors(how):
    layout = _ncf_layout()
    packed = pack_sparse(_sparse_vector(layout), layout)
    unpack_sparse(packed, layout)  # the undamaged vector is fine
    with pytest.raises(ReplyError):
        unpack_sparse(_damage(packed, layout, how), layout)


@pytest.mark.parametrize("suffix", ["", "#rows", "#sum"])
def test_unpack_sparse_rejects_a_private_key(suffix):
    layout = _ncf_layout()
    packed = pack_sparse(_sparse_vector(layout), layout)
    packed[layout.private_keys[0] + suffix] = np.zeros((3, 4), dtype=np.float32)
    with pytest.raises(PrivacyViolation):
        unpack_sparse(packed, layout)


# ================================================================================================ forget set and config
def _config(**overrides) -> RunConfig:
    mapping = default_mapping()
    mapping.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return RunConfig.from_mapping(mapping)


def test_forget_set_is_seeded_and_the_union_of_ids_and_fraction():
    drawn = forget_set(_config(forget_fraction=0.25, unlearning="hfkcu"), 24)
    assert drawn.dtype == np.int64 and drawn.size == 6 and np.all(np.diff(drawn) > 0)
    assert drawn.min() >= 0 and drawn.max() < 24
    np.testing.assert_array_equal(drawn, forget_set(_config(forget_fraction=0.25, unlearning="hfkcu"), 24))
    others = [forget_set(_config(forget_fraction=0.25, unlearning="hfkcu", seed=s), 24) for s in (1, 2, 3)]
    assert any(not np.array_equal(drawn, o) for o in others)
    union = forget_set(_config(forget_fraction=0.25, forget_users="23, 3,3", unlearning="hfkcu"), 24)
    np.testing.assert_array_equal(union, np.union1d(drawn, [3, 23]))
    np.testing.assert_array_equal(forget_set(_config(forget_users="7,2", unlearning="retrain"), 24), [2, 7])
    assert forget_set(_config(forget_fraction=0.01, unlearning="hfkcu"), 24).size == 1  # at least one
    assert forget_set(_config(), 24).size == 0


@pytest.mark.parametrize(
    "overrides",
    [
        {"forget_users": "3,24"},
        {"forget_fraction": 1.0},
        {"forget_users": ",".join(str(u) for u in range(24))},
        {"forget_users": "0,1", "forget_fraction": 0.95},
    ],
)
def test_forget_set_refuses_out_of_range_ids_and_forgetting_everyone(overrides):
    config = _config(unlearning="hfkcu", **overrides)
    with pytest.raises(ConfigError):
        forget_set(config, 24)
    with pytest.raises(ConfigError):
        UnlearningSettings.from_config(config, 24)


def test_unlearning_settings_come_from_the_config():
    config = _config(
        unlearning="hfkcu",
        forget_users="4,1",
        krylov_mode="local",
        cg_iterations=7,
        damping=0.2,
        unlearn_scale=0.5,
        adaptive_scale=False,
        causal_weighting=False,
        num_server_rounds=9,
    )
    settings = UnlearningSettings.from_config(config, 10)
    assert settings.method == "hfkcu" and settings.forget == (1, 4) and settings.round == 9
    assert (settings.krylov_mode, settings.cg_iterations, settings.damping, settings.scale) == ("local", 7, 0.2, 0.5)
    assert not settings.adaptive_scale and not settings.causal_weighting
    assert (
        UnlearningSettings.from_config(
            _config(unlearning="hfkcu", forget_users="1", unlearn_round=3, num_server_rounds=9), 10
        ).round
        == 3
    )
    with pytest.raises(ValueError, match="phase"):
        ClientUnlearning(object(), settings.replace(method="retrain"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"unlearning": "hfkcu"}, "forget"),
        ({"unlearning": "retrain", "forget_users": ""}, "forget"),
        ({"unlearning": "hfkcu", "forget_users": "1", "unlearn_round": 11, "num_server_rounds": 10}, "unlearn-round"),
        ({"unlearning": "hfkcu", "forget_users": "1", "krylov_mode": "local", "damping": 0.0}, "damping"),
        ({"unlearning": "forget-it", "forget_users": "1"}, "unlearning"),
        ({"unlearning": "hfkcu", "forget_users": "1", "krylov_mode": "global"}, "krylov-mode"),
        ({"unlearning": "hfkcu", "forget_users": "1,x"}, "forget-users"),
        ({"unlearning": "hfkcu", "forget_users": "-1"}, "forget-users"),
        ({"unlearning": "hfkcu", "forget_fraction": 1.5}, "forget-fraction"),
        ({"unlearning": "hfkcu", "forget_users": "1", "damping": -0.1}, "damping"),
    ],
)
def test_config_refuses_inconsistent_unlearning_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(**overrides)


def test_config_accepts_consistent_unlearning_keys():
    _config(unlearning="hfkcu", forget_users="1", krylov_mode="distributed", damping=0.0)  # distributed may use 0
    _config(unlearning="hfkcu", forget_fraction=0.1, unlearn_round=10, num_server_rounds=10)
    _config(unlearning="none", forget_users="2")  # a forget set without unlearning: evaluation leaves it out
    assert _config(unlearning="gradient-ascent", forget_users="1", num_server_rounds=7).effective_unlearn_round == 7


# ================================================================================================ whole runs (serial)
ROUNDS, PHASE_ROUND = 3, 2
FORGET = tuple(int(u) for u in sample_users(0, ROUNDS, 24, 0.5)[:2])
"""Two users the seed samples in the round after the phase (so leaving them out is visible)."""

METHODS = [
    ("hfkcu", {"krylov_mode": "distributed"}),
    ("hfkcu", {"krylov_mode": "local", "damping": 1.0}),  # the tiny NCF users' Hessians are indefinite at 0.01
    ("gradient-ascent", {"ascent_steps": 2}),
    ("continue", {"continue_rounds": 2}),
    ("retrain", {}),
]


def _run_config(folder, **overrides):
    overrides = {"num_server_rounds": ROUNDS, "forget_users": ",".join(map(str, FORGET)), **overrides}
    mapping = tiny_run_config(folder, **overrides)
    return RunConfig.from_mapping(mapping).to_dict()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The same federation trained to the phase's round without unlearning (a forget set configured, so the
    evaluation users are the same): its final model is the model the phase starts from."""
    folder = tmp_path_factory.mktemp("reference")
    config = _run_config(folder, unlearning="none", num_server_rounds=PHASE_ROUND)
    return run_serial(config)


def _arrays(path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize(
    ("method", "extra"), METHODS, ids=["hfkcu-distributed", "hfkcu-local", "gradient-ascent", "continue", "retrain"]
)
def test_serial_run_unlearns_and_leaves_the_forgotten_users_out(tmp_path, reference_run, method, extra, caplog):
    caplog.set_level(logging.INFO)
    config = _run_config(tmp_path, unlearning=method, unlearn_round=PHASE_ROUND, **extra)
    recorder = MessageRecorder(tmp_path / "messages")
    after_phase = {}

    def on_round(view):
        if view.server_round == PHASE_ROUND:
            after_phase.update({k: v.numpy().copy() for k, v in view.arrays.items()})

    folder = run_serial(config, client_app=make_client_app(config, mods=[recorder]), on_round=on_round)
    records = recorder.records()
    forget = set(FORGET)
    assert not any(r["error"] for r in records), [r["error"] for r in records if r["error"]][:3]
    summary = json.loads((folder / "summary.json").read_text())

    # --- training: who is named in which round
    train = [r for r in records if r["type"] == "train"]
    rounds = sorted({r["round"] for r in train})
    extra_rounds = list(range(ROUNDS + 1, ROUNDS + 1 + extra.get("continue_rounds", 0))) if method == "continue" else []
    assert rounds == list(range(1, ROUNDS + 1)) + extra_rounds
    for server_round in rounds:
        named = {u for r in train if r["round"] == server_round for u in r["users"]}
        sampled = set(sample_users(0, server_round, 24, 0.5).tolist())
        if method == "retrain" or server_round > PHASE_ROUND:
            assert named == sampled - forget, server_round
        else:  # before the phase the forgotten users still train
            assert named == sampled, server_round
    assert forget <= set(sample_users(0, ROUNDS, 24, 0.5).tolist())

    # --- evaluation never names a forgotten user, and covers every other one
    evaluate = [r for r in records if r["type"] == "evaluate"]
    assert evaluate
    for server_round in range(1, ROUNDS + 1):
        named = [u for r in evaluate if r["round"] == server_round for u in r["users"]]
        assert not forget & set(named)
        assert set(named) == set(range(24)) - forget

    if method == "retrain":
        assert json.loads((folder / "unlearning.json").read_text()) == {
            "method": "retrain",
            "forget-users": sorted(FORGET),
        }
        assert not (folder / "before-unlearning.npz").exists()
        assert "unlearning" not in summary
        assert not [r for r in records if r["type"].startswith("query.unlearn")]
        return

    # --- the phase's files
    report = json.loads((folder / "unlearning.json").read_text())
    assert summary["unlearning"]["method"] == method
    assert report["method"] == method and report["round"] == PHASE_ROUND
    assert report["forget-users"] == sorted(FORGET)
    assert report["messages"] > 0 and report["seconds"] > 0
    reference_metrics = {r["round"]: r for r in json.loads((reference_run / "metrics.json").read_text())}
    for key in ("HR@10", "NDCG@10"):
        assert report["before"][key] == pytest.approx(reference_metrics[PHASE_ROUND][key], abs=1e-9)
    assert report["before"]["eval-users"] == 24 - len(FORGET)
    # --- the console says what the phase did, why the solve stopped, and that later metrics are after it
    console = [r.getMessage() for r in caplog.records]
    assert describe_unlearning(report) in console, console
    assert (
        f"HR@10 {report['before']['HR@10']:.4f}" in describe_before(report["before"], PHASE_ROUND)
        and describe_before(report["before"], PHASE_ROUND) in console
    ), console
    assert console.index(describe_before(report["before"], PHASE_ROUND)) < console.index(describe_unlearning(report))
    assert describe_before(report["before"], PHASE_ROUND).startswith("before unlearning: HR@5 ")  # K in order
    assert describe_before(report["before"], PHASE_ROUND).endswith(
        f"; every evaluation from round {PHASE_ROUND} on is of the unlearned model"
    )
    if "cg-termination" in report:
        assert f"stopped on {report['cg-termination']}" in describe_unlearning(report)
    before = _arrays(folder / "before-unlearning.npz")
    reference = _arrays(reference_run / "final_arrays.npz")
    assert set(before) == set(reference) == set(_arrays(folder / "final_arrays.npz"))
    for key in before:
        np.testing.assert_array_equal(before[key], reference[key], err_msg=key)
    assert set(after_phase) == set(before)
    assert any(not np.array_equal(after_phase[k], before[k]) for k in before), "the phase changed nothing"
    assert all(np.isfinite(v).all() for v in after_phase.values())

    queries = [r for r in records if r["type"].startswith("query.unlearn")]
    if method == "continue":
        assert report["continue-rounds"] == 2 and not queries
        assert report["messages"] == len([r for r in train if r["round"] > ROUNDS])
        return
    assert report["messages"] == len(queries)
    assert report["update-norm"] > 0 and report["forget-gradient-norm"] > 0
    assert report["relative-update"] == pytest.approx(
        np.sqrt(sum(np.sum((after_phase[k].astype(np.float64) - before[k]) ** 2) for k in before))
        / np.sqrt(sum(np.sum(before[k].astype(np.float64) ** 2) for k in before)),
        rel=1e-3,
    )
    gradient_queries = [r for r in queries if r["type"] == "query.unlearn_gradient"]
    assert {u for r in gradient_queries for u in r["users"]} == forget
    others = [r for r in queries if r["type"] != "query.unlearn_gradient"]
    assert not any(r["users"] for r in others)  # curvature queries name no user: nodes answer for all their users
    if method == "gradient-ascent":
        assert report["ascent-steps"] == 2
        assert len(gradient_queries) == 2 * len(FORGET)  # one node per forgotten user, once per step
    else:
        assert report["krylov-mode"] == extra["krylov_mode"]
        assert 1 <= report["cg-iterations"] <= report["cg-max-iterations"] == 10
        assert np.isfinite(report["cg-residual"]) and report["cg-residual"] >= 0
        assert 0 < report["affected-users"] <= 24 - len(FORGET) and report["support-rows"] > 0
        # the defaults: the full step (scale 1) of a trust-region solve on the Gauss-Newton matrix, whose norm is
        # at most trust-radius (0.1) times the norm of the parameters the forgotten users' gradient touches
        assert report["scale"] == 1.0
        assert (report["krylov-solver"], report["curvature"]) == ("steihaug", "gauss-newton")
        assert 0 < report["update-norm"] <= report["trust-radius-absolute"] * (1 + 1e-5)
        assert report["relative-update"] <= 0.1
        assert report["bytes-sent"] > 0 and report["bytes-received"] > 0
        hvp_or_cg = "query.unlearn_hvp" if extra["krylov_mode"] == "distributed" else "query.unlearn_local_cg"
        assert any(r["type"] == hvp_or_cg for r in queries)
        if extra["krylov_mode"] == "distributed":
            assert isinstance(report["cg-converged"], bool) and isinstance(report["cg-negative-curvature"], bool)
            assert report["cg-termination"] in ("tolerance", "boundary", "negative-curvature", "iterations")
        else:
            assert report["local-cg-users"] == report["affected-users"]

    # --- privacy: no unlearning reply carries a private key or a user-embedding value
    layout = get_runtime(config).layout
    private_rows = np.unique(
        np.concatenate(
            [np.atleast_2d(a).astype(np.float64) for r in records for rec in r["state"].values() for a in rec.values()]
        ),
        axis=0,
    )
    assert_no_private_value_in_replies(queries, layout, list(private_rows))


def test_server_optimizer_strategy_continues_from_the_unlearned_model(tmp_path):
    """A strategy that keeps its own copy of the parameters (server optimizer) adopts the phase's result: the next
    round steps from the unlearned model, not from the one before the phase."""
    config = _run_config(
        tmp_path,
        strategy="server-optimizer",
        client="fedrecgel",
        unlearning="gradient-ascent",
        unlearn_round=PHASE_ROUND,
        ascent_steps=1,
    )
    seen = {}

    def on_round(view):
        seen[view.server_round] = (
            {k: p.detach().numpy().copy() for k, p in view.strategy.parameters.items()},
            {k: v.numpy().copy() for k, v in view.arrays.items()},
        )

    folder = run_serial(config, on_round=on_round)
    before = _arrays(folder / "before-unlearning.npz")
    parameters, arrays = seen[PHASE_ROUND]
    assert any(not np.array_equal(arrays[k], before[k]) for k in before)
    for key in arrays:
        np.testing.assert_array_equal(parameters[key], arrays[key], err_msg=key)
    assert json.loads((folder / "unlearning.json").read_text())["method"] == "gradient-ascent"


def test_unlearning_replies_never_carry_a_private_value_even_for_one_user(tmp_path):
    """The strongest case for a leak: MF, one forgotten user alone on its node (its gradient is a multiple of its
    embedding on every row), local CG so that every affected user answers alone too."""
    config = _run_config(tmp_path, model="mf", unlearning="hfkcu", krylov_mode="local", num_server_rounds=2)
    config["forget-users"] = str(FORGET[0])
    recorder = MessageRecorder(tmp_path / "messages")
    run_serial(config, client_app=make_client_app(config, mods=[recorder]))
    records = recorder.records()
    queries = [r for r in records if r["type"].startswith("query.unlearn")]
    assert {r["type"] for r in queries} == {
        "query.unlearn_gradient",
        "query.unlearn_affected",
        "query.unlearn_local_cg",
    }
    private_rows = [
        row for r in records for rec in r["state"].values() for a in rec.values() for row in np.atleast_2d(a)
    ]
    assert_no_private_value_in_replies(queries, get_runtime(config).layout, private_rows)
    for record in queries:
        for arrays in record["reply-arrays"].values():
            assert all(k.split("#")[0] in get_runtime(config).layout.shared_shapes for k in arrays)


# ================================================================================================ MF: exact checks
MF_ROUNDS, MF_DAMPING, MF_LOCAL_DAMPING, MF_FORGET, MF_USERS_PER_NODE = 3, 1e-2, 1e-3, (0,), 2


def _mf_terms(p, items, labels, table):
    """One MF user's BCE influence loss over ``items``: value, gradient ``(n, d)`` and per-row Hessian blocks
    ``(n, d, d)`` with respect to the item table (the loss is a mean over the examples)."""
    weight = 1.0 / items.size
    z = table[items] @ p
    s = 1.0 / (1.0 + np.exp(-z))
    grad = np.zeros_like(table)
    hess = np.zeros((*table.shape, table.shape[1]))
    np.add.at(grad, items, weight * (s - labels)[:, None] * p[None, :])
    np.add.at(hess, items, weight * (s * (1 - s))[:, None, None] * np.outer(p, p)[None])
    value = float(weight * np.sum(np.logaddexp(0.0, z) - labels * z))
    return value, grad, hess


@pytest.fixture(scope="module")
def mf_phase(tmp_path_factory):
    """A trained FedMF federation (sparse data: 24 users, ~100 items, two users per node) and, on its last round's
    model, several unlearning variants run through ClientUnlearning on the live grid; plus every user's explicit
    MF gradient and Hessian blocks."""
    folder = tmp_path_factory.mktemp("mf")
    mapping = tiny_run_config(
        folder,
        model="mf",
        num_train_negatives=1,
        num_server_rounds=MF_ROUNDS,
        fraction_train=1.0,
        optimizer="sgd",
        learning_rate=20.0,
        eval_every=MF_ROUNDS,
        users_per_node=MF_USERS_PER_NODE,
    )
    write_tiny_dataset(folder, num_items=300, per_user=6)  # sparse: many users share no row with user 0
    config = RunConfig.from_mapping(mapping).to_dict()
    base = UnlearningSettings(
        method="hfkcu",
        forget=MF_FORGET,
        round=MF_ROUNDS,
        cg_iterations=200,
        cg_tolerance=1e-9,
        damping=MF_DAMPING,
        scale=1.0,
        adaptive_scale=False,
        krylov_solver="cg",
        curvature="hessian",
    )
    variants = {
        "causal": base,
        # MF's Gauss-Newton matrix is its Hessian; a radius no step reaches leaves Steihaug equal to plain CG
        "gauss-newton-steihaug": base.replace(krylov_solver="steihaug", curvature="gauss-newton", trust_radius=1e6),
        "trust-region": base.replace(krylov_solver="steihaug", curvature="gauss-newton", trust_radius=0.01),
        "all-users": base.replace(causal_weighting=False),
        "adaptive": base.replace(adaptive_scale=True, max_step=0.05),
        "local": base.replace(krylov_mode="local", damping=MF_LOCAL_DAMPING, cg_iterations=100),
        "local-trust-region": base.replace(
            krylov_mode="local",
            damping=MF_LOCAL_DAMPING,
            cg_iterations=100,
            krylov_solver="steihaug",
            curvature="gauss-newton",
            trust_radius=0.01,
        ),
        "ascent": base.replace(method="gradient-ascent", ascent_steps=2, ascent_learning_rate=3.0),
    }
    out = {"results": {}}

    def on_round(view):
        if view.server_round != MF_ROUNDS:
            return
        out["theta"] = {k: v.numpy().astype(np.float64) for k, v in view.arrays.items()}
        for name, settings in variants.items():
            new, report = ClientUnlearning(view.strategy, settings).run(view.grid, view.arrays, view.server_round)
            out["results"][name] = ({k: v.numpy().astype(np.float64) for k, v in new.items()}, report)

    _, grid = run_serial(config, on_round=on_round, return_grid=True)
    runtime = get_runtime(config)
    table = out["theta"]["item_embedding.weight"]
    users = []
    for user in range(runtime.split.num_users):
        client = make_client(runtime, user, grid.contexts[1000 + user // MF_USERS_PER_NODE])
        client.load_private()
        p = runtime.model.user_embedding.weight.detach().numpy()[0].astype(np.float64)
        positives, negatives = client.influence_examples()
        items = np.concatenate([positives, negatives])
        labels = np.concatenate([np.ones(positives.size), np.zeros(negatives.size)])
        users.append(
            {
                "p": p,
                "items": items,
                "labels": labels,
                "rows": client.influence_items(),
                "terms": _mf_terms(p, items, labels, table),
            }
        )
    out.update(runtime=runtime, users=users, table=table)
    return out


def _explicit_solve(blocks, rhs, damping):
    x = np.zeros_like(rhs)
    d = rhs.shape[1]
    for row in np.flatnonzero(np.any(rhs != 0, axis=1)):
        x[row] = np.linalg.solve(blocks[row] + damping * np.eye(d), rhs[row])
    return x


def _forget_and_remaining(mf):
    users = mf["users"]
    g_forget = sum(users[u]["terms"][1] for u in MF_FORGET)
    remaining = [u for u in range(len(users)) if u not in MF_FORGET]
    return g_forget, remaining


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_mf_distributed_cg_step_is_the_explicit_damped_newton_step(mf_phase):
    """HF-KCU's step on the live federation equals +(H_R + lambda I)^{-1} g_F computed with explicit MF Hessian
    blocks (sign included), and the curvature matters (it is not just g_F / lambda)."""
    mf = mf_phase
    g_forget, remaining = _forget_and_remaining(mf)
    h_remaining = sum(mf["users"][u]["terms"][2] for u in remaining)
    expected = _explicit_solve(h_remaining, g_forget, MF_DAMPING)
    assert _rel(g_forget / MF_DAMPING, expected) > 0.05  # the system is not dominated by the damping

    new, report = mf["results"]["causal"]
    step = new["item_embedding.weight"] - mf["table"]
    assert report["scale"] == 1.0 and report["cg-converged"] and not report["cg-negative-curvature"]
    assert report["cg-iterations"] < 200 and report["cg-residual"] <= 1e-9
    assert _rel(step, expected) < 1e-5
    assert _rel(-step, expected) > 1.9  # the opposite sign would be far off
    assert report["update-norm"] == pytest.approx(np.linalg.norm(expected), rel=1e-4)
    # to first order the step raises the forgotten users' loss: g_F . x > 0
    assert float(np.sum(g_forget * step)) > 0


def test_mf_gauss_newton_steihaug_equals_the_newton_step_inside_the_radius_and_stops_on_a_small_one(mf_phase):
    """The default solver and curvature on the live federation: with a radius no step reaches, the Steihaug step on
    the Gauss-Newton matrix is the explicit damped Newton step (MF's GGN is its Hessian); with a small radius the step
    ends on the boundary (radius = trust-radius x the norm of the rows the forgotten users' gradient touches) and
    still raises the forgotten users' loss to first order."""
    mf = mf_phase
    g_forget, remaining = _forget_and_remaining(mf)
    expected = _explicit_solve(sum(mf["users"][u]["terms"][2] for u in remaining), g_forget, MF_DAMPING)
    new, report = mf["results"]["gauss-newton-steihaug"]
    assert report["cg-termination"] == "tolerance" and not report["cg-boundary"]
    assert _rel(new["item_embedding.weight"] - mf["table"], expected) < 1e-5

    new, report = mf["results"]["trust-region"]
    step = new["item_embedding.weight"] - mf["table"]
    touched = mf["table"][np.flatnonzero(np.any(g_forget != 0, axis=1))]
    assert report["trust-radius"] == 0.01  # the config key, relative; the norm bound the solve used is absolute
    assert report["trust-radius-absolute"] == pytest.approx(0.01 * np.linalg.norm(touched), rel=1e-6)
    assert report["trust-radius-absolute"] < np.linalg.norm(expected)  # the Newton step would leave the radius
    assert report["cg-boundary"] and report["cg-termination"] == "boundary" and not report["cg-negative-curvature"]
    assert np.linalg.norm(step) == pytest.approx(report["trust-radius-absolute"], rel=1e-4)
    assert float(np.sum(g_forget * step)) > 0


def test_mf_causal_weighting_is_exact_and_queries_only_users_sharing_rows(mf_phase):
    mf = mf_phase
    causal, causal_report = mf["results"]["causal"]
    everyone, everyone_report = mf["results"]["all-users"]
    g_forget, remaining = _forget_and_remaining(mf)
    support = np.flatnonzero(np.any(g_forget != 0, axis=1))
    assert causal_report["support-rows"] == support.size
    sharing = [u for u in remaining if np.isin(mf["users"][u]["rows"], support).any()]
    assert 0 < len(sharing) < len(remaining)  # the sparse data has users that share no row with the forgotten one
    assert causal_report["affected-users"] == everyone_report["affected-users"] == len(sharing)
    assert causal_report["remaining-users"] == len(remaining)
    nodes = {u // MF_USERS_PER_NODE for u in sharing}
    assert causal_report["queried-nodes"] == len(nodes) < 24 // MF_USERS_PER_NODE
    assert everyone_report["queried-nodes"] == everyone_report["nodes"] == 24 // MF_USERS_PER_NODE
    assert causal_report["messages"] < everyone_report["messages"]  # fewer nodes queried
    assert causal_report["cg-iterations"] == everyone_report["cg-iterations"]
    for key in causal:
        np.testing.assert_allclose(causal[key], everyone[key], rtol=1e-6, atol=1e-6 * np.abs(everyone[key]).max())
    # rows outside g_F's support never move
    outside = np.setdiff1d(np.arange(mf["table"].shape[0]), support)
    np.testing.assert_array_equal(causal["item_embedding.weight"][outside], mf["table"][outside])


def test_mf_local_cg_is_the_gradient_norm_weighted_sum_of_per_user_solves(mf_phase):
    """Algorithm 1 (krylov-mode = local): x = sum_u w_u (H_u + lambda I)^{-1} g_F over the users sharing rows with
    g_F, w_u = ||grad L_u|| / sum_v ||grad L_v||."""
    mf = mf_phase
    g_forget, remaining = _forget_and_remaining(mf)
    support = np.flatnonzero(np.any(g_forget != 0, axis=1))
    sharing = [u for u in remaining if np.isin(mf["users"][u]["rows"], support).any()]
    norms = np.array([np.linalg.norm(mf["users"][u]["terms"][1]) for u in sharing])
    weights = norms / norms.sum()
    expected = sum(
        w * _explicit_solve(mf["users"][u]["terms"][2], g_forget, MF_LOCAL_DAMPING) for w, u in zip(weights, sharing)
    )
    new, report = mf["results"]["local"]
    assert report["krylov-mode"] == "local" and report["local-cg-users"] == len(sharing)
    assert report["local-cg-negative-curvature"] == 0
    step = new["item_embedding.weight"] - mf["table"]
    assert _rel(step, expected) < 1e-5
    # the uniform average would be a different step: the weighting is really applied
    uniform = sum(_explicit_solve(mf["users"][u]["terms"][2], g_forget, MF_LOCAL_DAMPING) for u in sharing) / len(
        sharing
    )
    assert _rel(uniform, expected) > 1e-3  # far above the 1e-5 agreement above


def test_mf_local_trust_region_solves_are_kept_and_stay_inside_the_radius(mf_phase):
    """Algorithm 1 with the trust region: every affected user's solve is used (none dropped), the ones whose Newton
    step leaves the radius end on it, and the weighted average stays inside the radius."""
    mf = mf_phase
    new, report = mf["results"]["local-trust-region"]
    _, plain = mf["results"]["local"]
    assert report["local-cg-dropped"] == 0 and report["local-cg-users"] == plain["local-cg-users"] > 0
    assert report["local-cg-boundary"] > 0
    step = new["item_embedding.weight"] - mf["table"]
    assert 0 < np.linalg.norm(step) <= report["trust-radius-absolute"] * (1 + 1e-5)


def test_mf_adaptive_scale_caps_the_relative_change_of_the_rows_it_touches(mf_phase):
    mf = mf_phase
    g_forget, remaining = _forget_and_remaining(mf)
    h_remaining = sum(mf["users"][u]["terms"][2] for u in remaining)
    x = _explicit_solve(h_remaining, g_forget, MF_DAMPING)
    touched = np.any(x != 0, axis=1)
    cap = 0.05 * np.linalg.norm(mf["table"][touched]) / np.linalg.norm(x)
    assert cap < 1.0  # the cap binds
    new, report = mf["results"]["adaptive"]
    assert report["scale"] == pytest.approx(cap, rel=1e-4)
    step = new["item_embedding.weight"] - mf["table"]
    assert _rel(step, cap * x) < 1e-4
    assert np.linalg.norm(step) / np.linalg.norm(mf["table"][touched]) == pytest.approx(0.05, rel=1e-4)


def test_mf_gradient_ascent_climbs_the_forgotten_users_loss(mf_phase):
    mf = mf_phase
    table = mf["table"].copy()
    forget_user = mf["users"][MF_FORGET[0]]
    losses = []
    for _ in range(2):
        value, grad, _ = _mf_terms(forget_user["p"], forget_user["items"], forget_user["labels"], table)
        losses.append(value)
        table = table + 3.0 * grad
    losses.append(_mf_terms(forget_user["p"], forget_user["items"], forget_user["labels"], table)[0])
    new, report = mf["results"]["ascent"]
    np.testing.assert_allclose(new["item_embedding.weight"], table, rtol=1e-5, atol=1e-6)
    assert report["forget-loss"] == pytest.approx(losses[0], rel=1e-5)
    assert losses[0] < losses[1] < losses[2]


# ================================================================================================ Ray simulation
def test_hfkcu_under_ray_matches_the_serial_grid(tmp_path):
    """Flower's Ray simulation runs the phase (custom query messages included) and gives the same model and report
    as the in-process serial grid."""
    from conftest import simulate

    overrides = dict(unlearning="hfkcu", users_per_node=6, num_server_rounds=2)
    ray_folder = simulate(_run_config(tmp_path / "ray", **overrides))
    serial_folder = run_serial(_run_config(tmp_path / "serial", **overrides))
    ray_report = json.loads((ray_folder / "unlearning.json").read_text())
    serial_report = json.loads((serial_folder / "unlearning.json").read_text())
    assert ray_report["method"] == "hfkcu" and ray_report["round"] == 2 and ray_report["messages"] > 0
    drop = lambda report: {k: v for k, v in report.items() if k != "seconds"}  # noqa: E731
    assert drop(ray_report) == drop(serial_report)
    for name in ("final_arrays.npz", "before-unlearning.npz"):
        a, b = _arrays(ray_folder / name), _arrays(serial_folder / name)
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{name} {key}")
