"""MF / NCF: private-shared split by module, shapes, deterministic init, strict state loading."""

import numpy as np
import pytest
import torch

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.models import MF, MODELS, NCF, build_model

USERS, ITEMS = 6, 11

EXPECTED_PRIVATE = {"mf": {"user_embedding.weight"}, "ncf": {"user_embedding_gmf.weight", "user_embedding_mlp.weight"}}


@pytest.mark.parametrize("name", ["mf", "ncf"])
def test_private_state_is_exactly_user_embeddings(name):
    model = build_model(name, USERS, ITEMS, embedding_dim=8)
    private = model.private_state()
    assert set(private) == EXPECTED_PRIVATE[name]
    assert all(v.shape == (USERS, 8) for v in private.values())
    shared = model.shared_state()
    assert not set(shared) & set(private)
    # Every parameter is in exactly one of the two states, and no shared tensor has a user dimension.
    all_params = {n for n, _ in model.named_parameters()}
    assert set(shared) | set(private) == all_params
    assert all(not k.startswith("user") for k in shared)
    user_ids = {id(p) for p in model.private_parameters()}
    assert not user_ids & {id(p) for p in model.shared_parameters()}


def test_pfedrec_private_state_is_the_score_function_and_resets_to_its_initial_value():
    model = build_model("pfedrec", USERS, ITEMS, embedding_dim=8, seed=5)
    assert set(model.private_state()) == {"score.weight", "score.bias"}
    assert set(model.shared_state()) == {"item_embedding.weight"}
    initial = model.private_state()
    with torch.no_grad():
        model.score.weight.add_(1.0)
    model.reset_private(torch.Generator().manual_seed(0))
    for key, value in model.private_state().items():
        assert torch.equal(value, initial[key])
    # scores ignore the user index: the client's own score function is the personalisation
    items = torch.arange(5)
    assert torch.equal(model(torch.zeros(5, dtype=torch.long), items), model(torch.full((5,), 3), items))


def test_ncf_shared_keys_and_item_tables():
    model = build_model("ncf", USERS, ITEMS)
    assert list(model.shared_state()) == [
        "item_embedding_gmf.weight",
        "item_embedding_mlp.weight",
        "mlp.0.weight",
        "mlp.0.bias",
        "mlp.2.weight",
        "mlp.2.bias",
        "mlp.4.weight",
        "mlp.4.bias",
        "output.weight",
        "output.bias",
    ]
    assert set(model.item_embedding_modules()) == {"item_embedding_gmf", "item_embedding_mlp"}
    assert model.shared_state()["mlp.0.weight"].shape == (64, 64)
    assert model.shared_state()["output.weight"].shape == (1, 32 + 16)
    mf = build_model("mf", USERS, ITEMS)
    assert isinstance(mf, MF) and isinstance(model, NCF)
    assert list(mf.shared_state()) == ["item_embedding.weight"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_output_shape_and_dtype(name):
    model = build_model(name, USERS, ITEMS)
    out = model(torch.tensor([0, 1, 5, 5]), torch.tensor([0, 10, 3, 3]))
    assert out.shape == (4,) and out.dtype == torch.float32
    assert out[2] == out[3]


def test_mf_is_dot_product():
    model = build_model("mf", USERS, ITEMS, embedding_dim=4)
    u, i = torch.tensor([2]), torch.tensor([7])
    expected = model.user_embedding.weight[2] @ model.item_embedding.weight[7]
    assert model(u, i).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_deterministic_init_by_seed_without_global_rng(name):
    before = torch.random.get_rng_state()
    a = build_model(name, USERS, ITEMS, seed=3).state_dict()
    b = build_model(name, USERS, ITEMS, seed=3).state_dict()
    c = build_model(name, USERS, ITEMS, seed=4).state_dict()
    assert torch.equal(before, torch.random.get_rng_state())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shared_init_does_not_depend_on_num_users(name):
    server = build_model(name, 50, ITEMS, seed=1)
    client = build_model(name, 1, ITEMS, seed=1)
    for key, value in server.shared_state().items():
        assert torch.equal(value, client.shared_state()[key]), key


def test_embedding_init_scale():
    model = build_model("ncf", 200, 300, embedding_dim=32)
    std = model.item_embedding_gmf.weight.std().item()
    assert 0.008 < std < 0.012


def test_reset_private_uses_generator():
    model = build_model("ncf", 3, ITEMS)
    shared = model.shared_state()
    model.reset_private(torch.Generator().manual_seed(5))
    first = model.private_state()
    model.reset_private(torch.Generator().manual_seed(5))
    second = model.private_state()
    assert all(torch.equal(first[k], second[k]) for k in first)
    model.reset_private(torch.Generator().manual_seed(6))
    assert not torch.equal(first["user_embedding_gmf.weight"], model.private_state()["user_embedding_gmf.weight"])
    assert all(torch.equal(shared[k], v) for k, v in model.shared_state().items())


def test_state_round_trip_and_numpy_input():
    src = build_model("ncf", USERS, ITEMS, seed=1)
    dst = build_model("ncf", USERS, ITEMS, seed=2)
    dst.load_shared_state({k: v.numpy() for k, v in src.shared_state().items()})
    dst.load_private_state(src.private_state())
    users, items = torch.arange(USERS), torch.arange(USERS)
    assert torch.equal(src(users, items), dst(users, items))


def test_state_is_a_copy():
    model = build_model("mf", USERS, ITEMS)
    state = model.shared_state()
    state["item_embedding.weight"].zero_()
    assert model.item_embedding.weight.abs().sum() > 0


def test_strict_load_errors_name_the_key():
    model = build_model("ncf", USERS, ITEMS)
    shared = model.shared_state()
    missing = {k: v for k, v in shared.items() if k != "mlp.2.bias"}
    with pytest.raises(ValueError, match="mlp.2.bias"):
        model.load_shared_state(missing)
    with pytest.raises(ValueError, match="user_embedding_gmf.weight"):
        model.load_shared_state({**shared, "user_embedding_gmf.weight": torch.zeros(USERS, 32)})
    with pytest.raises(ValueError, match="output.weight.*shape"):
        model.load_shared_state({**shared, "output.weight": torch.zeros(1, 5)})
    bad = {k: v.clone() for k, v in shared.items()}
    bad["mlp.0.bias"][0] = float("nan")
    before = model.shared_state()
    with pytest.raises(ValueError, match="NaN"):
        model.load_shared_state(bad)
    assert all(torch.equal(before[k], v) for k, v in model.shared_state().items())  # nothing half-loaded
    with pytest.raises(ValueError, match="item_embedding_gmf"):
        model.load_private_state({**model.private_state(), "item_embedding_gmf.weight": np.zeros((ITEMS, 32))})


def test_build_model_errors():
    with pytest.raises(ConfigError, match="mf.*ncf"):
        build_model("lightgcn", USERS, ITEMS)
    with pytest.raises(ConfigError, match="num_items"):
        build_model("mf", USERS, 0)
    with pytest.raises(ConfigError, match="mlp_layers"):
        build_model("ncf", USERS, ITEMS, mlp_layers=())


def test_custom_mlp_layers():
    model = build_model("ncf", USERS, ITEMS, embedding_dim=8, mlp_layers=(16, 4))
    assert [k for k in model.shared_state() if k.startswith("mlp")] == [
        "mlp.0.weight",
        "mlp.0.bias",
        "mlp.2.weight",
        "mlp.2.bias",
    ]
    assert model.output.in_features == 8 + 4
