"""FedAU²'s server step of the adversary ``h_w`` (fedrec_flwr.strategies.adversary.AdversaryServerStep) by hand: SGD and Adam
from the values sent each round, and the user-weighted mean of the replies' gradients."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from fedrec_flwr.strategies.adversary import AdversaryServerStep, mean_reply_gradient
from fedrec_flwr.wire import ARRAYS, METRICS, NUM_EXAMPLES

KEYS = ("adversary.head.weight", "adversary.head.bias")


def _values(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {KEYS[0]: rng.normal(size=(2, 3)).astype(np.float32), KEYS[1]: rng.normal(size=2).astype(np.float32)}


def test_sgd_steps_start_from_the_values_sent_each_time():
    """``new = sent - lr * g`` for every step, also when the values sent differ from the last step's result (another
    phase, e.g. unlearning, or a checkpoint changed ``h_w`` in between)."""
    step = AdversaryServerStep(KEYS, optimizer="sgd", learning_rate=0.25)
    for seed in range(3):
        sent, gradient = _values(10 + seed), _values(20 + seed)
        new = step.step(sent, gradient)
        for key in KEYS:
            np.testing.assert_allclose(new[key], sent[key] - 0.25 * gradient[key], rtol=1e-6, atol=1e-7)
            assert new[key].dtype == np.float32


def test_adam_second_step_starts_from_the_new_values_with_the_kept_moments():
    """Adam (Kingma & Ba 2015) with bias correction: the first step moves every entry by ``lr * sign(g)``; the
    second, from different values sent, by ``lr * m_hat / (sqrt(v_hat) + eps)`` with the moments of both gradients."""
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    step = AdversaryServerStep(KEYS, optimizer="adam", learning_rate=lr)
    sent1, g1, sent2, g2 = _values(1), _values(2), _values(3), _values(4)
    first = step.step(sent1, g1)
    for key in KEYS:
        expected = sent1[key] - lr * g1[key] / (np.abs(g1[key]) + eps)
        np.testing.assert_allclose(first[key], expected, rtol=1e-5, atol=1e-6)
    second = step.step(sent2, g2)
    for key in KEYS:
        m = (1 - b1) * (b1 * g1[key].astype(np.float64) + g2[key])
        v = (1 - b2) * (b2 * g1[key].astype(np.float64) ** 2 + g2[key].astype(np.float64) ** 2)
        m_hat, v_hat = m / (1 - b1**2), v / (1 - b2**2)
        expected = sent2[key] - lr * m_hat / (np.sqrt(v_hat) + eps)
        np.testing.assert_allclose(second[key], expected, rtol=1e-5, atol=1e-6)


def _reply(gradient: dict, weight: float) -> RecordDict:
    return RecordDict(
        {ARRAYS: ArrayRecord({k: Array(v) for k, v in gradient.items()}), METRICS: MetricRecord({NUM_EXAMPLES: weight})}
    )


def test_apply_steps_on_the_user_weighted_mean_of_the_replies_and_keeps_the_other_keys():
    grads = [_values(5), _values(6)]
    replies = [_reply(grads[0], 3.0), _reply(grads[1], 1.0)]
    mean = mean_reply_gradient(replies, KEYS)
    for key in KEYS:
        np.testing.assert_allclose(mean[key], (3.0 * grads[0][key] + grads[1][key]) / 4.0, rtol=1e-6)
    sent = _values(7)
    other = np.arange(4, dtype=np.float32)
    current = ArrayRecord({**{k: Array(v) for k, v in sent.items()}, "item_embedding.weight": Array(other)})
    step = AdversaryServerStep(KEYS, optimizer="sgd", learning_rate=0.5)
    new = step.apply(current, replies, current)
    for key in KEYS:
        np.testing.assert_allclose(new[key].numpy(), sent[key] - 0.5 * mean[key], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(new["item_embedding.weight"].numpy(), other)


@pytest.mark.parametrize(
    "kwargs", [{"optimizer": "rmsprop"}, {"learning_rate": 0.0}, {"steps": 0}, {"query_users": "some"}]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        AdversaryServerStep(KEYS, **kwargs)


def test_a_reply_is_usable_only_with_h_ws_keys_shapes_finite_values_and_a_positive_weight():
    step = AdversaryServerStep(KEYS, optimizer="sgd", learning_rate=0.5)
    sent = ArrayRecord({k: Array(v) for k, v in _values(8).items()})
    assert step._reply_problem(_reply(_values(9), 2.0), sent) == ""
    bad_shape = {**_values(9), KEYS[1]: np.zeros(3, np.float32)}
    non_finite = {**_values(9), KEYS[0]: np.full((2, 3), np.nan, np.float32)}
    extra_key = {**_values(9), "item_embedding.weight": np.zeros(2, np.float32)}
    for content, words in (
        (_reply(bad_shape, 1.0), "shape"),
        (_reply(non_finite, 1.0), "non-finite"),
        (_reply(extra_key, 1.0), "keys"),
        (_reply(_values(9), 0.0), "positive"),
        (_reply(_values(9), float("inf")), "positive"),
        (RecordDict(), "no arrays"),
    ):
        assert words in step._reply_problem(content, sent)
