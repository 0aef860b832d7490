"""FedAU²'s ``adversary-server-steps``: after a round's train replies the server takes S - 1 more steps of
the global h_w, each from an ``adversary_gradient`` query to the round's nodes (the mean h_w gradient over their
users at their current, frozen embeddings). S = 1 is the one-step behaviour; S = 3 applies exactly three steps whose
gradients are those of a hand computation from the nodes' private embeddings; no reply carries a label or an
embedding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import MessageRecorder, assert_no_private_value_in_replies, seeded_private_vectors
from test_fedau2_server import _config

from fedrec_flwr.adversary import ADVERSARY_MODULE, AttributeAdversary
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.config import make_run_config
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.wire import NUM_EXAMPLES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PREFIX = ADVERSARY_MODULE + "."
QUERY = "query.adversary_gradient"
LR = 0.3


def _run(folder, steps: int, **overrides):
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial

    config = _config(
        folder,
        adversary_server_optimizer="sgd",
        adversary_server_learning_rate=LR,
        num_server_rounds=1,
        adversary_server_steps=steps,
        **overrides,
    )
    initial = {
        k: v.numpy().astype(np.float64)
        for k, v in get_runtime(config).model.shared_state().items()
        if k.startswith(PREFIX)
    }  # before the run: the in-process runtime's model is the clients' model
    recorder = MessageRecorder(folder / "messages")
    out = run_serial(config, client_app=make_client_app(config, mods=[recorder]))
    return config, initial, np.load(out / "final_arrays.npz"), recorder.records()


def _train_step(initial, train):
    """h_w after the train replies' SGD step (num-examples-weighted mean gradient), as in test_fedau2_server."""
    weights = np.array([r["reply-metrics"]["metrics"][NUM_EXAMPLES] for r in train])
    return {
        k: v
        - LR
        * np.tensordot(weights, np.stack([r["reply-arrays"]["arrays"][k].astype(np.float64) for r in train]), axes=1)
        / weights.sum()
        for k, v in initial.items()
    }


