"""Flower's own strategies through :class:`fedrec_flwr.strategies.flower_adapter.FlowerStrategyAdapter`: every class of
``flwr.serverapp.strategy`` (found at test time), the dense-reply semantics against hand computations and against
``item-fedavg`` with ``"selected"`` rows, privacy, and the ``strategy-args`` checks."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
from conftest import MessageRecorder, assert_no_private_value_in_replies, tiny_run_config
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower
from flwr.serverapp.strategy import FedAvg, FedMedian, Strategy

from fedrec_flwr.app.client_app import make_client_app
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.registry import resolve_strategy
from fedrec_flwr.serial import run_serial
from fedrec_flwr.strategies.flower_adapter import FlowerStrategyAdapter, build_flower_strategy, parse_strategy_args
from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg, Topology
from fedrec_flwr.wire import ARRAYS, METRICS, ModelLayout, PrivacyViolation

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FLOWER = "flwr.serverapp.strategy:"

REQUIRED_VALUES = {
    "strategy": FLOWER + "FedAvg",
    "noise_multiplier": 0.1,
    "clipping_norm": 100.0,
    "num_sampled_clients": 4,
    "client_learning_rate": 0.01,
}
"""Values for constructor arguments without a default (a new Flower strategy with another one fails the test below
with the argument's name: add a value here)."""

REFUSED = {
    "FedXgbBagging": "XGBoost boosters",
    "DifferentialPrivacyClientSideFixedClipping": "does not honour",
    "DifferentialPrivacyClientSideAdaptiveClipping": "does not honour",
}
"""Classes that cannot serve our models, with the reason the run stops with: XGBoost bagging aggregates one serialized
booster; client-side DP needs clipping on the client, which ours do not do (a ConfigError before any message)."""


def _needs_callable(cls: type) -> bool:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return any(p.default is p.empty and "Callable" in str(p.annotation) for p in params)


def flower_strategy_classes() -> list[str]:
    """Every concrete strategy class of ``flwr.serverapp.strategy`` whose constructor needs no callable argument."""
    names = []
    for name in sorted(dir(flower)):
        cls = getattr(flower, name)
        if (
            isinstance(cls, type)
            and issubclass(cls, Strategy)
            and not inspect.isabstract(cls)
            and not _needs_callable(cls)
        ):
            names.append(name)
    return names


def test_the_discovery_finds_flowers_strategies():
    names = flower_strategy_classes()
    assert {"FedAvg", "FedAdam", "FedProx", "FedMedian", "Krum", "Bulyan", "QFedAvg"} <= set(names)
    assert "Strategy" not in names


@pytest.mark.parametrize("name", flower_strategy_classes())
def test_every_flower_strategy_runs_two_rounds_through_the_adapter(tmp_path, name):
    cls = getattr(flower, name)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    required = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [n for n in required if n not in REQUIRED_VALUES]
    if unknown:
        pytest.fail(f"{name} needs {unknown}: add test values to REQUIRED_VALUES")
    args = ",".join(f"{n}={REQUIRED_VALUES[n]}" for n in required)
    config = tiny_run_config(
        tmp_path,
        strategy=FLOWER + name,
        strategy_args=args,
        num_server_rounds=2,
        users_per_node=6,
        eval_every=2,
        fraction_evaluate=0.5,
    )
    if name in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[name]):
            run_serial(config)
        return
    folder = run_serial(config)
    rows = json.loads((folder / "metrics.json").read_text())
    assert [r["round"] for r in rows] == [1, 2]
    # every sampled user trains, unless the strategy addresses fewer nodes (FedXgbCyclic: one node per round)
    assert all(0 < r["train-users"] <= 12 and r["num-failures"] == 0 for r in rows)
    assert name == "FedXgbCyclic" or all(r["train-users"] == 12 for r in rows)
    assert np.isfinite(rows[-1]["HR@10"])
    final = np.load(folder / "final_arrays.npz")
    assert all(np.isfinite(final[k]).all() for k in final.files)
    recorded = json.loads((folder / "config.json").read_text())
    assert recorded["run-config"]["strategy-args"] == args
    assert recorded["strategy"]["wrapped"].endswith(":" + name)
    assert set(required) <= set(recorded["strategy"]["arguments"])


