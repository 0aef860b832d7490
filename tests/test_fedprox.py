"""FedProx (Li et al., MLSys 2020) through the Flower adapter: our clients honour the ``"proximal-mu"`` that Flower's
``FedProx`` sends, with the paper's proximal term on the shared parameters (:class:`fedrec_flwr.local.training.ProximalTerm`);
a client class that does not list the key is still refused before the run starts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import tiny_run_config
from flwr.app import RecordDict
from flwr.serverapp.strategy import FedProx

from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.clients.fedrec import FedRecClient
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.training import ProximalTerm
from fedrec_flwr.serial import run_serial
from fedrec_flwr.strategies.flower_adapter import build_flower_strategy, check_sent_keys

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
FLOWER = "flwr.serverapp.strategy:"


def test_the_proximal_term_is_half_mu_times_the_squared_distance_and_its_gradient_pulls_back():
    weights, bias = torch.tensor([[1.0, 2.0]], requires_grad=True), torch.tensor([3.0], requires_grad=True)
    term = ProximalTerm([weights, bias], mu=0.5)
    with torch.no_grad():
        weights += torch.tensor([[0.2, -0.4]])
        bias -= 1.0
    value = term()
    value.backward()
    assert value.item() == pytest.approx(0.25 * (0.04 + 0.16 + 1.0))
    torch.testing.assert_close(weights.grad, 0.5 * torch.tensor([[0.2, -0.4]]))
    torch.testing.assert_close(bias.grad, torch.tensor([-0.5]))
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="proximal-mu"):
            ProximalTerm([weights], bad)


def _distance_from_global(runtime, shared, mu: float | None) -> float:
    """Squared distance of user 0's uploaded shared parameters from ``shared`` after one local round from it."""
    config = {"server-round": 1, **({} if mu is None else {"proximal-mu": mu})}
    update = FedRecClient(runtime, 0, RecordDict()).fit_named(dict(shared), config)
    total = sum(float(((v - shared[k]) ** 2).sum()) for k, v in update.dense.items())
    total += sum(float(((values - shared[k][rows]) ** 2).sum()) for k, (rows, values) in update.rows.items())
    return total


def test_a_larger_proximal_mu_keeps_a_users_update_nearer_the_global_model(tmp_path):
    runtime = get_runtime(tiny_run_config(tmp_path, users_per_node=1, local_epochs=3))
    shared = {k: v.detach().cpu().numpy().copy() for k, v in runtime.model.shared_state().items()}
    plain = _distance_from_global(runtime, shared, None)
    assert _distance_from_global(runtime, shared, 0.0) == plain  # mu 0 is FedAvg's local step, exactly
    distances = [_distance_from_global(runtime, shared, mu) for mu in (1.0, 100.0)]
    # Adam (the default) normalises each step, so a large mu bounds the drift at about the step size, not at 0
    assert plain > 0 and distances[0] < 0.2 * plain and distances[1] < distances[0], (plain, distances)


def test_fedprox_runs_through_the_adapter_and_a_node_of_users_trains_them_per_user(tmp_path):
    """FedProx with mu > 0 is accepted, differs from FedAvg, and gives the same model whether a node's users would
    go through the block path (which has no proximal term, so they are trained per user) or not."""
    common = dict(num_server_rounds=2, users_per_node=6, eval_every=2, local_epochs=3)  # one step: FedProx = FedAvg
    runs = {
        name: run_serial(tiny_run_config(tmp_path / name, **extra, **common))
        for name, extra in {
            "prox-blocks": dict(strategy=FLOWER + "FedProx", strategy_args="proximal_mu=0.5", block_training="on"),
            "prox-per-user": dict(strategy=FLOWER + "FedProx", strategy_args="proximal_mu=0.5", block_training="off"),
            "fedavg": dict(strategy=FLOWER + "FedAvg", block_training="off"),
        }.items()
    }
    final = {name: np.load(folder / "final_arrays.npz") for name, folder in runs.items()}
    for key in final["fedavg"].files:
        np.testing.assert_array_equal(final["prox-blocks"][key], final["prox-per-user"][key], err_msg=key)
    assert any(not np.allclose(final["prox-per-user"][k], final["fedavg"][k]) for k in final["fedavg"].files)


def test_a_client_that_does_not_honour_proximal_mu_is_still_refused():
    def fedprox():  # as the adapter builds it (min nodes 1)
        return build_flower_strategy(FedProx, {"proximal_mu": 0.1})[0]

    check_sent_keys(fedprox(), FedRecClient.strategy_config_keys)  # ours: accepted
    with pytest.raises(ConfigError, match="'proximal-mu' = 0.1, which the client does not honour"):
        check_sent_keys(fedprox(), honoured=())


def test_fedprox_is_refused_for_pfedrec_whose_item_rate_would_make_it_diverge(tmp_path):
    config = tiny_run_config(
        tmp_path,
        model="pfedrec",
        client="pfedrec",
        optimizer="sgd",
        learning_rate=0.1,
        strategy=FLOWER + "FedProx",
        strategy_args="proximal_mu=0.1",
        num_server_rounds=1,
    )
    with pytest.raises(ConfigError, match="'proximal-mu' = 0.1, which the client does not honour"):
        run_serial(config)