def test_one_step_sends_no_query_and_three_steps_apply_two_more_hand_computed_gradients(tmp_path):
    """S = 1: no adversary_gradient query, h_w = one SGD step on the train replies (the behaviour before the key).
    S = 3, same seed: the same train replies and the same non-h_w arrays; h_w = that step followed by two SGD steps
    on the mean over the round's users of grad CE(h_w(e_u), a_u), e_u the user's embedding after the round's training
    (read from the node's private state) and h_w the server's current copy, computed here by hand."""
    config1, initial, final1, records1 = _run(tmp_path / "s1", 1)
    runtime = get_runtime(config1)
    train1 = [r for r in records1 if r["type"] == "train"]
    assert len(train1) == 12 and not [r for r in records1 if r["type"] == QUERY]
    one = _train_step(initial, train1)
    for key in initial:
        np.testing.assert_allclose(final1[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)

    _, initial3, final3, records3 = _run(tmp_path / "s3", 3)
    assert all(np.array_equal(initial[k], initial3[k]) for k in initial)
    train3 = [r for r in records3 if r["type"] == "train"]
    queries = [r for r in records3 if r["type"] == QUERY]
    assert len(train3) == 12 and len(queries) == 2 * 12
    for a, b in zip(sorted(train1, key=lambda r: r["users"]), sorted(train3, key=lambda r: r["users"])):
        assert a["users"] == b["users"]
        for key in a["reply-arrays"]["arrays"]:
            np.testing.assert_array_equal(a["reply-arrays"]["arrays"][key], b["reply-arrays"]["arrays"][key])
    for key in final1.files:
        if not key.startswith(PREFIX):
            np.testing.assert_array_equal(final1[key], final3[key], err_msg=key)

    users = sorted(u for r in train3 for u in r["users"])
    assert sorted(u for r in queries for u in r["users"]) == sorted(2 * users)  # the round's users, twice
    embeddings = torch.as_tensor(
        np.stack(
            [
                np.concatenate([r["state"][f"user:{u}"][k][0] for k in runtime.layout.private_keys])
                for r in train3
                for u in r["users"]
            ]
        ),
        dtype=torch.float32,
    )
    labels = torch.as_tensor([int(runtime.protected.labels[u]) for r in train3 for u in r["users"]])
    names = [k[len(PREFIX) :] for k in initial]
    hidden = initial[PREFIX + "hidden.weight"].shape[0]
    hand = AttributeAdversary(embeddings.shape[1], 2, hidden, generator=torch.Generator().manual_seed(0))
    values = one
    for _ in range(2):
        hand.load_state_dict({n: torch.as_tensor(values[PREFIX + n], dtype=torch.float32) for n in names})
        hand.zero_grad()
        F.cross_entropy(hand(embeddings), labels).backward()  # the mean over the round's users
        grads = dict(hand.named_parameters())
        values = {PREFIX + n: values[PREFIX + n] - LR * grads[n].grad.numpy().astype(np.float64) for n in names}
    for key in initial:
        np.testing.assert_allclose(final3[key], values[key], rtol=1e-4, atol=1e-6, err_msg=key)
        assert not np.allclose(final3[key], one[key])  # the extra steps moved h_w


@pytest.mark.parametrize("adversary", ["mlp", "dsvae"])
def test_no_adversary_gradient_reply_carries_a_label_a_count_or_an_embedding(tmp_path, adversary):
    """Every query reply holds h_w's keys only and num-examples (the node's user count), no config, and no private
    vector (conftest's check over every state the nodes held); the users' embeddings do not change in a query."""
    config, _, _, records = _run(tmp_path, 2, adversary=adversary)
    layout = get_runtime(config).layout
    queries = [r for r in records if r["type"] == QUERY]
    assert len(queries) == 12
    keys = {k for k in layout.dense_keys if k.startswith(PREFIX)}
    for record in queries:
        assert set(record["reply-arrays"]["arrays"]) == keys
        assert record["reply-metrics"]["metrics"] == {NUM_EXAMPLES: float(len(record["users"]))}
        assert not record["reply-configs"]
        for key, arrays in record["state"].items():
            for name, value in arrays.items():
                np.testing.assert_array_equal(value, record["state-before"][key][name])
    assert_no_private_value_in_replies(records, layout, extra=seeded_private_vectors(config))


@pytest.mark.parametrize("value", [0, 1001, 2.5])
def test_adversary_server_steps_is_range_checked(value):
    with pytest.raises(ConfigError, match="adversary-server-steps"):
        make_run_config(adversary_server_steps=value)


def test_query_users_all_sends_every_extra_step_to_every_user_of_the_federation(tmp_path):
    """adversary-query-users = "all", S = 3: the train round samples some users (fraction-train 0.5), but each of the two
    query steps names every user of the federation once (24 users, one per node), so h_w's extra steps are
    full-batch steps over all users' current embeddings; the train replies are those of the "sampled" default."""
    _, _, _, sampled = _run(tmp_path / "sampled", 3)
    _, _, _, every = _run(tmp_path / "all", 3, adversary_query_users="all")
    train = [r for r in every if r["type"] == "train"]
    queries = [r for r in every if r["type"] == QUERY]
    assert len(train) == 12 and sorted(u for r in queries for u in r["users"]) == sorted(2 * list(range(24)))
    assert sorted(u for r in train for u in r["users"]) == sorted(
        u for r in sampled if r["type"] == "train" for u in r["users"]
    )
    with pytest.raises(ConfigError, match="adversary-query-users"):
        make_run_config(adversary_query_users="some")


@pytest.mark.parametrize(
    "adversary, hidden, placement, noise",
    [
        ("mlp", 0, "all", 1.0),
        ("mlp", 8, "all", 1.0),
        ("dsvae", 0, "all", 1.0),
        ("dsvae", 8, "head", 1.0),
        ("dsvae", 8, "all", 1.0),
        ("dsvae", 0, "all", 0.0),
    ],
)
@pytest.mark.parametrize("query_users", ["sampled", "all"])
def test_batched_query_gradient_equals_the_per_user_loop_mean(
    tmp_path, adversary, hidden, placement, noise, query_users
):
    """A node answers an adversary_gradient query with one batched computation (clients/fedau2.py,
    mean_adversary_gradient): the mean over its users of each one's h_w gradient, with the class prior, and for DSVAE
    each user's latent and label-masking noise from the user's own stream, equal to the per-user loop's mean (float
    summation order only; noise 0 checks the noiseless gradient on its own). block-training = "off" keeps the loop."""
    from flwr.app import RecordDict

    from fedrec_flwr.clients.fedau2 import FedAU2Client

    keys = dict(
        adversary=adversary,
        adversary_hidden=hidden,
        adversary_query_users=query_users,
        adversary_class_prior="0.3,0.7",
        adversary_server_steps=3,
        dsvae_noise_placement=placement,
        dsvae_gradient_noise=noise,
        dsvae_kl_weight=0.5,
    )
    runtime = get_runtime(_config(tmp_path, **keys))
    state = RecordDict()
    shared = {k: v.numpy().copy() for k, v in runtime.model.shared_state().items()}
    query = {"server-round": 2, "adversary-step": 1}
    users = list(range(24))
    for user in users[::2]:  # half the users have trained: a stored embedding unlike its initialisation
        client = FedAU2Client(runtime, user, state)
        client.load_private()
        with torch.no_grad():
            for table in runtime.model.user_embedding_modules().values():
                table.weight.add_(0.3 * torch.randn(table.weight.shape))
        client.save_private()
    batched = FedAU2Client(runtime, 0, state).adversary_query_mean_gradient(shared, query, users)
    loop = [FedAU2Client(runtime, u, state).adversary_query_gradient(shared, query) for u in users]
    layers = (1 if hidden == 0 else 2) + (adversary == "dsvae")
    assert set(batched) == set(loop[0]) and len(batched) == 2 * layers
    for key, value in batched.items():
        expected = np.mean([g[key] for g in loop], axis=0)
        assert np.abs(expected).max() > 1e-4, key  # a gradient, not zeros
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=key)
    if adversary == "dsvae" and noise > 0:  # the users' own draws: another round's streams give another mean
        other = FedAU2Client(runtime, 0, state).adversary_query_mean_gradient(
            shared, {**query, "server-round": 3}, users
        )
        assert any(not np.allclose(other[k], batched[k]) for k in batched)
    off = get_runtime(_config(tmp_path / "off", block_training="off", **keys))
    assert FedAU2Client(off, 0, RecordDict()).adversary_query_mean_gradient(shared, query, users) is None