# ---------------------------------------------------------------------------------------------- semantics, by hand
ITEMS, SCORE = "item_embedding.weight", "output.weight"
LAYOUT = ModelLayout({ITEMS: (4, 2), SCORE: (1, 2)}, (ITEMS,), ("user_embedding.weight",))
TABLE = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=np.float32)  # row i = (2i, 2i + 1)
SENT_SCORE = np.ones((1, 2), dtype=np.float32)
TOPOLOGY = Topology(np.array([10, 10, 11, 11, 12]))  # users 0,1 on node 10; 2,3 on node 11; 4 on node 12
# per node: (num-users, rows, sums, counts, dense value)
REPLIES = {
    10: (2, [0], [[10.0, 10.0]], [1], [[3.0, 3.0]]),
    11: (2, [0, 1], [[4.0, 4.0], [6.0, 6.0]], [2, 1], [[5.0, 5.0]]),
    12: (1, [3], [[1.0, 1.0]], [1], [[0.0, 0.0]]),
}


def _round(strategy, examples: dict[int, float], extra=None, silent=()):
    """One round over :data:`REPLIES`; the nodes in ``silent`` send no reply."""
    arrays = ArrayRecord({ITEMS: Array(TABLE), SCORE: Array(SENT_SCORE)})
    requests = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, arrays, ConfigRecord(), grid=None)}
    replies = []
    for node, (users, rows, sums, counts, dense) in REPLIES.items():
        if node in silent:
            continue
        reply = {
            ITEMS + "#rows": np.asarray(rows, np.int64),
            ITEMS + "#sum": np.asarray(sums, np.float32),
            ITEMS + "#count": np.asarray(counts, np.float32),
            SCORE: np.asarray(dense, np.float32),
            **(extra or {}),
        }
        content = RecordDict(
            {
                ARRAYS: ArrayRecord({k: Array(v) for k, v in reply.items()}),
                METRICS: MetricRecord({"num-examples": examples[node], "num-users": users, "train-loss": 0.5}),
            }
        )
        replies.append(Message(content=content, reply_to=requests[node]))
    new, _ = strategy.aggregate_train(1, replies)
    return {k: v.numpy() for k, v in new.items()}, requests


def _adapter(cls=FedAvg, **args):
    wrapped, arguments = build_flower_strategy(cls, args)
    return FlowerStrategyAdapter(
        LAYOUT, wrapped=wrapped, arguments=arguments, topology=TOPOLOGY, seed=0, fraction_train=1.0
    )


def _dense_by_hand() -> dict[int, np.ndarray]:
    """Each node's reply as a full table: its users' mean, a row a user did not touch counting as TABLE's value."""
    dense = {}
    for node, (users, rows, sums, counts, _) in REPLIES.items():
        table = TABLE.astype(np.float64).copy()
        for row, total, count in zip(rows, np.asarray(sums), counts):
            table[row] = (total + (users - count) * TABLE[row]) / users
        dense[node] = table
    return dense


def test_a_node_reply_is_its_users_mean_full_table_and_fedavg_weights_it_by_examples(task_identity):
    examples = {10: 6.0, 11: 2.0, 12: 4.0}
    new, requests = _round(_adapter(), examples)
    assert list(requests[10].content["config"]["users"]) == [0, 1]  # the adapter names each node's users
    dense = _dense_by_hand()
    expected = sum(examples[n] * dense[n] for n in REPLIES) / sum(examples.values())
    np.testing.assert_allclose(new[ITEMS], expected, rtol=1e-6)
    np.testing.assert_allclose(new[ITEMS][2], TABLE[2])  # a row nobody touched does not move
    np.testing.assert_allclose(new[SCORE], [[(6 * 3 + 2 * 5 + 0) / 12] * 2], rtol=1e-6)


