"""FedAU²'s end-to-end acceptance check, small and in-process: a synthetic federation whose users' embeddings start
with the protected attribute written along one linear direction (logistic-regression attacker AUC >= 0.9), trained
through the whole Flower path (serial grid, item-fedavg, FedAU²'s clients with the server-trained adversary); the
method should drive the attacker to AUC <= 0.6.

The local step size is part of the construction (experiments/fedau2/README.md reports this check). The
adversarial pull is added to the loss the local Adam steps, once per round here (one batch per user), and Adam's first
step moves every coordinate by about ``learning-rate`` whatever the gradient's size. An embedding therefore cannot
settle closer to ``h_w``'s boundary than about ``learning-rate * sqrt(d)`` along the attribute direction. At 0.01
(d = 8) that quantum is 0.028: half the planted offset ``DELTA`` and three times the embeddings' own spread (init std
0.01), so (our reading) both classes overshoot the boundary in mirrored phase and stay separable (measured:
1.00 -> 0.83). At ``LEARNING_RATE`` = 0.002, fixed from that arithmetic before it was run, the quantum (0.006) is
below the spread, and 30 rounds can still move an embedding 0.17 > ``DELTA`` along the direction. Without the
adversary, the same federation keeps the direction readable (AUC 1.00 -> 0.997 at 0.01, 1.00 -> 1.00 at 0.002);
with it, 1.00 -> 0.56 at 0.002 (as the README reports). The arm is the label-independent entropy pull (ours), always on."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import tiny_run_config, write_tiny_dataset

from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.attacks import attribute_inference, collect_user_embeddings
from fedrec_flwr.config import FIRST_RELEASE_ADVERSARY

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

USERS, ROUNDS, DELTA = 96, 30, 0.05
LEARNING_RATE = 0.002
"""The local Adam rate: its per-round quantum along the planted direction, 0.002 * sqrt(8), is below the embeddings'
spread (module docstring)."""


def _federation(folder, base=FIRST_RELEASE_ADVERSARY, **overrides):
    """Run the synthetic federation; returns ``(attacker AUC at the start, attacker AUC after ROUNDS)``. Every user's
    embedding gets ``DELTA * (+1 | -1) * v`` (``v`` the unit diagonal) at its first visit, by a client mod (the
    interactions do not depend on the attribute: users of ``write_tiny_dataset`` prefer one of 3 item groups, the
    attribute is ``user % 2``)."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.clients.fedau2 import FedAU2Client
    from fedrec_flwr.serial import run_serial

    data = write_tiny_dataset(folder / "data", num_users=USERS)
    labels = np.arange(USERS) % 2
    attributes = folder / "attributes.csv"
    attributes.write_text("user,gender\n" + "".join(f"u{u},{'FM'[labels[u]]}\n" for u in range(USERS)))
    config = tiny_run_config(
        folder / "run",
        generic_file=str(data),
        client="fedau2",
        protected_attribute="gender",
        generic_attributes_file=str(attributes),
        model="mf",
        **{
            "users_per_node": USERS,
            "fraction_train": 1.0,
            "num_server_rounds": ROUNDS,
            "eval_every": ROUNDS,
            **base,
            **overrides,
        },
    )  # the settings its numbers were measured at
    runtime = get_runtime(config)
    direction = torch.full((runtime.config.embedding_dim,), runtime.config.embedding_dim**-0.5)
    truth = runtime.protected.labels
    start = []

    def plant(message, context, call_next):
        users = message.content["config"].get("users", []) if message.metadata.message_type == "train" else []
        for user in (int(u) for u in users):
            if f"user:{user}" not in context.state:
                client = FedAU2Client(runtime, user, context.state)
                client.load_private()
                with torch.no_grad():
                    runtime.model.user_embedding.weight[0] += DELTA * (2 * int(truth[user]) - 1) * direction
                start.append(runtime.model.user_embedding.weight[0].detach().numpy().copy())
                client.save_private()
        return call_next(message, context)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    _, grid = run_serial(config, client_app=make_client_app(config, mods=[plant]), return_grid=True)
    x, present = collect_user_embeddings([c.state for c in grid.contexts.values()], runtime.layout.private_keys, USERS)
    assert present.all() and len(start) == USERS
    before = attribute_inference(np.stack(start), truth, classifier="logreg", splits=5).auc[0]
    after = attribute_inference(x, truth, classifier="logreg", splits=5).auc[0]
    return before, after


def test_server_trained_fedau2_drives_a_planted_linear_attribute_to_chance(tmp_path):
    before, after = _federation(
        tmp_path,
        adversary="mlp",
        adversary_objective="entropy",
        adversary_trigger="always",
        adversary_server_learning_rate=0.05,
        learning_rate=LEARNING_RATE,
    )
    if before < 0.9:  # the federation must start leaking (a failure of the construction, not of the method)
        pytest.fail(f"the planted direction gives attacker AUC {before:.3f} < 0.9 at the start")
    assert after <= 0.6, (before, after)


def test_the_same_federation_without_the_pull_keeps_the_planted_attribute_readable(tmp_path):
    """The control of the test above: the same arm at ``adversary-epsilon = 0`` (``h_w`` still trained, the embedding
    gets no adversarial step) leaves the planted direction readable, so the fall to chance above is the method's,
    not the low local rate's or recommendation training's."""
    before, after = _federation(
        tmp_path,
        adversary="mlp",
        adversary_objective="entropy",
        adversary_trigger="always",
        adversary_server_learning_rate=0.05,
        learning_rate=LEARNING_RATE,
        adversary_epsilon=0.0,
    )
    assert before >= 0.9 and after >= 0.9, (before, after)


@pytest.mark.xfail(
    strict=True,
    reason="not met: the defaults' linear h_w (server Adam 0.001) with eps capped at 1 leaves the planted direction "
    "readable here (AUC 1.00 -> 1.00; h_w's own balanced accuracy 0.93 at eps 1 by round 25); the arm above "
    "(server rate 0.05, fixed eps 1) reaches <= 0.6",
)
def test_the_package_defaults_drive_a_planted_linear_attribute_to_chance(tmp_path, caplog):
    """``client = "fedau2"`` and a ``protected-attribute`` with every adversary key at the package default (``adversary
    = "auto"``: a linear ``h_w`` trained by the server under SecAgg+, the adaptive weight, the ``"aggregate"`` prior):
    the planted direction (attacker AUC >= 0.9) falls to within 0.1 of chance. Only the construction's keys are set:
    the local rate (module docstring) and 4 nodes of 24 users (SecAgg+ needs 2 nodes or more)."""
    caplog.set_level(logging.INFO, logger="fedrec_flwr.strategies.adversary")
    before, after = _federation(tmp_path, base={}, learning_rate=LEARNING_RATE, users_per_node=USERS // 4)
    if before < 0.9:
        pytest.fail(f"the planted direction gives attacker AUC {before:.3f} < 0.9 at the start")
    assert abs(after - 0.5) <= 0.1, (before, after)
    assert "adaptive eps" in caplog.text  # the controller stepped eps on the securely summed statistics
