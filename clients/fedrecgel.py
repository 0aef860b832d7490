"""FedRecGEL's client: decoupled sharpness-aware local training on NCF.

Source: "Sharpness-Aware Minimization for Generalized Embedding Learning in Federated Recommendation" (FedRecGEL,
arXiv:2603.11503), Sec. 4.2, and its public code (anonymifish/FedRecGEL, ``models/fedrecgel.py``): per round, one
decoupled SAM step over all of the user's examples (:class:`fedrec_flwr.local.sam.SAMTrainer`); the user's embeddings are
updated locally by an optimizer whose state persists across rounds (Adam, local rate 0.1 in the public code); the
shared group's SAM gradient is what the server receives.

Upload modes (chosen by the strategy, key ``"upload"`` of the train message's config):

* ``"gradient"`` (the faithful mode, sent by :class:`fedrec_flwr.strategies.server_optimizer.ServerOptimizerStrategy`): the user
  uploads the shared group's SAM gradient (rows of the items it trained on, and the score function's gradient) with
  weight 1, and its local step on the shared parameters is discarded, as in the public code. The server averages the
  gradients and applies its own optimizer.
* ``"parameters"`` (the default, e.g. with ``item-fedavg``): the shared parameters also take a local step with their
  SAM gradient, and the updated values are uploaded (FedAvg of updates).

``rho-shared = 0`` / ``rho-private = 0`` are the paper's "w/o shared" / "w/o non-shared" ablations; both 0 is FedNCF.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Array, ArrayRecord

from fedrec_flwr.clients.fedrec import FedRecClient
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.sam import SAMTrainer
from fedrec_flwr.local.training import load_optimizer_state_arrays, optimizer_state_arrays
from fedrec_flwr.state.client_state import OPTIMIZER_PREFIX
from fedrec_flwr.wire import UserUpdate

UPLOAD_KEY = "upload"
"""Train-config key by which a strategy asks for ``"gradient"`` or ``"parameters"`` uploads."""


class FedRecGELClient(FedRecClient):
    """One user's FedRecGEL client (NCF, decoupled SAM). See the module docstring.

    Run-config keys: ``rho-shared``, ``rho-private`` (SAM radii), ``learning-rate`` and ``optimizer`` (the local
    optimizer of the user's embeddings; its state is kept in ``context.state["user-opt:<id>"]``), ``batch-size``
    (the loss's chunk size), ``local-epochs`` (SAM steps per round).
    """

    uploads_gradients = True
    block_training = "sam"

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if config.loss != "bce":
            raise ConfigError(f"client 'fedrecgel' trains with loss = 'bce' (its paper's loss), got {config.loss!r}")
        if config.model == "pfedrec":
            raise ConfigError("client 'fedrecgel' needs a model with user embeddings: model = 'ncf' (or 'mf')")

    @property
    def optimizer_key(self) -> str:
        return f"{OPTIMIZER_PREFIX}{self.user}"

    def make_trainer(self, config: Mapping[str, Any]) -> SAMTrainer:
        upload = str(config.get(UPLOAD_KEY, "parameters"))
        if upload not in ("gradient", "parameters"):
            raise ValueError(f"train config '{UPLOAD_KEY}' = {upload!r}: expected 'gradient' or 'parameters'")
        cfg = self.runtime.config
        trainer = SAMTrainer(
            self.model,
            self.runtime.train_config,
            rho_shared=cfg.rho_shared,
            rho_private=cfg.rho_private,
            update_shared=upload == "parameters",
        )
        record = self.state_record(self.optimizer_key)
        if record is not None:
            load_optimizer_state_arrays(trainer.optimizer, {k: v.numpy() for k, v in record.items()})
        return trainer

    def save_private(self) -> None:
        super().save_private()
        trainer = getattr(self, "trainer", None)
        if isinstance(trainer, SAMTrainer):
            arrays = optimizer_state_arrays(trainer.optimizer)
            self.state[self.optimizer_key] = ArrayRecord({k: Array(v) for k, v in arrays.items()})

    def shared_update(self, trainer: SAMTrainer, result, config: Mapping[str, Any]) -> UserUpdate:
        if trainer.update_shared:
            return super().shared_update(trainer, result, config)
        return self.update_from(trainer.shared_grads, result, weight=1.0, is_gradient=True)