def test_fedavg_equals_item_fedavg_selected_when_examples_are_proportional_to_users(task_identity):
    examples = {10: 6.0, 11: 6.0, 12: 3.0}  # 3 examples per user
    ours, _ = _round(
        ItemEmbeddingFedAvg(LAYOUT, topology=TOPOLOGY, seed=0, fraction_train=1.0, item_aggregation="selected"),
        examples,
    )
    theirs, _ = _round(_adapter(), examples)
    for key in ours:
        np.testing.assert_allclose(theirs[key], ours[key], rtol=1e-6, err_msg=key)
    unequal, _ = _round(_adapter(), {10: 6.0, 11: 2.0, 12: 4.0})  # otherwise they differ by the weighting
    assert not np.allclose(unequal[ITEMS], ours[ITEMS])
    by_users, _ = _round(_adapter(weighted_by_key="num-users"), {10: 6.0, 11: 2.0, 12: 4.0})
    np.testing.assert_allclose(by_users[ITEMS], ours[ITEMS], rtol=1e-6)  # ... unless weighted by num-users
    # Dense parameters (NCF's MLP): ours are weighted by examples like FedAvg, so FedAvg-by-users differs there; this
    # is why FedAvg-by-users equals item-fedavg-selected for FedMF but not for FedNCF (experiments/flower_strategies).
    ours_unequal, _ = _round(
        ItemEmbeddingFedAvg(LAYOUT, topology=TOPOLOGY, seed=0, fraction_train=1.0, item_aggregation="selected"),
        {10: 6.0, 11: 2.0, 12: 4.0},
    )
    np.testing.assert_allclose(unequal[SCORE], ours_unequal[SCORE], rtol=1e-6)
    np.testing.assert_allclose(by_users[ITEMS], ours_unequal[ITEMS], rtol=1e-6)
    assert not np.allclose(by_users[SCORE], ours_unequal[SCORE])


def test_fedmedian_leaves_rows_that_most_users_did_not_train_at_their_global_value(task_identity):
    new, _ = _round(_adapter(FedMedian), {10: 6.0, 11: 2.0, 12: 4.0})
    np.testing.assert_allclose(new[ITEMS], np.median(np.stack(list(_dense_by_hand().values())), axis=0), rtol=1e-6)
    np.testing.assert_allclose(new[ITEMS][[1, 2, 3]], TABLE[[1, 2, 3]])  # each trained by one node of three


def test_a_reply_carrying_a_user_embedding_fails_the_round_before_the_wrapped_strategy_sees_it(task_identity):
    strategy = _adapter()
    strategy.wrapped.aggregate_train = lambda *a: pytest.fail("the wrapped strategy saw a leaking reply")
    with pytest.raises(PrivacyViolation, match="user_embedding"):
        _round(strategy, {10: 6.0, 11: 2.0, 12: 4.0}, extra={"user_embedding.weight": np.ones((1, 2), np.float32)})


# ---------------------------------------------------------------------------------------------- whole runs
def test_flower_fedavg_through_the_adapter_equals_item_fedavg_selected(tmp_path):
    """The tiny data gives every user 12 interactions, so every user has the same example count and the two
    aggregations are the same average (up to float32 rounding)."""
    common = dict(num_server_rounds=3, users_per_node=4, eval_every=3, fraction_evaluate=0.5)
    ours = run_serial(tiny_run_config(tmp_path / "ours", strategy="item-fedavg", item_aggregation="selected", **common))
    theirs = run_serial(tiny_run_config(tmp_path / "theirs", strategy=FLOWER + "FedAvg", **common))
    a, b = np.load(ours / "final_arrays.npz"), np.load(theirs / "final_arrays.npz")
    assert set(a.files) == set(b.files)
    for key in a.files:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)
    rows_a, rows_b = (json.loads((f / "metrics.json").read_text()) for f in (ours, theirs))
    assert [r["train-users"] for r in rows_a] == [r["train-users"] for r in rows_b]


def test_no_reply_carries_private_parameters_through_the_adapter(tmp_path):
    recorder = MessageRecorder(tmp_path / "messages")
    config = tiny_run_config(
        tmp_path,
        strategy=FLOWER + "FedMedian",
        users_per_node=4,
        num_server_rounds=2,
        eval_every=2,
        fraction_evaluate=0.5,
    )
    run_serial(config, client_app=make_client_app(config, mods=[recorder]))
    assert_no_private_value_in_replies(recorder.records(), get_runtime(config).layout)


