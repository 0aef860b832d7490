"""The adaptive GRL weight (fedrec_flwr.adversary.adaptive): the summable statistics of h_w worked by hand and additive
over users, the controller's step against hand-computed values, its direction below chance and its bounds, its
checkpointable state, and a small synthetic federation where it finds a protecting eps from one 500 times too small."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedrec_flwr.adversary import AttributeAdversary, DSVAEAdversary, grad_reverse
from fedrec_flwr.adversary.adaptive import (
    STATISTICS,
    AdaptiveEpsilon,
    AdaptiveEpsilonConfig,
    adversary_statistics,
    balanced_signal,
    epsilon_step,
    statistics_block,
    statistics_length,
)
from fedrec_flwr.attacks import attribute_inference


def _stats(users, correct, probability=None, ce=None) -> np.ndarray:
    c = len(users)
    return np.concatenate([users, correct, probability or [0.0] * c, ce or [0.0] * c]).astype(np.float64)


def _linear(weight, bias=None) -> AttributeAdversary:
    weight = torch.tensor(weight, dtype=torch.float32)
    adversary = AttributeAdversary(weight.shape[1], weight.shape[0], 0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adversary.head.weight.copy_(weight)
        adversary.head.bias.copy_(torch.zeros(weight.shape[0]) if bias is None else torch.tensor(bias))
    return adversary


# ---------------------------------------------------------------------------------------------------- statistics
def test_the_statistics_of_two_users_worked_by_hand():
    """h_w's logits are (x1, -x1): a user at x = (1, 0) gets p = (sigmoid(2), sigmoid(-2)); with label 0 it is correct
    (CE log(1 + e^-2)), with label 1 it is not (CE log(1 + e^2))."""
    adversary = _linear([[1.0, 0.0], [-1.0, 0.0]])
    stats = adversary_statistics(adversary, torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]))
    p = 1.0 / (1.0 + math.exp(-2.0))
    expected = [1, 1, 1, 0, p, 1 - p, math.log1p(math.exp(-2.0)), math.log1p(math.exp(2.0))]
    assert stats.dtype == np.float64 and stats.shape == (statistics_length(2),) == (8,)
    np.testing.assert_allclose(stats, expected, rtol=1e-6)
    assert statistics_block(stats, "correct", 2).tolist() == [1.0, 0.0]
    assert STATISTICS == ("users", "correct", "true-probability", "cross-entropy")


def test_the_class_prior_enters_the_cross_entropy_block_only():
    adversary = _linear([[1.0, 0.0], [-1.0, 0.0]])
    x, y = torch.tensor([[1.0, 0.0], [0.2, 0.0]]), torch.tensor([0, 1])
    log_prior = torch.log(torch.tensor([0.7, 0.3]))
    plain, adjusted = adversary_statistics(adversary, x, y), adversary_statistics(adversary, x, y, log_prior=log_prior)
    np.testing.assert_array_equal(plain[:6], adjusted[:6])
    with torch.no_grad():
        hand = F.cross_entropy(adversary.predict_logits(x) + log_prior, y, reduction="none").double().numpy()
    np.testing.assert_allclose(adjusted[6:], hand, rtol=1e-6)
    assert not np.allclose(plain[6:], adjusted[6:])


@pytest.mark.parametrize("kind", ["mlp", "dsvae"])
def test_statistics_summed_over_two_halves_equal_the_statistics_of_the_union(kind):
    generator = torch.Generator().manual_seed(3)
    if kind == "mlp":
        adversary = AttributeAdversary(6, 3, 5, generator=generator)
    else:
        adversary = DSVAEAdversary(6, 3, 5, 4, gradient_noise=1.0, generator=generator)
    x = torch.randn(50, 6, generator=generator)
    y = torch.randint(0, 3, (50,), generator=generator)
    union = adversary_statistics(adversary, x, y)
    halves = adversary_statistics(adversary, x[:17], y[:17]) + adversary_statistics(adversary, x[17:], y[17:])
    one_by_one = sum(adversary_statistics(adversary, x[i : i + 1], y[i : i + 1]) for i in range(50))
    for parts in (halves, one_by_one):  # counts exactly; sums up to the float32 logits' batch-dependent rounding
        np.testing.assert_array_equal(parts[:6], union[:6])
        np.testing.assert_allclose(parts[6:], union[6:], rtol=1e-6)
    assert statistics_block(union, "users", 3).tolist() == np.bincount(y.numpy(), minlength=3).tolist()
    correct = adversary.predict_logits(x).argmax(-1) == y
    assert statistics_block(union, "correct", 3).sum() == int(correct.sum()) > 0
    assert np.array_equal(adversary_statistics(adversary, x[:0], y[:0]), np.zeros(12))


def test_the_statistics_refuse_labels_outside_the_classes_and_mismatched_shapes():
    adversary = _linear([[1.0, 0.0], [-1.0, 0.0]])
    with pytest.raises(ValueError, match="outside"):
        adversary_statistics(adversary, torch.zeros(2, 2), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="labels"):
        adversary_statistics(adversary, torch.zeros(2, 2), torch.tensor([0]))


def test_the_signals_read_the_blocks_and_are_nan_with_a_class_absent():
    stats = _stats([10, 30], [8, 12], [6.0, 15.0])
    assert balanced_signal(stats, 2) == pytest.approx((0.8 + 0.4) / 2, abs=1e-15)
    assert balanced_signal(stats, 2, "balanced-probability") == pytest.approx((0.6 + 0.5) / 2, abs=1e-15)
    assert math.isnan(balanced_signal(_stats([10, 0], [8, 0]), 2))
    with pytest.raises(ValueError, match="signal"):
        balanced_signal(stats, 2, "accuracy")


# ---------------------------------------------------------------------------------------------------- the step
def test_one_step_equals_the_hand_computed_one_binary_and_three_classes():
    """bacc 0.7, C = 2, delta 0.05: g = (0.7 - 0.5 - 0.05) / 0.5 = 0.3, eps = 1 * exp(0.5 * 0.3). bacc 2/3, C = 3,
    delta 0.1: g = (2/3 - 1/3 - 0.1) * 3 = 0.7, eps = 2 * exp(0.2 * 0.7)."""
    binary = AdaptiveEpsilon(AdaptiveEpsilonConfig(2, target_delta=0.05, rate=0.5), 1.0)
    assert binary.step(_stats([10, 10], [8, 6])) == pytest.approx(math.exp(0.15), rel=1e-14)
    assert binary.epsilon == pytest.approx(1.1618342427282831, rel=1e-14) and binary.steps == 1
    assert binary.last_signal == pytest.approx(0.7, abs=1e-15)
    three = AdaptiveEpsilon(AdaptiveEpsilonConfig(3, target_delta=0.1, rate=0.2), 2.0)
    assert three.step(_stats([4, 5, 6], [2, 5, 3])) == pytest.approx(2.0 * math.exp(0.14), rel=1e-14)
    probability = AdaptiveEpsilon(
        AdaptiveEpsilonConfig(2, target_delta=0.0, rate=1.0, signal="balanced-probability"), 1
    )
    assert probability.step(_stats([4, 4], [4, 4], [3.0, 2.0])) == pytest.approx(math.exp(0.25), rel=1e-14)
    assert epsilon_step(1.0, 0.7, num_classes=2, delta=0.05, rate=0.5, lower=1e-3, upper=100) == binary.epsilon


def test_eps_decreases_below_chance_holds_at_the_edge_and_grows_above_it():
    def after(bacc_hits, delta=0.05):
        controller = AdaptiveEpsilon(AdaptiveEpsilonConfig(2, target_delta=delta, rate=0.5), 1.0)
        return controller.step(_stats([100, 100], bacc_hits))

    assert after([30, 30]) < after([50, 50]) < 1.0  # below chance (the sign-flip case) and at chance: down
    assert after([55, 55]) == pytest.approx(1.0, rel=1e-14)  # at 1/C + delta: held
    assert after([90, 70]) > 1.0
    assert after([50, 50], delta=0.0) == 1.0


def test_eps_stays_within_its_bounds_and_a_round_without_a_class_keeps_it():
    controller = AdaptiveEpsilon(AdaptiveEpsilonConfig(2, rate=2.0, epsilon_min=0.01, epsilon_max=5.0), 1.0)
    seen = [controller.step(_stats([10, 10], [10, 10])) for _ in range(20)]
    assert max(seen) == seen[-1] == 5.0
    seen = [controller.step(_stats([10, 10], [0, 0])) for _ in range(40)]
    assert min(seen) == seen[-1] == 0.01
    assert controller.step(_stats([10, 0], [10, 0])) == 0.01 and math.isnan(controller.last_signal)
    with pytest.raises(ValueError, match="outside"):
        AdaptiveEpsilon(AdaptiveEpsilonConfig(2, epsilon_max=5.0), 6.0)


def test_smoothing_steps_on_the_discounted_sum_of_the_rounds_statistics():
    controller = AdaptiveEpsilon(AdaptiveEpsilonConfig(2, target_delta=0.0, rate=1.0, smoothing=0.5), 1.0)
    controller.step(_stats([10, 10], [10, 10]))  # bacc 1: g = 1
    second = controller.step(_stats([10, 10], [0, 0]))  # discounted: users 15 each, correct 5 each: bacc 1/3
    assert controller.discounted[:4] == (15.0, 15.0, 5.0, 5.0)
    assert second == pytest.approx(math.exp(1.0) * math.exp((1 / 3 - 0.5) / 0.5), rel=1e-14)


def test_the_state_round_trips_through_json_and_steps_on_identically():
    config = AdaptiveEpsilonConfig(3, smoothing=0.3)
    controller = AdaptiveEpsilon(config, 0.5)
    controller.step(_stats([4, 5, 6], [2, 5, 3], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]))
    state = json.loads(json.dumps(controller.state_dict()))
    restored = AdaptiveEpsilon.from_state(config, state)
    assert restored == controller
    nxt = _stats([1, 2, 3], [1, 1, 1])
    assert restored.step(nxt) == controller.step(nxt)
    fresh = json.loads(json.dumps(AdaptiveEpsilon(config, 0.5).state_dict(), allow_nan=True))
    assert math.isnan(AdaptiveEpsilon.from_state(config, fresh).last_signal)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_classes": 1}, "num_classes"),
        ({"target_delta": 0.5}, "target-delta"),
        ({"target_delta": -0.1}, "target-delta"),
        ({"rate": 0.0}, "rate"),
        ({"epsilon_min": 0.0}, "bounds"),
        ({"epsilon_min": 2.0, "epsilon_max": 1.0}, "bounds"),
        ({"signal": "auc"}, "signal"),
        ({"smoothing": 1.0}, "smoothing"),
    ],
)
def test_the_config_refuses_settings_outside_their_ranges(overrides, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveEpsilonConfig(**{"num_classes": 2, **overrides})


def test_a_step_refuses_a_vector_of_the_wrong_length_or_a_negative_entry():
    controller = AdaptiveEpsilon(AdaptiveEpsilonConfig(2), 1.0)
    with pytest.raises(ValueError, match="shape"):
        controller.step(np.zeros(6))
    with pytest.raises(ValueError, match=">= 0"):
        controller.step(_stats([10, -1], [1, 0]))


# ---------------------------------------------------------------------------------------------------- synthetic
USERS, DIM, OFFSET, ROUNDS = 400, 8, 1.2, 150


def _federation(*, adaptive: bool, seed: int = 0, epsilon: float = 0.01, every: int = 10):
    """Users' embeddings ``e0 ~ N(0, I) + OFFSET * (+1 | -1) * e_1`` by a binary attribute; each round 25% of the users
    take 5 SGD steps (rate 0.1) on ``0.5 ||e - e0||^2`` (a utility anchor, standing in for the recommendation loss)
    plus ``CE(h_w(GRL_eps(e)), a)`` at the round's frozen linear ``h_w``; the server then takes 5 Adam steps (rate
    0.05) of ``h_w`` on those users' mean cross-entropy, and (adaptive) the controller steps on the round's summed
    :func:`adversary_statistics` of the stepped ``h_w`` on the same users (in-sample, as the strategy would see it).

    Returns ``(attacker AUC at the start, attacker AUCs every ``every`` rounds, final eps)``; the attacker is logistic
    regression on half the users, scored on the other half (5 random halves)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (USERS,), generator=generator)
    direction = torch.zeros(DIM)
    direction[0] = 1.0
    anchor = torch.randn(USERS, DIM, generator=generator) + OFFSET * (2 * labels - 1).float()[:, None] * direction
    embeddings = anchor.clone()
    adversary = AttributeAdversary(DIM, 2, 0, generator=torch.Generator().manual_seed(seed + 1))
    optimizer = torch.optim.Adam(adversary.parameters(), lr=0.05)
    controller = AdaptiveEpsilon(AdaptiveEpsilonConfig(2), epsilon)

    def attacker_auc() -> float:
        return attribute_inference(embeddings.numpy(), labels.numpy(), splits=5, seed=0).auc[0]

    start, aucs, eps = attacker_auc(), [], epsilon
    for round_ in range(1, ROUNDS + 1):
        users = torch.randperm(USERS, generator=generator)[: USERS // 4]
        x, y = embeddings[users].clone(), labels[users]
        frozen = {name: p.detach() for name, p in adversary.named_parameters()}
        for _ in range(5):
            x.requires_grad_(True)
            logits = torch.func.functional_call(adversary, frozen, (grad_reverse(x, eps),))
            loss = 0.5 * (x - anchor[users]).pow(2).sum() + F.cross_entropy(logits, y, reduction="sum")
            (grad,) = torch.autograd.grad(loss, x)
            x = (x - 0.1 * grad).detach()
        embeddings[users] = x
        for _ in range(5):
            optimizer.zero_grad()
            F.cross_entropy(adversary(x), y).backward()
            optimizer.step()
        if adaptive:
            eps = controller.step(adversary_statistics(adversary, x, y))
        if round_ % every == 0:
            aucs.append(attacker_auc())
    return start, aucs, eps


def test_the_controller_drives_a_planted_attribute_to_chance_from_an_eps_500_times_too_small():
    """Measured (seeds 0-4, mean attacker AUC over the last 5 evaluations): 0.540, 0.572, 0.576, 0.531, 0.567 from
    0.905-0.962 at the start; final eps 3.5-7.3. The fixed eps = 0.01 it starts from keeps AUC within 0.003 of the
    start; a fixed eps of 5 (what the controller finds) ends in the same band. Single evaluations fluctuate by
    about +-0.05 (the GRL's chase between h_w and the embeddings): seed 0 spans 0.489-0.630 over its last 5."""
    start, aucs, eps = _federation(adaptive=True)
    assert start >= 0.9
    assert abs(np.mean(aucs[-5:]) - 0.5) <= 0.1, aucs
    assert eps > 1.0
    fixed_start, fixed_aucs, _ = _federation(adaptive=False, every=ROUNDS)
    assert fixed_start == start and fixed_aucs[-1] >= 0.9
