"""ItemEmbeddingFedAvg against hand computations, with mock replies (no simulation)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg, RoundFailed, Topology
from fedrec_flwr.wire import ARRAYS, METRICS, ModelLayout, PrivacyViolation

LAYOUT = ModelLayout(
    shared_shapes={"item_embedding.weight": (4, 2), "output.weight": (1, 2)},
    item_keys=("item_embedding.weight",),
    private_keys=("user_embedding.weight",),
)
TABLE = np.arange(8, dtype=np.float32).reshape(4, 2)
DENSE = np.array([[1.0, 1.0]], dtype=np.float32)


def _strategy(**kwargs) -> ItemEmbeddingFedAvg:
    # users 0,1 on node 10; users 2,3 on node 11; user 4 on node 12
    topology = Topology(np.array([10, 10, 11, 11, 12]))
    kwargs.setdefault("fraction_train", 1.0)
    return ItemEmbeddingFedAvg(LAYOUT, topology=topology, seed=0, **kwargs)


def _configure(strategy):
    arrays = ArrayRecord({"item_embedding.weight": Array(TABLE), "output.weight": Array(DENSE)})
    return strategy.configure_train(1, arrays, ConfigRecord(), grid=None)


def _reply(request: Message, rows, sums, counts, dense, n, extra=None, loss=0.5) -> Message:
    arrays = {
        "item_embedding.weight#rows": np.asarray(rows, dtype=np.int64),
        "item_embedding.weight#sum": np.asarray(sums, dtype=np.float32).reshape(len(rows), 2),
        "item_embedding.weight#count": np.asarray(counts, dtype=np.float32),
        "output.weight": np.asarray(dense, dtype=np.float32).reshape(1, 2),
    }
    arrays.update(extra or {})
    content = RecordDict(
        {
            ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            METRICS: MetricRecord({"num-examples": float(n), "num-users": 1, "train-loss": loss}),
        }
    )
    return Message(content=content, reply_to=request)


def test_configure_train_sends_each_node_its_sampled_users(task_identity):
    messages = {m.metadata.dst_node_id: m for m in _configure(_strategy())}
    assert sorted(messages) == [10, 11, 12]
    assert list(messages[10].content["config"]["users"]) == [0, 1]
    assert list(messages[12].content["config"]["users"]) == [4]
    assert messages[11].content["config"]["server-round"] == 1


def test_rowwise_and_weighted_dense_average_match_hand_computation(task_identity):
    strategy = _strategy()
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    replies = [
        # node 10: two users touched row 0 (sum of their rows), one touched row 2
        _reply(requests[10], [0, 2], [[2.0, 4.0], [10.0, 10.0]], [2, 1], [[3.0, 3.0]], n=10),
        # node 11: one user touched row 0 and row 3
        _reply(requests[11], [0, 3], [[7.0, 7.0], [1.0, 1.0]], [1, 1], [[0.0, 6.0]], n=30),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    table = arrays["item_embedding.weight"].numpy()
    np.testing.assert_allclose(table[0], [(2 + 7) / 3, (4 + 7) / 3], rtol=1e-6)  # 3 users touched row 0
    np.testing.assert_allclose(table[1], TABLE[1])  # nobody touched row 1: unchanged
    np.testing.assert_allclose(table[2], [10.0, 10.0])
    np.testing.assert_allclose(table[3], [1.0, 1.0])
    dense = arrays["output.weight"].numpy()
    np.testing.assert_allclose(dense, [[(10 * 3 + 30 * 0) / 40, (10 * 3 + 30 * 6) / 40]], rtol=1e-6)
    assert strategy.last_train["num-replies"] == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"sums": [[np.nan, 1.0]]},
        {"sums": [[np.inf, 1.0]]},
        {"counts": [0.0]},
        {"n": 0},
        {"rows": [9]},
        {"extra": {"surprise": np.zeros(2, dtype=np.float32)}},
    ],
)
def test_bad_replies_are_rejected_and_never_change_the_model(task_identity, bad):
    strategy = _strategy(min_train_fraction=0.0)
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    args = {"rows": [1], "sums": [[5.0, 5.0]], "counts": [1.0], "dense": [[9.0, 9.0]], "n": 5}
    args.update(bad)
    good = _reply(requests[10], [0], [[1.0, 1.0]], [1], [[2.0, 2.0]], n=5)
    arrays, _ = strategy.aggregate_train(1, [good, _reply(requests[11], **args)])
    table = arrays["item_embedding.weight"].numpy()
    np.testing.assert_allclose(table[1], TABLE[1])  # the bad reply's row 1 never landed
    np.testing.assert_allclose(arrays["output.weight"].numpy(), [[2.0, 2.0]])
    assert strategy.last_train["num-replies"] == 1


def test_update_norm_is_the_mean_change_of_the_sent_parameters(task_identity):
    strategy = _strategy()
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    # row 2 was (4, 5): two users summing to (10, 12) -> mean (5, 6), change (1, 1); dense (1, 1) -> (1, 3): (0, 2)
    reply = _reply(requests[10], [2], [[10.0, 12.0]], [2], [[1.0, 3.0]], n=4)
    assert strategy.update_norm(reply.content) == pytest.approx(np.sqrt(1 + 1 + 0 + 4))


def test_max_update_norm_rejects_long_updates_with_a_logged_reason(task_identity, caplog):
    strategy = _strategy(min_train_fraction=0.0, max_update_norm=3.0)
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    small = _reply(requests[10], [0], [[0.5, 1.5]], [1], [[1.0, 2.0]], n=5)  # change sqrt(0.25 + 0.25 + 1) < 3
    large = _reply(requests[11], [1], [[100.0, 3.0]], [1], [[1.0, 1.0]], n=5)  # row 1 moves by 98
    with caplog.at_level("WARNING", logger="fedrec_flwr.strategies.item_fedavg"):
        arrays, _ = strategy.aggregate_train(1, [small, large])
    np.testing.assert_allclose(arrays["item_embedding.weight"].numpy()[1], TABLE[1])  # never reached the model
    np.testing.assert_allclose(arrays["item_embedding.weight"].numpy()[0], [0.5, 1.5])
    # node 11 rejected, node 12 sampled but silent: both count as failures
    assert strategy.last_train["num-replies"] == 1 and strategy.last_train["num-failures"] == 2
    assert "node 11" in caplog.text and "exceeds max-update-norm 3" in caplog.text
    assert "node 12 failed: no reply within round-timeout" in caplog.text
    off = _strategy(min_train_fraction=0.0)  # 0 = off: the same reply is accepted
    requests = {m.metadata.dst_node_id: m for m in _configure(off)}
    large = _reply(requests[11], [1], [[100.0, 3.0]], [1], [[1.0, 1.0]], n=5)
    assert off.aggregate_train(1, [large])[0]["item_embedding.weight"].numpy()[1, 0] == 100.0


def test_a_round_whose_replies_are_all_too_long_fails_loudly(task_identity):
    strategy = _strategy(max_update_norm=1.0)
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    replies = [_reply(requests[n], [0], [[50.0, 50.0]], [1], [[1.0, 1.0]], n=5) for n in (10, 11, 12)]
    with pytest.raises(RoundFailed, match="0 valid replies of 3.*exceeds max-update-norm"):
        strategy.aggregate_train(1, replies)


def test_reply_carrying_a_user_embedding_fails_the_round(task_identity):
    strategy = _strategy()
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    leak = {"user_embedding.weight": np.ones((1, 2), dtype=np.float32)}
    with pytest.raises(PrivacyViolation, match="user_embedding"):
        strategy.aggregate_train(1, [_reply(requests[10], [0], [[1.0, 1.0]], [1], [[0.0, 0.0]], 3, extra=leak)])


def test_a_node_the_superlink_reports_unavailable_is_named_as_the_failed_node(task_identity, caplog):
    """Flower's SuperLink answers for a node that stopped sending heartbeats with an error reply from itself (node
    1): the failure is logged and counted against the sampled node that did not answer."""
    strategy = _strategy(min_train_fraction=0.0)
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    good = [_reply(requests[n], [0], [[1.0, 1.0]], [1], [[2.0, 2.0]], n=5) for n in (10, 12)]
    unavailable = Message(Error(code=5, reason="Error: Node Unavailable"), reply_to=requests[11])
    unavailable.metadata.__dict__["_src_node_id"] = 1  # what the SuperLink sends
    with caplog.at_level("WARNING", logger="fedrec_flwr.strategies.item_fedavg"):
        strategy.aggregate_train(1, [*good, unavailable])
    assert strategy.failures == {11: 1}
    assert "round 1: node 11 failed: Error: Node Unavailable" in caplog.text
    assert strategy.last_train["num-failures"] == 1


def test_too_few_valid_replies_fail_the_round_and_failures_are_counted(task_identity):
    strategy = _strategy(min_train_fraction=0.7)
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    failed = [Message(Error(code=1, reason="crash"), reply_to=requests[n]) for n in (11, 12)]
    good = _reply(requests[10], [0], [[1.0, 1.0]], [1], [[2.0, 2.0]], n=5)
    with pytest.raises(RoundFailed, match="1 valid replies of 3"):
        strategy.aggregate_train(1, [good, *failed])
    assert strategy.failures == {11: 1, 12: 1}


def test_sampling_is_by_user_and_fixed_by_seed():
    topology = Topology(np.arange(100) // 10)
    a = ItemEmbeddingFedAvg(LAYOUT, topology=topology, seed=3, fraction_train=0.2)
    b = ItemEmbeddingFedAvg(LAYOUT, topology=Topology(np.arange(100)), seed=3, fraction_train=0.2)
    for rnd in (1, 2, 3):
        np.testing.assert_array_equal(a.sample_train_users(rnd), b.sample_train_users(rnd))
        assert len(a.sample_train_users(rnd)) == 20
    assert not np.array_equal(a.sample_train_users(1), a.sample_train_users(2))


def test_evaluation_rounds():
    strategy = ItemEmbeddingFedAvg(LAYOUT, eval_every=5, num_rounds=12)
    assert [r for r in range(1, 13) if strategy.is_evaluation_round(r)] == [5, 10, 12]


def test_evaluation_metrics_are_the_mean_over_users_weighting_each_reply_by_its_users(task_identity):
    """A node's evaluate reply carries its users' mean metrics and ``num-examples`` = its number of users: the
    round's metric is the mean over all evaluated users (weights 1 and 3), not the mean of the two replies."""
    strategy = _strategy()
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}

    def evaluate_reply(node, users, hr, ndcg):
        content = RecordDict({METRICS: MetricRecord({"num-examples": float(users), "HR@10": hr, "NDCG@10": ndcg})})
        return Message(content=content, reply_to=requests[node])

    failed = Message(Error(code=1, reason="crash"), reply_to=requests[12])
    metrics = strategy.aggregate_evaluate(
        1, [evaluate_reply(11, 3, 0.0, 0.25), failed, evaluate_reply(10, 1, 1.0, 0.5)]
    )
    assert metrics["HR@10"] == (1 * 1.0 + 3 * 0.0) / 4 == 0.25
    assert metrics["NDCG@10"] == (1 * 0.5 + 3 * 0.25) / 4 == 0.3125
    assert strategy.last_evaluate == {"HR@10": 0.25, "NDCG@10": 0.3125, "eval-users": 4.0, "eval-failures": 1.0}


def test_min_train_fraction_rounds_the_needed_replies_up(task_identity):
    """3 sampled nodes, min-train-fraction 0.5: ceil(1.5) = 2 valid replies are needed; 1 fails the round."""
    strategy = _strategy(min_train_fraction=0.5)
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    with pytest.raises(RoundFailed, match=r"1 valid replies of 3 sampled nodes \(min-train-fraction 0.5 needs 2\)"):
        strategy.aggregate_train(1, [_reply(requests[10], [0], [[1.0, 1.0]], [1], [[2.0, 2.0]], n=5)])
    strategy = _strategy(min_train_fraction=0.5)
    requests = {m.metadata.dst_node_id: m for m in _configure(strategy)}
    good = [_reply(requests[n], [0], [[1.0, 1.0]], [1], [[2.0, 2.0]], n=5) for n in (10, 11)]
    strategy.aggregate_train(1, good)
    assert strategy.last_train["num-replies"] == 2 and strategy.last_train["num-failures"] == 1
