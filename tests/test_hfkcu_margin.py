"""HF-KCU's membership-margin step (``line-search = "membership-margin"``): popularity bins, a user's margins
built by hand, the bracketing root search on known 1-D functions, nodes answering with sums only, and the phase on a
tiny poisoned federation stopping where the forgotten users' mean margin on their dominated items is 0."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from conftest import MessageRecorder

from fedrec_flwr.unlearning.margin import bracket_root, dominated_items, popularity_bins, user_margins

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---------------------------------------------------------------------------------------------- pieces
def test_popularity_bins_are_equal_sized_and_ordered_by_count():
    counts = np.array([5, 0, 9, 0, 3, 7, 1, 2])
    bins = popularity_bins(counts, bins=4)
    assert np.bincount(bins).tolist() == [2, 2, 2, 2]
    assert bins[[1, 3]].tolist() == [0, 0]  # the two unrated items (ties by index) are the least popular
    assert bins[2] == 3 and bins[5] == 3
    assert np.all(np.diff(counts[np.argsort(bins, kind="stable")]) >= -10)
    for low, high in zip(np.argsort(counts), np.argsort(counts)[1:]):
        assert bins[low] <= bins[high] or counts[low] == counts[high]
    with pytest.raises(ValueError, match="bins"):
        popularity_bins(counts, bins=0)


def test_dominated_items_are_those_the_forgotten_users_rate_most():
    assert dominated_items(np.array([3, 0, 5, 2]), np.array([4, 0, 5, 1])).tolist() == [0]


def test_user_margins_equal_the_hand_computed_differences():
    """Items 0-5, bins {0,1,2} / {3,4,5}; the user interacted with 1 and 4 (positives) and 2 (held out); items 1 and 4
    are dominated. Margin of 1: s1 - mean(s0) (2 left out as interacted); of 4: s4 - mean(s3, s5)."""
    scores = np.array([0.5, 3.0, 9.0, -1.0, 2.0, 1.0])
    bins = np.array([0, 0, 0, 1, 1, 1])
    got = user_margins(
        scores, positives=np.array([1, 4]), interacted=np.array([1, 2, 4]), bins=bins, dominated=np.array([1, 4])
    )
    np.testing.assert_allclose(got, [3.0 - 0.5, 2.0 - 0.0])
    only = user_margins(scores, np.array([1, 4]), np.array([1, 2, 4]), bins, dominated=np.array([4, 5]))
    np.testing.assert_allclose(only, [2.0])
    assert user_margins(scores, np.array([1]), np.array([1]), bins, dominated=np.array([3])).size == 0


# ---------------------------------------------------------------------------------------------- the search
@pytest.mark.parametrize("root", [0.3, 1.0, 2.7, 6.5, 21.0])
def test_bracket_root_finds_the_root_of_an_affine_margin_exactly(root):
    """FedMF's margins are affine in the multiple: the regula-falsi answer is exact, wherever the root lies (inside
    the first ladder, or past it after doubling)."""
    calls = []

    def evaluate(steps):
        calls.append(list(steps))
        return [1.7 * (root - a) for a in steps]

    result = bracket_root(evaluate, rounds=4)
    assert result.termination == "root"
    assert result.step == pytest.approx(root, rel=1e-9)
    assert result.rounds == len(calls) <= 4
    assert calls[0][0] == 0.0


def test_bracket_root_narrows_on_a_curved_margin():
    """A convex decreasing M(a) = exp(-a) - 0.2 (root ln 5): the bracket shrinks 4x a round, and the last secant is
    within a few percent."""
    result = bracket_root(lambda steps: [math.exp(-a) - 0.2 for a in steps], rounds=4)
    assert result.termination == "root"
    assert result.step == pytest.approx(math.log(5.0), rel=0.02)
    assert result.rounds == 4


def test_bracket_root_takes_no_step_when_already_non_member_and_stops_unbracketed():
    result = bracket_root(lambda steps: [-0.1 - a for a in steps])
    assert (result.step, result.termination, result.rounds) == (0.0, "nonpositive-at-zero", 1)
    result = bracket_root(lambda steps: [1.0 for _ in steps], max_step=32.0, rounds=5)
    assert result.termination == "unbracketed" and result.step == 32.0 and result.rounds == 3


@pytest.mark.parametrize("reply, message", [(lambda s: [0.0], "returned"), (lambda s: [math.nan] * len(s), "returned")])
def test_bracket_root_refuses_bad_replies(reply, message):
    with pytest.raises(ValueError, match=message):
        bracket_root(reply)
    with pytest.raises(ValueError, match="ladder"):
        bracket_root(lambda s: [1.0] * len(s), ladder=(1.0, 2.0))


# ---------------------------------------------------------------------------------------------- the phase
def test_margin_step_on_a_poisoned_federation_replies_with_sums_and_reaches_zero_margin(tmp_path, caplog):
    """A tiny poisoned MF federation (fakes push one item, ``tests/test_hfkcu_poison.py``'s data) unlearned with
    ``line-search = "membership-margin"``: ``unlearn_counts`` replies carry two ``(I,)`` count vectors and nothing
    else, ``unlearn_margin`` replies carry no array and only node sums (one per step) and a term count; the chosen
    multiple makes the forgotten users' mean margin on their dominated items 0 (recomputed here from their private
    records), the promoted item is dominated, and its genuine users' percentile falls."""
    from test_hfkcu_poison import FAKES, ROUNDS, poisoned_setting

    from experiments.hfkcu.analysis import exposure, private_records, scores
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.config import RunConfig
    from fedrec_flwr.serial import run_serial
    from fedrec_flwr.strategies.unlearning import ClientUnlearning, UnlearningSettings

    mapping, runtime, fakes, target, genuine = poisoned_setting(tmp_path, "mf")
    split = runtime.split
    assert fakes.size == FAKES
    recorder = MessageRecorder(tmp_path / "messages")
    seen = {}

    def on_round(view):
        if view.server_round != ROUNDS:
            return
        config = RunConfig.from_mapping(
            {
                **mapping,
                "unlearning": "hfkcu",
                "line-search": "membership-margin",
                "forget-users": ",".join(str(int(u)) for u in fakes),
            }
        )
        settings = UnlearningSettings.from_config(config, split.num_users)
        theta = {k: v.numpy().astype(np.float64) for k, v in view.arrays.items()}
        new, report = ClientUnlearning(view.strategy, settings).run(view.grid, view.arrays, view.server_round)
        records = private_records(view.grid, range(split.num_users))
        moved = {k: v.numpy() for k, v in new.items()}
        seen.update(
            report=report,
            theta=theta,
            moved=moved,
            before=exposure(runtime, records, theta, genuine, target)["target-percentile"],
            after=exposure(runtime, records, moved, genuine, target)["target-percentile"],
            scores={
                k: scores(runtime, records, a, {int(u): np.arange(split.num_items) for u in fakes})
                for k, a in (("before", theta), ("after", moved))
            },
        )

    caplog.set_level(logging.WARNING, logger="fedrec_flwr.strategies")
    logging.getLogger("fedrec_flwr.strategies").addHandler(
        caplog.handler
    )  # the ServerApp's logging setup stops propagation
    try:
        run_serial(
            RunConfig.from_mapping(mapping), on_round=on_round, client_app=make_client_app(mapping, mods=[recorder])
        )
    finally:
        logging.getLogger("fedrec_flwr.strategies").removeHandler(caplog.handler)
    report = seen["report"]
    assert report["margin-termination"] == "root", report
    assert 0 < report["margin-step"] < report["margin-steps"][-1]
    # the rule's statistic, recomputed from the forgotten users' private records and the split
    n_r = np.bincount(np.concatenate([split.positives(int(u)) for u in genuine]), minlength=split.num_items)
    n_f = np.bincount(np.concatenate([split.positives(int(u)) for u in fakes]), minlength=split.num_items)
    dominated, bins = dominated_items(n_r, n_f), popularity_bins(n_r)
    assert target in dominated and report["margin-dominated-items"] == dominated.size

    def mean_margin(which):
        got = [
            user_margins(
                seen["scores"][which][int(u)], split.positives(int(u)), split.interacted(int(u)), bins, dominated
            )
            for u in fakes
        ]
        return float(np.concatenate(got).mean())

    assert mean_margin("before") > 0.1
    assert mean_margin("before") == pytest.approx(report["margin-values"][0], rel=1e-4)
    assert abs(mean_margin("after")) < 0.02 * mean_margin("before")  # MF: affine in a, float32 model
    assert seen["after"] < seen["before"]
    # privacy: sums only, and the counts' cost is said (one user per node: that user's training items)
    assert "every node sends its users' training-positive counts per item" in caplog.text
    counts = [r for r in recorder.records() if r["type"] == "query.unlearn_counts"]
    margins = [r for r in recorder.records() if r["type"] == "query.unlearn_margin"]
    assert counts and margins
    for record in counts:
        (arrays,) = record["reply-arrays"].values()
        assert set(arrays) == {"remaining", "forgotten"}
        assert all(np.asarray(a).shape == (split.num_items,) for a in arrays.values())
        assert not record["reply-metrics"]
    for record in margins:
        assert not record["reply-arrays"] and not record["reply-configs"]
        (metrics,) = record["reply-metrics"].values()
        assert set(metrics) == {"num-users", "margin-sums", "margin-count"}
    fake_nodes = {int(u) // runtime.config.users_per_node for u in fakes}  # consecutive blocks of users per node
    assert len(margins) == report["margin-rounds"] * len(fake_nodes)  # only the forgotten users' nodes, each round


def test_membership_margin_is_a_valid_line_search_value_and_not_the_default():
    from fedrec_flwr.config import RunConfig, default_mapping
    from fedrec_flwr.errors import ConfigError

    assert (
        RunConfig.from_mapping({**default_mapping(), "line-search": "membership-margin"}).line_search
        == "membership-margin"
    )
    assert RunConfig.from_mapping(default_mapping()).line_search == "none"
    with pytest.raises(ConfigError, match="line-search"):
        RunConfig.from_mapping({**default_mapping(), "line-search": "membership"})


@pytest.mark.parametrize("model", ["mf", "ncf"])
def test_node_margin_sums_batched_equal_the_users_one_at_a_time(tmp_path, model):
    """``margin_sums`` over a node's users in one batched model equals the sum of each user's own margins."""
    from test_hfkcu_line_search import random_node

    from fedrec_flwr.unlearning.margin import margin_sums

    runtime, clients, shared, direction = random_node(tmp_path, model, seed=1)
    split = runtime.split
    rng = np.random.default_rng(2)
    bins = popularity_bins(rng.integers(0, 9, size=split.num_items), bins=5)
    dominated = np.unique(np.concatenate([split.positives(u)[:3] for u in range(4)]))
    steps = [0.0, 0.7, 2.0]
    got, count = margin_sums(runtime, clients, shared, direction, steps, bins, dominated)
    expected, expected_count = np.zeros(3), 0
    for client in clients:
        sums, n = margin_sums(runtime, [client], shared, direction, steps, bins, dominated)
        expected += sums
        expected_count += n
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert count == expected_count > 0 and got[0] != got[2]
