"""SAM numerics (fedrec_flwr.local.sam): perturbation norm, zero/missing gradients, exact restore, hand-computed gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedrec_flwr.local.sam import (
    SAMTrainer,
    decoupled_sam_gradients,
    sam_gradient,
    sam_perturbation,
    sam_perturbations,
)
from fedrec_flwr.local.training import LocalTrainConfig
from fedrec_flwr.models import build_model


def test_perturbation_norm_over_the_group_equals_rho():
    grads = [torch.randn(5, 3), torch.randn(7), None]
    for rho in (0.01, 0.05, 1.0, 3.0):
        eps = sam_perturbation(grads, rho)
        assert eps[2] is None
        norm = torch.sqrt(sum((e.double() ** 2).sum() for e in eps if e is not None))
        assert float(norm) == pytest.approx(rho, rel=1e-6)
        # direction: parallel to the gradient
        assert torch.allclose(
            eps[0] / rho, grads[0] / torch.sqrt(grads[0].pow(2).sum() + grads[1].pow(2).sum()), atol=1e-6
        )


@pytest.mark.parametrize("grads", [[torch.zeros(4, 2), torch.zeros(3)], [None, None], []])
def test_zero_or_missing_gradient_gives_no_perturbation_and_no_nan(grads):
    eps = sam_perturbation(grads, 0.5)
    for e in eps:
        assert e is None or (torch.isfinite(e).all() and not e.any())


def test_negative_rho_is_rejected():
    with pytest.raises(ValueError, match="rho"):
        sam_perturbation([torch.ones(2)], -0.1)


def test_sam_gradient_on_a_quadratic_matches_hand_computation():
    # L(w) = 0.5 * w^T A w  ->  g = A w;  eps = rho g/|g|;  SAM gradient = A (w + eps).
    A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    rho = 0.3

    def loss_fn():
        return 0.5 * w @ A @ w

    loss_fn().backward()
    g = w.grad.clone()
    sam, perturbed_loss = sam_gradient([w], [g], rho, loss_fn)
    expected_eps = rho * (A @ w.detach()) / torch.linalg.norm(A @ w.detach())
    expected = A @ (w.detach() + expected_eps)
    assert torch.allclose(sam[0], expected, atol=1e-12)
    assert float(perturbed_loss) == pytest.approx(
        float(0.5 * (w.detach() + expected_eps) @ A @ (w.detach() + expected_eps))
    )
    assert torch.equal(w.detach(), torch.tensor([1.0, -2.0], dtype=torch.float64))  # restored exactly


def test_batched_perturbation_gives_each_user_its_own_norm_and_equals_the_batch_of_one():
    """The block path's batched perturbation and the per-user one are the same function: user ``u``'s row of the
    batch is bit for bit the per-user perturbation of ``u``'s gradients, normalised by ``u``'s own norm."""
    generator = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(4, 5, 3, generator=generator), "b": torch.randn(4, 7, generator=generator)}
    grads["a"][1] *= 100.0  # users of very different norms
    grads["a"][2].zero_()
    grads["b"][2].zero_()  # a user without gradient stays unperturbed
    eps = sam_perturbations(grads, 0.3)
    for user in range(4):
        one = sam_perturbation([grads["a"][user], grads["b"][user]], 0.3)
        assert torch.equal(eps["a"][user], one[0]) and torch.equal(eps["b"][user], one[1]), user
        norm = torch.sqrt((eps["a"][user].double() ** 2).sum() + (eps["b"][user].double() ** 2).sum())
        assert float(norm) == (0.0 if user == 2 else pytest.approx(0.3, rel=1e-6)), user
    assert sam_perturbations(grads, 0.0) is None
    assert sam_perturbations({"a": torch.zeros(3, 2)}, 0.3) is None


def test_decoupled_sam_gradients_of_a_batch_equal_each_users_in_place_sam_gradient():
    """Three users with quadratic losses ``0.5 w_u^T A_u w_u`` over two groups, as one batch with a functional
    gradient (the block path's form) and one by one in place (the per-user path's form): the same SAM gradients."""
    generator = torch.Generator().manual_seed(1)
    k = 3
    m = torch.randn(k, 5, 5, generator=generator, dtype=torch.float64)
    a = m @ m.transpose(1, 2) + torch.eye(5, dtype=torch.float64)  # (k, 5, 5) SPD
    w = torch.randn(k, 5, generator=generator, dtype=torch.float64)
    groups = ((["s"], 0.2), (["p"], 0.05))  # s = w[:, :3], p = w[:, 3:]

    def gradients(point, keys):
        full = torch.cat([point["s"], point["p"]], dim=1)
        g = torch.einsum("kij,kj->ki", a, full)
        return {key: {"s": g[:, :3], "p": g[:, 3:]}[key] for key in keys}

    params = {"s": w[:, :3], "p": w[:, 3:]}
    batched = decoupled_sam_gradients(params, gradients(params, ["s", "p"]), groups, gradients)
    for user in range(k):
        s = torch.nn.Parameter(w[user, :3].clone())
        p = torch.nn.Parameter(w[user, 3:].clone())

        def loss_fn(user=user, s=s, p=p):
            full = torch.cat([s, p])
            return 0.5 * full @ a[user] @ full

        loss_fn().backward()
        base_s, base_p = s.grad.clone(), p.grad.clone()
        (sam_s,), _ = sam_gradient([s], [base_s], 0.2, loss_fn)
        (sam_p,), _ = sam_gradient([p], [base_p], 0.05, loss_fn)
        np.testing.assert_allclose(batched["s"][user].numpy(), sam_s.numpy(), rtol=0, atol=1e-13)
        np.testing.assert_allclose(batched["p"][user].numpy(), sam_p.numpy(), rtol=0, atol=1e-13)
        # and the perturbation did move each group's gradient (a no-op SAM would pass the equalities above)
        assert (sam_s - base_s).abs().max() > 1e-3 and (sam_p - base_p).abs().max() > 1e-4


def _examples(num_items: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    items = rng.choice(num_items, size=40, replace=False)
    labels = np.r_[np.ones(8, np.float32), np.zeros(32, np.float32)]
    return np.zeros(40, np.int64), items.astype(np.int64), labels


def test_perturb_and_restore_with_zero_learning_rate_leaves_every_parameter_bit_identical():
    model = build_model("ncf", 1, 50, embedding_dim=8, mlp_layers=(16, 8), seed=3)
    before = {k: v.clone() for k, v in {**model.private_state(), **model.shared_state()}.items()}
    cfg = LocalTrainConfig(learning_rate=0.0, optimizer="sgd", batch_size=16)
    trainer = SAMTrainer(model, cfg, rho_shared=0.5, rho_private=0.5, update_shared=True)
    users, items, labels = _examples(50)
    trainer.fit_examples(users, items, labels, torch.Generator().manual_seed(0))
    after = {**model.private_state(), **model.shared_state()}
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
    # and the SAM gradients were really computed at a different point than the plain ones
    assert any(g.abs().sum() > 0 for g in trainer.shared_grads.values())


def test_sam_gradient_differs_from_plain_gradient_and_rho_zero_is_plain():
    users, items, labels = _examples(50)
    grads = {}
    for rho in (0.0, 0.5):
        model = build_model("ncf", 1, 50, embedding_dim=8, mlp_layers=(16, 8), seed=3)
        trainer = SAMTrainer(
            model,
            LocalTrainConfig(learning_rate=0.1, optimizer="adam", batch_size=16),
            rho_shared=rho,
            rho_private=rho,
            update_shared=False,
        )
        trainer.fit_examples(users, items, labels, torch.Generator().manual_seed(0))
        grads[rho] = trainer.shared_grads
    plain_model = build_model("ncf", 1, 50, embedding_dim=8, mlp_layers=(16, 8), seed=3)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    u, i, y = (torch.as_tensor(a)[order] for a in (users, items, labels))
    trainer = SAMTrainer(plain_model, LocalTrainConfig(batch_size=16), rho_shared=0, rho_private=0, update_shared=False)
    trainer.chunked_loss(u, i, y).backward()
    for key in plain_model.shared_state():
        grad = dict(zip(plain_model.shared_state(), plain_model.shared_parameters()))[key].grad
        assert torch.allclose(grads[0.0][key], grad, atol=1e-7), key
    assert any(not torch.allclose(grads[0.0][k], grads[0.5][k]) for k in grads[0.0])


def test_gradient_mode_leaves_shared_parameters_unchanged_and_updates_private():
    model = build_model("ncf", 1, 50, embedding_dim=8, mlp_layers=(16, 8), seed=3)
    shared_before, private_before = model.shared_state(), model.private_state()
    trainer = SAMTrainer(
        model,
        LocalTrainConfig(learning_rate=0.1, optimizer="adam", batch_size=16),
        rho_shared=0.05,
        rho_private=0.05,
        update_shared=False,
    )
    users, items, labels = _examples(50)
    trainer.fit_examples(users, items, labels, torch.Generator().manual_seed(0))
    for key, value in model.shared_state().items():
        assert torch.equal(value, shared_before[key]), key
    assert any(not torch.equal(v, private_before[k]) for k, v in model.private_state().items())
    untouched = np.setdiff1d(np.arange(50), items)
    assert not trainer.shared_grads["item_embedding_gmf.weight"][untouched].any()


def test_non_finite_loss_restores_parameters_and_raises():
    model = build_model("ncf", 1, 50, embedding_dim=8, mlp_layers=(16, 8), seed=3)
    with torch.no_grad():
        model.output.weight.fill_(float("inf"))
    before = {k: v.clone() for k, v in model.shared_state().items()}
    trainer = SAMTrainer(model, LocalTrainConfig(batch_size=16), rho_shared=0.05, rho_private=0.05, update_shared=True)
    with pytest.raises(FloatingPointError):
        trainer.fit_examples(*_examples(50), torch.Generator().manual_seed(0))
    for key, value in model.shared_state().items():
        assert torch.equal(value, before[key]) or (torch.isinf(value) == torch.isinf(before[key])).all()


@pytest.mark.parametrize(("field", "value", "message"), [("loss", "bpr", "bce"), ("weight_decay", 0.1, "weight decay")])
def test_sam_trainer_rejects_what_fedrecgel_does_not_define(field, value, message):
    from fedrec_flwr.errors import ConfigError

    model = build_model("ncf", 1, 50, embedding_dim=8, mlp_layers=(16, 8), seed=3)
    with pytest.raises(ConfigError, match=message):
        SAMTrainer(model, LocalTrainConfig(**{field: value}), rho_shared=0.05, rho_private=0.05, update_shared=False)


# ------------------------------------------------------------------ decoupled SAM against a float64 hand computation
# A one-user MF model (logit = <p, q_i>) with hand-set values; the mean BCE and its gradients are written out in
# numpy below (dL/dz_j = (sigmoid(z_j) - y_j) / n; dL/dp = sum_j dz_j q_{i_j}; dL/dq_{i_j} += dz_j p), independent
# of torch's autograd and of fedrec_flwr.local.sam.
P0 = np.array([0.5, -0.2, 0.1])
Q0 = np.array([[0.3, 0.1, -0.4], [-0.2, 0.6, 0.2], [0.1, -0.3, 0.5], [0.4, 0.4, -0.1], [-0.5, 0.2, 0.3]])
ITEMS = np.array([0, 2, 4, 1, 3])
LABELS = np.array([1.0, 1.0, 0.0, 0.0, 0.0])


def _hand_gradients(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    z = q[ITEMS] @ p
    dz = (1.0 / (1.0 + np.exp(-z)) - LABELS) / len(ITEMS)
    grad_q = np.zeros_like(q)
    np.add.at(grad_q, ITEMS, dz[:, None] * p[None, :])
    return dz @ q[ITEMS], grad_q


def _hand_sam(rho_shared: float, rho_private: float, p: np.ndarray = P0, q: np.ndarray = Q0):
    """(private SAM gradient, shared SAM gradient) at ``(p, q)``: each group perturbed alone by rho * g / ||g||
    (its own radius)."""
    g_p, g_q = _hand_gradients(p, q)
    eps_q = rho_shared * g_q / np.linalg.norm(g_q)
    eps_p = rho_private * g_p / np.linalg.norm(g_p)
    return _hand_gradients(p + eps_p, q)[0], _hand_gradients(p, q + eps_q)[1]


def _mf64() -> torch.nn.Module:
    model = build_model("mf", 1, len(Q0), embedding_dim=3, seed=0).double()
    with torch.no_grad():
        model.user_embedding.weight.copy_(torch.from_numpy(P0[None, :]))
        model.item_embedding.weight.copy_(torch.from_numpy(Q0))
    return model


@pytest.mark.parametrize(("rho_shared", "rho_private"), [(0.3, 0.0), (0.0, 0.3), (0.3, 0.1), (0.1, 0.3)])
def test_decoupled_sam_gradients_equal_the_float64_hand_computation(rho_shared, rho_private):
    """FedRecGEL Sec. 4.2: the shared group's SAM gradient is taken with only the shared group perturbed (radius
    rho-shared), the private one with only the private group perturbed (rho-private). Unequal radii tell a swap of
    the two radii, or one joint perturbation of both groups (plain SAM), from the decoupled rule."""
    model = _mf64()
    lr = 0.5
    trainer = SAMTrainer(
        model,
        LocalTrainConfig(learning_rate=lr, optimizer="sgd", batch_size=64),
        rho_shared=rho_shared,
        rho_private=rho_private,
        update_shared=False,
    )
    trainer.fit_examples(np.zeros(len(ITEMS), np.int64), ITEMS, LABELS, torch.Generator().manual_seed(0), epochs=1)
    sam_p, sam_q = _hand_sam(rho_shared, rho_private)
    np.testing.assert_allclose(trainer.shared_grads["item_embedding.weight"].numpy(), sam_q, rtol=0, atol=1e-13)
    # the private group took one SGD step with its SAM gradient; the shared group is only uploaded (not stepped)
    np.testing.assert_allclose(model.user_embedding.weight.detach().numpy()[0], P0 - lr * sam_p, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(model.item_embedding.weight.detach().numpy(), Q0)
    # and the hand computation is sensitive to what it checks: perturbing a group changes its gradient
    plain_p, plain_q = _hand_gradients(P0, Q0)
    assert (np.abs(sam_q - plain_q).max() > 1e-5) == (rho_shared > 0)
    assert (np.abs(sam_p - plain_p).max() > 1e-5) == (rho_private > 0)


def test_decoupled_sam_updates_the_shared_group_with_its_own_sam_gradient_in_fedavg_of_updates_mode():
    model = _mf64()
    lr = 0.5
    trainer = SAMTrainer(
        model,
        LocalTrainConfig(learning_rate=lr, optimizer="sgd", batch_size=64),
        rho_shared=0.3,
        rho_private=0.1,
        update_shared=True,
    )
    trainer.fit_examples(np.zeros(len(ITEMS), np.int64), ITEMS, LABELS, torch.Generator().manual_seed(0), epochs=1)
    sam_p, sam_q = _hand_sam(0.3, 0.1)
    np.testing.assert_allclose(model.item_embedding.weight.detach().numpy(), Q0 - lr * sam_q, rtol=0, atol=1e-13)
    np.testing.assert_allclose(model.user_embedding.weight.detach().numpy()[0], P0 - lr * sam_p, rtol=0, atol=1e-13)


def test_uploaded_shared_gradient_is_the_mean_over_local_steps():
    """Two full-batch steps in gradient mode: the private group moves after step 1, so step 2's shared SAM gradient
    is taken at (P1, Q0); the upload is the mean of the two."""
    model, lr = _mf64(), 0.5
    trainer = SAMTrainer(
        model,
        LocalTrainConfig(learning_rate=lr, optimizer="sgd", batch_size=64),
        rho_shared=0.3,
        rho_private=0.1,
        update_shared=False,
    )
    trainer.fit_examples(np.zeros(len(ITEMS), np.int64), ITEMS, LABELS, torch.Generator().manual_seed(0), epochs=2)
    sam_p1, sam_q1 = _hand_sam(0.3, 0.1)
    p1 = P0 - lr * sam_p1
    sam_p2, sam_q2 = _hand_sam(0.3, 0.1, p1, Q0)
    np.testing.assert_allclose(
        trainer.shared_grads["item_embedding.weight"].numpy(), (sam_q1 + sam_q2) / 2, rtol=0, atol=1e-13
    )
    np.testing.assert_allclose(model.user_embedding.weight.detach().numpy()[0], p1 - lr * sam_p2, rtol=0, atol=1e-13)
    assert np.abs(sam_q1 - sam_q2).max() > 1e-4  # the two steps' gradients differ: a sum or a last-only would show


def test_reported_loss_is_the_mean_of_the_chunk_means_at_the_start_of_the_last_step():
    """batch-size 2 over 5 examples: chunks of 2, 2 and 1 examples in the step's shuffled order; the loss summed over
    chunks (FedRecGEL's objective) is reported divided by the number of chunks."""
    model = _mf64()
    trainer = SAMTrainer(
        model,
        LocalTrainConfig(learning_rate=0.5, optimizer="sgd", batch_size=2),
        rho_shared=0.3,
        rho_private=0.1,
        update_shared=True,
    )
    loss, n = trainer.fit_examples(
        np.zeros(len(ITEMS), np.int64), ITEMS, LABELS, torch.Generator().manual_seed(0), epochs=1
    )
    order = torch.randperm(len(ITEMS), generator=torch.Generator().manual_seed(0)).numpy()
    z = Q0[ITEMS[order]] @ P0
    per_example = np.logaddexp(0.0, z) - LABELS[order] * z  # BCE with logits
    chunk_means = [per_example[i : i + 2].mean() for i in range(0, len(ITEMS), 2)]
    assert n == 5 and len(chunk_means) == 3
    assert loss == pytest.approx(sum(chunk_means) / 3, rel=0, abs=1e-13)
    assert abs(sum(chunk_means) / 3 - per_example.mean()) > 1e-6  # the chunking is visible in the value


class _NaNAtCall:
    """A loss term that is 0 until its ``at``-th call (1-based), where it poisons the loss: a NaN constant, or NaN
    times the sum of the given parameters (so that their gradients are NaN)."""

    def __init__(self, at: int, params=()) -> None:
        self.at, self.params, self.calls = at, list(params), 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.calls != self.at:
            return torch.zeros((), dtype=torch.float64)
        if not self.params:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return float("nan") * sum(p.sum() for p in self.params)


@pytest.mark.parametrize(
    ("at", "poisoned", "message"),
    [
        # one chunk, both radii > 0: each SAM step evaluates the loss 3 times (current point, shared-perturbed,
        # private-perturbed); calls 4-6 are the second step, after the first step moved both groups
        (4, None, "loss nan at SAM step 2"),
        (5, "shared", "shared SAM gradient at SAM step 2"),
        (6, "private", "parameters after SAM step 2"),
    ],
)
def test_a_non_finite_step_after_the_parameters_moved_restores_them_exactly(at, poisoned, message):
    """A NaN in the second SAM step (its loss, its shared SAM gradient, or the parameters after it) raises and puts
    back the values from before the whole local training, not just before that step."""
    model = _mf64()
    groups = {None: (), "shared": model.shared_parameters(), "private": model.private_parameters()}
    trainer = SAMTrainer(
        model,
        LocalTrainConfig(learning_rate=0.5, optimizer="sgd", batch_size=64, local_epochs=3),
        rho_shared=0.3,
        rho_private=0.1,
        update_shared=True,
    )
    term = _NaNAtCall(at, groups[poisoned])
    trainer.loss_terms.append(term)
    with pytest.raises(FloatingPointError, match=message):
        trainer.fit_examples(np.zeros(len(ITEMS), np.int64), ITEMS, LABELS, torch.Generator().manual_seed(0))
    assert term.calls == (4 if at == 4 else 6)  # the failure was seen in step 2, after one whole step
    np.testing.assert_array_equal(model.user_embedding.weight.detach().numpy()[0], P0)
    np.testing.assert_array_equal(model.item_embedding.weight.detach().numpy(), Q0)
    # the first step did move both groups (what the restore undid)
    sam_p, sam_q = _hand_sam(0.3, 0.1)
    assert np.abs(sam_p).max() > 1e-3 and np.abs(sam_q).max() > 1e-3
