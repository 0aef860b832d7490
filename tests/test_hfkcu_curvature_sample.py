"""HF-KCU's subsampled curvature (``curvature-sample``): the node draw and its scale factor are a pure,
seeded function; in a phase only the drawn nodes answer the Gauss-Newton products, still as sums over all their
users, and the products are scaled by all users over the drawn nodes' users."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import MessageRecorder, tiny_run_config

from fedrec_flwr.app.client_app import make_client_app
from fedrec_flwr.config import RunConfig
from fedrec_flwr.serial import run_serial
from fedrec_flwr.strategies.unlearning import curvature_sample_nodes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_every_node_and_no_scaling_at_fraction_one():
    users = {7: 3, 2: 5, 9: 1}
    assert curvature_sample_nodes(users, 1.0, seed=0) == ([2, 7, 9], 1.0)
    assert curvature_sample_nodes({}, 0.5, seed=0) == ([], 1.0)


@pytest.mark.parametrize("fraction, size", [(0.5, 2), (0.25, 1), (0.01, 1), (0.75, 3)])
def test_a_seeded_share_of_the_nodes_scaled_by_all_users_over_the_drawn_users(fraction, size):
    users = {10: 4, 11: 6, 12: 10, 13: 20}
    drawn, factor = curvature_sample_nodes(users, fraction, seed=3)
    assert len(drawn) == size and set(drawn) <= set(users) and drawn == sorted(drawn)
    assert factor == pytest.approx(40 / sum(users[n] for n in drawn))
    assert curvature_sample_nodes(users, fraction, seed=3) == (drawn, factor)  # deterministic for a seed
    # equal per-user products: the scaled sum over the drawn nodes is the full sum exactly
    per_user = np.array([0.3, -1.2])
    assert np.allclose(factor * sum(users[n] * per_user for n in drawn), 40 * per_user)


def test_the_draw_depends_on_the_seed():
    users = {n: 1 for n in range(20)}
    draws = {tuple(curvature_sample_nodes(users, 0.2, seed=s)[0]) for s in range(5)}
    assert len(draws) > 1


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, float("nan")])
def test_a_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match="curvature-sample"):
        curvature_sample_nodes({1: 1}, fraction, seed=0)


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_the_key_is_validated_with_its_name(value):
    from fedrec_flwr.config import default_mapping
    from fedrec_flwr.errors import ConfigError

    with pytest.raises(ConfigError, match="curvature-sample"):
        RunConfig.from_mapping({**default_mapping(), "curvature-sample": value})
    assert RunConfig.from_mapping(default_mapping()).curvature_sample == 1.0  # every node by default


def recorded_phase(tmp_path, model: str, keys: dict) -> tuple[list, dict, dict, dict]:
    """A serial run (2 rounds, 2 users per node, every user trains) whose HF-KCU phase forgets user 0 with causal
    weighting off (every node holds remaining users), 3 CG iterations and the run-config ``keys``, every reply
    recorded: ``(records, partition id -> its remaining users, unlearning.json, the run config)``."""
    mapping = tiny_run_config(
        tmp_path, model=model, num_server_rounds=2, fraction_train=1.0, eval_every=2, users_per_node=2
    )
    mapping.update({"unlearning": "hfkcu", "forget-users": "0", "causal-weighting": False, "cg-iterations": 3, **keys})
    recorder = MessageRecorder(tmp_path / "messages")
    run_serial(mapping, client_app=make_client_app(mapping, mods=[recorder]))
    records = recorder.records()
    remaining = {
        r["partition-id"]: r["reply-configs"]["config"]["remaining-users"]
        for r in records
        if r["type"] == "query.unlearn_affected"
    }
    (report_file,) = (tmp_path / "results").rglob("unlearning.json")
    return records, remaining, json.loads(report_file.read_text()), mapping


def test_only_the_drawn_nodes_answer_the_products_as_sums(tmp_path):
    """A serial FedMF run with HF-KCU, causal weighting off (every node holds remaining users) and
    ``curvature-sample = 0.5``: the ``unlearn_hvp`` queries go to half of the nodes, every reply carries one summed
    vector and ``num-users`` (all the node's remaining users), and the phase reports the factor all remaining users /
    the drawn nodes' remaining users."""
    records, remaining, report, _ = recorded_phase(tmp_path, "mf", {"curvature-sample": 0.5, "trust-radius": 1.0})
    hvp = [r for r in records if r["type"] == "query.unlearn_hvp"]
    asked = {r["partition-id"] for r in hvp}
    assert len(remaining) >= 4
    assert len(asked) == max(1, round(0.5 * len(remaining)))
    for record in hvp:
        (metrics,) = record["reply-metrics"].values()
        assert metrics["num-users"] == remaining[record["partition-id"]]
    assert report["curvature-nodes"] == len(asked)
    assert report["curvature-factor"] == pytest.approx(sum(remaining.values()) / sum(remaining[p] for p in asked))
    assert report["cg-iterations"] >= 1
