"""HF-KCU's trust-region solve and positive semi-definite curvature: Steihaug-Toint CG on small dense
problems against exact solutions, and the Gauss-Newton product against ``J^T H_loss J v`` built by hand for MF and NCF
with BCE and BPR."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedrec_flwr.models import build_model
from fedrec_flwr.unlearning.krylov import (
    CompositeLoss,
    conjugate_gradient,
    curvature_vector_product,
    gauss_newton_vector_product,
    hessian_vector_product,
    krylov_solve,
    steihaug_cg,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _symmetric(eigenvalues, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(len(eigenvalues), len(eigenvalues))))
    return (q * np.asarray(eigenvalues, dtype=np.float64)) @ q.T


def _model_value(matrix, b, x) -> float:
    return float(-b @ x + 0.5 * x @ matrix @ x)


# ---------------------------------------------------------------------------------------------- Steihaug-Toint CG
@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_steihaug_on_spd_equals_the_exact_solve_inside_the_radius(damping):
    matrix = _symmetric([6.0, 4.0, 3.0, 1.5, 1.0, 0.5, 0.2], seed=1)
    b = np.random.default_rng(2).normal(size=7)
    exact = np.linalg.solve(matrix + damping * np.eye(7), b)
    radius = 2.0 * np.linalg.norm(exact)  # the solution lies strictly inside
    result = steihaug_cg(lambda v: matrix @ v, b, radius=radius, iterations=50, damping=damping, tolerance=1e-12)
    assert result.converged and not result.boundary and not result.negative_curvature
    assert result.termination == "tolerance"
    np.testing.assert_allclose(result.x, exact, rtol=1e-8, atol=1e-10)
    plain = conjugate_gradient(lambda v: matrix @ v, b, iterations=50, damping=damping, tolerance=1e-12)
    np.testing.assert_allclose(result.x, plain.x, rtol=1e-10, atol=1e-12)


def test_steihaug_on_spd_with_a_small_radius_stops_on_the_boundary_and_decreases_the_model():
    matrix = _symmetric([6.0, 4.0, 3.0, 1.5, 1.0, 0.5, 0.2], seed=3)
    b = np.random.default_rng(4).normal(size=7)
    exact = np.linalg.solve(matrix, b)
    radius = 0.3 * np.linalg.norm(exact)
    result = steihaug_cg(lambda v: matrix @ v, b, radius=radius, iterations=50, tolerance=1e-12)
    assert result.boundary and not result.negative_curvature and result.termination == "boundary"
    assert np.linalg.norm(result.x) == pytest.approx(radius, rel=1e-10)
    assert _model_value(matrix, b, result.x) < 0.0  # better than no step
    # the reported residual is the true one of the returned step
    assert result.residual == pytest.approx(np.linalg.norm(b - matrix @ result.x) / np.linalg.norm(b), rel=1e-8)
    # no worse than the Cauchy point (the model's minimiser along b inside the radius): N&W Theorem 7.3 / 4.4
    curvature = b @ matrix @ b
    t = min(b @ b / curvature, radius / np.linalg.norm(b))
    assert _model_value(matrix, b, result.x) <= _model_value(matrix, b, t * b) + 1e-12


def test_steihaug_on_an_indefinite_matrix_follows_negative_curvature_to_the_boundary():
    """The plain CG arm stops (and HF-KCU used to drop the step); the trust-region arm returns a boundary step along
    the direction of negative curvature, with the model value decreasing over the iterations."""
    matrix = _symmetric([5.0, 3.0, 2.0, 1.0, -0.5, -2.0], seed=5)
    b = np.random.default_rng(6).normal(size=6)
    plain = conjugate_gradient(lambda v: matrix @ v, b, iterations=50, tolerance=1e-12)
    assert plain.negative_curvature and plain.termination == "negative-curvature"
    assert plain.iterations >= 2  # so that the model's decrease over iterations is checked
    radius = 2.0 * float(np.linalg.norm(plain.x)) + 1.0  # CG's iterates grow in norm: the radius is not hit first

    values = []
    for k in range(1, 7):
        step = steihaug_cg(lambda v: matrix @ v, b, radius=radius, iterations=k, tolerance=1e-12)
        assert np.linalg.norm(step.x) <= radius * (1 + 1e-10)
        values.append(_model_value(matrix, b, step.x))
        if step.negative_curvature:
            break
    result = steihaug_cg(lambda v: matrix @ v, b, radius=radius, iterations=50, tolerance=1e-12)
    assert result.negative_curvature and result.boundary and result.termination == "negative-curvature"
    assert not result.converged
    assert np.linalg.norm(result.x) == pytest.approx(radius, rel=1e-10)
    assert values[-1] == pytest.approx(_model_value(matrix, b, result.x))
    assert all(later < earlier for earlier, later in zip(values, values[1:])), values  # strictly decreasing
    assert values[0] < 0.0
    # the last direction has negative curvature: the step's component on it lowers the model below any interior
    # CG iterate (the plain arm's truncated point)
    assert values[-1] < _model_value(matrix, b, plain.x)


def test_steihaug_negative_curvature_on_the_first_direction_steps_along_b_to_the_boundary():
    result = steihaug_cg(lambda v: -v, np.array([3.0, 4.0]), radius=2.0, iterations=5)
    assert result.negative_curvature and result.boundary and result.iterations == 1
    np.testing.assert_allclose(result.x, [1.2, 1.6])


def test_steihaug_and_dispatch_refuse_bad_arguments():
    for radius in (0.0, -1.0, float("inf"), float("nan"), None):
        with pytest.raises(ValueError, match="radius"):
            steihaug_cg(lambda v: v, np.ones(3), radius=radius)
    with pytest.raises(ValueError, match="solver"):
        krylov_solve(lambda v: v, np.ones(3), solver="gmres", iterations=3, damping=0.0, tolerance=1e-6)
    with pytest.raises(ValueError, match="NaN"):
        steihaug_cg(lambda v: v * np.nan, np.ones(3), radius=1.0)
    zero = steihaug_cg(lambda v: v, np.zeros(3), radius=1.0)
    assert zero.termination == "zero-rhs" and zero.iterations == 0 and zero.converged


# ---------------------------------------------------------------------------------------------- Gauss-Newton product
def _tiny(name: str, loss: str, seed: int = 0):
    """A float64 model (5 users, 9 items), a batch, and the loss as a CompositeLoss of its logits; also the batch's
    index tensors so the test can build ``J`` and ``H_loss`` by hand."""
    model = build_model(name, 5, 9, embedding_dim=3, mlp_layers=(6, 4), seed=seed).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.8)
    users = torch.tensor([0, 1, 1, 2, 3, 3])
    weights = torch.tensor([0.5, 1.0, 0.25, 2.0, 1.0, 0.75], dtype=torch.float64)
    if loss == "bce":
        items = torch.tensor([0, 1, 2, 3, 4, 1])
        labels = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)

        def outputs(params):
            return torch.func.functional_call(model, params, (users, items))

        def output_loss(z):
            return (weights * F.binary_cross_entropy_with_logits(z, labels, reduction="none")).sum()
    else:
        positives, negatives = torch.tensor([0, 1, 2, 3, 4, 1]), torch.tensor([5, 6, 7, 8, 0, 2])
        n = users.numel()

        def outputs(params):
            return torch.func.functional_call(
                model, params, (torch.cat([users, users]), torch.cat([positives, negatives]))
            )

        def output_loss(z):
            return -(weights * F.logsigmoid(z[:n] - z[n:])).sum()

    params = {k: p.detach().clone() for k, p in model.named_parameters() if not k.startswith("user_embedding")}
    return CompositeLoss(outputs, output_loss, lambda p: 0.05 * sum(v.pow(2).sum() for v in p.values())), params


def _flat(params):
    return torch.cat([v.reshape(-1) for v in params.values()])


def _unflat(flat, params):
    out, start = {}, 0
    for k, v in params.items():
        out[k] = flat[start : start + v.numel()].reshape(v.shape)
        start += v.numel()
    return out


@pytest.mark.parametrize("loss", ["bce", "bpr"])
@pytest.mark.parametrize("name", ["mf", "ncf"])
def test_gauss_newton_product_equals_j_transpose_h_loss_j_built_by_hand(name, loss):
    composite, params = _tiny(name, loss)
    flat = _flat(params)
    # J: the Jacobian of the outputs w.r.t. the flat shared parameters, (outputs, P), by autograd
    jacobian = torch.autograd.functional.jacobian(lambda f: composite.outputs(_unflat(f, params)), flat)
    z = composite.outputs(params).detach()
    w = torch.tensor([0.5, 1.0, 0.25, 2.0, 1.0, 0.75], dtype=torch.float64)
    if loss == "bce":  # diagonal: w_j sigma(z_j)(1 - sigma(z_j))
        h_loss = torch.diag(w * torch.sigmoid(z) * torch.sigmoid(-z))
    else:  # per pair d = z+ - z-: w sigma(d) sigma(-d) [[1, -1], [-1, 1]]
        n = w.numel()
        d = z[:n] - z[n:]
        c = w * torch.sigmoid(d) * torch.sigmoid(-d)
        h_loss = torch.cat(
            [torch.cat([torch.diag(c), -torch.diag(c)], 1), torch.cat([-torch.diag(c), torch.diag(c)], 1)]
        )
    regulariser = 0.1 * torch.eye(flat.numel(), dtype=torch.float64)  # Hessian of 0.05 ||theta||^2
    ggn = jacobian.T @ h_loss @ jacobian + regulariser
    assert torch.linalg.eigvalsh(ggn).min() >= -1e-10  # PSD by construction
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        v = torch.randn(flat.numel(), generator=gen, dtype=torch.float64)
        product = gauss_newton_vector_product(composite, params, _unflat(v, params))
        torch.testing.assert_close(_flat(product), ggn @ v, rtol=1e-9, atol=1e-11)
        dispatched = curvature_vector_product(composite, params, _unflat(v, params), "gauss-newton")
        torch.testing.assert_close(_flat(dispatched), ggn @ v, rtol=1e-12, atol=1e-14)
    hessian = torch.autograd.functional.hessian(lambda f: composite(_unflat(f, params)), flat)
    if name == "mf":  # MF's scores are bilinear, linear in the item rows: GGN = Hessian there
        torch.testing.assert_close(ggn, hessian, rtol=1e-9, atol=1e-11)
    else:  # NCF: the dropped term sum_j dl/dz_j d2 z_j makes them differ; the Hessian may be indefinite
        assert not torch.allclose(ggn, hessian, atol=1e-6)
        exact = hessian_vector_product(composite, params, _unflat(v, params))
        torch.testing.assert_close(_flat(exact), hessian @ v, rtol=1e-8, atol=1e-10)


def test_curvature_product_refuses_an_unknown_curvature_and_a_plain_loss_for_gauss_newton():
    composite, params = _tiny("mf", "bce")
    v = {k: torch.ones_like(p) for k, p in params.items()}
    with pytest.raises(ValueError, match="curvature"):
        curvature_vector_product(composite, params, v, "fisher")
    with pytest.raises(ValueError, match="CompositeLoss"):
        curvature_vector_product(lambda p: composite(p), params, v, "gauss-newton")
    with pytest.raises(ValueError, match="differ"):
        gauss_newton_vector_product(composite, params, {**v, "extra": torch.zeros(1)})
