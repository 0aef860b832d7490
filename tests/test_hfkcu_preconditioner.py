"""HF-KCU's preconditioned trust-region solve (``krylov-preconditioner``): Steihaug CG with a diagonal
preconditioner on small dense problems (``M = I`` is the Euclidean solve; inside the radius it is the exact solve; on
the boundary the ``M``-norm is the radius), the Gauss-Newton diagonal against ``diag(J^T H_loss J)`` built by hand,
and in a phase every node's ``unlearn_diagonal`` reply is one sum over its users."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from test_hfkcu_curvature_sample import recorded_phase  # the recorded tiny phase (shared with that test)
from test_hfkcu_trust_region import _model_value, _symmetric  # the small dense problems

from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.clients.fedrec import FedRecClient
from fedrec_flwr.config import RunConfig, default_mapping
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.models import build_model
from fedrec_flwr.unlearning.influence import influence_gn_diagonal
from fedrec_flwr.unlearning.krylov import CompositeLoss, gauss_newton_diagonal, krylov_solve, steihaug_cg

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---------------------------------------------------------------------------------------------- preconditioned Steihaug
@pytest.mark.parametrize(
    "eigenvalues, radius",
    [
        ([6.0, 4.0, 3.0, 1.5, 1.0, 0.5, 0.2], 0.4),  # SPD, boundary
        ([6.0, 4.0, 3.0, 1.5, 1.0, 0.5, 0.2], 50.0),  # SPD, inside
        ([5.0, 3.0, 2.0, 1.0, -0.5, -2.0, 0.7], 3.0),
    ],
)  # indefinite
def test_identity_preconditioner_gives_the_euclidean_solve(eigenvalues, radius):
    matrix = _symmetric(eigenvalues, seed=1)
    b = np.random.default_rng(2).normal(size=7)
    plain = steihaug_cg(lambda v: matrix @ v, b, radius=radius, iterations=30, damping=0.1, tolerance=1e-12)
    ones = steihaug_cg(
        lambda v: matrix @ v, b, radius=radius, iterations=30, damping=0.1, tolerance=1e-12, preconditioner=np.ones(7)
    )
    assert (ones.termination, ones.iterations, ones.boundary) == (plain.termination, plain.iterations, plain.boundary)
    np.testing.assert_allclose(ones.x, plain.x, rtol=1e-12, atol=1e-14)
    assert ones.residual == pytest.approx(plain.residual, rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_preconditioned_steihaug_on_spd_equals_the_exact_solve_inside_the_radius(damping):
    matrix = _symmetric([60.0, 4.0, 3.0, 1.5, 1.0, 0.5, 0.02], seed=3)
    b = np.random.default_rng(4).normal(size=7)
    m = np.array([50.0, 0.1, 3.0, 1.0, 7.0, 0.5, 2.0])
    exact = np.linalg.solve(matrix + damping * np.eye(7), b)
    radius = 2.0 * np.sqrt(exact @ (m * exact))  # the solution lies strictly inside the M-norm ball
    result = steihaug_cg(
        lambda v: matrix @ v, b, radius=radius, iterations=50, damping=damping, tolerance=1e-12, preconditioner=m
    )
    assert result.converged and not result.boundary and result.termination == "tolerance"
    np.testing.assert_allclose(result.x, exact, rtol=1e-8, atol=1e-10)
    dispatched = krylov_solve(
        lambda v: matrix @ v,
        b,
        solver="steihaug",
        iterations=50,
        damping=damping,
        tolerance=1e-12,
        radius=radius,
        preconditioner=m,
    )
    np.testing.assert_allclose(dispatched.x, result.x, rtol=0, atol=0)


def test_diagonal_preconditioner_solves_a_diagonal_system_in_one_product():
    """``M = A`` (a diagonal ``A``): ``M^{-1} A = I``, so the first preconditioned step is the solution."""
    a = np.array([100.0, 1.0, 0.01, 5.0])
    b = np.array([1.0, -2.0, 0.5, 3.0])
    result = steihaug_cg(lambda v: a * v, b, radius=1e6, iterations=10, tolerance=1e-10, preconditioner=a)
    assert result.iterations == 1 and result.converged
    np.testing.assert_allclose(result.x, b / a, rtol=1e-12)


def test_on_the_boundary_the_m_norm_is_the_radius_and_the_model_decreases():
    matrix = _symmetric([6.0, 4.0, 3.0, 1.5, 1.0, 0.5, 0.2], seed=5)
    b = np.random.default_rng(6).normal(size=7)
    m = np.array([10.0, 0.1, 1.0, 1.0, 4.0, 0.3, 2.0])
    radius = 0.05
    result = steihaug_cg(lambda v: matrix @ v, b, radius=radius, iterations=50, tolerance=1e-12, preconditioner=m)
    assert result.boundary and result.termination == "boundary"
    assert np.sqrt(result.x @ (m * result.x)) == pytest.approx(radius, rel=1e-10)
    assert _model_value(matrix, b, result.x) < 0.0
    assert result.residual == pytest.approx(np.linalg.norm(b - matrix @ result.x) / np.linalg.norm(b), rel=1e-8)
    # the first step goes along M^{-1} b: a small M entry gets a long reach
    first = steihaug_cg(lambda v: matrix @ v, b, radius=1e-6, iterations=50, preconditioner=m)
    direction = b / m
    np.testing.assert_allclose(first.x / np.linalg.norm(first.x), direction / np.linalg.norm(direction), rtol=1e-8)


def test_indefinite_preconditioned_solve_ends_on_the_m_norm_boundary_with_lower_model_value():
    matrix = _symmetric([5.0, 3.0, 2.0, 1.0, -0.5, -2.0], seed=7)
    b = np.random.default_rng(8).normal(size=6)
    m = np.array([2.0, 0.5, 1.0, 3.0, 0.2, 1.0])
    result = steihaug_cg(lambda v: matrix @ v, b, radius=4.0, iterations=50, tolerance=1e-12, preconditioner=m)
    assert result.boundary
    assert np.sqrt(result.x @ (m * result.x)) == pytest.approx(4.0, rel=1e-10)
    assert _model_value(matrix, b, result.x) < 0.0


@pytest.mark.parametrize(
    "bad",
    [np.ones(3), np.array([1.0, 0.0, 1.0, 1.0]), np.array([1.0, np.nan, 1.0, 1.0]), np.array([1.0, -1.0, 1.0, 1.0])],
)
def test_a_bad_preconditioner_is_refused(bad):
    with pytest.raises(ValueError, match="preconditioner"):
        steihaug_cg(lambda v: v, np.ones(4), radius=1.0, preconditioner=bad)
    with pytest.raises(ValueError, match="preconditioner"):
        krylov_solve(
            lambda v: v, np.ones(4), solver="cg", iterations=3, damping=0.0, tolerance=1e-6, preconditioner=np.ones(4)
        )


# ---------------------------------------------------------------------------------------------- Gauss-Newton diagonal
def _tiny_rows(name: str, loss: str):
    """A float64 model (4 users, 9 items), an item-row-separable CompositeLoss (as fedrec_flwr.unlearning.influence builds it)
    and the hand-built ``diag(J^T H_loss J + 0.1 I)``."""
    model = build_model(name, 4, 9, embedding_dim=3, mlp_layers=(6, 4), seed=0).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.8)
    w = torch.tensor([0.5, 1.0, 0.25, 2.0, 1.0, 0.75], dtype=torch.float64)
    base_users = torch.tensor([0, 1, 1, 2, 3, 3])
    if loss == "bce":
        users, items = base_users, torch.tensor([0, 1, 2, 3, 1, 1])
        labels = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)

        def output_loss(z):
            return (w * torch.nn.functional.binary_cross_entropy_with_logits(z, labels, reduction="none")).sum()

        def output_curvature(z):
            return w * torch.sigmoid(z) * torch.sigmoid(-z)
    else:
        n = base_users.numel()
        users = torch.cat([base_users, base_users])
        items = torch.cat([torch.tensor([0, 1, 2, 3, 4, 1]), torch.tensor([5, 6, 7, 8, 0, 2])])

        def output_loss(z):
            return -(w * torch.nn.functional.logsigmoid(z[:n] - z[n:])).sum()

        def output_curvature(z):
            c = w * torch.sigmoid(z[:n] - z[n:]) * torch.sigmoid(z[n:] - z[:n])
            return torch.cat([c, c])

    def outputs(params):
        return torch.func.functional_call(model, params, (users, items))

    def example_outputs(params):
        return torch.func.functional_call(model, params, (users, torch.arange(items.numel())))

    params = {k: p.detach().clone() for k, p in model.named_parameters() if not k.startswith("user_embedding")}
    item_keys = tuple(k for k in params if k.startswith("item_embedding"))
    composite = CompositeLoss(
        outputs,
        output_loss,
        lambda p: 0.05 * sum(v.pow(2).sum() for v in p.values()),
        output_curvature=output_curvature,
        row_keys=item_keys,
        example_rows=items,
        example_outputs=example_outputs,
    )
    flat = torch.cat([v.reshape(-1) for v in params.values()])

    def unflat(f):
        out, start = {}, 0
        for k, v in params.items():
            out[k] = f[start : start + v.numel()].reshape(v.shape)
            start += v.numel()
        return out

    jacobian = torch.autograd.functional.jacobian(lambda f: outputs(unflat(f)), flat)
    h_loss = torch.autograd.functional.hessian(output_loss, outputs(params).detach())
    exact = unflat(torch.diagonal(jacobian.T @ h_loss @ jacobian) + 0.1)
    return composite, params, item_keys, exact


@pytest.mark.parametrize("loss", ["bce", "bpr"])
@pytest.mark.parametrize("name", ["mf", "ncf"])
def test_gauss_newton_diagonal_is_exact_on_item_rows(name, loss):
    composite, params, item_keys, exact = _tiny_rows(name, loss)
    diagonal = gauss_newton_diagonal(composite, params, probes=1, generator=torch.Generator().manual_seed(0))
    assert item_keys
    for key in item_keys:
        torch.testing.assert_close(diagonal[key], exact[key], rtol=1e-10, atol=1e-12)
    assert all(bool((v >= 0).all()) for v in diagonal.values())


def test_gauss_newton_diagonal_estimates_the_dense_keys_of_ncf_without_bias():
    """BCE (diagonal ``H_loss``): the Monte Carlo estimate on the MLP is unbiased; with many sign draws it is close."""
    composite, params, item_keys, exact = _tiny_rows("ncf", "bce")
    diagonal = gauss_newton_diagonal(composite, params, probes=4000, generator=torch.Generator().manual_seed(0))
    dense = [k for k in params if k not in item_keys]
    estimate = torch.cat([diagonal[k].reshape(-1) for k in dense])
    truth = torch.cat([exact[k].reshape(-1) for k in dense])
    assert float((estimate - truth).abs().sum() / truth.abs().sum()) < 0.05


def test_gauss_newton_diagonal_refuses_a_loss_without_per_example_parts():
    composite, params, _, _ = _tiny_rows("mf", "bce")
    with pytest.raises(ValueError, match="example"):
        gauss_newton_diagonal(CompositeLoss(composite.outputs, composite.output_loss), params)
    with pytest.raises(ValueError, match="probes"):
        gauss_newton_diagonal(composite, params, probes=0)


# ---------------------------------------------------------------------------------------------- config and phase
def test_the_key_is_validated_with_its_name():
    assert RunConfig.from_mapping(default_mapping()).krylov_preconditioner == "none"  # the Euclidean solve
    with pytest.raises(ConfigError, match="krylov-preconditioner"):
        RunConfig.from_mapping({**default_mapping(), "krylov-preconditioner": "jacobi"})
    for bad in ({"krylov-solver": "cg"}, {"krylov-mode": "local"}):
        with pytest.raises(ConfigError, match="krylov-preconditioner"):
            RunConfig.from_mapping({**default_mapping(), "krylov-preconditioner": "diagonal", **bad})


@pytest.mark.parametrize("model", ["mf", "ncf"])
def test_node_diagonal_is_the_sum_of_its_users_and_the_reply_a_sum(tmp_path, model):
    """A serial FedMF / FedNCF run with HF-KCU and ``krylov-preconditioner = "diagonal"``, causal weighting off: each
    node's ``unlearn_diagonal`` reply carries one summed vector and ``num-users`` = all its remaining users; and a
    node's batched diagonal equals the sum of its users' one-user diagonals on the item rows (exact there; NCF's MLP
    part is a Monte Carlo estimate whose draws differ between the two)."""
    records, remaining, report, mapping = recorded_phase(tmp_path, model, {"krylov-preconditioner": "diagonal"})
    diagonal = [r for r in records if r["type"] == "query.unlearn_diagonal"]
    assert len(diagonal) == len(remaining) >= 2  # one round, every node
    for record in diagonal:
        (metrics,) = record["reply-metrics"].values()
        assert metrics["num-users"] == remaining[record["partition-id"]]
    assert report["krylov-preconditioner"] == "diagonal"
    assert report["preconditioner-bytes-received"] > 0 and report["preconditioner-bytes-sent"] > 0
    assert report["bytes-received"] >= report["preconditioner-bytes-received"]
    assert 0 < report["preconditioner-min"] <= 1.0 <= report["preconditioner-max"]

    # the node sum is the sum of the users' diagonals (what the node's reply adds up)
    runtime = get_runtime(mapping)
    shared = {k: v.detach().numpy().copy() for k, v in runtime.model.shared_state().items()}
    clients = [FedRecClient(runtime, user, RecordDict()) for user in (1, 2, 3)]
    together = influence_gn_diagonal(runtime, clients, shared, probes=1, seed=0)
    singles = [influence_gn_diagonal(runtime, [client], shared, probes=1, seed=0) for client in clients]
    for key in runtime.layout.item_keys:
        summed = np.zeros(runtime.layout.shared_shapes[key])
        for _, rows in singles:
            np.add.at(summed, rows[key][0], rows[key][1])
        joint = np.zeros_like(summed)
        np.add.at(joint, together[1][key][0], together[1][key][1])
        np.testing.assert_allclose(joint, summed, rtol=1e-5, atol=1e-7)
        assert joint.sum() > 0
    for key in runtime.layout.dense_keys:  # NCF's MLP: a non-negative estimate of the right shape
        assert together[0][key].shape == runtime.layout.shared_shapes[key] and (together[0][key] >= 0).all()
