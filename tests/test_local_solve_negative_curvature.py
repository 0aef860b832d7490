"""HF-KCU's local mode on a node (fedrec_flwr.app.client_app.unlearn_local_cg) with the exact Hessian of NCF at random
parameters, where users' Hessians are indefinite: a trust-region (Steihaug) solve that meets negative curvature steps
to its radius along that direction, and that step is kept in the node's sum; plain CG's truncated iterate on negative
curvature is left out and counted. The reply is checked against each user's own solve
(:meth:`fedrec_flwr.clients.fedrec.FedRecClient.influence_solve`) summed by hand."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_run_config
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedrec_flwr.app.client_app import make_client, unlearn_local_cg
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.arrays import decode_array, encode_array
from fedrec_flwr.config import RunConfig
from fedrec_flwr.wire import ARRAYS, CONFIG, METRICS, VECTOR, pack_sparse, unpack_sparse

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

USERS = 6


@pytest.fixture
def node(tmp_path):
    mapping = RunConfig.from_mapping(
        tiny_run_config(tmp_path, model="ncf", num_train_negatives=2, users_per_node=USERS)
    ).to_dict()
    runtime = get_runtime(mapping)
    rng = np.random.default_rng(0)
    context = Context(
        run_id=1,
        node_id=1000,
        node_config={"partition-id": 0, "num-partitions": 1},
        state=RecordDict(),
        run_config=mapping,
    )
    for user in range(USERS):
        context.state[f"user:{user}"] = ArrayRecord(
            {
                k: Array(rng.normal(scale=1.0, size=v.shape).astype(np.float32))
                for k, v in runtime.model.private_state().items()
            }
        )
    shared = {k: rng.normal(scale=0.8, size=s).astype(np.float32) for k, s in runtime.layout.shared_shapes.items()}
    rhs = {k: rng.normal(scale=0.1, size=s) for k, s in runtime.layout.shared_shapes.items()}
    for key in runtime.layout.item_keys:  # the forgotten user's rows
        rows = np.zeros(rhs[key].shape[0], dtype=bool)
        rows[make_client(runtime, 0, context).influence_items()] = True
        rhs[key][~rows] = 0.0
    return runtime, context, shared, rhs


def _query(runtime, context, shared, rhs, solver):
    config = {
        "exclude": [0],
        "iterations": 25,
        "damping": 1e-3,
        "tolerance": 1e-10,
        "curvature": "hessian",
        "solver": solver,
        "server-round": 1,
    }
    if solver == "steihaug":
        config["radius"] = 0.5
    message = Message(
        content=RecordDict(
            {
                ARRAYS: ArrayRecord({k: encode_array(v) for k, v in shared.items()}),
                VECTOR: ArrayRecord({k: Array(v) for k, v in pack_sparse(rhs, runtime.layout).items()}),
                CONFIG: ConfigRecord(config),
            }
        ),
        dst_node_id=1000,
        message_type="query.unlearn_local_cg",
    )
    reply = unlearn_local_cg(message, context, context.run_config)
    vector = unpack_sparse({k: decode_array(a) for k, a in reply.content[ARRAYS].items()}, runtime.layout)
    solves = [
        make_client(runtime, u, context).influence_solve(
            shared,
            rhs,
            iterations=25,
            damping=1e-3,
            tolerance=1e-10,
            curvature="hessian",
            solver=solver,
            radius=config.get("radius"),
        )
        for u in range(1, USERS)
    ]
    return dict(reply.content[METRICS]), vector, solves


def _sum(runtime, solves):
    total = {k: np.zeros(s) for k, s in runtime.layout.shared_shapes.items()}
    for dense, rows, _ in solves:
        for key, value in dense.items():
            total[key] += value
        for key, (ids, values) in rows.items():
            np.add.at(total[key], ids, values)
    return total


def test_trust_region_solves_that_meet_negative_curvature_are_kept(node, task_identity):
    runtime, context, shared, rhs = node
    metrics, vector, solves = _query(runtime, context, shared, rhs, "steihaug")
    negative = sum(result.negative_curvature for _, _, result in solves)
    assert negative >= 1  # NCF's Hessian at these parameters is indefinite for some user
    assert all(result.boundary for _, _, result in solves if result.negative_curvature)
    assert metrics["negative-curvature"] == negative and metrics["dropped"] == 0
    assert metrics["solved"] == USERS - 1 and metrics["weight-sum"] == USERS - 1
    expected = _sum(runtime, solves)
    for key in expected:
        np.testing.assert_allclose(
            vector[key], expected[key], rtol=1e-5, atol=1e-6 * (np.abs(expected[key]).max() + 1e-12)
        )


def test_plain_cg_solves_that_meet_negative_curvature_are_left_out(node, task_identity):
    runtime, context, shared, rhs = node
    metrics, vector, solves = _query(runtime, context, shared, rhs, "cg")
    kept = [s for s in solves if not s[2].negative_curvature and s[2].residual <= 1.0]
    assert len(kept) < len(solves)  # some (here possibly all) solves met negative curvature
    assert metrics["dropped"] == len(solves) - len(kept) and metrics["solved"] == len(kept)
    expected = _sum(runtime, kept)
    for key in expected:
        np.testing.assert_allclose(
            vector[key], expected[key], rtol=1e-5, atol=1e-6 * (np.abs(expected[key]).max() + 1e-12)
        )