# ---------------------------------------------------------------------------------------------- strategy-args
def test_strategy_args_parse_literals_and_keep_commas_inside_brackets():
    assert parse_strategy_args(" eta=1e-2, beta_1 = 0.9,flag=true, name='a,b', xs=[1, 2], s=flwr.x:Y") == {
        "eta": 0.01,
        "beta_1": 0.9,
        "flag": True,
        "name": "a,b",
        "xs": [1, 2],
        "s": "flwr.x:Y",
    }
    assert parse_strategy_args("") == {}
    assert parse_strategy_args("  ") == {}


@pytest.mark.parametrize(
    ("cls", "args", "message"),
    [
        (flower.FedAdam, "etta=0.1", "has no argument 'etta'"),
        (flower.FedAdam, "fraction_train=0.5", "set by the adapter"),
        (flower.FedAdam, "eta='fast'", "does not fit the parameter's type float"),
        (flower.FedAvg, "train_metrics_aggr_fn=print", "takes a callable"),
        (flower.QFedAvg, "", r"needs \['client_learning_rate'\]"),
        (flower.FedAvg, "eta", "is not name=value"),
        (flower.FedAdam, "eta=0.1,,beta_1=0.9", "entry 2 of 3 is empty"),
        (flower.FedAdam, "eta=0.1,", "entry 2 of 2 is empty"),
        (flower.FedAdam, "eta=0.1,name='a", "the quote ' is never closed"),
        (flower.FedAdam, "xs=[1,2", "its brackets do not balance"),
        (flower.FedAdam, "xs=1]", "its brackets do not balance"),
        (flower.FedXgbBagging, "", "XGBoost"),
    ],
)
def test_bad_strategy_args_name_the_problem(cls, args, message):
    with pytest.raises(ConfigError, match=message):
        build_flower_strategy(cls, parse_strategy_args(args))


def test_a_flower_strategy_resolves_to_the_adapter_and_strategy_args_need_one(tmp_path):
    assert resolve_strategy(FLOWER + "FedAdam") is FlowerStrategyAdapter
    assert resolve_strategy("item-fedavg") is ItemEmbeddingFedAvg
    with pytest.raises(ConfigError, match="'strategy-args'.*item-fedavg"):
        run_serial(tiny_run_config(tmp_path, strategy="item-fedavg", strategy_args="eta=0.1"))


def test_a_subclass_taking_kwargs_records_the_arguments_by_their_own_names():
    """A Flower strategy subclass with ``**kwargs``: the record (log line, config.json) lists what it took, e.g.
    ``tag``, and no ``kwargs`` entry."""

    class TaggedFedAvg(FedAvg):
        def __init__(self, tag: str = "", **kwargs):
            super().__init__(**kwargs)
            self.tag = tag

    strategy, record = build_flower_strategy(TaggedFedAvg, parse_strategy_args("tag=hello,min_evaluate_nodes=1"))
    assert strategy.tag == "hello"
    assert record["tag"] == "hello" and record["min_evaluate_nodes"] == 1 and "kwargs" not in record


def test_server_side_dp_with_several_users_per_node_warns_that_its_unit_is_the_node():
    """Flower's server-side DP wrappers clip and noise each reply; a reply of a node serving k > 1 users is their
    mean, so the guarantee is per node. That ran with no warning (the tester's finding); now it is named."""
    from fedrec_flwr.strategies.flower_adapter import node_level_dp_warning

    dp, _ = build_flower_strategy(
        flower.DifferentialPrivacyServerSideFixedClipping,
        parse_strategy_args(
            "strategy=flwr.serverapp.strategy:FedAvg,noise_multiplier=0.1,clipping_norm=1.0,num_sampled_clients=19"
        ),
    )
    warning = node_level_dp_warning(dp, users_per_node=50)
    assert warning is not None and "per node (a group of users), not per user" in warning and "= 50" in warning
    assert node_level_dp_warning(dp, users_per_node=1) is None
    assert node_level_dp_warning(FedAvg(), users_per_node=50) is None


