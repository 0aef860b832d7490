"""LocalTrainer: learning, row isolation, error handling, NaN guard, determinism; evaluate_user."""

import numpy as np
import pytest
import torch

from fedrec_flwr.errors import ConfigError, DataError
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer, evaluate_user, resolve_device
from fedrec_flwr.models import build_model

ITEMS = 30
POS = np.array([1, 4, 7, 9, 12], dtype=np.int64)
NEG = np.array([0, 2, 3, 5, 6, 8, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], dtype=np.int64)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "name, loss, opt, lr",
    [
        ("ncf", "bce", "adam", 0.01),
        ("mf", "bce", "sgd", 5.0),
        ("ncf", "bpr", "adam", 0.01),
        ("mf", "bpr", "adam", 0.05),
    ],
)
def test_loss_decreases_on_tiny_problem(name, loss, opt, lr):
    model = build_model(name, 1, ITEMS, embedding_dim=8, seed=0)
    trainer = LocalTrainer(
        model, LocalTrainConfig(local_epochs=5, batch_size=8, learning_rate=lr, loss=loss, optimizer=opt)
    )
    g = gen()
    first = trainer.train(0, POS, NEG, g).loss
    for _ in range(10):
        last = trainer.train(0, POS, NEG, g).loss
    assert last < 0.7 * first
    metrics = evaluate_user(model, 0, int(POS[0]), NEG, ks=(5,))
    assert metrics["HR@5"] == 1.0  # a training positive now outranks the negatives


def test_result_fields():
    model = build_model("ncf", 1, ITEMS, seed=0)
    trainer = LocalTrainer(model, LocalTrainConfig(local_epochs=2))
    result = trainer.train(0, POS, np.array([20, 3, 3, 20]), gen())
    assert result.num_examples == 9
    assert result.touched_items.dtype == np.int64
    np.testing.assert_array_equal(result.touched_items, [1, 3, 4, 7, 9, 12, 20])
    assert np.isfinite(result.loss) and result.loss > 0
    bpr = LocalTrainer(build_model("mf", 1, ITEMS), LocalTrainConfig(loss="bpr")).train(0, POS, NEG, gen())
    assert bpr.num_examples == len(NEG)  # pairs: 5 positives x 4 negatives


@pytest.mark.parametrize("opt, wd", [("sgd", 0.0), ("adam", 0.0), ("sgd", 0.1), ("adam", 0.1)])
def test_only_users_row_and_touched_items_change(opt, wd):
    model = build_model("ncf", 5, ITEMS, seed=1)
    before_private, before_shared = model.private_state(), model.shared_state()
    cfg = LocalTrainConfig(local_epochs=3, batch_size=4, learning_rate=0.05, optimizer=opt, weight_decay=wd)
    result = LocalTrainer(model, cfg).train(2, POS, NEG[:6], gen())
    for key, after in model.private_state().items():
        changed_rows = np.flatnonzero((after != before_private[key]).any(dim=1).numpy())
        np.testing.assert_array_equal(changed_rows, [2], err_msg=key)
    untouched = np.setdiff1d(np.arange(ITEMS), result.touched_items)
    for name in model.item_embedding_modules():
        key = f"{name}.weight"
        after = model.shared_state()[key]
        assert torch.equal(after[untouched], before_shared[key][untouched]), key
        assert not torch.equal(after[result.touched_items], before_shared[key][result.touched_items])
    assert not torch.equal(model.shared_state()["mlp.0.weight"], before_shared["mlp.0.weight"])


def test_empty_positives_and_bad_indices():
    trainer = LocalTrainer(build_model("mf", 1, ITEMS), LocalTrainConfig())
    with pytest.raises(ValueError, match="no positives"):
        trainer.train(0, np.array([], dtype=np.int64), NEG, gen())
    with pytest.raises(DataError, match="negatives: index 30 at position 1"):
        trainer.train(0, POS, np.array([0, 30]), gen())
    with pytest.raises(DataError, match="user_index 1"):
        trainer.train(1, POS, NEG, gen())
    bpr = LocalTrainer(build_model("mf", 1, ITEMS), LocalTrainConfig(loss="bpr"))
    with pytest.raises(ValueError, match="negatives per positive"):
        bpr.train(0, POS, NEG[:7], gen())


def test_same_generator_seed_is_bit_identical():
    def run(seed):
        model = build_model("ncf", 1, ITEMS, seed=0)
        trainer = LocalTrainer(
            model, LocalTrainConfig(local_epochs=2, batch_size=4, optimizer="adam", learning_rate=0.01)
        )
        result = trainer.train(0, POS, NEG, gen(seed))
        return result, model.state_dict()

    (r1, s1), (r2, s2), (_, s3) = run(7), run(7), run(8)
    assert r1.loss == r2.loss
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert any(not torch.equal(s1[k], s3[k]) for k in s1)  # a different shuffle gives a different model


