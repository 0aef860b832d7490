"""The contribution history and its aggregation rule: against the strategy's own aggregation of mock replies, the
checkpoint round trip, the storage bytes and the float16 error bound."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg, Topology
from fedrec_flwr.unlearning.aggregate import UserDelta, aggregate_deltas
from fedrec_flwr.unlearning.history import ContributionHistory, delta_from_reply
from fedrec_flwr.wire import ARRAYS, COUNT, METRICS, ROWS, SUM, ModelLayout

ITEM, DENSE_KEY = "item_embedding.weight", "output.weight"
LAYOUT = ModelLayout(
    shared_shapes={ITEM: (5, 2), DENSE_KEY: (1, 2)},
    item_keys=(ITEM,),
    private_keys=("user_embedding.weight",),
)
TABLE = np.arange(10, dtype=np.float32).reshape(5, 2) / 8
DENSE = np.array([[1.0, -0.5]], dtype=np.float32)
# user -> (rows, upload rows, dense upload, examples): users 0-3, one node each
UPLOADS = {
    0: ([0, 2], [[0.5, 0.25], [1.0, 0.0]], [[1.25, -0.5]], 10),
    1: ([2, 3], [[0.75, 0.5], [0.0, 2.0]], [[0.5, 0.0]], 30),
    2: ([1, 2, 4], [[-1.0, 1.0], [0.25, 0.25], [3.0, 3.0]], [[2.0, 1.0]], 20),
    3: ([3], [[0.5, 0.5]], [[1.0, -1.0]], 5),
}


def _reply(user: int) -> RecordDict:
    rows, values, dense, n = UPLOADS[user]
    arrays = {
        ITEM + ROWS: np.asarray(rows, dtype=np.int64),
        ITEM + SUM: np.asarray(values, dtype=np.float32),
        ITEM + COUNT: np.ones(len(rows), dtype=np.float32),
        DENSE_KEY: np.asarray(dense, dtype=np.float32),
    }
    return RecordDict(
        {
            ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            METRICS: MetricRecord({"num-examples": float(n), "num-users": 1, "train-loss": 0.5}),
        }
    )


def _strategy_aggregate(users: list[int], mode: str) -> dict[str, np.ndarray]:
    strategy = ItemEmbeddingFedAvg(
        LAYOUT, topology=Topology(np.array([10, 11, 12, 13])), seed=0, fraction_train=1.0, item_aggregation=mode
    )
    current = ArrayRecord({ITEM: Array(TABLE), DENSE_KEY: Array(DENSE)})
    strategy.configure_train(1, current, ConfigRecord(), grid=None)
    out = strategy.aggregate_arrays([_reply(u) for u in users])
    return {k: out[k].numpy() for k in LAYOUT.shared_shapes}


def _history(mode: str = "touched", dtype: str = "float64") -> ContributionHistory:
    history = ContributionHistory.from_layout(LAYOUT, mode=mode, dtype=dtype)
    current = {ITEM: TABLE, DENSE_KEY: DENSE}
    for user in UPLOADS:
        reply = _reply(user)
        arrays = {k: reply[ARRAYS][k].numpy() for k in reply[ARRAYS]}
        rows, row_delta, dense_delta = delta_from_reply(arrays, current, LAYOUT, num_users=1)
        history.record(1, user, rows, row_delta, dense_delta, weight=UPLOADS[user][3])
    return history


@pytest.mark.parametrize("mode", ["touched", "selected"])
@pytest.mark.parametrize("exclude", [(), (2,), (0, 3)])
def test_round_aggregate_matches_the_strategys_aggregation(task_identity, mode, exclude):
    expected = _strategy_aggregate([u for u in UPLOADS if u not in exclude], mode)
    update = _history(mode).round_aggregate(1, exclude=set(exclude))
    table = TABLE.astype(np.float64)
    table[update.rows] += update.items[ITEM]
    np.testing.assert_allclose(table, expected[ITEM], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(DENSE + update.dense[DENSE_KEY], expected[DENSE_KEY], rtol=1e-6, atol=1e-7)
    # untouched rows keep their value in both
    untouched = np.setdiff1d(np.arange(5), update.rows)
    np.testing.assert_array_equal(expected[ITEM][untouched], TABLE[untouched])


def test_aggregate_deltas_hand_computed():
    """Row 2: users 0, 1 and 2 with deltas (1, 1), (3, 0), (-1, 2): touched mean (1, 1), selected (sum / 3) the same;
    row 0 only user 0's (2, 4): touched (2, 4), selected (2/3, 4/3). Dense: weights 1 and 3."""
    deltas = [
        UserDelta(np.array([0, 2]), {ITEM: np.array([[2.0, 4.0], [1.0, 1.0]])}, {DENSE_KEY: np.array([[4.0, 0.0]])}, 1),
        UserDelta(np.array([2]), {ITEM: np.array([[3.0, 0.0]])}, {DENSE_KEY: np.array([[0.0, 4.0]])}, 3),
        UserDelta(np.array([2]), {ITEM: np.array([[-1.0, 2.0]])}, {DENSE_KEY: np.array([[0.0, 0.0]])}, 4),
    ]
    shapes = {ITEM: (5, 2)}, {DENSE_KEY: (1, 2)}
    touched = aggregate_deltas(deltas, *shapes, mode="touched")
    np.testing.assert_array_equal(touched.rows, [0, 2])
    np.testing.assert_array_equal(touched.items[ITEM], [[2.0, 4.0], [1.0, 1.0]])
    np.testing.assert_array_equal(touched.count, [1.0, 3.0])
    np.testing.assert_allclose(touched.dense[DENSE_KEY], [[0.5, 1.5]], rtol=0, atol=1e-15)
    selected = aggregate_deltas(deltas, *shapes, mode="selected")
    np.testing.assert_allclose(selected.items[ITEM], [[2 / 3, 4 / 3], [1.0, 1.0]], rtol=0, atol=1e-15)
    empty = aggregate_deltas([], *shapes)
    assert empty.rows.size == 0 and empty.num_users == 0
    np.testing.assert_array_equal(empty.dense[DENSE_KEY], np.zeros((1, 2)))


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_checkpoint_round_trip(tmp_path, dtype):
    history = _history(dtype=dtype)
    history.record(3, 1, np.array([4, 0]), np.array([[0.5, -0.5], [0.25, 0.125]]), {DENSE_KEY: np.ones((1, 2))}, 2.0)
    arrays = history.to_arrays()
    np.savez(tmp_path / "history.npz", **arrays)
    with np.load(tmp_path / "history.npz") as saved:
        back = ContributionHistory.from_arrays(dict(saved))
    assert back.rounds() == [1, 3] and back.mode == "touched" and back.dtype == np.dtype(dtype)
    assert back.item_shapes == history.item_shapes and back.dense_shapes == history.dense_shapes
    for t in history.rounds():
        np.testing.assert_array_equal(back.users(t), history.users(t))
        for user in history.users(t):
            a, b = history.contribution(t, user), back.contribution(t, user)
            np.testing.assert_array_equal(a.rows, b.rows)
            np.testing.assert_array_equal(a.items[ITEM], b.items[ITEM])
            np.testing.assert_array_equal(a.dense[DENSE_KEY], b.dense[DENSE_KEY])
            assert a.weight == b.weight
    assert back.nbytes() == history.nbytes()
    # rows were given unsorted in round 3: stored sorted, with their deltas
    np.testing.assert_array_equal(back.contribution(3, 1).rows, [0, 4])
    np.testing.assert_array_equal(back.contribution(3, 1).items[ITEM], [[0.25, 0.125], [0.5, -0.5]])