DP_SERVER_SIDE = {
    "DifferentialPrivacyServerSideFixedClipping": "clipping_norm=1.0,",
    "DifferentialPrivacyServerSideAdaptiveClipping": "",
}
"""Flower's server-side DP wrappers, with the arguments each needs beyond the inner strategy, noise and sample size."""


def _dp_args(name: str, sampled: int) -> str:
    return (
        f"strategy=flwr.serverapp.strategy:FedAvg,noise_multiplier=0.1,{DP_SERVER_SIDE[name]}"
        f"num_sampled_clients={sampled}"
    )


@pytest.mark.parametrize("name", sorted(DP_SERVER_SIDE))
def test_server_side_dp_whose_num_sampled_clients_is_not_the_rounds_replies_is_refused_before_round_1(tmp_path, name):
    """fraction-train 0.5 of the tiny data's 24 users, one user per node: 12 replies every round. With
    num_sampled_clients = 10 the wrapper's noise is calibrated to 10 replies and Flower only warns, every round (a new
    user's finding); now the preflight with the data refuses it, naming the keys, the values and the value to set.
    With 12 it passes."""
    from fedrec_flwr.app.preflight import preflight

    config = tiny_run_config(tmp_path, strategy=FLOWER + name, strategy_args=_dp_args(name, 10), users_per_node=1)
    with pytest.raises(ConfigError) as caught:
        run_serial(config)
    message = str(caught.value)
    assert message.startswith(f"run-config key 'strategy-args': {name}(num_sampled_clients=10)"), message
    assert "fraction-train 0.5 of 24 users, users-per-node 1" in message and "every round has 12" in message
    assert "set num_sampled_clients=12 in 'strategy-args'" in message and "\n" not in message
    assert not (tmp_path / "results" / "run").exists()  # refused before the run's folder and its first round
    preflight(
        tiny_run_config(tmp_path, strategy=FLOWER + name, strategy_args=_dp_args(name, 12), users_per_node=1),
        with_data=True,
    )


def test_server_side_dp_whose_rounds_reach_different_numbers_of_nodes_is_refused(tmp_path):
    """fraction-train 0.25 samples 6 of 24 users; with 6 users per node they fall on 4, 4 and 3 nodes in rounds 1-3,
    so no num_sampled_clients fits every round: the message says so and how to make the count constant."""
    name = "DifferentialPrivacyServerSideFixedClipping"
    config = tiny_run_config(
        tmp_path, strategy=FLOWER + name, strategy_args=_dp_args(name, 4), users_per_node=6, fraction_train=0.25
    )
    with pytest.raises(ConfigError) as caught:
        run_serial(config)
    message = str(caught.value)
    assert "from 3 (round 3) to 4 (round 1) nodes" in message and "no num_sampled_clients fits every round" in message
    assert "users-per-node = 1" in message and "fraction-train = 1" in message
    with pytest.raises(ConfigError, match="from 3 .* to 4"):  # around a robust rule too (Krum: 3 and 4 are enough)
        run_serial({**config, "strategy-args": _dp_args(name, 4).replace(":FedAvg", ":Krum")})


def test_the_readme_dp_example_passes_the_sample_size_check():
    """The README's server-side DP command (the default experiment: 943 users, fraction-train 0.1, one per node)
    names num_sampled_clients=94, every round's number of replies."""
    from fedrec_flwr.strategies.flower_adapter import dp_sample_size_mismatch, server_side_dp
    from fedrec_flwr.wire import sample_users

    dp, _ = build_flower_strategy(
        flower.DifferentialPrivacyServerSideFixedClipping,
        parse_strategy_args(_dp_args("DifferentialPrivacyServerSideFixedClipping", 94)),
    )
    assert server_side_dp(dp) is dp and server_side_dp(FedAvg()) is None
    rounds = {}
    for server_round in range(1, 101):
        rounds.setdefault(len(sample_users(0, server_round, 943, 0.1)), (server_round, 94))
    assert dp_sample_size_mismatch(dp, rounds, num_users=943, fraction_train=0.1, users_per_node=1) is None
    assert "set num_sampled_clients=94" in dp_sample_size_mismatch(
        build_flower_strategy(
            flower.DifferentialPrivacyServerSideFixedClipping,
            parse_strategy_args(_dp_args("DifferentialPrivacyServerSideFixedClipping", 95)),
        )[0],
        rounds,
        num_users=943,
        fraction_train=0.1,
        users_per_node=1,
    )


