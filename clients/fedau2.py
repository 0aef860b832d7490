"""FedAU²'s client: adversarial attribute unlearning on one user's embedding, and the DP-noise baseline.

Source: Li et al., "FedAU²: Attribute Unlearning for User-Level Federated Recommender Systems with Adaptive and
Robust Adversarial Training" (arXiv:2511.22872); the local step is :class:`fedrec_flwr.adversary.AdversarialTrainer`.

Run-config keys (``client = "fedau2"``, with ``model = "mf"`` (FedMF) or ``"ncf"`` (FedNCF)):

* ``protected-attribute``: the user attribute to unlearn (``gender``, ``age`` for MovieLens-100K). The user's class
  is private data of the client: it is read from the client's own copy of the dataset, used only in the local loss,
  and never sent, in any form (tested: no reply carries it, and replies are identical for any attribute value except
  through the trained parameters).
* ``adversary``: ``"mlp"`` (plain adversary), ``"dsvae"`` (FedAU²'s defence against gradient label leakage) or
  ``"none"`` (the original recommender; with ``user-embedding-noise`` the DP baseline).
* ``adversary-trigger``: ``"sut"`` (FedAU²'s selective unlearning trigger) or ``"always"`` (constant ``eps``).
* ``adversary-epsilon``, ``adversary-hidden``, ``dsvae-latent-dim``, ``dsvae-kl-weight``, ``dsvae-gradient-noise``.
* ``user-embedding-noise``: the DP baseline (ours in detail: FedAU² compares against DP noise on the user embedding
  without giving its mechanism): after each local training the user embedding is replaced by ``e + Laplace(0, b)``
  per coordinate (the Laplace mechanism, Dwork et al. 2006, with scale ``b``), and that perturbed embedding is what
  the client keeps, recommends with and trains from next time.

The adversary ``h_w`` is a shared module of the model (its parameters travel like the score function's and are
averaged by the strategy, weighted by examples). Randomness (DSVAE draws, Laplace noise) comes from the stream
``(seed, TAG_CLIENT_EXTRA, user, round)``, so runs are reproducible whatever the number of workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from clients.fedrec import FedRecClient
from fedrec_flwr.adversary import AdversarialTrainer
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.seeding import TAG_CLIENT_EXTRA, torch_generator
from fedrec_flwr.training import LocalTrainer

_ADVERSARY_STREAM, _NOISE_STREAM = 0, 1


class FedAU2Client(FedRecClient):
    """One user's FedAU² client (FedMF or FedNCF with an attribute adversary); see the module docstring."""

    @classmethod
    def check_config(cls, config) -> None:
        if config.model == "pfedrec":
            raise ConfigError("client 'fedau2' needs a model with a user embedding: model = 'mf' or 'ncf'")
        if config.adversary == "none" and config.user_embedding_noise == 0:
            return
        if config.adversary != "none" and not config.protected_attribute:
            raise ConfigError("client 'fedau2' with an adversary needs 'protected-attribute'")

    def _generator(self, config: Mapping[str, Any], stream: int) -> torch.Generator:
        return torch_generator(self.runtime.config.seed, TAG_CLIENT_EXTRA, self.user, int(config["server-round"]),
                               stream)

    @property
    def protected_label(self) -> int:
        """The user's private attribute class (never sent)."""
        protected = self.runtime.protected
        if protected is None:
            raise ConfigError("client 'fedau2': no 'protected-attribute' is configured")
        return int(protected.labels[self.user])

    def make_trainer(self, config: Mapping[str, Any]) -> LocalTrainer:
        self._round_config = config
        cfg = self.runtime.config
        if cfg.adversary == "none":
            return super().make_trainer(config)
        return AdversarialTrainer(
            self.model, self.runtime.train_config, label=self.protected_label, epsilon=cfg.adversary_epsilon,
            trigger=cfg.adversary_trigger, kl_weight=cfg.dsvae_kl_weight,
            generator=self._generator(config, _ADVERSARY_STREAM),
        )

    def save_private(self) -> None:
        """Save the user's embedding; in a training round with ``user-embedding-noise = b > 0``, perturb it first by
        ``Laplace(0, b)`` per coordinate (the DP baseline)."""
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
        super().save_private()
