"""SAM numerics (fedrec_flwr.sam): perturbation norm, zero/missing gradients, exact restore, hand-computed gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedrec_flwr.models import build_model
from fedrec_flwr.sam import SAMTrainer, sam_gradient, sam_perturbation
from fedrec_flwr.training import LocalTrainConfig


def test_perturbation_norm_over_the_group_equals_rho():
    grads = [torch.randn(5, 3), torch.randn(7), None]
    for rho in (0.01, 0.05, 1.0, 3.0):
        eps = sam_perturbation(grads, rho)
        assert eps[2] is None
        norm = torch.sqrt(sum((e.double() ** 2).sum() for e in eps if e is not None))
        assert float(norm) == pytest.approx(rho, rel=1e-6)
        # direction: parallel to the gradient
        assert torch.allclose(eps[0] / rho, grads[0] / torch.sqrt(grads[0].pow(2).sum() + grads[1].pow(2).sum()), atol=1e-6)


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
    assert float(perturbed_loss) == pytest.approx(float(0.5 * (w.detach() + expected_eps) @ A @ (w.detach() + expected_eps)))
    assert torch.equal(w.detach(), torch.tensor([1.0, -2.0], dtype=torch.float64))  # restored exactly


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
        trainer = SAMTrainer(model, LocalTrainConfig(learning_rate=0.1, optimizer="adam", batch_size=16),
                             rho_shared=rho, rho_private=rho, update_shared=False)
        trainer.fit_examples(users, items, labels, torch.Generator().manual_seed(0))
        grads[rho] = trainer.shared_grads
    plain_model = build_model("ncf", 1, 50, embedding_dim=8, mlp_layers=(16, 8), seed=3)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    u, i, y = (torch.as_tensor(a)[order] for a in (users, items, labels))
    trainer = SAMTrainer(plain_model, LocalTrainConfig(batch_size=16), rho_shared=0, rho_private=0, update_shared=False)
    trainer.chunked_loss(u, i, y).backward()
    for key, param in plain_model.shared_state().items():
        grad = dict(zip(plain_model.shared_state(), plain_model.shared_parameters()))[key].grad
        assert torch.allclose(grads[0.0][key], grad, atol=1e-7), key
    assert any(not torch.allclose(grads[0.0][k], grads[0.5][k]) for k in grads[0.0])


def test_gradient_mode_leaves_shared_parameters_unchanged_and_updates_private():
    model = build_model("ncf", 1, 50, embedding_dim=8, mlp_layers=(16, 8), seed=3)
    shared_before, private_before = model.shared_state(), model.private_state()
    trainer = SAMTrainer(model, LocalTrainConfig(learning_rate=0.1, optimizer="adam", batch_size=16),
                         rho_shared=0.05, rho_private=0.05, update_shared=False)
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