# ---------------------------------------------------------------------------------------------- values refused up front
@pytest.mark.parametrize(
    ("name", "args", "argument", "value"),
    [
        ("FedAvg", "weighted_by_key=foo", "weighted_by_key", "'foo'"),  # was: InconsistentMessageReplies in round 1
        ("FedMedian", "weighted_by_key=train-loss", "weighted_by_key", "'train-loss'"),
        ("QFedAvg", "client_learning_rate=0.1,train_loss_key=train_loss", "train_loss_key", "'train_loss'"),
        ("QFedAvg", "client_learning_rate=0", "client_learning_rate", "0.0"),  # was: ZeroDivisionError in round 1
        ("QFedAvg", "client_learning_rate=0.1,q=-1", "q", "-1.0"),
        ("FedAdam", "tau=0", "tau", "0.0"),
        ("FedAdam", "eta=-0.1", "eta", "-0.1"),
        ("FedYogi", "beta_2=1.5", "beta_2", "1.5"),
        ("FedAdam", "beta_1=1", "beta_1", "1.0"),
        ("FedAvgM", "server_momentum=1", "server_momentum", "1.0"),
        ("FedAvgM", "server_learning_rate=0", "server_learning_rate", "0.0"),
        ("Krum", "num_malicious_nodes=-1", "num_malicious_nodes", "-1"),
        ("MultiKrum", "num_nodes_to_select=0", "num_nodes_to_select", "0"),  # was: "returned arrays {}" in round 1
    ],
)
def test_flower_strategy_args_that_break_in_round_1_are_refused_by_the_preflight(tmp_path, name, args, argument, value):
    """Values that pass the signature and type checks but break (or silently mislead) once replies arrive are refused
    when the run config is checked (the launcher's, run_serial's and the ServerApp's preflight, no data needed): one
    line naming the strategy, the argument and the value."""
    from fedrec_flwr.app.preflight import preflight

    with pytest.raises(ConfigError) as caught:
        preflight(tiny_run_config(tmp_path, strategy=FLOWER + name, strategy_args=args))
    message = str(caught.value)
    assert f"{name}({argument}={value})" in message and "'strategy-args'" in message and "\n" not in message


@pytest.mark.parametrize("args", ["weighted_by_key=num-users", "weighted_by_key=num-examples"])
def test_flower_strategies_may_weight_by_either_count_every_reply_carries(tmp_path, args):
    from fedrec_flwr.app.preflight import preflight

    preflight(tiny_run_config(tmp_path, strategy=FLOWER + "FedAvg", strategy_args=args))
    preflight(
        tiny_run_config(
            tmp_path,
            strategy=FLOWER + "QFedAvg",
            strategy_args="client_learning_rate=0.1,train_loss_key=train-loss,q=0",
        )
    )


# ---------------------------------------------------------------------------------------------- Krum, MultiKrum, Bulyan
def test_robust_strategies_name_the_reply_count_they_need():
    """Krum / MultiKrum: n > 2f + 2 (Blanchard et al. 2017; Flower does not check it), MultiKrum also selects at most
    n; Bulyan: n >= 4f + 3 (Flower skips the aggregation below it). Found through a DP wrapper too."""
    from fedrec_flwr.strategies.flower_adapter import robust_aggregation_shortfall as shortfall

    krum, _ = build_flower_strategy(flower.Krum, {"num_malicious_nodes": 2})
    assert "more than 2 * num_malicious_nodes + 2 = 6" in shortfall(krum, 6)
    assert shortfall(krum, 7) is None
    multi, _ = build_flower_strategy(flower.MultiKrum, {"num_malicious_nodes": 1, "num_nodes_to_select": 6})
    assert "more than 2 * num_malicious_nodes + 2 = 4" in shortfall(multi, 4)
    assert "num_nodes_to_select = 6" in shortfall(multi, 5)
    assert shortfall(multi, 6) is None
    bulyan, _ = build_flower_strategy(flower.Bulyan, {"num_malicious_nodes": 1})
    assert "at least 4 * num_malicious_nodes + 3 = 7" in shortfall(bulyan, 6)
    assert shortfall(bulyan, 7) is None
    dp, _ = build_flower_strategy(
        flower.DifferentialPrivacyServerSideFixedClipping,
        parse_strategy_args(
            "strategy=flwr.serverapp.strategy:Bulyan,noise_multiplier=0.1,clipping_norm=1.0,num_sampled_clients=2"
        ),
    )
    assert "at least 4 * num_malicious_nodes + 3 = 3" in shortfall(dp, 2)
    assert shortfall(FedAvg(), 1) is None