class PoisonedTrainer(LocalTrainer):
    """Records the parameters before each step; its third step writes NaN into them (as a broken subclass might)."""

    def __init__(self, model, cfg):
        super().__init__(model, cfg)
        self.before_step = []

    def step(self, users, items, labels):
        self.before_step.append({k: v.clone() for k, v in self.model.state_dict().items()})
        value = super().step(users, items, labels)
        if len(self.before_step) == 3:
            with torch.no_grad():
                self.model.item_embedding.weight.fill_(float("nan"))
            return float("nan")
        return value


def test_nan_guard_restores_parameters_from_before_local_training():
    model = build_model("mf", 1, ITEMS)
    trainer = PoisonedTrainer(model, LocalTrainConfig(batch_size=5, learning_rate=1.0))
    with pytest.raises(FloatingPointError, match="epoch 1, step 3"):
        trainer.train(0, POS, NEG, gen())
    state = model.state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())
    assert all(torch.equal(state[k], trainer.before_step[0][k]) for k in state)
    assert not torch.equal(
        trainer.before_step[2]["item_embedding.weight"], trainer.before_step[0]["item_embedding.weight"]
    )


def test_divergence_raises_and_leaves_a_finite_model():
    model = build_model("ncf", 1, ITEMS)
    trainer = LocalTrainer(model, LocalTrainConfig(local_epochs=50, batch_size=5, learning_rate=1e30))
    with pytest.raises(FloatingPointError, match="non-finite"):
        trainer.train(0, POS, NEG, gen())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_evaluate_user_ties_and_order():
    model = build_model("mf", 1, ITEMS)
    with torch.no_grad():
        model.item_embedding.weight.zero_()  # every candidate scores 0: ties against the model
    negatives = np.arange(1, 21)
    assert evaluate_user(model, 0, 0, negatives, ks=(10,)) == {"HR@10": 0.0, "NDCG@10": 0.0}
    with torch.no_grad():
        model.user_embedding.weight.fill_(1.0)
        model.item_embedding.weight[0] = 1.0  # the target scores highest
    assert evaluate_user(model, 0, 0, negatives, ks=(1, 10)) == {
        "HR@1": 1.0,
        "NDCG@1": 1.0,
        "HR@10": 1.0,
        "NDCG@10": 1.0,
    }
    assert model.training  # train/eval mode restored


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"local_epochs": 0}, "local_epochs"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"loss": "mse"}, "loss"),
        ({"optimizer": "rmsprop"}, "optimizer"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"weight_decay": float("nan")}, "weight_decay"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        LocalTrainConfig(**kwargs)


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="device"):
        resolve_device("banana")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_training_in_a_compact_item_subset_equals_training_on_the_full_tables(optimizer):
    """RecModel.item_subset: a user trains a compact copy of the rows it uses; same result, full tables untouched."""
    from fedrec_flwr.models import build_model

    rng = np.random.default_rng(0)
    positives = rng.choice(60, size=6, replace=False)
    negatives = rng.choice(np.setdiff1d(np.arange(60), positives), size=24)
    cfg = LocalTrainConfig(local_epochs=2, batch_size=7, optimizer=optimizer, learning_rate=0.05)
    full = build_model("ncf", 1, 60, embedding_dim=8, mlp_layers=(16, 8), seed=2)
    compact = build_model("ncf", 1, 60, embedding_dim=8, mlp_layers=(16, 8), seed=2)
    tables_before = {k: v.clone() for k, v in compact.shared_state().items() if k.startswith("item")}
    LocalTrainer(full, cfg).train(0, positives, negatives, torch.Generator().manual_seed(1))
    items = np.union1d(positives, negatives)
    with compact.item_subset(items) as subset:
        assert compact.num_items == len(items) and compact.item_embedding_gmf.weight.shape[0] == len(items)
        LocalTrainer(compact, cfg).train(
            0, np.searchsorted(subset, positives), np.searchsorted(subset, negatives), torch.Generator().manual_seed(1)
        )
        trained = {k: v.clone() for k, v in compact.shared_state().items()}
    assert compact.num_items == 60 and compact.active_item_subset is None
    for key, value in full.shared_state().items():
        if key.startswith("item"):
            torch.testing.assert_close(trained[key], value[items], rtol=0, atol=0, msg=key)
            assert torch.equal(compact.shared_state()[key], tables_before[key]), key  # full table restored as it was
        else:
            torch.testing.assert_close(trained[key], value, rtol=0, atol=0, msg=key)


def test_item_subset_rejects_unsorted_or_out_of_range_items():
    from fedrec_flwr.models import build_model

    model = build_model("mf", 1, 10, embedding_dim=4)
    for bad in ([3, 1], [1, 1], [0, 10], []):
        with pytest.raises(ValueError, match="sorted unique"):
            with model.item_subset(np.array(bad, dtype=np.int64)):
                pass
