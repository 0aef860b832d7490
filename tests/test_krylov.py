"""Hessian-free Krylov tools (fedrec_flwr.unlearning.krylov): conjugate gradient against explicit matrices, Hessian-vector
products against finite differences of the gradient (through the embedding lookups of MF and NCF), flat memory over
many products, and the flatten / unflatten helpers."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedrec_flwr.models import build_model
from fedrec_flwr.unlearning.krylov import (
    CGResult,
    conjugate_gradient,
    flatten,
    gradient,
    hessian_vector_product,
    unflatten,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _explicit(matrix: np.ndarray):
    """A matvec over an explicit matrix that counts its calls."""
    calls = []

    def matvec(v):
        calls.append(1)
        return matrix @ v

    return matvec, calls


def _spd_with_spectrum(eigenvalues, seed: int = 0) -> np.ndarray:
    """``Q diag(eigenvalues) Q^T`` with a random orthogonal ``Q``: a dense symmetric matrix with a known spectrum."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(len(eigenvalues), len(eigenvalues))))
    return (q * np.asarray(eigenvalues, dtype=np.float64)) @ q.T


def _true_residual(matrix, damping, x, b) -> float:
    return float(np.linalg.norm(b - (matrix + damping * np.eye(len(b))) @ x) / np.linalg.norm(b))


# ---------------------------------------------------------------------------------------------- conjugate gradient
def test_cg_solves_a_diagonal_spd_system_in_at_most_n_iterations():
    n = 12
    diagonal = np.linspace(0.5, 7.0, n)  # n distinct eigenvalues: exact arithmetic needs exactly n iterations
    b = np.random.default_rng(1).normal(size=n)
    matvec, calls = _explicit(np.diag(diagonal))
    result = conjugate_gradient(matvec, b, iterations=50, tolerance=1e-10)
    assert isinstance(result, CGResult)
    assert result.converged and not result.negative_curvature
    assert 1 <= result.iterations <= n
    assert result.iterations == len(calls)
    assert result.residual <= 1e-10
    np.testing.assert_allclose(result.x, b / diagonal, rtol=1e-9, atol=0)
    assert _true_residual(np.diag(diagonal), 0.0, result.x, b) <= 1e-9
    assert result.summary() == {
        "cg-iterations": result.iterations,
        "cg-residual": result.residual,
        "cg-converged": True,
        "cg-negative-curvature": False,
        "cg-boundary": False,
        "cg-termination": "tolerance",
    }


def test_cg_takes_as_many_iterations_as_distinct_eigenvalues():
    diagonal = np.array([1.0, 1.0, 1.0, 4.0, 4.0, 9.0])  # 3 distinct eigenvalues
    b = np.random.default_rng(2).normal(size=6)
    result = conjugate_gradient(_explicit(np.diag(diagonal))[0], b, iterations=6, tolerance=1e-10)
    assert result.converged and result.iterations == 3
    np.testing.assert_allclose(result.x, b / diagonal, rtol=1e-9)


def test_cg_keeps_the_shape_of_b_and_applies_damping():
    diagonal = np.arange(1.0, 13.0).reshape(3, 4)
    b = np.ones((3, 4))
    result = conjugate_gradient(lambda v: diagonal * v, b, iterations=20, damping=0.5, tolerance=1e-12)
    assert result.x.shape == (3, 4) and result.converged
    np.testing.assert_allclose(result.x, b / (diagonal + 0.5), rtol=1e-10)


