"""Centralized NCF on real MovieLens-100K beats the item-popularity baseline (the non-federated ceiling works).

Settings: NCF d=32, MLP (64, 32, 16), Adam lr 0.001, batch 1024, 4 BCE negatives, 4 epochs. Epochs were picked for
the time budget and checked on the VALIDATION item (holdout_validation=True: NCF val HR@10 0.66 at epoch 4 vs
popularity 0.46), never on test.
"""

import numpy as np
import pytest
import torch

from fedrec_flwr.baselines import evaluate_model, evaluate_popularity, train_centralized
from fedrec_flwr.data import load_split


@pytest.fixture
def split(ml100k_dir, tmp_path):
    return load_split("ml-100k", ml100k_dir, cache_dir=tmp_path / "cache", download=False)


@pytest.fixture
def one_torch_thread():
    """Small matrices on a shared 2-core machine: OpenMP threads only contend (observed 50x slower), so use one."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_centralized_ncf_beats_popularity(split, one_torch_thread):
    popularity = evaluate_popularity(split, ks=(10,))
    result = train_centralized(
        split, "ncf", epochs=4, batch_size=1024, learning_rate=0.001, optimizer="adam", eval_every=4, ks=(10,), seed=0
    )
    final = result.history[-1]
    assert [r["epoch"] for r in result.history] == [1, 2, 3, 4]
    assert "HR@10" not in result.history[0] and "HR@10" in final
    losses = [r["loss"] for r in result.history]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    # the history's metrics are the trained model's, recomputed here from its logits without the evaluation code
    candidates = np.concatenate([split.test_items[:, None], split.test_negatives], axis=1)
    users = np.repeat(np.arange(split.num_users), candidates.shape[1])
    with torch.no_grad():
        result.model.eval()
        logits = result.model(torch.as_tensor(users), torch.as_tensor(candidates.ravel())).numpy()
    logits = logits.reshape(candidates.shape)
    rank = (logits >= logits[:, :1]).sum(axis=1) - 1
    assert final["HR@10"] == pytest.approx(np.mean(rank < 10), abs=1e-12)
    assert final["NDCG@10"] == pytest.approx(np.mean(np.where(rank < 10, 1 / np.log2(rank + 2), 0.0)), abs=1e-12)
    assert evaluate_model(result.model, split, ks=(10,)) == {"HR@10": final["HR@10"], "NDCG@10": final["NDCG@10"]}
    print(
        f"\nML-100K HR@10/NDCG@10: centralized NCF {final['HR@10']:.4f}/{final['NDCG@10']:.4f}, "
        f"popularity {popularity['HR@10']:.4f}/{popularity['NDCG@10']:.4f}"
    )
    # the seeded split (tie rule "random"): 371 of 943 test items rank in the popularity top 10 (README: 0.393)
    assert popularity["HR@10"] == 371 / 943
    assert popularity["NDCG@10"] == pytest.approx(0.21477365640561655, abs=1e-12)
    assert final["HR@10"] > popularity["HR@10"] + 0.05
    assert final["NDCG@10"] > popularity["NDCG@10"]
