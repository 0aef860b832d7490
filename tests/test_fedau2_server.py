"""FedAU²'s federated adversary (adversary-training = "server"): the global h_w is frozen within a round,
clients upload its gradient at that copy, the server steps it on the averaged gradients; no reply carries a label;
the per-round diagnostics; and, on a small synthetic federation where a linear direction encodes the attribute, the
method drives a logistic-regression attacker to chance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import MessageRecorder, assert_no_private_value_in_replies, seeded_private_vectors, tiny_run_config
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from fedrec_flwr.adversary import ADVERSARY_MODULE, AttributeAdversary, adversary_diagnostics
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.config import FIRST_RELEASE_ADVERSARY
from fedrec_flwr.strategies.adversary import AdversaryServerStep
from fedrec_flwr.wire import ARRAYS, METRICS, NUM_EXAMPLES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PREFIX = ADVERSARY_MODULE + "."
STANDARD_TRAIN_METRICS = {"num-examples", "num-users", "train-loss", "gradient-users"}


def _config(folder, flip: bool = False, first_release: bool = True, **overrides):
    folder.mkdir(parents=True, exist_ok=True)
    attributes = folder / "attributes.csv"
    genders = ("M", "F") if flip else ("F", "M")
    attributes.write_text("user,gender\n" + "".join(f"u{u},{genders[u % 3 == 0]}\n" for u in range(24)))
    # the mechanism tests were written for the first release's adversary keys (SUT, reversal, MLP h_w, one server
    # step): pinned, so they keep testing that mechanism whatever the package defaults are
    options = dict(
        client="fedau2",
        adversary="mlp",
        protected_attribute="gender",
        generic_attributes_file=str(attributes),
        users_per_node=1,
        **(FIRST_RELEASE_ADVERSARY if first_release else {}),
    )
    options.update(overrides)
    return tiny_run_config(folder, **options)


def _user_vector(record, layout) -> torch.Tensor:
    return torch.as_tensor(np.concatenate([record[k].numpy()[0] for k in layout.private_keys]))[None, :]


@pytest.mark.parametrize("training", ["server", "per-client"])
def test_every_sut_decision_of_a_round_reads_the_global_adversary_only_with_server_training(
    tmp_path, monkeypatch, training
):
    """Server arm: at every local step the SUT reads exactly the h_w the server sent (the model's copy never moves), and
    the upload under h_w's keys is the gradient of CE(h_w(e_u), a) at that copy and the user's final embedding. The
    per-client arm (as first implemented) trains its local copy, so its later SUT decisions read a changed h_w."""
    import fedrec_flwr.adversary.term as adversary_module
    from fedrec_flwr.clients.fedau2 import FedAU2Client

    config = _config(
        tmp_path, adversary_training=training, optimizer="sgd", learning_rate=0.5, batch_size=8, local_epochs=2
    )
    runtime = get_runtime(config)
    shared = {k: v.numpy().copy() for k, v in runtime.model.shared_state().items()}
    sent = {k[len(PREFIX) :]: torch.as_tensor(v) for k, v in shared.items() if k.startswith(PREFIX)}
    reads_global = []
    original = adversary_module.sut_strength

    def spy(adversary, *args):
        reads_global.append(all(torch.equal(p.detach(), sent[n]) for n, p in adversary.named_parameters()))
        return original(adversary, *args)

    monkeypatch.setattr(adversary_module, "sut_strength", spy)
    client = FedAU2Client(runtime, 0, RecordDict())
    update = client.fit_named(shared, {"server-round": 1})
    assert len(reads_global) == client.trainer.loss_terms[0].steps >= 4
    if training == "per-client":
        assert reads_global[0] and not all(reads_global)
        return
    assert all(reads_global)
    hand = AttributeAdversary(
        sent["hidden.weight"].shape[1], 2, sent["hidden.weight"].shape[0], generator=torch.Generator().manual_seed(0)
    )
    hand.load_state_dict(sent)
    label = int(runtime.protected.labels[0])
    F.cross_entropy(hand(_user_vector(client.state["user:0"], runtime.layout)), torch.tensor([label])).backward()
    for name, param in hand.named_parameters():
        np.testing.assert_allclose(update.dense[PREFIX + name], param.grad.numpy(), rtol=1e-5, atol=1e-8, err_msg=name)


def _reply(weight: float, grads: dict[str, np.ndarray]) -> RecordDict:
    return RecordDict(
        {
            ARRAYS: ArrayRecord({k: Array(v.astype(np.float32)) for k, v in grads.items()}),
            METRICS: MetricRecord({NUM_EXAMPLES: weight}),
        }
    )


def test_server_step_is_sgd_or_adam_on_the_weighted_mean_of_the_replies_gradients():
    """Two replies of weights 1 and 3: SGD gives w - lr * (g1 + 3 g2) / 4; Adam's first two steps match the textbook
    update (Kingma & Ba 2015, Alg. 1) computed by hand; keys outside h_w pass through untouched."""
    rng = np.random.default_rng(0)
    keys = (PREFIX + "a", PREFIX + "b")
    w = {k: rng.normal(size=(3, 2)).astype(np.float32) for k in keys}
    rounds = [[{k: rng.normal(size=(3, 2)) for k in keys} for _ in range(2)] for _ in range(2)]
    current = ArrayRecord({k: Array(v) for k, v in w.items()})
    aggregate = ArrayRecord({**{k: Array(v) for k, v in w.items()}, "other": Array(np.ones(2, np.float32))})

    sgd = AdversaryServerStep(keys, optimizer="sgd", learning_rate=0.3)
    out = sgd.apply(current, [_reply(1.0, rounds[0][0]), _reply(3.0, rounds[0][1])], aggregate)
    for k in keys:
        mean = (rounds[0][0][k].astype(np.float32) + 3 * rounds[0][1][k].astype(np.float32)) / 4
        np.testing.assert_allclose(out[k].numpy(), w[k] - 0.3 * mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out["other"].numpy(), np.ones(2))

    adam = AdversaryServerStep(keys, optimizer="adam", learning_rate=0.01)
    values = {k: w[k].astype(np.float64) for k in keys}
    m = {k: 0.0 for k in keys}
    v = {k: 0.0 for k in keys}
    for t, replies in enumerate(rounds, start=1):
        sent = ArrayRecord({k: Array(values[k].astype(np.float32)) for k in keys})
        out = adam.apply(sent, [_reply(1.0, replies[0]), _reply(3.0, replies[1])], sent)
        for k in keys:
            g = (replies[0][k].astype(np.float32).astype(np.float64) + 3 * replies[1][k].astype(np.float32)) / 4
            m[k] = 0.9 * m[k] + 0.1 * g
            v[k] = 0.999 * v[k] + 0.001 * g * g
            values[k] = values[k] - 0.01 * (m[k] / (1 - 0.9**t)) / (np.sqrt(v[k] / (1 - 0.999**t)) + 1e-8)
            np.testing.assert_allclose(out[k].numpy(), values[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="optimizer"):
        AdversaryServerStep(keys, optimizer="rmsprop")


def test_strategy_steps_the_global_adversary_on_the_replies_weighted_mean_gradient(tmp_path):
    """Through the whole serial federation (item-fedavg, one user per node, one round): the final h_w equals the sent
    h_w minus the server's SGD rate times the num-examples-weighted mean of the replies' h_w arrays."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial

    config = _config(
        tmp_path, adversary_server_optimizer="sgd", adversary_server_learning_rate=0.3, num_server_rounds=1
    )
    initial = {k: v.numpy().copy() for k, v in get_runtime(config).model.shared_state().items() if k.startswith(PREFIX)}
    recorder = MessageRecorder(tmp_path / "messages")
    folder = run_serial(config, client_app=make_client_app(config, mods=[recorder]))
    train = [r for r in recorder.records() if r["type"] == "train"]
    assert len(train) == 12
    final = np.load(folder / "final_arrays.npz")
    weights = np.array([r["reply-metrics"]["metrics"][NUM_EXAMPLES] for r in train])
    for key, value in initial.items():
        grads = np.stack([r["reply-arrays"]["arrays"][key].astype(np.float64) for r in train])
        expected = value - 0.3 * np.tensordot(weights, grads, axes=1) / weights.sum()
        np.testing.assert_allclose(final[key], expected, rtol=1e-5, atol=1e-6, err_msg=key)
    diagnostics = (folder / "adversary-diagnostics.csv").read_text().splitlines()
    assert diagnostics[0].split(",")[:3] == ["round", "users", "predicted-share-0"] and len(diagnostics) == 2


@pytest.mark.parametrize(
    "adversary,first_release",
    [("mlp", True), ("dsvae", True), ("dsvae", False)],
    ids=["mlp", "dsvae", "dsvae-package-defaults"],
)
def test_no_reply_carries_a_label_a_class_count_or_an_embedding(tmp_path, adversary, first_release):
    """Server arm, one user per node: every train reply holds exactly the layout's keys and the four standard metrics
    (no label, no count, no config), no private vector; and in round 1 (one local step, the loss reported at the
    starting point) every metric and every array except h_w's gradient is the same whatever the users' labels. The
    per-client arm (as first implemented) put CE on the label into the reported loss. Also at the package defaults
    (the entropy pull, 20 server steps: 19 adversary-gradient queries a round, every reply of which is checked)."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial

    runs = {}
    for flip in (False, True):
        config = _config(
            tmp_path / f"flip{flip}",
            flip=flip,
            first_release=first_release,
            adversary=adversary,
            num_server_rounds=1,
            batch_size=1000,
            eval_every=1,
        )
        recorder = MessageRecorder(tmp_path / f"flip{flip}" / "messages")
        run_serial(config, client_app=make_client_app(config, mods=[recorder]))
        runs[flip] = sorted((r for r in recorder.records() if r["type"] == "train"), key=lambda r: r["users"])
        layout = get_runtime(config).layout
        for record in runs[flip]:
            assert set(record["reply-metrics"]["metrics"]) == STANDARD_TRAIN_METRICS
            assert not record["reply-configs"]
            assert set(record["reply-arrays"]["arrays"]) == layout.reply_keys()
        assert_no_private_value_in_replies(recorder.records(), layout, extra=seeded_private_vectors(config))
    assert len(runs[False]) == len(runs[True]) == 12
    differs = 0
    for a, b in zip(runs[False], runs[True]):
        assert a["users"] == b["users"] and a["reply-metrics"] == b["reply-metrics"]
        for key, value in a["reply-arrays"]["arrays"].items():
            if key.startswith(PREFIX):
                differs += not np.array_equal(value, b["reply-arrays"]["arrays"][key])
            else:
                np.testing.assert_array_equal(value, b["reply-arrays"]["arrays"][key], err_msg=key)
    if get_runtime(config).config.secure_aggregation == "off":
        assert differs > 0  # h_w's gradient is where the label is (masked by DSVAE's noise, measured by the audit)
    else:  # SecAgg+ (the package default): h_w's keys carry zeros, the gradient travels only in the masked sum
        assert differs == 0


def test_adversary_diagnostics_by_hand():
    """Predicted-class mix, per-class trigger rate (the SUT fires where h_w is right), balanced accuracy, AUC."""
    adversary = AttributeAdversary(2, 2, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # logits = (0, 10 * x0): predicts class 1 iff x0 > 0
        adversary.hidden.weight.copy_(torch.tensor([[1.0, 0], [-1, 0], [0, 0], [0, 0]]))
        adversary.hidden.bias.zero_()
        adversary.head.weight.copy_(torch.tensor([[0.0, 0, 0, 0], [10, -10, 0, 0]]))
        adversary.head.bias.zero_()
    x = torch.tensor([[1.0, 0], [2, 0], [-1, 0], [-2, 0], [3, 0]])
    labels = np.array([1, 1, 1, 0, 0])
    out = adversary_diagnostics(adversary, x, labels)
    assert out["predicted-share-1"] == pytest.approx(3 / 5) and out["predicted-share-0"] == pytest.approx(2 / 5)
    assert out["trigger-rate-1"] == pytest.approx(2 / 3) and out["trigger-rate-0"] == pytest.approx(1 / 2)
    assert out["balanced-accuracy"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert out["auc"] == pytest.approx(3 / 6)  # scores 10, 20, -10 (class 1) against -20, 30 (class 0)


def test_server_step_state_survives_a_checkpoint_round_trip():
    """The strategy's checkpoint carries h_w's Adam moments: a step restored from them equals the uninterrupted one."""
    rng = np.random.default_rng(1)
    keys = (PREFIX + "a",)
    w = ArrayRecord({keys[0]: Array(rng.normal(size=(4,)).astype(np.float32))})
    replies = [[_reply(1.0, {keys[0]: rng.normal(size=(4,))})] for _ in range(2)]
    straight = AdversaryServerStep(keys, optimizer="adam", learning_rate=0.1)
    first = straight.apply(w, replies[0], w)
    saved = straight.state_arrays()
    expected = straight.apply(first, replies[1], first)
    resumed = AdversaryServerStep(keys, optimizer="adam", learning_rate=0.1)
    resumed.load_state_arrays(first, saved)
    np.testing.assert_array_equal(resumed.apply(first, replies[1], first)[keys[0]].numpy(), expected[keys[0]].numpy())
    fresh = AdversaryServerStep(keys, optimizer="adam", learning_rate=0.1).apply(first, replies[1], first)
    assert not np.array_equal(fresh[keys[0]].numpy(), expected[keys[0]].numpy())  # the moments matter


def test_sgd_entropy_pull_steps_by_exactly_lr_eps_grad_and_not_at_the_uniform_point():
    """``adversary-embedding-optimizer = "sgd"`` with ``adversary-objective = "entropy"``:
    the term takes the plain step ``e_u <- e_u - lr * eps * dH_x(uniform, softmax(W e_u + b))/de_u`` itself, which for
    a linear ``h_w`` is ``-lr * eps * W^T (softmax(W e_u + b) - 1/C)`` (hand-computed in float64), returns a constant
    0 for the local optimizer, and does not move an embedding where ``h_w`` already predicts every class equally
    (Adam's step there would still be about its rate)."""
    from fedrec_flwr.adversary import AdversarialTerm
    from fedrec_flwr.models import build_model

    lr, eps, classes = 0.1, 3.0, 3
    model = build_model("mf", 1, 10, embedding_dim=4, seed=5)
    gen = torch.Generator().manual_seed(7)
    model.attach_shared_module(ADVERSARY_MODULE, AttributeAdversary(4, classes, 0, generator=gen))
    w = model.adversary.head.weight.detach().double().numpy()
    b = model.adversary.head.bias.detach().double().numpy()
    u0 = model.user_embedding.weight.detach().double().numpy()[0].copy()
    logits = w @ u0 + b
    p = np.exp(logits - logits.max())
    p /= p.sum()
    expected = -lr * eps * w.T @ (p - 1.0 / classes)
    assert np.abs(expected).max() > 1e-4
    term = AdversarialTerm(
        model,
        label=1,
        epsilon=eps,
        trigger="always",
        kl_weight=0.0,
        generator=torch.Generator().manual_seed(0),
        objective="entropy",
        frozen=True,
        embedding_step=lr,
    )
    loss = term()
    assert float(loss) == 0.0 and not loss.requires_grad
    change = model.user_embedding.weight.detach().double().numpy()[0] - u0
    np.testing.assert_allclose(change, expected, rtol=1e-5, atol=5e-8)  # float32 embedding: ulp ~ 7e-9 at 0.1
    with torch.no_grad():  # h_w constant in e_u: uniform prediction everywhere, so the pull's step is 0
        model.adversary.head.weight.zero_()
        model.adversary.head.bias.zero_()
    before = model.user_embedding.weight.detach().clone()
    term()
    assert torch.equal(model.user_embedding.weight.detach(), before)