def test_cg_stops_on_negative_curvature_without_damping_and_converges_with_enough():
    eigenvalues = [5.0, 4.0, 3.0, 2.0, 1.0, -0.5]
    matrix = _spd_with_spectrum(eigenvalues, seed=3)
    b = np.random.default_rng(4).normal(size=6)
    matvec, _ = _explicit(matrix)
    result = conjugate_gradient(matvec, b, iterations=50, damping=0.0, tolerance=1e-10)
    assert result.negative_curvature and not result.converged
    assert 1 <= result.iterations <= 6  # the indefinite direction is met within the n-dimensional Krylov space
    # x is the iterate before the bad direction and its residual is reported honestly
    assert result.residual == pytest.approx(_true_residual(matrix, 0.0, result.x, b), rel=1e-8, abs=1e-12)
    assert result.residual > 1e-10

    damped = conjugate_gradient(matvec, b, iterations=50, damping=0.6, tolerance=1e-10)  # 0.6 > |-0.5|
    assert damped.converged and not damped.negative_curvature
    np.testing.assert_allclose(damped.x, np.linalg.solve(matrix + 0.6 * np.eye(6), b), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("iterations", [6, 50])
def test_cg_on_a_singular_semidefinite_operator_returns_a_bounded_iterate(iterations):
    """``A`` positive semi-definite with a null direction that ``b`` has a component on (HF-KCU with damping 0: an MF
    item row that only forgotten users touch, so ``H_R`` is exactly 0 there). CG cannot solve it; once the range is
    resolved the curvature ``p^T A p`` is 0 up to rounding. It must say so (not converged, non-positive curvature)
    and return a finite iterate of the size of the range solution, not divide by a rounding-level curvature."""
    diagonal = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    b = np.random.default_rng(4).normal(size=6)
    range_solution = np.where(diagonal > 0, b / np.where(diagonal > 0, diagonal, 1.0), 0.0)
    result = conjugate_gradient(lambda v: diagonal * v, b, iterations=iterations, tolerance=1e-10)
    assert not result.converged
    assert np.isfinite(result.x).all()
    assert np.linalg.norm(result.x) <= 10 * np.linalg.norm(range_solution), np.linalg.norm(result.x)
    assert result.residual == pytest.approx(
        float(np.linalg.norm(b - diagonal * result.x) / np.linalg.norm(b)), rel=1e-6
    )


def test_cg_negative_curvature_on_the_first_direction_returns_zero():
    result = conjugate_gradient(lambda v: -v, np.ones(4), iterations=10)
    assert result.negative_curvature and not result.converged
    assert result.iterations == 1
    np.testing.assert_array_equal(result.x, np.zeros(4))
    assert result.residual == pytest.approx(1.0)


def test_cg_reports_a_non_converged_solve_and_its_true_residual():
    matrix = _spd_with_spectrum(np.geomspace(1e-2, 1e2, 30), seed=5)
    b = np.random.default_rng(6).normal(size=30)
    result = conjugate_gradient(_explicit(matrix)[0], b, iterations=3, damping=0.1, tolerance=1e-8)
    assert result.iterations == 3
    assert not result.converged and not result.negative_curvature
    true = _true_residual(matrix, 0.1, result.x, b)
    assert true > 1e-8
    assert result.residual == pytest.approx(true, rel=1e-6)
    # the residual need not fall monotonically, but CG's error in the operator's norm does (below x0 = 0's)
    damped = matrix + 0.1 * np.eye(30)
    exact = np.linalg.solve(damped, b)
    a_norm = lambda e: float(np.sqrt(e @ damped @ e))  # noqa: E731
    assert a_norm(result.x - exact) < a_norm(exact)


def test_cg_with_zero_right_hand_side_returns_zeros_without_products():
    matvec, calls = _explicit(np.eye(5))
    result = conjugate_gradient(matvec, np.zeros(5), iterations=10)
    np.testing.assert_array_equal(result.x, np.zeros(5))
    assert result.iterations == 0 and result.residual == 0.0 and result.converged and not result.negative_curvature
    assert not calls


@pytest.mark.parametrize(
    "kwargs",
    [
        {"iterations": 0},
        {"iterations": -2},
        {"iterations": 1.5},
        {"iterations": True},
        {"damping": -1e-3},
        {"damping": math.nan},
        {"damping": math.inf},
        {"tolerance": -1.0},
        {"tolerance": math.nan},
    ],
)
def test_cg_refuses_bad_settings(kwargs):
    matvec, calls = _explicit(np.eye(3))
    with pytest.raises(ValueError):
        conjugate_gradient(matvec, np.ones(3), **kwargs)
    assert not calls


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_cg_refuses_a_non_finite_right_hand_side(bad):
    b = np.ones(3)
    b[1] = bad
    with pytest.raises(ValueError, match="right-hand side"):
        conjugate_gradient(lambda v: v, b)


@pytest.mark.parametrize(
    ("matvec", "message"),
    [
        (lambda v: np.ones(len(v) + 1), "shape"),
        (lambda v: v.reshape(1, -1), "shape"),
        (lambda v: np.full_like(v, np.nan), "NaN"),
        (lambda v: np.full_like(v, np.inf), "NaN or Inf"),
    ],
)
def test_cg_refuses_a_bad_operator(matvec, message):
    with pytest.raises(ValueError, match=message):
        conjugate_gradient(matvec, np.ones(4), iterations=3)


# ---------------------------------------------------------------------------------------------- Hessian-vector products
def _model_loss(name: str, seed: int = 0):
    """A float64 model with 5 users / 12 items, a BCE loss over a batch that never looks up user 4 nor items 9..11,
    and ``(loss_fn, params)`` over every parameter (private and shared)."""
    model = build_model(name, 5, 12, embedding_dim=4, mlp_layers=(8, 4), seed=seed).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # larger than the N(0, 0.01^2) initialisation, so that curvature is not negligible
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.7)
    users = torch.tensor([0, 0, 1, 2, 3, 3, 1, 2])
    items = torch.tensor([0, 1, 2, 3, 4, 5, 8, 0])
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)

    def loss_fn(params):
        logits = torch.func.functional_call(model, params, (users, items))
        return F.binary_cross_entropy_with_logits(logits, labels) + 0.1 * logits.pow(2).mean()

    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return loss_fn, params


