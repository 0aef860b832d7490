"""HF-KCU's line search on the remaining users' loss: the ladder search finds the minimiser of known 1-D
functions from batches of values, nodes answer its query with scalar sums only, and those sums are the remaining
users' summed influence loss along the step."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import MessageRecorder, tiny_run_config

from fedrec_flwr.app.client_app import make_client, make_client_app
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.config import RunConfig
from fedrec_flwr.serial import run_serial
from fedrec_flwr.unlearning.influence import influence_loss_sums
from fedrec_flwr.unlearning.krylov import ladder_line_search

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _quadratic(minimiser: float, curvature: float = 3.0):
    calls = []

    def evaluate(steps):
        calls.append(list(steps))
        return [curvature * (a - minimiser) ** 2 - 5.0 for a in steps]

    return evaluate, calls


# ---------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("minimiser", [0.37, 1.0, 3.3, 21.5, 0.02])
def test_ladder_search_picks_the_minimiser_of_a_quadratic_along_the_step(minimiser):
    """Inside the ladder (0.37, 1, 3.3), beyond it (21.5: extended), and below it (0.02: refined downwards); the
    parabolic step lands on the minimiser exactly, since the function is a parabola."""
    evaluate, calls = _quadratic(minimiser)
    result = ladder_line_search(evaluate)
    assert result.termination == "bracketed"
    assert result.step == pytest.approx(minimiser, rel=1e-9)
    assert result.value == pytest.approx(-5.0, abs=1e-9)
    assert result.rounds == len(calls) <= 4
    assert calls[0][0] == 0.0 and result.steps[0] == 0.0  # f(0) is always asked
    assert sorted(result.steps) == sorted(a for batch in calls for a in batch)


def test_ladder_search_keeps_the_best_tried_step_on_a_non_quadratic_function():
    """f(a) = a log a - a has its minimiser at 1; interpolation is not exact but never makes the choice worse."""
    result = ladder_line_search(lambda steps: [a * math.log(a) - a if a > 0 else 0.0 for a in steps])
    assert result.termination == "bracketed"
    assert result.step == pytest.approx(1.0, rel=0.1)
    assert result.value == min(result.values)


def test_ladder_search_takes_no_step_when_the_function_only_rises():
    """f rises from 0 (f'(0) = 1 > 0): one round, no downward refinement, no step."""
    result = ladder_line_search(lambda steps: [a + a * a for a in steps], max_rounds=3)
    assert result.step == 0.0 and result.termination == "no-decrease" and result.value == 0.0
    assert result.rounds == 1


def test_ladder_search_refines_downwards_while_the_slope_at_zero_is_negative():
    """f'(0) < 0 but f(0.25) > f(0) (a minimiser at 0.001): refined downwards, then the parabola finds it; where
    the decrease is too small for the budget the step stays 0."""
    result = ladder_line_search(lambda steps: [(a - 0.001) ** 2 for a in steps])
    assert result.termination == "bracketed" and result.step == pytest.approx(0.001, rel=1e-6)
    assert result.rounds == 4  # the ladder, two refinements downwards, the parabola's minimiser
    result = ladder_line_search(lambda steps: [(a - 0.001) ** 2 for a in steps], max_rounds=1)
    assert result.step == 0.0 and result.termination == "no-decrease"


def test_ladder_search_stops_at_its_largest_step_or_round_budget():
    result = ladder_line_search(lambda steps: [-a for a in steps], max_step=40.0, max_rounds=5)
    assert result.step == 40.0 and result.termination == "max-step" and max(result.steps) == 40.0
    result = ladder_line_search(lambda steps: [-a for a in steps], max_rounds=1)
    assert result.step == 8.0 and result.termination == "rounds" and result.rounds == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ladder": ()}, "increasing"),
        ({"ladder": (1.0, 0.5)}, "increasing"),
        ({"ladder": (0.0, 1.0)}, "increasing"),
        ({"factor": 1.0}, "factor"),
        ({"max_step": 2.0}, "max_step"),
        ({"max_rounds": 0}, "max_rounds"),
    ],
)
def test_ladder_search_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ladder_line_search(lambda steps: [0.0] * len(steps), **kwargs)


@pytest.mark.parametrize(
    "reply, message", [(lambda s: [0.0], "values for"), (lambda s: [float("nan")] * len(s), "non-finite")]
)
def test_ladder_search_refuses_bad_replies(reply, message):
    with pytest.raises(ValueError, match=message):
        ladder_line_search(reply)


