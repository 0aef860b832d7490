"""Server-side steps of the unlearning phase (fedrec_flwr.strategies.unlearning.ClientUnlearning) computed by hand, with the
federation's queries replaced by fixed answers, so each formula is checked on its own:

* gradient ascent: ``theta += lr * g_F(theta) / |F|`` per step, ``g_F`` recomputed at each new point, with two
  forgotten users (so the division by ``|F|`` shows);
* the preconditioner ``M = (d + floor) / mean_S(d + floor)``, ``floor = PRECONDITIONER_FLOOR * mean_S(d)``: its mean
  over the entries the forgotten users' gradient touches is exactly 1;
* the forget-fraction draw comes from its own stream ``(seed, TAG_FORGET)``, not the curvature sample's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fedrec_flwr.config import RunConfig, default_mapping
from fedrec_flwr.models import build_model
from fedrec_flwr.seeding import numpy_rng
from fedrec_flwr.strategies.unlearning import (
    PRECONDITIONER_FLOOR,
    TAG_CURVATURE_SAMPLE,
    TAG_FORGET,
    ClientUnlearning,
    UnlearningSettings,
    forget_set,
)
from fedrec_flwr.unlearning.krylov import flatten, unflatten
from fedrec_flwr.wire import ModelLayout

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _layout() -> ModelLayout:
    return ModelLayout.from_model(build_model("ncf", 3, 10, embedding_dim=4, mlp_layers=(8, 4)))


def _phase(layout: ModelLayout, **settings) -> ClientUnlearning:
    base = UnlearningSettings(method="hfkcu", forget=(3, 7), round=2)
    return ClientUnlearning(SimpleNamespace(layout=layout), base.replace(**settings))


def _vector(layout: ModelLayout, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s) for k, s in layout.shared_shapes.items()}


# ---------------------------------------------------------------------------------------------- gradient ascent
@pytest.mark.parametrize("forget", [(3, 7), (1, 4, 8)])
def test_gradient_ascent_steps_by_the_rate_times_the_mean_gradient_over_the_forgotten_users(forget):
    """Two steps: ``theta_1 = theta_0 + lr g_0 / |F|`` (``g_0``: the phase's ``g_F``), then the gradient is queried
    at ``theta_1`` (the point sent) for the forgotten users and ``theta_2 = theta_1 + lr g_1 / |F|``."""
    layout = _layout()
    phase = _phase(layout, method="gradient-ascent", forget=forget, ascent_steps=2, ascent_learning_rate=0.5)
    theta, g0, g1 = _vector(layout, 0), _vector(layout, 1), _vector(layout, 2)
    asked = []

    def gradient(grid, record, users):
        asked.append(({k: v.numpy().astype(np.float64) for k, v in record.items()}, list(users)))
        return g1, 0.0

    phase.gradient = gradient
    step = phase._gradient_ascent(None, theta, g0)
    n = len(forget)
    theta1 = {k: theta[k] + 0.5 * g0[k] / n for k in theta}
    assert len(asked) == 1 and asked[0][1] == list(forget)
    for key in theta:
        np.testing.assert_allclose(asked[0][0][key], theta1[key], rtol=1e-6, atol=1e-6)  # sent as float32
        np.testing.assert_allclose(step[key], 0.5 * (g0[key] + g1[key]) / n, rtol=1e-12, atol=1e-12)


def test_gradient_ascent_with_one_step_sends_no_query():
    layout = _layout()
    phase = _phase(layout, method="gradient-ascent", ascent_steps=1, ascent_learning_rate=2.0)
    phase.gradient = lambda *args: pytest.fail("a one-step ascent needs no further gradient")
    theta, g0 = _vector(layout, 0), _vector(layout, 1)
    step = phase._gradient_ascent(None, theta, g0)
    for key in theta:
        np.testing.assert_allclose(step[key], 2.0 * g0[key] / 2, rtol=1e-12)


# ---------------------------------------------------------------------------------------------- preconditioner
def _rhs(layout: ModelLayout, rows=(0, 2, 5)) -> dict[str, np.ndarray]:
    """A right-hand side touching item rows ``rows`` and the dense keys but the last."""
    rhs = _vector(layout, 3)
    for key in layout.item_keys:
        mask = np.zeros(rhs[key].shape[0], dtype=bool)
        mask[list(rows)] = True
        rhs[key][~mask] = 0.0
    rhs[layout.dense_keys[-1]][...] = 0.0
    return rhs


def _preconditioner(layout, diagonal, rhs, mode="diagonal", factor=1.0):
    phase = _phase(layout, preconditioner=mode)
    phase._curvature_targets = lambda nodes, forget, extra: ({}, factor)
    phase._query = lambda *args, **kwargs: []
    phase._sum = lambda replies: {k: v.copy() for k, v in diagonal.items()}
    report = {}
    m = phase.preconditioner(None, None, [1], np.array([3, 7]), np.array([0, 2, 5]), rhs, report)
    return unflatten(m, layout.shared_shapes), report


def _support(layout, rhs, values):
    parts = []
    for key in layout.shared_shapes:
        if key in layout.item_keys:
            parts.append(values[key][np.any(rhs[key] != 0, axis=1)].reshape(-1))
        elif np.any(rhs[key] != 0):
            parts.append(values[key].reshape(-1))
    return np.concatenate(parts)


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_preconditioner_is_the_floored_diagonal_with_mean_one_on_the_support(factor):
    layout = _layout()
    rng = np.random.default_rng(4)
    diagonal = {k: rng.uniform(0.0, 5.0, size=s) ** 3 for k, s in layout.shared_shapes.items()}  # far from mean 1
    rhs = _rhs(layout)
    m, report = _preconditioner(layout, diagonal, rhs, factor=factor)
    on_support = _support(layout, rhs, m)
    assert on_support.mean() == pytest.approx(1.0, rel=1e-12)
    d = _support(layout, rhs, {k: factor * v for k, v in diagonal.items()})
    floor = PRECONDITIONER_FLOOR * d.mean()
    assert report["preconditioner-mean"] == pytest.approx(d.mean(), rel=1e-12)
    for key in layout.shared_shapes:  # everywhere (support or not) the same affine map of the diagonal
        np.testing.assert_allclose(m[key], (factor * diagonal[key] + floor) / (d.mean() + floor), rtol=1e-12)
    assert report["preconditioner-min"] == pytest.approx(on_support.min())
    assert report["preconditioner-max"] == pytest.approx(on_support.max())
    assert on_support.min() >= PRECONDITIONER_FLOOR / (1 + PRECONDITIONER_FLOOR) * (1 - 1e-12)


def test_row_preconditioner_is_constant_on_each_item_row_and_each_dense_key_with_mean_one():
    layout = _layout()
    rng = np.random.default_rng(5)
    diagonal = {k: rng.uniform(0.0, 5.0, size=s) for k, s in layout.shared_shapes.items()}
    rhs = _rhs(layout)
    m, _ = _preconditioner(layout, diagonal, rhs, mode="row")
    assert _support(layout, rhs, m).mean() == pytest.approx(1.0, rel=1e-12)
    for key in layout.shared_shapes:
        if key in layout.item_keys:
            np.testing.assert_allclose(m[key], np.broadcast_to(m[key][:, :1], m[key].shape), rtol=1e-12)
        else:
            np.testing.assert_allclose(m[key], m[key].reshape(-1)[0], rtol=1e-12)


def test_preconditioner_without_curvature_on_the_support_is_the_identity():
    layout = _layout()
    diagonal = {k: np.zeros(s) for k, s in layout.shared_shapes.items()}
    m, report = _preconditioner(layout, diagonal, _rhs(layout))
    np.testing.assert_array_equal(flatten(m, layout.shared_shapes), 1.0)
    assert report["preconditioner-mean"] == 0.0


# ---------------------------------------------------------------------------------------------- forget draw
def _config(**overrides) -> RunConfig:
    mapping = default_mapping()
    mapping.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return RunConfig.from_mapping(mapping)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_forget_fraction_is_drawn_from_its_own_stream(seed):
    drawn = forget_set(_config(forget_fraction=0.25, unlearning="hfkcu", seed=seed), 24)
    expected = np.sort(numpy_rng(seed, TAG_FORGET).choice(24, size=6, replace=False))
    np.testing.assert_array_equal(drawn, expected)
    other = np.sort(numpy_rng(seed, TAG_CURVATURE_SAMPLE).choice(24, size=6, replace=False))
    assert not np.array_equal(expected, other)  # the two streams give different users here