def test_storage_bytes_by_round_and_user():
    history = _history(dtype="float32")
    # per user: T rows int32 + T x 2 float32 deltas + 2 float32 dense + 24 bytes (id, weight, offset)
    expected = {u: 4 * len(r) + 8 * len(r) + 8 + 24 for u, (r, *_rest) in UPLOADS.items()}
    assert history.nbytes_per_user() == expected
    assert history.nbytes_per_round() == {1: sum(expected.values()) + 8}
    half = _history(dtype="float16")
    assert half.nbytes_per_user() == {u: 4 * len(r) + 4 * len(r) + 4 + 24 for u, (r, *_rest) in UPLOADS.items()}
    metadata = history.nbytes() - sum(history.nbytes_per_round().values())
    assert 0 < metadata < 100  # mode, rounds, shapes


def test_float16_error_bound():
    rng = np.random.default_rng(0)
    values = rng.normal(0, 1e-2, size=(400, 2)) * rng.choice([1e-4, 1e-2, 1.0, 100.0], size=(400, 1))
    history = ContributionHistory({ITEM: (400, 2)}, dtype="float16")
    history.record(1, 0, np.arange(400), values)
    error = np.abs(history.contribution(1, 0).items[ITEM] - values)
    assert np.all(error <= 2.0**-11 * np.abs(values) + 2.0**-25)
    assert error.max() > 0  # float16 does round
    with pytest.raises(ValueError, match="not finite"):
        history.record(2, 0, np.arange(1), np.array([[7e4, 0.0]]))


def test_record_refuses_bad_contributions():
    history = ContributionHistory.from_layout(LAYOUT)
    dense = {DENSE_KEY: np.zeros((1, 2))}
    history.record(1, 0, np.array([1]), np.zeros((1, 2)), dense)
    with pytest.raises(ValueError, match="already recorded"):
        history.record(1, 0, np.array([2]), np.zeros((1, 2)), dense)
    with pytest.raises(ValueError, match="shape"):
        history.record(1, 1, np.array([1, 2]), np.zeros((1, 2)), dense)
    with pytest.raises(ValueError, match=r"in \[0, 5\)"):
        history.record(1, 1, np.array([5]), np.zeros((1, 2)), dense)
    with pytest.raises(ValueError, match="unique"):
        history.record(1, 1, np.array([2, 2]), np.zeros((2, 2)), dense)
    with pytest.raises(ValueError, match="dense_delta keys"):
        history.record(1, 1, np.array([2]), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="weight"):
        history.record(1, 1, np.array([2]), np.zeros((1, 2)), dense, weight=0)


def test_a_reply_of_several_users_is_refused():
    arrays = {k: _reply(0)[ARRAYS][k].numpy() for k in _reply(0)[ARRAYS]}
    current = {ITEM: TABLE, DENSE_KEY: DENSE}
    with pytest.raises(ValueError, match="one user per node"):
        delta_from_reply(arrays, current, LAYOUT, num_users=2)
    arrays[ITEM + COUNT] = np.array([1.0, 2.0], dtype=np.float32)
    with pytest.raises(ValueError, match="more than one user"):
        delta_from_reply(arrays, current, LAYOUT, num_users=1)