def _random_like(params, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}


@pytest.mark.parametrize("name", ["mf", "ncf"])
def test_hvp_matches_central_finite_differences_of_the_gradient(name):
    loss_fn, params = _model_loss(name)
    vector = _random_like(params, 7)
    product = hessian_vector_product(loss_fn, params, vector)
    assert set(product) == set(params)
    eps = 1e-5
    plus = gradient(loss_fn, {k: params[k] + eps * vector[k] for k in params})
    minus = gradient(loss_fn, {k: params[k] - eps * vector[k] for k in params})
    scale = max(float(v.abs().max()) for v in product.values())
    assert scale > 1e-2  # a real second-order effect
    for key in params:
        assert product[key].shape == params[key].shape and product[key].dtype == torch.float64
        assert product[key].grad_fn is None and not product[key].requires_grad, key
        fd = (plus[key] - minus[key]) / (2 * eps)
        torch.testing.assert_close(product[key], fd, rtol=1e-6, atol=1e-7 * scale, msg=key)
    # rows never looked up get exactly 0 (no spurious coupling through the tables)
    for key, value in product.items():
        if key.startswith("item_embedding"):
            assert torch.count_nonzero(value[9:]) == 0, key
            assert torch.count_nonzero(value[:6]) > 0, key
        if key.startswith("user_embedding"):
            assert torch.count_nonzero(value[4]) == 0, key
            assert torch.count_nonzero(value[:4]) > 0, key


@pytest.mark.parametrize("name", ["mf", "ncf"])
def test_hvp_is_symmetric_and_linear(name):
    loss_fn, params = _model_loss(name, seed=3)
    u, v = _random_like(params, 11), _random_like(params, 12)
    hu, hv = hessian_vector_product(loss_fn, params, u), hessian_vector_product(loss_fn, params, v)
    dot = lambda a, b: sum(float((a[k] * b[k]).sum()) for k in params)  # noqa: E731
    assert dot(u, hv) == pytest.approx(dot(v, hu), rel=1e-10)
    combo = hessian_vector_product(loss_fn, params, {k: 2 * u[k] - 3 * v[k] for k in params})
    for key in params:
        torch.testing.assert_close(combo[key], 2 * hu[key] - 3 * hv[key], rtol=1e-10, atol=1e-12)


