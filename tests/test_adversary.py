"""FedAU² building blocks (fedrec_flwr.adversary, fedrec_flwr.attributes): gradient reversal, the plain and DSVAE
adversaries, the SUT, adversarial local training, attribute encoding and the config checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import without_timings
from torch.distributions import Normal, kl_divergence

from fedrec_flwr.adversary import (
    ADVERSARY_MODULE,
    AdversarialTrainer,
    AttributeAdversary,
    DSVAEAdversary,
    build_adversary,
    grad_reverse,
    sut_strength,
    user_vector,
    user_vector_dim,
)
from fedrec_flwr.attributes import AGE_BUCKETS, encode_attribute
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer
from fedrec_flwr.models import build_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- GRL
def test_grl_is_identity_forward_and_gives_exactly_minus_strength_times_the_gradient():
    x = torch.randn(4, 3, generator=_gen(0), requires_grad=True)
    y = grad_reverse(x, 0.5)
    assert torch.equal(y, x)
    (2 * y).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, -1.0))


def test_grl_per_row_strength_tensor_scales_each_row_and_gets_no_gradient():
    x = torch.randn(3, 4, generator=_gen(1), requires_grad=True)
    strength = torch.tensor([[0.0], [1.0], [2.5]], requires_grad=True)
    y = grad_reverse(x, strength)
    assert torch.equal(y, x)
    (3 * y).sum().backward()
    assert torch.equal(x.grad, (-3.0 * strength.detach()).expand(3, 4))
    assert strength.grad is None


def test_grl_reverses_the_user_vector_gradient_but_not_the_adversary_parameter_gradients():
    adversary = AttributeAdversary(6, 3, 8, generator=_gen(2))
    u = torch.randn(5, 6, generator=_gen(3))
    target = torch.tensor([0, 1, 2, 1, 0])
    eps = 0.7

    def grads(reverse: bool):
        adversary.zero_grad(set_to_none=True)
        x = u.clone().requires_grad_(True)
        F.cross_entropy(adversary(grad_reverse(x, eps) if reverse else x), target).backward()
        return x.grad.clone(), {n: p.grad.clone() for n, p in adversary.named_parameters()}

    gx_rev, gp_rev = grads(True)
    gx, gp = grads(False)
    assert gx.abs().sum() > 0
    for name, grad in gp.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(gp_rev[name], grad), name
    torch.testing.assert_close(gx_rev, -eps * gx, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------- SUT
def test_sut_gives_epsilon_only_when_the_deterministic_prediction_is_the_label():
    for adversary in (
        AttributeAdversary(6, 3, 8, generator=_gen(4)),
        DSVAEAdversary(6, 3, 8, 4, gradient_noise=1.0, generator=_gen(5)),
    ):
        assert adversary.generator is None  # the SUT must not draw: a DSVAE forward would raise here
        for seed in range(10):
            u = torch.randn(1, 6, generator=_gen(seed))
            predicted = int(adversary.predict_logits(u).argmax())
            assert sut_strength(adversary, u, predicted, 0.8, "sut") == 0.8
            for other in set(range(3)) - {predicted}:
                assert sut_strength(adversary, u, other, 0.8, "sut") == 0.0
                assert sut_strength(adversary, u, other, 0.8, "always") == 0.8


def test_sut_unknown_trigger_is_refused():
    adversary = AttributeAdversary(6, 2, 8, generator=_gen(0))
    with pytest.raises(ValueError, match="trigger"):
        sut_strength(adversary, torch.zeros(1, 6), 0, 1.0, "sometimes")


# ---------------------------------------------------------------------------------------------------- DSVAE
def _dsvae(noise: float = 1.0, num_classes: int = 3, seed: int = 0) -> DSVAEAdversary:
    return DSVAEAdversary(6, num_classes, 8, 4, gradient_noise=noise, generator=_gen(seed))


@pytest.mark.parametrize("batch", [1, 5])
def test_dsvae_kl_equals_torch_kl_of_the_posterior_to_the_standard_normal(batch):
    adversary = _dsvae()
    adversary.generator = _gen(1)
    assert float(adversary.regulariser()) == 0.0  # before any forward
    u = torch.randn(batch, 6, generator=_gen(2)) * 3
    adversary(u)
    mu, logvar = adversary.encoder(F.relu(adversary.hidden(u))).chunk(2, dim=-1)
    logvar = logvar.clamp(-10.0, 10.0)
    expected = (
        kl_divergence(Normal(mu, torch.exp(0.5 * logvar)), Normal(torch.zeros_like(mu), torch.ones_like(mu)))
        .sum(dim=-1)
        .mean()
    )
    assert float(expected.detach()) > 0
    torch.testing.assert_close(adversary.regulariser(), expected, rtol=1e-5, atol=1e-6)


def test_dsvae_predict_logits_is_deterministic_and_uses_the_posterior_mean():
    adversary = _dsvae()  # no generator: predict_logits must not draw
    u = torch.randn(4, 6, generator=_gen(3))
    first, second = adversary.predict_logits(u), adversary.predict_logits(u)
    assert torch.equal(first, second)
    mu, _ = adversary.encoder(F.relu(adversary.hidden(u))).chunk(2, dim=-1)
    torch.testing.assert_close(first, adversary.head(mu))


def test_dsvae_forward_is_reproducible_from_the_generator_seed_and_stochastic_otherwise():
    adversary = _dsvae()
    u = torch.randn(4, 6, generator=_gen(3))
    adversary.generator = _gen(7)
    a = adversary(u)
    adversary.generator = _gen(7)
    b = adversary(u)
    adversary.generator = _gen(8)
    c = adversary(u)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert not torch.allclose(a, adversary.predict_logits(u))


def test_dsvae_gradient_noise_changes_only_the_head_gradients_by_the_drawn_noise():
    u = torch.randn(1, 6, generator=_gen(4))
    target = torch.tensor([1])

    def run(noise: float):
        adversary = _dsvae(noise)
        adversary.generator = _gen(5)
        logits = adversary(u)
        F.cross_entropy(logits, target).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in adversary.named_parameters()}

    logits0, grads0 = run(0.0)
    logits1, grads1 = run(1.0)
    assert torch.equal(logits0, logits1)  # the same xi: it is drawn before the noise
    for name in ("hidden.weight", "hidden.bias", "encoder.weight", "encoder.bias"):
        assert grads0[name].abs().sum() > 0, name
        assert torch.equal(grads0[name], grads1[name]), name
    draws = _gen(5)
    torch.randn((1, 4), generator=draws)  # xi
    weight_noise, bias_noise = torch.randn((3, 4), generator=draws), torch.randn((3,), generator=draws)
    torch.testing.assert_close(grads1["head.weight"] - grads0["head.weight"], weight_noise, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads1["head.bias"] - grads0["head.bias"], bias_noise, rtol=1e-5, atol=1e-6)
    # without noise the bias gradient is exactly iDLG's p - onehot(a)
    expected = F.softmax(logits0, dim=-1)[0] - F.one_hot(target, 3)[0].float()
    torch.testing.assert_close(grads0["head.bias"], expected, rtol=1e-6, atol=1e-7)


def test_dsvae_without_generator_raises():
    with pytest.raises(RuntimeError, match="generator"):
        _dsvae()(torch.zeros(1, 6))


def test_build_adversary_kinds_and_refusals():
    assert (
        type(build_adversary("mlp", 6, 2, hidden=8, latent=4, gradient_noise=1.0, generator=_gen(0)))
        is AttributeAdversary
    )
    dsvae = build_adversary("dsvae", 6, 2, hidden=8, latent=4, gradient_noise=0.5, generator=_gen(0))
    assert type(dsvae) is DSVAEAdversary and dsvae.gradient_noise == 0.5 and dsvae.latent == 4
    with pytest.raises(ValueError, match="unknown adversary"):
        build_adversary("gan", 6, 2, hidden=8, latent=4, gradient_noise=1.0, generator=_gen(0))
    with pytest.raises(ValueError, match="gradient_noise"):
        _dsvae(noise=-1.0)
    with pytest.raises(ValueError, match=">= 2 classes"):
        AttributeAdversary(6, 1, 8, generator=_gen(0))


# ---------------------------------------------------------------------------------------------------- trainer
NUM_ITEMS = 30
POSITIVES, NEGATIVES = np.arange(6), np.arange(6, NUM_ITEMS)  # 30 examples
BATCHES = 4  # ceil(30 / 8) per epoch


def _mf(with_adversary: str | None = "mlp", seed: int = 0):
    model = build_model("mf", 1, NUM_ITEMS, embedding_dim=8, seed=seed)
    if with_adversary:
        adversary = build_adversary(
            with_adversary, user_vector_dim(model), 2, hidden=8, latent=4, gradient_noise=1.0, generator=_gen(11)
        )
        model.attach_shared_module(ADVERSARY_MODULE, adversary)
    return model


def _cfg(lr: float = 0.1, epochs: int = 2) -> LocalTrainConfig:
    return LocalTrainConfig(learning_rate=lr, optimizer="sgd", batch_size=8, local_epochs=epochs)


def _adversarial(model, *, label=1, epsilon=1.0, trigger="always", lr=0.1, seed=3):
    return AdversarialTrainer(
        model, _cfg(lr), label=label, epsilon=epsilon, trigger=trigger, kl_weight=0.01, generator=_gen(seed)
    )


@pytest.mark.parametrize("kind", ["mlp", "dsvae"])
def test_adversarial_training_moves_the_adversary_and_the_user_embedding(kind):
    model = _mf(kind)
    assert user_vector(model).shape == (1, 8)
    before = {k: v.clone() for k, v in {**model.shared_state(), **model.private_state()}.items()}
    _adversarial(model).train(0, POSITIVES, NEGATIVES, _gen(0))
    after = {**model.shared_state(), **model.private_state()}
    adversary_keys = [k for k in before if k.startswith(ADVERSARY_MODULE + ".")]
    assert adversary_keys
    for key in adversary_keys:
        assert not torch.equal(before[key], after[key]), key
    for key in model.private_state():
        assert not torch.equal(before[key], after[key]), key


def test_epsilon_zero_leaves_the_embedding_update_of_a_plain_trainer_and_epsilon_one_does_not():
    plain = _mf(None)
    LocalTrainer(plain, _cfg()).train(0, POSITIVES, NEGATIVES, _gen(0))
    zero = _mf("mlp")
    _adversarial(zero, epsilon=0.0).train(0, POSITIVES, NEGATIVES, _gen(0))
    one = _mf("mlp")
    _adversarial(one, epsilon=1.0).train(0, POSITIVES, NEGATIVES, _gen(0))
    for key, value in plain.private_state().items():
        assert torch.equal(zero.private_state()[key], value), key
        assert not torch.allclose(one.private_state()[key], value), key
    for key, value in plain.shared_state().items():  # item table and score function: same recommendation loss
        assert torch.equal(zero.shared_state()[key], value), key


def test_trainer_counts_steps_and_triggered_steps():
    always = _adversarial(_mf(), trigger="always", epsilon=1.0)
    always.train(0, POSITIVES, NEGATIVES, _gen(0))
    assert always.steps == always.triggered == 2 * BATCHES
    off = _adversarial(_mf(), trigger="always", epsilon=0.0)
    off.train(0, POSITIVES, NEGATIVES, _gen(0))
    assert (off.steps, off.triggered) == (2 * BATCHES, 0)
    # lr = 0: the adversary's prediction never changes, so the SUT fires on every step or on none
    model = _mf()
    predicted = int(model.adversary.predict_logits(user_vector(model)).argmax())
    for label, expected in ((predicted, 2 * BATCHES), (1 - predicted, 0)):
        trainer = _adversarial(_mf(), label=label, trigger="sut", lr=0.0)
        trainer.train(0, POSITIVES, NEGATIVES, _gen(0))
        assert (trainer.steps, trainer.triggered) == (2 * BATCHES, expected)


def test_trainer_refuses_a_model_without_adversary_or_a_label_out_of_range():
    with pytest.raises(ValueError, match="no adversary"):
        _adversarial(_mf(None))
    with pytest.raises(ValueError, match="label 2 outside"):
        _adversarial(_mf(), label=2)


# ---------------------------------------------------------------------------------------------------- attributes
@pytest.fixture(scope="module")
def ml100k_split():
    from conftest import dataset_dir

    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.config import make_run_config

    return load_split_for(make_run_config(dataset="ml-100k", data_dir=str(dataset_dir("ml-100k"))))


def test_ml100k_gender_classes_and_counts(ml100k_split):
    gender = encode_attribute(ml100k_split.attributes, "gender")
    assert gender.classes == ("F", "M")
    assert gender.class_counts().tolist() == [273, 670]
    raw = np.asarray(ml100k_split.attributes["gender"])
    assert np.array_equal(gender.labels, (raw == "M").astype(np.int64))


def test_ml100k_age_has_seven_buckets_covering_every_user(ml100k_split):
    age = encode_attribute(ml100k_split.attributes, "age")
    assert age.classes == tuple(name for name, _, _ in AGE_BUCKETS)
    assert len(age.labels) == ml100k_split.num_users == 943
    assert age.class_counts().sum() == 943 and (age.class_counts() > 0).all()
    raw = np.asarray(ml100k_split.attributes["age"])
    assert np.array_equal(age.labels, np.digitize(raw, [18, 25, 35, 45, 50, 56]))


def test_unknown_attribute_names_it_and_lists_the_available_ones(ml100k_split):
    with pytest.raises(ConfigError) as error:
        encode_attribute(ml100k_split.attributes, "income")
    message = str(error.value)
    assert "income" in message
    for name in ("age", "gender", "occupation"):
        assert name in message


@pytest.mark.parametrize(("name", "values"), [("gender", ["F"] * 5), ("age", [19, 20, 24, 18, 22])])
def test_constant_attribute_is_refused(name, values):
    with pytest.raises(ConfigError, match="same value"):
        encode_attribute({name: np.asarray(values)}, name)


# ---------------------------------------------------------------------------------------------------- config
def test_adversary_without_protected_attribute_is_refused():
    from fedrec_flwr.config import make_run_config

    with pytest.raises(ConfigError, match="protected-attribute"):
        make_run_config(adversary="mlp")


def test_fedau2_with_pfedrec_model_is_refused_by_check_components():
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.registry import check_components

    check_components(
        make_run_config(
            client="fedau2", model="mf", adversary="dsvae", protected_attribute="gender", strategy="curious-item-fedavg"
        )
    )  # accepted
    with pytest.raises(ConfigError, match="(?i)fedau2"):
        check_components(
            make_run_config(client="fedau2", model="pfedrec", adversary="mlp", protected_attribute="gender")
        )


@pytest.mark.parametrize("client", ["fedrec", "fedrecgel", "pfedrec"])
@pytest.mark.parametrize("keys", [{"adversary": "mlp", "protected_attribute": "gender"}, {"user_embedding_noise": 0.1}])
def test_clients_without_attribute_unlearning_refuse_its_keys(client, keys):
    """A client that would silently ignore the adversary or the DP noise stops the run at start instead."""
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.registry import check_components

    model = "pfedrec" if client == "pfedrec" else "mf"
    with pytest.raises(ConfigError, match="attribute-unlearning client"):
        check_components(make_run_config(client=client, model=model, **keys))


@pytest.mark.parametrize(
    ("keys", "named", "unnamed"),
    [
        (
            {"adversary": "dsvae", "protected_attribute": "gender"},
            "run-config key 'adversary' = 'dsvae' needs",
            "user-embedding-noise",
        ),
        ({"user_embedding_noise": 0.1}, "run-config key 'user-embedding-noise' = 0.1 needs", "'adversary'"),
        (
            {"adversary": "mlp", "protected_attribute": "gender", "user_embedding_noise": 0.1},
            "run-config keys 'adversary' = 'mlp' and 'user-embedding-noise' = 0.1 need",
            None,
        ),
    ],
)
def test_a_plain_client_names_only_the_attribute_unlearning_keys_the_user_set(keys, named, unnamed):
    """``adversary = "dsvae"`` with ``client = "fedrec"`` was refused naming ``'user-embedding-noise' = 0.0`` too, a
    key the user never set (a fresh user's finding); the message names the keys set and the clients they need."""
    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.registry import check_components

    with pytest.raises(ConfigError) as caught:
        check_components(make_run_config(client="fedrec", model="ncf", **keys))
    message = str(caught.value)
    assert message.startswith(named), message
    assert "client = 'fedau2' or 'fedau2-gel'" in message and "client 'fedrec' would ignore" in message
    assert unnamed is None or unnamed not in message, message


# ---------------------------------------------------------------------------------------------------- composition
def test_adversarial_term_composes_with_fedrecgel_sam_client(tmp_path):
    """client = "fedau2-gel": the adversarial term rides on FedRecGEL's SAM trainer (once per chunk of each of the 3
    loss evaluations of a SAM step), the uploaded SAM gradient includes the adversary's, and a whole run works."""
    import math

    from conftest import tiny_run_config
    from flwr.app import RecordDict

    from fedrec_flwr.app.runtime import get_runtime
    from fedrec_flwr.clients.fedau2 import FedAU2GELClient
    from fedrec_flwr.serial import run_serial

    attributes = tmp_path / "attributes.csv"
    attributes.write_text("user,gender\n" + "".join(f"u{u},{'F' if u % 3 else 'M'}\n" for u in range(24)))
    config = tiny_run_config(
        tmp_path,
        client="fedau2-gel",
        strategy="server-optimizer",
        adversary="dsvae",
        protected_attribute="gender",
        generic_attributes_file=str(attributes),
        learning_rate=0.1,
        batch_size=1000,
        num_server_rounds=2,
    )
    runtime = get_runtime(config)
    shared = {k: v.numpy().copy() for k, v in runtime.model.shared_state().items()}
    client = FedAU2GELClient(runtime, 0, RecordDict())
    update = client.fit_named(shared, {"server-round": 1, "upload": "gradient"})
    term = client.trainer.loss_terms[0]
    assert term.steps == 3  # one chunk (batch-size 1000), base + two perturbed evaluations of one SAM step
    assert update.is_gradient and update.weight == 1.0
    assert np.abs(update.dense["adversary.head.bias"]).sum() > 0
    folder = run_serial(config)
    assert math.isfinite(json.loads((folder / "summary.json").read_text())["final"]["HR@10"])


def test_entropy_objective_pulls_the_embedding_the_same_way_for_every_label():
    """adversary-objective = "entropy" (our control): the embedding's gradient does not depend on the label, and the
    adversary's parameters get exactly the plain cross-entropy gradient (the pull does not train them)."""
    from fedrec_flwr.adversary import AdversarialTerm, AttributeAdversary

    def grads(label: int, objective: str):
        model = build_model("mf", 1, 10, embedding_dim=4, seed=0)
        model.attach_shared_module("adversary", AttributeAdversary(4, 2, 8, generator=_gen(3)))
        term = AdversarialTerm(
            model, label=label, epsilon=0.7, trigger="always", kl_weight=0.0, generator=_gen(0), objective=objective
        )
        term().backward()
        return model.user_embedding.weight.grad.clone(), [p.grad.clone() for p in model.adversary.parameters()]

    (e0, _), (e1, a1) = grads(0, "entropy"), (grads(1, "entropy"))
    assert torch.equal(e0, e1) and e0.abs().sum() > 0
    (r0, _), (r1, _) = grads(0, "reverse"), grads(1, "reverse")
    assert not torch.allclose(r0, r1)  # FedAU2's reversal pushes each label its own way
    model = build_model("mf", 1, 10, embedding_dim=4, seed=0)
    model.attach_shared_module("adversary", AttributeAdversary(4, 2, 8, generator=_gen(3)))
    F.cross_entropy(model.adversary(model.user_embedding.weight), torch.tensor([1])).backward()
    for got, plain in zip(a1, model.adversary.parameters()):
        assert torch.allclose(got, plain.grad)


def test_fedau2_dsvae_run_is_the_same_under_ray_as_in_the_serial_grid(tmp_path):
    """The DSVAE's random draws and the SUT come from per-(user, round) streams: Flower's Ray simulation and the
    in-process serial grid give bit-identical models (adversary included) and metrics."""
    from conftest import simulate, tiny_run_config

    from fedrec_flwr.serial import run_serial

    attributes = tmp_path / "attributes.csv"
    attributes.write_text("user,gender\n" + "".join(f"u{u},{'F' if u % 3 else 'M'}\n" for u in range(24)))
    overrides = dict(
        client="fedau2",
        adversary="dsvae",
        protected_attribute="gender",
        users_per_node=5,
        generic_attributes_file=str(attributes),
        strategy="curious-item-fedavg",
    )
    ray_results = simulate(tiny_run_config(tmp_path / "ray", **overrides))
    serial_results = run_serial(tiny_run_config(tmp_path / "serial", **overrides))
    a, b = np.load(ray_results / "final_arrays.npz"), np.load(serial_results / "final_arrays.npz")
    assert set(a.files) == set(b.files) and any(k.startswith("adversary.") for k in a.files)
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    strip = without_timings
    assert strip(json.loads((ray_results / "metrics.json").read_text())) == strip(
        json.loads((serial_results / "metrics.json").read_text())
    )


# ---------------------------------------------------------------------------------------------------- GRL as trained
def _hand_ce_gradient_wrt_u(adversary: AttributeAdversary, u: np.ndarray, label: int) -> np.ndarray:
    """dCE(h_w(u), a)/du of the plain MLP adversary, written out in float64: logits = W2 relu(W1 u + b1) + b2,
    dCE/dlogits = softmax - onehot(a), back through W2, the ReLU mask and W1."""
    w1, b1 = adversary.hidden.weight.detach().double().numpy(), adversary.hidden.bias.detach().double().numpy()
    w2, b2 = adversary.head.weight.detach().double().numpy(), adversary.head.bias.detach().double().numpy()
    pre = w1 @ u + b1
    logits = w2 @ np.maximum(pre, 0) + b2
    p = np.exp(logits - logits.max())
    p /= p.sum()
    p[label] -= 1.0
    return w1.T @ ((pre > 0) * (w2.T @ p))


@pytest.mark.parametrize("mode", ["per-client", "server", "server-sgd"])
def test_one_sgd_step_moves_the_embedding_up_the_adversary_loss_by_exactly_lr_eps_grad(mode):
    """As training uses it, the GRL turns the adversary's cross-entropy gradient around. One SGD step of size lr on
    the adversarial term changes the user embedding by -lr * (-eps * dCE/du) = +lr * eps * dCE/du (hand-computed in
    float64), for the per-client term (h_w trained too), the server arm's frozen global h_w, and its own SGD embedding
    step; a reversed GRL sign (`grad_reverse(u, -strength)`) gives the opposite change, so this test catches it."""
    from fedrec_flwr.adversary import AdversarialTerm

    lr, eps, label = 0.1, 0.7, 1
    model = build_model("mf", 1, 10, embedding_dim=4, seed=5)
    model.attach_shared_module(ADVERSARY_MODULE, AttributeAdversary(4, 2, 6, generator=_gen(7)))
    u0 = model.user_embedding.weight.detach().double().numpy()[0].copy()
    expected = lr * eps * _hand_ce_gradient_wrt_u(model.adversary, u0, label)
    assert np.abs(expected).max() > 1e-4
    term = AdversarialTerm(
        model,
        label=label,
        epsilon=eps,
        trigger="always",
        kl_weight=0.0,
        generator=_gen(0),
        frozen=mode != "per-client",
        embedding_step=lr if mode == "server-sgd" else 0.0,
    )
    optimizer = torch.optim.SGD([model.user_embedding.weight], lr=lr)
    optimizer.zero_grad()
    loss = term()
    if mode != "server-sgd":
        loss.backward()
        optimizer.step()
    else:  # the term took its own step; it returns a constant 0 (no gradient for the local optimizer)
        assert float(loss) == 0.0 and not loss.requires_grad
    change = model.user_embedding.weight.detach().double().numpy()[0] - u0
    np.testing.assert_allclose(change, expected, rtol=1e-5, atol=1e-9)


def test_adversarial_trainer_step_differs_from_the_plain_step_by_exactly_lr_eps_grad():
    """The same through the local trainer (recommendation loss + term, one SGD mini-batch): the embedding after one
    step with eps minus the one with eps = 0 is lr * eps * dCE/du at the starting point."""
    lr, eps = 0.05, 1.3

    def step(epsilon: float) -> np.ndarray:
        model = _mf("mlp")
        cfg = LocalTrainConfig(learning_rate=lr, optimizer="sgd", batch_size=1000, local_epochs=1)
        trainer = AdversarialTrainer(
            model, cfg, label=0, epsilon=epsilon, trigger="always", kl_weight=0.0, generator=_gen(3)
        )
        trainer.train(0, POSITIVES, NEGATIVES, _gen(0))
        return model.user_embedding.weight.detach().double().numpy()[0]

    start = _mf("mlp")
    expected = (
        lr * eps * _hand_ce_gradient_wrt_u(start.adversary, start.user_embedding.weight.detach().double().numpy()[0], 0)
    )
    np.testing.assert_allclose(step(eps) - step(0.0), expected, rtol=1e-4, atol=1e-7)


def test_a_protected_attribute_without_an_attribute_unlearning_client_is_named_as_unused(caplog):
    """``protected-attribute`` is read only by the FedAU² clients: a plain client's run says it is unused (a fresh
    user set it with ``client = "fedrec"`` and got no word)."""
    import logging

    from fedrec_flwr.config import make_run_config
    from fedrec_flwr.registry import resolve

    config = make_run_config(protected_attribute="gender")
    with caplog.at_level(logging.WARNING):
        resolve("client", "fedrec").check_config(config)
    assert "'protected-attribute' = 'gender' is unused: client 'fedrec'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resolve("client", "fedrec").check_config(make_run_config())
    assert "protected-attribute" not in caplog.text
