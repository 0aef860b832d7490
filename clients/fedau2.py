"""FedAU²'s clients: adversarial attribute unlearning on one user's embedding, and the DP-noise baseline.

Source: Li et al., "FedAU²: Attribute Unlearning for User-Level Federated Recommender Systems with Adaptive and
Robust Adversarial Training" (arXiv:2511.22872); the adversarial term is :class:`fedrec_flwr.adversary.AdversarialTerm`.

:class:`AttributeUnlearning` is a mixin that adds the term to whatever local trainer the client class below it builds,
so it composes with any client: :class:`FedAU2Client` (``client = "fedau2"``: FedMF with ``model = "mf"``, FedNCF with
``"ncf"``) and :class:`FedAU2GELClient` (``client = "fedau2-gel"``: FedRecGEL's decoupled SAM, the term added to every
chunk of every SAM loss evaluation).

Run-config keys (defaults in ``pyproject.toml``). **The package defaults are not FedAU²'s own mechanism**:
measured on MovieLens-100K, FedAU²'s selective unlearning trigger with gradient reversal wrote the
attribute *into* the embeddings (attacker AUC 0.54 -> 0.83 on FedMF, gender), a defence worse than none. The defaults
are the arm that met the targets there (experiments/fedau2/results/measurements.md, §9-13): the label-independent entropy pull
on every step (``adversary-trigger = "always"``, ``adversary-objective = "entropy"``, ``adversary-epsilon = 0.1``,
chosen on a validation item), a linear ``h_w`` (``adversary-hidden = 0``) trained on the server with 20 Adam steps of
0.001 a round, the dataset's published class prior and, with ``adversary = "dsvae"``, DSVAE's noise on every uploaded
``h_w`` gradient. FedAU² as the paper states it (SUT, GRL, a 32-wide ``h_w``, one server step, no prior, noise on the
head) is ``adversary-trigger = "sut"``, ``adversary-objective = "reverse"``, ``adversary-epsilon = 1``,
``adversary-hidden = 32``, ``adversary-server-steps = 1``, ``adversary-server-learning-rate = 0.01``,
``adversary-class-prior = ""``, ``dsvae-noise-placement = "head"`` (``fedrec_flwr.config.FIRST_RELEASE_ADVERSARY``).

* ``protected-attribute``: the user attribute to unlearn (``gender``, ``age`` for MovieLens-100K). The user's class
  is private data of the client: it is read from the client's own copy of the dataset, used only in the local loss,
  and never sent, in any form (tested: no reply carries it).
* ``adversary``: ``"mlp"`` (plain adversary), ``"dsvae"`` (FedAU²'s defence against gradient label leakage) or
  ``"none"`` (the original recommender; with ``user-embedding-noise`` the DP baseline).
* ``adversary-trigger``: ``"sut"`` (FedAU²'s selective unlearning trigger) or ``"always"`` (constant ``eps``).
* ``adversary-objective``: ``"reverse"`` (FedAU²'s gradient reversal) or ``"entropy"`` (ours, a control: the
  embedding moves toward the adversary's uniform prediction; :class:`fedrec_flwr.adversary.AdversarialTerm`).
* ``adversary-training``: ``"server"`` (default; ours): every client uses the round's global ``h_w``,
  frozen, for the SUT and the GRL, and uploads ``h_w``'s gradient at that frozen copy
  (:func:`fedrec_flwr.adversary.adversary_gradient`, with DSVAE's noise once on it) in place of ``h_w``'s values; the
  strategy averages the gradients and steps ``h_w`` with its own optimizer
  (:class:`fedrec_flwr.strategies.adversary.AdversaryServerStep`, ``adversary-server-optimizer``,
  ``adversary-server-learning-rate``; ``adversary-server-steps`` = S > 1: S - 1 more steps per round, each from an
  ``adversary_gradient`` query answered by :meth:`AttributeUnlearning.adversary_query_gradient`; with
  ``adversary-query-users = "all"`` every user of the federation answers them, not only the round's). ``"per-client"``: FedAU², per-client adversary as first implemented (each
  client trains its local copy of ``h_w`` on its single label, the strategy averages the copies; measured to collapse
  to the majority class and write the attribute into the embeddings).
* ``adversary-embedding-optimizer``: ``"local"`` (the adversarial gradient is part of the loss the local optimizer
  steps; Adam normalises its size away) or ``"sgd"`` (a plain SGD step of size ``learning-rate`` on the reversed
  gradient, or on the entropy pull with ``adversary-objective = "entropy"``, keeping its size; needs
  ``adversary-training = "server"`` and ``client = "fedau2"``).
* ``adversary-class-prior``: ``"published"`` (default: the dataset's published class shares,
  :data:`fedrec_flwr.attributes.PUBLISHED_CLASS_COUNTS`, MovieLens-100K's gender / age / occupation; no prior, with a
  warning, where none is published), explicit shares, or ``""``; the same for every user: ``h_w`` is trained with the
  logit-adjusted loss so its raw decision is balanced; no message carries a count.
* ``adversary-warmup-rounds`` = k (ours): a GRL warm-up, ``eps = 0`` in rounds 1..k while ``h_w`` learns
  (:meth:`AttributeUnlearning.round_epsilon`).
* ``dsvae-noise-placement``: ``"all"`` (default: on every uploaded ``h_w`` gradient;
  :func:`fedrec_flwr.adversary.adversary_gradient`) or ``"head"`` (DSVAE's noise on the uploaded head gradient only, as
  first built); without DSVAE or with per-client training there is no such noise and the key changes nothing.
* ``dsvae-noise-stream``: ``"per-user"`` (default: one noise draw per user for the whole run, so the train reply and
  every ``adversary_gradient`` query of the user carry the same noise and a server that averages a node's uploads,
  the curious server's linked iDLG, gets no more than from one), ``"per-round"`` (one draw per user and round) or
  ``"per-upload"`` (a fresh draw per upload, as first built: averaging a node's 20 uploads a round read every label);
  the latent ``xi`` is drawn afresh for every upload in all three.
* ``adversary-epsilon``, ``adversary-hidden`` (0: a linear ``h_w``), ``dsvae-latent-dim``, ``dsvae-kl-weight``, ``dsvae-gradient-noise``.
* ``user-embedding-noise``: the DP baseline (ours in detail: FedAU² compares against DP noise on the user embedding
  without giving its mechanism): after each local training the user embedding is replaced by ``e + Laplace(0, b)``
  per coordinate (the Laplace mechanism, Dwork et al. 2006, with scale ``b``), and that perturbed embedding is what
  the client keeps, recommends with and trains from next time.

The adversary ``h_w`` is a shared module of the model (its parameters travel like the score function's and are
averaged by the strategy). Randomness (DSVAE draws, Laplace noise) comes from the stream
``(seed, TAG_CLIENT_EXTRA, user, round)``, so runs are reproducible whatever the number of workers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedrec_flwr.adversary import (
    ADVERSARY_MODULE,
    AdversarialTerm,
    adversary_gradient,
    adversary_of,
    class_prior_text,
    entropy_pull,
    mean_adversary_gradient,
    parse_class_prior,
    user_vectors,
)
from fedrec_flwr.adversary.adaptive import adversary_statistics
from fedrec_flwr.adversary.prior import round_prior_text
from fedrec_flwr.adversary.secure import EPSILON_KEY
from fedrec_flwr.clients.fedrec import FedRecClient
from fedrec_flwr.clients.fedrecgel import FedRecGELClient
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.block_engine import Block
from fedrec_flwr.local.training import LocalTrainer
from fedrec_flwr.seeding import TAG_CLIENT_EXTRA, torch_generator

log = logging.getLogger(__name__)

_ADVERSARY_STREAM, _NOISE_STREAM, _UPLOAD_STREAM, _QUERY_STREAM, _DSVAE_NOISE_STREAM = 0, 1, 2, 3, 4


class AttributeUnlearning:
    """Client mixin: FedAU²'s adversarial term on the trainer of the class below it, and the DP-noise baseline
    (module docstring). Put it first: ``class C(AttributeUnlearning, SomeFedRecClient)``."""

    unlearns_attributes = True

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)  # type: ignore[misc]
        if config.model == "pfedrec":
            raise ConfigError(
                f"run-config key 'client' = {config.client!r}: attribute unlearning needs a model with a "
                f"user embedding (model = 'mf' or 'ncf'), got model = 'pfedrec'"
            )
        if config.adversary_embedding_optimizer == "sgd" and (
            config.adversary_training != "server" or not issubclass(cls, FedAU2Client)
        ):
            raise ConfigError(
                "run-config key 'adversary-embedding-optimizer' = 'sgd' needs adversary-training = 'server' and "
                f"client = 'fedau2' (got {config.adversary_training!r}, {config.client!r}; FedRecGEL's SAM evaluates "
                "the loss three times per step, so its adversarial term must stay a loss: use 'local')"
            )
        if config.adversary != "none":
            class_prior_text(config, warn=True)  # "published" without published shares: says so, once
        if config.adversary == "none" and config.user_embedding_noise == 0:
            log.warning(
                "client %r with adversary = 'none' and user-embedding-noise = 0 trains the original model",
                config.client,
            )

    def _generator(
        self, config: Mapping[str, Any], stream: int, *keys: int, user: int | None = None
    ) -> torch.Generator:
        """This user's (or ``user``'s) seeded stream ``stream`` of the round ``config["server-round"]``."""
        return torch_generator(
            self.runtime.config.seed,
            TAG_CLIENT_EXTRA,
            self.user if user is None else int(user),
            int(config["server-round"]),
            stream,
            *keys,
        )

    def _noise_generator(self, config: Mapping[str, Any], user: int | None = None) -> torch.Generator | None:
        """The stream of an upload's DSVAE gradient noise (``dsvae-noise-stream``): seeded from the user alone
        (``"per-user"``) or the user and round (``"per-round"``), so every such upload draws the same noise;
        ``None`` for ``"per-upload"`` (the upload's own stream, a fresh draw each time)."""
        stream = self.runtime.config.dsvae_noise_stream
        if stream == "per-upload":
            return None
        key = 0 if stream == "per-user" else int(config["server-round"])  # rounds are 1-based: 0 is no round's
        return torch_generator(
            self.runtime.config.seed,
            TAG_CLIENT_EXTRA,
            self.user if user is None else int(user),
            key,
            _DSVAE_NOISE_STREAM,
        )

    @property
    def protected_label(self) -> int:
        """The user's private attribute class (never sent)."""
        protected = self.runtime.protected
        if protected is None:
            raise ConfigError("attribute unlearning: no 'protected-attribute' is configured")
        return int(protected.labels[self.user])

    def make_trainer(self, config: Mapping[str, Any]) -> LocalTrainer:
        trainer = super().make_trainer(config)  # type: ignore[misc]
        self._round_config = config
        cfg = self.runtime.config
        if cfg.adversary != "none":
            server = cfg.adversary_training == "server"
            sgd = cfg.adversary_embedding_optimizer == "sgd"
            trainer.loss_terms.append(
                AdversarialTerm(
                    trainer.model,
                    label=self.protected_label,
                    epsilon=self.round_epsilon(config),
                    trigger=cfg.adversary_trigger,
                    kl_weight=cfg.dsvae_kl_weight,
                    generator=self._generator(config, _ADVERSARY_STREAM),
                    objective=cfg.adversary_objective,
                    frozen=server,
                    embedding_step=cfg.learning_rate if sgd else 0.0,
                    log_prior=self._log_prior(config),
                )
            )
        return trainer

    def round_epsilon(self, config: Mapping[str, Any]) -> float:
        """The GRL strength of this round: 0 in the warm-up rounds ``1 .. adversary-warmup-rounds`` (``h_w`` is still
        trained: its gradient is uploaded, or with ``"per-client"`` its local copy steps, but the embedding gets no
        adversarial step and the SUT fires for nobody), ``adversary-epsilon`` after.

        Ours: DANN ramps the reversal strength up from 0 while the domain classifier learns (Ganin et al.
        2016, JMLR, Sec. 5.2.2, ``lambda_p = 2 / (1 + exp(-10 p)) - 1``); a warm-up of ``k`` rounds is the step-function
        version, so that ``h_w`` can learn the attribute's direction before it moves the embeddings (an uninformed
        ``h_w`` under the SUT writes the attribute in, README of experiments/fedau2)."""
        cfg = self.runtime.config
        if int(config["server-round"]) <= cfg.adversary_warmup_rounds:
            return 0.0
        # adversary-weight-rule = "adaptive": the server's controller sends the round's eps
        return float(config.get(EPSILON_KEY, cfg.adversary_epsilon))

    def _log_prior(self, config: Mapping[str, Any] | None = None) -> torch.Tensor | None:
        """The log class prior of the message with config ``config`` (``adversary-class-prior``; under
        ``"aggregate"`` the shares the server sent in it, :func:`fedrec_flwr.adversary.prior.round_prior_text`)."""
        protected = self.runtime.protected
        text = round_prior_text(self.runtime.config, config, protected.classes)
        return parse_class_prior(text, protected.num_classes)

    def shared_update(self, trainer: LocalTrainer, result, config: Mapping[str, Any]):
        """The class below's upload; with ``adversary-training = "server"``, ``h_w``'s entries are replaced by this
        user's gradient at the frozen global ``h_w`` (:func:`fedrec_flwr.adversary.adversary_gradient`, DSVAE noise
        included), which the strategy averages and steps (:class:`fedrec_flwr.strategies.adversary.AdversaryServerStep`)."""
        update = super().shared_update(trainer, result, config)  # type: ignore[misc]
        cfg = self.runtime.config
        if cfg.adversary != "none" and cfg.adversary_training == "server":
            grads = adversary_gradient(
                self.model,
                label=self.protected_label,
                kl_weight=cfg.dsvae_kl_weight,
                generator=self._generator(config, _UPLOAD_STREAM),
                log_prior=self._log_prior(config),
                noise_placement=cfg.dsvae_noise_placement,
                noise_generator=self._noise_generator(config),
            )
            for key, grad in grads.items():
                update.dense[key] = grad.cpu().numpy()
        return update

    def adversary_query_gradient(self, shared: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        """This user's contribution to one more server step of ``h_w`` in the same round (``adversary-server-steps``
        > 1, the ``adversary_gradient`` query, :meth:`fedrec_flwr.strategies.adversary.AdversaryServerStep.extra_steps`): the
        same gradient as the train reply's (:func:`fedrec_flwr.adversary.adversary_gradient`, DSVAE's noise once on
        it), at the ``h_w`` of ``shared`` (the server's current copy) and the user's current private embedding
        (frozen: nothing is trained or saved). The DSVAE draws come from their own stream per step
        (``config["adversary-step"]``, 1 .. S - 1).

        Returns:
            shared key (``"adversary.<name>"``) -> float32 array shaped as the parameter.

        Raises:
            ConfigError: no adversary, or ``adversary-training`` is not ``"server"``.
        """
        cfg = self.runtime.config
        if cfg.adversary == "none" or cfg.adversary_training != "server":
            raise ConfigError(
                "the adversary_gradient query needs an adversary and adversary-training = 'server' "
                f"(got adversary = {cfg.adversary!r}, adversary-training = {cfg.adversary_training!r})"
            )
        self.load_shared(shared)
        self.load_private()
        grads = adversary_gradient(
            self.model,
            label=self.protected_label,
            kl_weight=cfg.dsvae_kl_weight,
            generator=self._generator(config, _QUERY_STREAM, int(config["adversary-step"])),
            log_prior=self._log_prior(config),
            noise_placement=cfg.dsvae_noise_placement,
            noise_generator=self._noise_generator(config),
        )
        return {key: grad.cpu().numpy() for key, grad in grads.items()}

    def adversary_query_mean_gradient(
        self, shared: Mapping[str, Any], config: Mapping[str, Any], users
    ) -> dict[str, Any] | None:
        """The mean of :meth:`adversary_query_gradient` over ``users`` (this node's, in the same state), in one batched
        computation (:func:`fedrec_flwr.adversary.mean_adversary_gradient`; ours, for speed), or ``None`` with
        ``block-training = "off"``, which keeps the per-user loop as the reference arm. A DSVAE adversary's draws come
        from each user's own stream, as in the loop. Equal to the loop's mean up to float summation order (tested);
        nothing is trained or saved.

        Returns:
            shared key -> float32 array, or ``None``.

        Raises:
            ConfigError: no adversary, or ``adversary-training`` is not ``"server"``.
        """
        cfg = self.runtime.config
        if cfg.block_training == "off":
            return None
        if cfg.adversary == "none" or cfg.adversary_training != "server":
            raise ConfigError(
                "the adversary_gradient query needs an adversary and adversary-training = 'server' "
                f"(got adversary = {cfg.adversary!r}, adversary-training = {cfg.adversary_training!r})"
            )
        self.load_shared(shared)
        users = [int(u) for u in users]
        vectors = user_vectors(self.model, Block(self.runtime, users, self.state).load_private(users))
        self.protected_label  # noqa: B018 (raises the ConfigError when no protected-attribute is configured)
        labels = torch.as_tensor(self.runtime.protected.labels[users], dtype=torch.long)
        step = int(config["adversary-step"])
        generators = [self._generator(config, _QUERY_STREAM, step, user=user) for user in users]
        grads = mean_adversary_gradient(
            adversary_of(self.model),
            vectors,
            labels,
            log_prior=self._log_prior(config),
            kl_weight=cfg.dsvae_kl_weight,
            generators=generators,
            noise_placement=cfg.dsvae_noise_placement,
            noise_generators=[self._noise_generator(config, user) for user in users],
        )
        return {key: grad.cpu().numpy() for key, grad in grads.items()}

    def adversary_statistics_sum(
        self, shared: Mapping[str, Any], users, config: Mapping[str, Any] | None = None
    ) -> np.ndarray:
        """The sum over ``users`` (this node's, after the round's training) of each one's
        :func:`fedrec_flwr.adversary.adaptive.adversary_statistics` at the ``h_w`` of ``shared`` (the round's global
        copy) and the user's current private embedding, with the class prior of ``adversary-class-prior``: the
        adaptive rule's contribution of this node (:mod:`fedrec_flwr.adversary.secure`; ``config``: the train message's,
        for the ``"aggregate"`` prior). Nothing is trained or saved.

        Returns:
            ``(4 C,)`` float64.
        """
        self.load_shared(shared)
        users = [int(u) for u in users]
        vectors = user_vectors(self.model, Block(self.runtime, users, self.state).load_private(users))
        self.protected_label  # noqa: B018 (raises the ConfigError when no protected-attribute is configured)
        labels = torch.as_tensor(self.runtime.protected.labels[users], dtype=torch.long)
        return adversary_statistics(adversary_of(self.model), vectors, labels, log_prior=self._log_prior(config))

    def save_private(self) -> None:
        """Save the user's private state; in a training round with ``user-embedding-noise = b > 0``, perturb the
        user embedding first by ``Laplace(0, b)`` per coordinate (the DP baseline)."""
        scale = self.runtime.config.user_embedding_noise
        config = getattr(self, "_round_config", None)
        if scale > 0 and config is not None:
            generator = self._generator(config, _NOISE_STREAM)
            with torch.no_grad():
                for table in self.model.user_embedding_modules().values():
                    # Laplace(0, b) by inverse CDF from the seeded generator (torch's Laplace takes no generator).
                    uniform = torch.rand(table.weight.shape, generator=generator, dtype=torch.float64) - 0.5
                    noise = -scale * torch.sign(uniform) * torch.log1p(-2.0 * uniform.abs().clamp(max=0.5 - 1e-12))
                    table.weight.add_(noise.to(table.weight.dtype).to(table.weight.device))
        super().save_private()  # type: ignore[misc]


class FedAU2Client(AttributeUnlearning, FedRecClient):
    """FedAU² on FedMF / FedNCF (``client = "fedau2"``); see the module docstring. Its users of one message train
    as one vectorized block (:mod:`fedrec_flwr.local.blocks`) in the arms :meth:`block_supports` names, per user otherwise."""

    block_training = "plain"

    @classmethod
    def block_supports(cls, config) -> bool:
        """Whether the block path reproduces this client under ``config``: no adversary, or the package's default arm
        (``adversary-training = "server"``, ``adversary-objective = "entropy"`` with either trigger,
        ``adversary-embedding-optimizer = "local"``), without ``user-embedding-noise``. The reversal objective (a
        DSVAE latent drawn per step), the SGD pull and per-client ``h_w`` training stay per user."""
        if config.user_embedding_noise > 0:
            return False
        return config.adversary == "none" or (
            config.adversary_training == "server"
            and config.adversary_objective == "entropy"
            and config.adversary_embedding_optimizer == "local"
        )

    @classmethod
    def block_term(cls, runtime, users, state, shared, config) -> EntropyPullBlock | None:
        """The block form of :meth:`make_trainer`'s term for a chunk of ``users`` (``None`` without an adversary)."""
        if runtime.config.adversary == "none":
            return None
        return EntropyPullBlock(cls(runtime, int(users[0]), state), users, shared, config)


class EntropyPullBlock:
    """FedAU²'s default adversarial term (:class:`fedrec_flwr.adversary.AdversarialTerm` with ``objective =
    "entropy"``, a frozen server ``h_w`` and the local optimizer) and its ``h_w`` upload (:meth:`shared_update`) for a
    chunk of a vectorized block (:class:`fedrec_flwr.local.blocks.BlockTerm`).

    At every step each user ``k``'s embedding ``e_k`` (its user tables' rows concatenated, :func:`user_vector`'s
    layout) gets the gradient ``eps_k * pull_k``, ``pull_k = d/de_k H_x(uniform, softmax(h_w(e_k)))`` (the mean
    over classes of ``-log softmax``; Roy & Boddeti 2019, Eq. 4), ``eps_k`` = the round's ``eps``, or with ``adversary-
    trigger = "sut"`` ``eps`` where ``h_w`` predicts the user's class; and its loss value ``eps_k <e_k, pull_k>``, as
    the per-user term adds. One autograd pass over the sum of the users' terms gives every ``pull_k`` (each depends
    on its own row only). After training, each user's upload under ``h_w``'s keys is its own gradient at the global
    ``h_w`` and its final embedding (:func:`mean_adversary_gradient` of one user: DSVAE's draws from the user's upload
    stream), as the per-user client uploads. Equal to the per-user path to float32 rounding (``tests/test_blocks.py``).

    Args:
        client: one :class:`AttributeUnlearning` client of the chunk (its run config, round ``eps``, prior, streams).
        users: the chunk's users, in block order. shared: the message's arrays (the global ``h_w``). config: the train
            message's config (``"server-round"``).
    """

    def __init__(self, client: AttributeUnlearning, users, shared, config: Mapping[str, Any]) -> None:
        runtime, cfg = client.runtime, client.runtime.config
        model = runtime.model
        keys = [k for k in runtime.layout.shared_shapes if k.startswith(f"{ADVERSARY_MODULE}.")]
        model.load_shared_state({k: shared[k] for k in keys}, partial=True)
        self.adversary = adversary_of(model)
        self.frozen_keys = frozenset(keys)
        self.model = model
        self.tables = [
            (f"{name}.weight", module.embedding_dim) for name, module in model.user_embedding_modules().items()
        ]
        device = self.adversary.head.weight.device
        client.protected_label  # noqa: B018 (raises the ConfigError when no protected-attribute is configured)
        self.labels = torch.as_tensor(
            runtime.protected.labels[[int(u) for u in users]], dtype=torch.long, device=device
        )
        self.epsilon, self.trigger = client.round_epsilon(config), cfg.adversary_trigger
        self.generators = [client._generator(config, _UPLOAD_STREAM, user=int(u)) for u in users]
        self.noise_generators = [client._noise_generator(config, int(u)) for u in users]
        self.log_prior, self.kl_weight = client._log_prior(config), cfg.dsvae_kl_weight
        self.placement = cfg.dsvae_noise_placement

    def add(self, params, grads, values, active):
        u = user_vectors(self.model, params).detach()
        pull, logits = entropy_pull(self.adversary, u)
        strength = torch.full((active,), self.epsilon, dtype=pull.dtype, device=pull.device)
        if self.trigger == "sut":
            strength = strength * (logits.argmax(dim=-1) == self.labels[:active]).to(pull.dtype)
        step = strength.unsqueeze(1) * pull
        grads, start = dict(grads), 0
        for key, width in self.tables:
            grads[key] = grads[key] + step[:, start : start + width].unsqueeze(1)
            start += width
        return grads, values + strength * (u * pull).sum(dim=-1)

    def uploads(self, params):
        u = user_vectors(self.model, params).detach()
        out = []
        for k in range(len(u)):
            grads = mean_adversary_gradient(
                self.adversary,
                u[k : k + 1],
                self.labels[k : k + 1],
                log_prior=self.log_prior,
                kl_weight=self.kl_weight,
                generators=self.generators[k : k + 1],
                noise_placement=self.placement,
                noise_generators=self.noise_generators[k : k + 1],
            )
            out.append({key: grad.cpu().numpy() for key, grad in grads.items()})
        return out


class FedAU2GELClient(AttributeUnlearning, FedRecGELClient):
    """FedAU² on FedRecGEL's SAM client (``client = "fedau2-gel"``, with ``strategy = "server-optimizer"`` or
    ``"item-fedavg"``); see the module docstring."""
