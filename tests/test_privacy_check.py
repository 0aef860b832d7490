"""The privacy check itself (conftest.assert_no_private_value_in_replies) sees what it must: a private vector in a
reply as a row, a column, a slice of a concatenation, a float32 copy, a list-valued metric; private records of every
kind (user:, user-opt:, ...) held before or after a handler; and it does not flag unrelated values."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_no_private_value_in_replies, find_vector, private_vectors

from fedrec_flwr.wire import ModelLayout

LAYOUT = ModelLayout({"item.weight": (5, 3)}, ("item.weight",), ("user.weight",))
SECRET = np.array([0.0123, -0.0456, 0.0789])
MOMENT = np.array([1.5e-5, 2.5e-5, -3.5e-5])  # an Adam moment: tiny, still private


def _record(reply_arrays=None, metrics=None, before=None, after=None) -> dict:
    return {
        "type": "train",
        "round": 2,
        "users": [0],
        "partition-id": 0,
        "error": None,
        "reply-arrays": {"arrays": reply_arrays or {}},
        "reply-metrics": {"metrics": metrics or {}},
        "reply-configs": {},
        "state-before": before or {},
        "state": after or {},
    }


def _state():
    return {
        "user:0": {"user.weight": SECRET[None, :].astype(np.float32)},
        "user-opt:0": {"0/exp_avg": MOMENT[None, :], "0/step": np.array(3.0)},
        "user-rows:0": {"rows": np.array([1, 2]), "values": np.ones((2, 3))},
    }


@pytest.mark.parametrize(
    "leak",
    [
        lambda v: np.vstack([np.zeros((2, 3)), v[None, :]]),  # a row
        lambda v: np.vstack([np.zeros((2, 3)), v[None, :]]).T.copy(),  # a column
        lambda v: np.concatenate([[9.0, 8.0], v, [7.0]]),  # a slice of a concatenation
        lambda v: v.astype(np.float32),  # a float32 copy
        lambda v: v * (1 + 2e-4),  # within 0.1 % of its scale
        lambda v: np.tile(v, (2, 2)),  # a flattened block
    ],
)
@pytest.mark.parametrize(("secret", "where"), [(SECRET, "state-before"), (SECRET, "state"), (MOMENT, "state")])
def test_a_private_vector_in_a_reply_is_found(leak, secret, where):
    state = _state()
    record = _record(
        reply_arrays={"item.weight#sum": leak(secret)}, **{"before" if where == "state-before" else "after": state}
    )
    with pytest.raises(AssertionError, match="contains private vector"):
        assert_no_private_value_in_replies([record], LAYOUT)


def test_a_private_vector_in_a_list_valued_metric_or_a_seeded_one_is_found():
    with pytest.raises(AssertionError, match="reply-metrics leak"):
        assert_no_private_value_in_replies([_record(metrics={"leak": SECRET.tolist()}, after=_state())], LAYOUT)
    seeded = np.array([0.5, -0.25, 0.125])  # never stored in a state: the caller supplies it
    with pytest.raises(AssertionError, match="contains private vector"):
        assert_no_private_value_in_replies(
            [_record(reply_arrays={"x": seeded[None, :]}, after=_state())], LAYOUT, extra=[seeded]
        )


def test_a_private_key_is_refused_by_name():
    with pytest.raises(AssertionError, match="user.weight"):
        assert_no_private_value_in_replies(
            [_record(reply_arrays={"user.weight": np.ones((1, 3))}, after=_state())], LAYOUT
        )


def test_unrelated_values_scalars_and_the_protocols_uploads_pass():
    far = SECRET * 1.01  # 1 % off on every element: another vector
    replies = {
        "item.weight#sum": np.vstack([far, np.zeros(3), np.ones(3)]),
        "item.weight#rows": np.array([0, 1, 2]),
        "item.weight#count": np.array([3.0, 1.0, 1.0]),
    }  # 3.0 = the Adam step count: a scalar, not private
    assert_no_private_value_in_replies(
        [_record(reply_arrays=replies, metrics={"num-examples": 3.0}, after=_state())], LAYOUT
    )
    # PFedRec's fine-tuned rows are its upload by design (not collected), and integer row ids are not vectors
    vectors = private_vectors([_record(after=_state())])
    assert sorted(len(v) for v in vectors) == [3, 3]
    assert find_vector(np.ones((2, 3)), vectors) is None