@pytest.mark.parametrize(
    ("name", "args", "condition"),
    [
        ("Krum", "num_malicious_nodes=5", "more than 2 * num_malicious_nodes + 2 = 12"),
        ("Bulyan", "num_malicious_nodes=3", "at least 4 * num_malicious_nodes + 3 = 15"),
        ("MultiKrum", "num_nodes_to_select=13", "num_nodes_to_select = 13"),
    ],
)
def test_a_round_too_small_for_a_robust_strategy_is_refused_before_any_round(tmp_path, name, args, condition):
    """fraction-train 0.5 of the tiny data's 24 users samples 12 users, one per node: too few for these arguments.
    That ran (Krum, MultiKrum: silently scoring with fewer neighbours or averaging everyone; Bulyan: skipping every
    aggregation) or failed in round 1; now the preflight with the data refuses it, naming the numbers."""
    config = tiny_run_config(tmp_path, strategy=FLOWER + name, strategy_args=args, users_per_node=1)
    with pytest.raises(ConfigError) as caught:
        run_serial(config)
    message = str(caught.value)
    assert condition in message and "12 users on 12 nodes" in message and "fraction-train 0.5 of 24 users" in message
    assert not (tmp_path / "results" / "run").exists()  # refused before the run's folder and its first round


FORGET_AFTER_ROUND_1 = {
    "users_per_node": 1,
    "forget_users": "0,1,2,3,4,5",
    "unlearning": "gradient-ascent",
    "unlearn_round": 1,
}
"""The tiny data's 24 users, fraction-train 0.5: 12 train per round; forgetting users 0-5 after round 1 leaves 10 in
rounds 2 and 3 (the seeded draws), one per node."""


def test_a_round_after_the_unlearning_phase_too_small_for_a_robust_strategy_is_refused_before_any_round(tmp_path):
    """The reply-count checks counted every round's sampled users, the forgotten ones too, so rounds after
    ``unlearn-round`` (which train without them) were checked with replies they never get: Krum with
    num_malicious_nodes = 4 (n > 10) passed with 12 replies in round 1 and ran rounds 2-3 on 10. Now refused,
    naming the round and the forgotten users; with the phase after the last round (unlearn-round = 0) it passes."""
    from fedrec_flwr.app.preflight import preflight

    config = tiny_run_config(
        tmp_path, strategy=FLOWER + "Krum", strategy_args="num_malicious_nodes=4", **FORGET_AFTER_ROUND_1
    )
    with pytest.raises(ConfigError) as caught:
        preflight(config, with_data=True)
    message = str(caught.value)
    assert "more than 2 * num_malicious_nodes + 2 = 10" in message and "round 2 trains 10 users on 10 nodes" in message
    assert "without the 6 forgotten users after the unlearning phase of round 1" in message and "\n" not in message
    preflight({**config, "unlearn-round": 0}, with_data=True)