# ---------------------------------------------------------------------------------------------- the query
def random_node(folder, model: str, seed: int, users: int = 4, **overrides):
    """A node serving the tiny dataset's first ``users`` users with random private embeddings, random shared
    parameters and a random direction: ``(runtime, clients, shared, direction)``."""
    from flwr.app import Array, ArrayRecord, Context, RecordDict

    mapping = RunConfig.from_mapping(tiny_run_config(folder, model=model, **overrides)).to_dict()
    runtime = get_runtime(mapping)
    rng = np.random.default_rng(seed)
    context = Context(
        run_id=1,
        node_id=1000,
        node_config={"partition-id": 0, "num-partitions": 1},
        state=RecordDict(),
        run_config=mapping,
    )
    for user in range(users):
        context.state[f"user:{user}"] = ArrayRecord(
            {
                k: Array(rng.normal(scale=0.7, size=v.shape).astype(np.float32))
                for k, v in runtime.model.private_state().items()
            }
        )
    shared = {k: rng.normal(scale=0.5, size=s).astype(np.float32) for k, s in runtime.layout.shared_shapes.items()}
    direction = {k: rng.normal(scale=0.1, size=s) for k, s in runtime.layout.shared_shapes.items()}
    return runtime, [make_client(runtime, user, context) for user in range(users)], shared, direction


def test_node_loss_sums_equal_the_users_summed_influence_losses(tmp_path):
    """``influence_loss_sums`` over a batched node is the sum of each user's own influence loss at theta + a d."""
    runtime, clients, shared, direction = random_node(tmp_path, "ncf", seed=0, num_train_negatives=2)
    steps = [0.0, 0.5, 2.0]
    got = influence_loss_sums(runtime, clients, shared, direction, steps)
    expected = np.zeros(3)
    for client in clients:
        for index, a in enumerate(steps):
            moved = {k: (shared[k] + a * direction[k]).astype(np.float32) for k in shared}
            with client.influence_objective(moved) as (loss_fn, params, _):
                with torch.no_grad():
                    expected[index] += float(loss_fn(params))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert got[0] != got[2]
    assert influence_loss_sums(runtime, [], shared, direction, steps).tolist() == [0.0, 0.0, 0.0]


def test_line_search_phase_replies_carry_only_scalar_sums(tmp_path):
    """A serial run with ``line-search = "remaining-loss"``: every ``unlearn_loss`` reply holds no array, and its
    metrics are ``num-users`` and one loss sum per step asked; the phase reports the search and the chosen scale."""
    from conftest import write_tiny_dataset

    write_tiny_dataset(tmp_path)
    mapping = tiny_run_config(
        tmp_path, model="mf", num_server_rounds=2, fraction_train=1.0, eval_every=2, users_per_node=3
    )
    mapping.update({"unlearning": "hfkcu", "forget-users": "0,1", "line-search": "remaining-loss"})
    recorder = MessageRecorder(tmp_path / "messages")
    run_serial(mapping, client_app=make_client_app(mapping, mods=[recorder]))
    loss_queries = [r for r in recorder.records() if r["type"] == "query.unlearn_loss"]
    assert loss_queries
    for record in loss_queries:
        assert not record["reply-arrays"] and not record["reply-configs"]
        (metrics,) = record["reply-metrics"].values()
        assert set(metrics) == {"num-users", "loss-sums"}
        assert metrics["loss-sums"] and all(isinstance(v, float) for v in metrics["loss-sums"])
    # the first round asks f(0) and the ladder (0.25 ... 8): seven sums per node
    assert 7 in {len(next(iter(r["reply-metrics"].values()))["loss-sums"]) for r in loss_queries}
    (report_file,) = (tmp_path / "results").rglob("unlearning.json")
    report = json.loads(report_file.read_text())
    values, steps = report["line-search-values"], report["line-search-steps"]
    assert len(loss_queries) == report["line-search-rounds"] * report["queried-nodes"]  # one sum per node and a
    assert report["line-search-step"] == steps[int(np.argmin(values))]
    assert min(values) <= values[0]
    assert report["scale"] == pytest.approx(report["line-search-step"])


@pytest.mark.parametrize(
    "key, value", [("line-search", "armijo"), ("line-search-max-step", 4.0), ("line-search-rounds", 0)]
)
def test_line_search_keys_are_validated_with_the_key_named(key, value):
    from fedrec_flwr.config import default_mapping
    from fedrec_flwr.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        RunConfig.from_mapping({**default_mapping(), key: value})


def test_line_search_keys_reach_the_unlearning_settings():
    from fedrec_flwr.config import default_mapping
    from fedrec_flwr.strategies.unlearning import UnlearningSettings

    mapping = {
        **default_mapping(),
        "unlearning": "hfkcu",
        "forget-users": "1",
        "line-search": "remaining-loss",
        "line-search-max-step": 16.0,
        "line-search-rounds": 2,
    }
    settings = UnlearningSettings.from_config(RunConfig.from_mapping(mapping), num_users=10)
    assert (settings.line_search, settings.line_search_max_step, settings.line_search_rounds) == (
        "remaining-loss",
        16.0,
        2,
    )
    default = UnlearningSettings.from_config(RunConfig.from_mapping({**mapping, "line-search": "none"}), 10)
    assert default.line_search == "none"
    assert RunConfig.from_mapping(default_mapping()).line_search == "none"  # the fixed radius stays the default
