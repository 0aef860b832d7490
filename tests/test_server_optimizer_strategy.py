"""ServerOptimizerStrategy (FedRecGEL's server) and the 'selected' item aggregation, against hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from test_item_fedavg_strategy import DENSE, LAYOUT, TABLE  # the same 4-item layout and tables

from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg, Topology
from fedrec_flwr.strategies.server_optimizer import ServerOptimizerStrategy
from fedrec_flwr.wire import ARRAYS, METRICS, merge_rows

TOPOLOGY = Topology(np.array([10, 11, 12]))


def _arrays(table=TABLE, dense=DENSE):
    return ArrayRecord(
        {
            "item_embedding.weight": Array(np.asarray(table, np.float32)),
            "output.weight": Array(np.asarray(dense, np.float32)),
        }
    )


def _reply(request, rows, sums, dense, users=1):
    arrays = {
        "item_embedding.weight#rows": np.asarray(rows, np.int64),
        "item_embedding.weight#sum": np.asarray(sums, np.float32).reshape(len(rows), 2),
        "item_embedding.weight#count": np.ones(len(rows), np.float32) * users,
        "output.weight": np.asarray(dense, np.float32).reshape(1, 2),
    }
    content = RecordDict(
        {
            ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            METRICS: MetricRecord(
                {"num-examples": float(users), "num-users": users, "train-loss": 0.1, "gradient-users": users}
            ),
        }
    )
    return Message(content=content, reply_to=request)


def _round(strategy, server_round, arrays, grads_by_node):
    requests = {m.metadata.dst_node_id: m for m in strategy.configure_train(server_round, arrays, ConfigRecord(), None)}
    assert all(m.content["config"]["upload"] == "gradient" for m in requests.values())
    replies = [_reply(requests[node], *grads) for node, grads in grads_by_node.items()]
    out, _ = strategy.aggregate_train(server_round, replies)
    return out


def test_selected_mode_is_dense_adam_on_the_mean_over_selected_users(task_identity):
    strategy = ServerOptimizerStrategy(LAYOUT, topology=TOPOLOGY, fraction_train=1.0, server_learning_rate=0.1)
    assert strategy.item_aggregation == "selected"  # "auto" -> the faithful default
    # 3 users; row 0 touched by two users (grads 3 and 6), row 1 by one (grad 3); dense grads 1, 2, 3.
    grads = {
        10: ([0], [[3.0, 3.0]], [1.0, 1.0]),
        11: ([0, 1], [[6.0, 6.0], [3.0, 3.0]], [2.0, 2.0]),
        12: ([3], [[0.0, 0.0]], [3.0, 3.0]),
    }
    out = _round(strategy, 1, _arrays(), grads)
    # reference: torch Adam on the hand-computed mean gradient (sum over users / 3, zeros elsewhere)
    ref_table = torch.nn.Parameter(torch.tensor(TABLE))
    ref_dense = torch.nn.Parameter(torch.tensor(DENSE))
    optimizer = torch.optim.Adam([ref_table, ref_dense], lr=0.1)
    ref_table.grad = torch.tensor([[3.0, 3.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    ref_dense.grad = torch.tensor([[2.0, 2.0]])
    optimizer.step()
    assert np.allclose(out["item_embedding.weight"].numpy(), ref_table.detach().numpy(), atol=1e-6)
    assert np.allclose(out["output.weight"].numpy(), ref_dense.detach().numpy(), atol=1e-6)
    # round 2: nobody touches row 0 -> with dense Adam it keeps moving (momentum), as documented
    before = out["item_embedding.weight"].numpy().copy()
    out2 = _round(
        strategy,
        2,
        out,
        {10: ([2], [[1.0, 1.0]], [0.0, 0.0]), 11: ([2], [[1.0, 1.0]], [0.0, 0.0]), 12: ([2], [[1.0, 1.0]], [0.0, 0.0])},
    )
    assert not np.allclose(out2["item_embedding.weight"].numpy()[0], before[0])


def test_touched_mode_freezes_rows_nobody_touched_and_their_adam_state(task_identity):
    strategy = ServerOptimizerStrategy(
        LAYOUT, topology=TOPOLOGY, fraction_train=1.0, server_learning_rate=0.1, item_aggregation="touched"
    )
    out = _round(
        strategy,
        1,
        _arrays(),
        {
            10: ([0], [[3.0, 3.0]], [1.0, 1.0]),
            11: ([0, 1], [[6.0, 6.0], [3.0, 3.0]], [1.0, 1.0]),
            12: ([1], [[1.0, 1.0]], [1.0, 1.0]),
        },
    )
    table = out["item_embedding.weight"].numpy()
    assert np.array_equal(table[2:], TABLE[2:])  # untouched rows unchanged
    # Adam's first step moves each touched coordinate by lr (sign of the mean gradient)
    assert np.allclose(table[:2], TABLE[:2] - 0.1, atol=1e-6)
    param = strategy.parameters["item_embedding.weight"]
    state = next(opt for opt in strategy.optimizers if isinstance(opt, torch.optim.SparseAdam)).state[param]
    moments_row0 = state["exp_avg"][0].clone()
    out2 = _round(
        strategy,
        2,
        out,
        {10: ([3], [[1.0, 1.0]], [1.0, 1.0]), 11: ([3], [[1.0, 1.0]], [1.0, 1.0]), 12: ([3], [[1.0, 1.0]], [1.0, 1.0])},
    )
    table2 = out2["item_embedding.weight"].numpy()
    assert np.array_equal(table2[:3], table[:3])  # rows 0..2 frozen this round
    assert torch.equal(state["exp_avg"][0], moments_row0)  # and their moments too
    assert not np.array_equal(table2[3], table[3])


def test_selected_item_aggregation_equals_the_average_of_full_tables():
    current = np.arange(8, dtype=np.float64).reshape(4, 2)
    # 4 users: full tables = current with their touched rows replaced
    full = [current.copy() for _ in range(4)]
    full[0][1] = [10, 10]
    full[1][1] = [20, 20]
    full[1][3] = [-5, 5]
    updates = [
        (np.array([1]), np.array([[10.0, 10.0]]), np.array([1.0])),
        (np.array([1, 3]), np.array([[20.0, 20.0], [-5.0, 5.0]]), np.array([1.0, 1.0])),
    ]
    new, count = merge_rows(current.astype(np.float32), updates, mode="selected", num_users=4)
    assert np.allclose(new, np.mean(full, axis=0))
    assert count.tolist() == [0, 2, 0, 1]
    with pytest.raises(ValueError, match="num_users"):
        merge_rows(current, updates, mode="selected", num_users=1)


def test_item_fedavg_selected_mode(task_identity):
    strategy = ItemEmbeddingFedAvg(LAYOUT, topology=TOPOLOGY, fraction_train=1.0, item_aggregation="selected")
    requests = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, _arrays(), ConfigRecord(), None)}
    replies = [
        _reply(requests[10], [0], [[10.0, 10.0]], [1.0, 1.0]),
        _reply(requests[11], [1], [[2.0, 3.0]], [1.0, 1.0]),
        _reply(requests[12], [0], [[4.0, 4.0]], [1.0, 1.0]),
    ]
    out, _ = strategy.aggregate_train(1, replies)
    table = out["item_embedding.weight"].numpy()
    assert np.allclose(table[0], (np.array([10.0, 10.0]) + [4.0, 4.0] + TABLE[0]) / 3)
    assert np.allclose(table[1], (np.array([2.0, 3.0]) + 2 * TABLE[1]) / 3)
    assert np.array_equal(table[2:], TABLE[2:])


def test_a_reply_with_parameters_instead_of_gradients_is_rejected(task_identity):
    from fedrec_flwr.strategies.item_fedavg import RoundFailed

    strategy = ServerOptimizerStrategy(LAYOUT, topology=TOPOLOGY, fraction_train=1.0)
    requests = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, _arrays(), ConfigRecord(), None)}
    replies = [_reply(requests[n], [0], [[1.0, 1.0]], [1.0, 1.0]) for n in (10, 11, 12)]
    for reply in replies:
        reply.content[METRICS]["gradient-users"] = 0
    with pytest.raises(RoundFailed, match="sent gradients"):
        strategy.aggregate_train(1, replies)