@pytest.mark.parametrize(
    ("unlearning", "remedy"),
    [
        ("gradient-ascent", "set unlearn-round = 0"),
        ("continue", "use another unlearning method and unlearn-round = 0"),
    ],
)
def test_server_side_dp_whose_rounds_after_the_unlearning_phase_have_fewer_replies_is_refused(
    tmp_path, unlearning, remedy
):
    """num_sampled_clients = 12 fits rounds 1..unlearn-round, not the rounds after it (10 replies: the forgotten users
    train no more), nor unlearning = "continue"'s own rounds; the check took every round as 12 and passed."""
    from fedrec_flwr.app.preflight import preflight

    name = "DifferentialPrivacyServerSideFixedClipping"
    config = tiny_run_config(
        tmp_path,
        strategy=FLOWER + name,
        strategy_args=_dp_args(name, 12),
        **{**FORGET_AFTER_ROUND_1, "unlearning": unlearning},
    )
    with pytest.raises(ConfigError) as caught:
        preflight(config, with_data=True)
    message = str(caught.value)
    assert message.startswith(f"run-config key 'strategy-args': {name}(num_sampled_clients=12)"), message
    assert "the unlearning phase of round 1 train without its 6 forgotten users (round 2: 10 nodes)" in message
    assert remedy in message and "users-per-node = 1" not in message
    if unlearning != "continue":
        preflight({**config, "unlearn-round": 0}, with_data=True)


def test_the_checked_users_of_each_round_are_the_ones_it_trains(tmp_path):
    """:meth:`ItemEmbeddingFedAvg.planned_train_users`, which the reply-count checks count before round 1, against
    a run: 12 users in round 1, 10 after the unlearning phase of round 1 removed users 0-5."""
    from fedrec_flwr.app.preflight import _block_topology
    from fedrec_flwr.config import RunConfig

    config = tiny_run_config(tmp_path, eval_every=3, **FORGET_AFTER_ROUND_1)
    runtime = get_runtime(config)
    strategy = ItemEmbeddingFedAvg.from_run_config(
        RunConfig.from_mapping(config), runtime.layout, _block_topology(RunConfig.from_mapping(config), 24)
    )
    planned = [len(strategy.planned_train_users(r)) for r in strategy.planned_train_rounds()]
    rows = json.loads((run_serial(config) / "metrics.json").read_text())
    assert planned == [row["train-users"] for row in rows if "train-users" in row] == [12, 10, 10]


def test_a_robust_strategy_whose_round_loses_replies_fails_it_with_the_numbers(task_identity):
    """Krum over the 3 nodes of TOPOLOGY is fine (n = 3 > 2); with one node silent, 2 replies are too few for it
    (the round would otherwise score each reply against a single neighbour)."""
    from fedrec_flwr.strategies.item_fedavg import RoundFailed

    _round(_adapter(flower.Krum), {10: 6.0, 11: 2.0, 12: 4.0})
    with pytest.raises(
        RoundFailed,
        match=r"round 1: .*Krum.* more than 2 \* num_malicious_nodes \+ 2 = 2 .* 2 "
        r"accepted replies of the 3 sampled nodes",
    ):
        _round(_adapter(flower.Krum), {10: 6.0, 11: 2.0, 12: 4.0}, silent=(12,))


def test_a_federation_with_too_few_nodes_for_a_robust_strategy_is_told_to_lower_users_per_node(tmp_path):
    """24 users, 6 per node: 4 nodes, fewer than Krum with num_malicious_nodes 1 ever gets (n > 4); raising
    fraction-train cannot help, so the error says so instead of suggesting it (a new user's finding)."""
    config = tiny_run_config(
        tmp_path, strategy=FLOWER + "Krum", strategy_args="num_malicious_nodes=1", users_per_node=6
    )
    with pytest.raises(ConfigError) as caught:
        run_serial(config)
    message = str(caught.value)
    assert "only 4 nodes" in message and "lower 'users-per-node'" in message and "raise 'fraction-train'" not in message


def test_a_bad_inner_strategy_is_blamed_on_strategy_args_not_on_strategy(tmp_path):
    config = tiny_run_config(
        tmp_path,
        strategy=FLOWER + "DifferentialPrivacyServerSideFixedClipping",
        strategy_args=(
            "strategy=flwr.serverapp.strategy:NoSuch,noise_multiplier=0.1,clipping_norm=1.0,num_sampled_clients=2"
        ),
    )
    with pytest.raises(ConfigError) as caught:
        run_serial(config)
    message = str(caught.value)
    assert message.startswith("run-config key 'strategy-args'") and "NoSuch" in message
