"""FedAU²'s clients: adversarial attribute unlearning on one user's embedding, and the DP-noise baseline.

Source: Li et al., "FedAU²: Attribute Unlearning for User-Level Federated Recommender Systems with Adaptive and
Robust Adversarial Training" (arXiv:2511.22872); the adversarial term is :class:`fedrec_flwr.adversary.AdversarialTerm`.

:class:`AttributeUnlearning` is a mixin that adds the term to whatever local trainer the client class below it builds,
so it composes with any client: :class:`FedAU2Client` (``client = "fedau2"``: FedMF with ``model = "mf"``, FedNCF with
``"ncf"``) and :class:`FedAU2GELClient` (``client = "fedau2-gel"``: FedRecGEL's decoupled SAM, the term added to every
chunk of every SAM loss evaluation).

Run-config keys:

* ``protected-attribute``: the user attribute to unlearn (``gender``, ``age`` for MovieLens-100K). The user's class
  is private data of the client: it is read from the client's own copy of the dataset, used only in the local loss,
  and never sent, in any form (tested: no reply carries it).
* ``adversary``: ``"mlp"`` (plain adversary), ``"dsvae"`` (FedAU²'s defence against gradient label leakage) or
  ``"none"`` (the original recommender; with ``user-embedding-noise`` the DP baseline).
* ``adversary-trigger``: ``"sut"`` (FedAU²'s selective unlearning trigger) or ``"always"`` (constant ``eps``).
* ``adversary-objective``: ``"reverse"`` (FedAU²'s gradient reversal) or ``"entropy"`` (ours, a control: the
  embedding moves toward the adversary's uniform prediction; :class:`fedrec_flwr.adversary.AdversarialTerm`).
* ``adversary-epsilon``, ``adversary-hidden``, ``dsvae-latent-dim``, ``dsvae-kl-weight``, ``dsvae-gradient-noise``.
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

import torch

from clients.fedrec import FedRecClient
from clients.fedrecgel import FedRecGELClient
from fedrec_flwr.adversary import AdversarialTerm
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.seeding import TAG_CLIENT_EXTRA, torch_generator
from fedrec_flwr.training import LocalTrainer

log = logging.getLogger(__name__)

_ADVERSARY_STREAM, _NOISE_STREAM = 0, 1


class AttributeUnlearning:
    """Client mixin: FedAU²'s adversarial term on the trainer of the class below it, and the DP-noise baseline
    (module docstring). Put it first: ``class C(AttributeUnlearning, SomeFedRecClient)``."""

    unlearns_attributes = True

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)  # type: ignore[misc]
        if config.model == "pfedrec":
            raise ConfigError(f"run-config key 'client' = {config.client!r}: attribute unlearning needs a model with a "
                              f"user embedding (model = 'mf' or 'ncf'), got model = 'pfedrec'")
        if config.adversary == "none" and config.user_embedding_noise == 0:
            log.warning("client %r with adversary = 'none' and user-embedding-noise = 0 trains the original model",
                        config.client)

    def _generator(self, config: Mapping[str, Any], stream: int) -> torch.Generator:
        return torch_generator(self.runtime.config.seed, TAG_CLIENT_EXTRA, self.user, int(config["server-round"]),
                               stream)

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
            trainer.loss_terms.append(AdversarialTerm(
                trainer.model, label=self.protected_label, epsilon=cfg.adversary_epsilon,
                trigger=cfg.adversary_trigger, kl_weight=cfg.dsvae_kl_weight,
                generator=self._generator(config, _ADVERSARY_STREAM), objective=cfg.adversary_objective))
        return trainer

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
    """FedAU² on FedMF / FedNCF (``client = "fedau2"``); see the module docstring."""


class FedAU2GELClient(AttributeUnlearning, FedRecGELClient):
    """FedAU² on FedRecGEL's SAM client (``client = "fedau2-gel"``, with ``strategy = "server-optimizer"`` or
    ``"item-fedavg"``); see the module docstring."""