def test_hvp_of_a_quadratic_is_the_matrix_product():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 6))
    matrix = torch.as_tensor(a @ a.T + np.eye(6))
    loss_fn = lambda p: 0.5 * p["w"] @ matrix @ p["w"] + p["w"].sum()  # noqa: E731
    params = {"w": torch.as_tensor(rng.normal(size=6))}
    v = torch.as_tensor(rng.normal(size=6))
    torch.testing.assert_close(hessian_vector_product(loss_fn, params, {"w": v})["w"], matrix @ v)
    torch.testing.assert_close(gradient(loss_fn, params)["w"], matrix @ params["w"] + 1)


def test_hvp_refuses_mismatched_vectors():
    loss_fn, params = _model_loss("mf")
    vector = _random_like(params, 1)
    with pytest.raises(ValueError, match="keys"):
        hessian_vector_product(loss_fn, params, {k: v for k, v in vector.items() if k != "item_embedding.weight"})
    with pytest.raises(ValueError, match="keys"):
        hessian_vector_product(loss_fn, params, {**vector, "extra": torch.zeros(1)})
    vector["item_embedding.weight"] = torch.zeros(11, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="shape"):
        hessian_vector_product(loss_fn, params, vector)


def test_hvp_casts_the_vector_to_the_parameters_dtype():
    loss_fn, params = _model_loss("mf")
    vector = _random_like(params, 2)
    single = {k: v.float() for k, v in vector.items()}
    a = hessian_vector_product(loss_fn, params, vector)
    b = hessian_vector_product(loss_fn, params, single)
    for key in params:
        assert b[key].dtype == torch.float64
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


def _live_tensors() -> int:
    gc.collect()
    count = 0
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj):
                count += 1
        except Exception:  # noqa: BLE001 - some objects refuse isinstance checks
            pass
    return count


def test_hvp_memory_stays_flat_over_many_products():
    """No autograd graph, cache or tensor survives a product: after a warm-up, 300 more products leave the number
    of live tensors unchanged and the parameters without ``.grad``."""
    loss_fn, params = _model_loss("ncf")
    vector = _random_like(params, 5)
    for _ in range(5):
        hessian_vector_product(loss_fn, params, vector)
    before = _live_tensors()
    total = None
    for _ in range(300):
        product = hessian_vector_product(loss_fn, params, vector)
        total = product if total is None else {k: total[k] + product[k] for k in total}
        del product
    after = _live_tensors()
    assert after <= before + len(total), (before, after)  # only `total` itself is new
    del total
    assert _live_tensors() <= before
    assert all(p.grad is None and p.grad_fn is None for p in params.values())


# ---------------------------------------------------------------------------------------------- flatten / unflatten
def test_flatten_unflatten_round_trip_in_the_shapes_order():
    shapes = {"b": (2, 3), "a": (4,), "c": (1, 1, 2)}
    rng = np.random.default_rng(0)
    vector = {k: rng.normal(size=s).astype(np.float32) for k, s in reversed(list(shapes.items()))}
    flat = flatten(vector, shapes)
    assert flat.dtype == np.float64 and flat.shape == (12,)
    np.testing.assert_array_equal(flat[:6], vector["b"].reshape(-1).astype(np.float64))  # shapes' order, not vector's
    back = unflatten(flat, shapes)
    assert list(back) == list(shapes)
    for key, shape in shapes.items():
        assert back[key].shape == shape
        np.testing.assert_array_equal(back[key], vector[key].astype(np.float64))
    np.testing.assert_array_equal(flatten(back, shapes), flat)
    assert flatten({}, {}).shape == (0,)
    assert unflatten(np.zeros(0), {}) == {}


@pytest.mark.parametrize("size", [11, 13, 0])
def test_unflatten_refuses_the_wrong_length(size):
    with pytest.raises(ValueError, match="12"):
        unflatten(np.zeros(size), {"b": (2, 3), "a": (4,), "c": (1, 1, 2)})
