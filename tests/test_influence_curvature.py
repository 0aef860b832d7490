"""The Gauss-Newton diagonal of the influence objective (fedrec_flwr.unlearning.influence.influence_objective with
fedrec_flwr.unlearning.krylov.gauss_newton_diagonal) against the diagonal of the Gauss-Newton product itself, ``e_k^T G e_k``
from :func:`fedrec_flwr.unlearning.krylov.gauss_newton_vector_product` on unit vectors, for a node of users with different
example counts (so each user's examples carry a different weight ``1 / count`` in its mean loss, and the diagonal's
output curvature must carry the same weights as the loss)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_run_config
from flwr.app import Array, ArrayRecord, Context, RecordDict

from fedrec_flwr.app.client_app import make_client
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.config import RunConfig
from fedrec_flwr.unlearning.influence import influence_objective
from fedrec_flwr.unlearning.krylov import gauss_newton_diagonal, gauss_newton_vector_product

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

COUNTS = (5, 9, 16, 7)
"""Interactions of each user (the latest is held out, so 4, 8, 15 and 6 training positives)."""


def _node(folder, model, loss):
    rng = np.random.default_rng(0)
    lines = ["user,item,rating,timestamp"]
    for user, count in enumerate(COUNTS):
        for t, item in enumerate(rng.choice(60, size=count, replace=False)):
            lines.append(f"u{user},i{item},5,{t}")
    for item in range(60):  # every item exists: twelve filler users of five items each
        lines.append(f"f{item % 12},i{item},5,{item}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "varied.csv").write_text("\n".join(lines) + "\n")
    mapping = tiny_run_config(folder, model=model, loss=loss, num_train_negatives=2)
    mapping["generic-file"] = str(folder / "varied.csv")
    mapping = RunConfig.from_mapping(mapping).to_dict()
    runtime = get_runtime(mapping)
    context = Context(
        run_id=1,
        node_id=1000,
        node_config={"partition-id": 0, "num-partitions": 1},
        state=RecordDict(),
        run_config=mapping,
    )
    users = [int(np.flatnonzero(runtime.split.user_ids == f"u{u}")[0]) for u in range(len(COUNTS))]
    for user in users:
        context.state[f"user:{user}"] = ArrayRecord(
            {
                k: Array(rng.normal(scale=0.7, size=v.shape).astype(np.float32))
                for k, v in runtime.model.private_state().items()
            }
        )
    shared = {k: rng.normal(scale=0.5, size=s).astype(np.float32) for k, s in runtime.layout.shared_shapes.items()}
    return runtime, [make_client(runtime, u, context) for u in users], shared


@pytest.mark.parametrize("loss", ["bce", "bpr"])
@pytest.mark.parametrize("model", ["mf", "ncf"])
def test_gauss_newton_diagonal_on_the_item_rows_is_the_products_diagonal(tmp_path, model, loss):
    runtime, clients, shared = _node(tmp_path, model, loss)
    sizes = {sum(len(part) for part in c.influence_examples()) for c in clients}
    assert len(sizes) == len(COUNTS)  # every user's examples weigh differently
    with influence_objective(runtime, clients, shared) as (loss_fn, params, items):
        diagonal = gauss_newton_diagonal(loss_fn, params, probes=1, generator=torch.Generator().manual_seed(0))
        zeros = {k: torch.zeros_like(v) for k, v in params.items()}
        checked = 0
        for key in runtime.layout.item_keys:
            rows, width = params[key].shape[0], int(np.prod(params[key].shape[1:]))
            for flat in range(0, rows * width, max(1, rows * width // 60)):  # about 60 entries per table
                unit = dict(zeros)
                unit[key] = torch.zeros_like(params[key]).reshape(-1)
                unit[key][flat] = 1.0
                unit[key] = unit[key].reshape(params[key].shape)
                product = gauss_newton_vector_product(loss_fn, params, unit)[key].reshape(-1)[flat]
                got = diagonal[key].reshape(-1)[flat]
                assert float(got) == pytest.approx(float(product), rel=1e-4, abs=1e-9), (key, flat)
                checked += int(float(product) > 1e-6)
        assert checked > 20  # most checked entries carry curvature
