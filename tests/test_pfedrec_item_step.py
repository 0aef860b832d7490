"""PFedRec's local step (fedrec_flwr.clients.pfedrec.PFedRecTrainer) worked by hand on one batch, and its default item rate.

PFedRec's score is ``z_i = w . e_i + b`` with BCE averaged over the batch (``B`` examples, distinct items here), so
``dL/dw = sum_j (s_j - y_j) e_j / B``, ``dL/db = sum_j (s_j - y_j) / B`` and ``dL/de_i = (s_i - y_i) w / B``
(``s = sigmoid(z)``). One batch (Zhang et al. 2023, Alg. 1; its code's ``fed_train_single_batch``): first
``w, b -= lr * grad`` at the old item rows, then, with the loss recomputed at the new ``w, b``, ``e_i -= item-lr *
dL/de_i``. The default ``item-lr`` is ``lr * num_items * 80`` (``LR_ETA``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_run_config
from flwr.app import RecordDict

from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.clients.pfedrec import LR_ETA, PFedRecClient, PFedRecTrainer
from fedrec_flwr.local.training import LocalTrainConfig
from fedrec_flwr.models import build_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ITEMS = np.array([3, 7, 1, 12, 5], dtype=np.int64)
LABELS = np.array([1.0, 1.0, 0.0, 0.0, 0.0])


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _hand_step(w, b, table, lr, item_lr):
    """The batch's two SGD steps in float64 numpy."""
    e = table[ITEMS]
    n = ITEMS.size
    r = _sigmoid(e @ w + b) - LABELS
    w1, b1 = w - lr * (r @ e) / n, b - lr * r.sum() / n
    r1 = _sigmoid(e @ w1 + b1) - LABELS
    new = table.copy()
    new[ITEMS] = e - item_lr * r1[:, None] * w1[None, :] / n
    return w1, b1, new


@pytest.mark.parametrize(("lr", "item_lr"), [(0.1, 40.0), (0.5, 3.0), (0.2, 0.2)])
def test_one_batch_moves_the_score_function_then_the_item_rows_by_their_own_rates(lr, item_lr):
    model = build_model("pfedrec", 1, 16, embedding_dim=4, seed=2)
    w0 = model.score.weight.detach().double().numpy()[0].copy()
    b0 = float(model.score.bias.detach()[0])
    table0 = model.item_embedding.weight.detach().double().numpy().copy()
    trainer = PFedRecTrainer(
        model, LocalTrainConfig(learning_rate=lr, optimizer="sgd", batch_size=8), item_learning_rate=item_lr
    )
    trainer.step(
        torch.zeros(ITEMS.size, dtype=torch.long), torch.as_tensor(ITEMS), torch.as_tensor(LABELS, dtype=torch.float32)
    )
    w1, b1, table1 = _hand_step(w0, b0, table0, lr, item_lr)
    np.testing.assert_allclose(model.score.weight.detach().numpy()[0], w1, rtol=1e-5, atol=1e-7)
    assert float(model.score.bias.detach()[0]) == pytest.approx(b1, rel=1e-5, abs=1e-7)
    table = model.item_embedding.weight.detach().numpy()
    np.testing.assert_allclose(table, table1, rtol=1e-5, atol=1e-6)
    others = np.setdiff1d(np.arange(16), ITEMS)
    np.testing.assert_array_equal(table[others], table0[others].astype(np.float32))  # untouched rows stay exact
    assert np.abs(table[ITEMS] - table0[ITEMS]).max() > 1e-4  # the rows did move


def test_item_learning_rate_must_be_positive():
    model = build_model("pfedrec", 1, 16, embedding_dim=4, seed=2)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="item_learning_rate"):
            PFedRecTrainer(model, LocalTrainConfig(), item_learning_rate=bad)


@pytest.mark.parametrize("item_lr", [0.0, 7.5])
def test_default_item_rate_is_lr_times_num_items_times_80(tmp_path, item_lr):
    config = tiny_run_config(
        tmp_path, model="pfedrec", client="pfedrec", optimizer="sgd", learning_rate=0.3, item_learning_rate=item_lr
    )
    runtime = get_runtime(config)
    trainer = PFedRecClient(runtime, 0, RecordDict()).make_trainer({})
    expected = item_lr or 0.3 * runtime.split.num_items * LR_ETA
    assert LR_ETA == 80 and runtime.split.num_items > 1
    assert trainer.item_learning_rate == pytest.approx(expected, rel=1e-12)
    assert trainer.cfg.learning_rate == pytest.approx(0.3)
