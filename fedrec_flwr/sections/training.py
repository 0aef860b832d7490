"""The model and local-training section of the run configuration: the recommender, its client algorithm and how
each client trains (epochs, batches, learning rate, optimizer, negatives, SAM's radii, the device).

:class:`TrainingSection` declares the keys of the ``model and local training`` group of ``[tool.flwr.app.config]``
(their defaults and meanings are there); :class:`fedrec_flwr.config.RunConfig` inherits it and resolves
``learning-rate = 0`` to the model's own rate (:data:`fedrec_flwr.config.MODEL_LEARNING_RATES`). No torch at import:
the configuration is read by processes that never train.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.fields import config_key, int_list


@dataclass(frozen=True)
class TrainingSection:
    """The run-config keys of the model and of each client's local training."""

    model: str = config_key("model", choices=("ncf", "mf", "pfedrec"))
    embedding_dim: int = config_key("embedding-dim", minimum=1)
    mlp_layers: str = config_key("mlp-layers")
    mlp_embedding_dim: int = config_key("mlp-embedding-dim", minimum=0)
    loss: str = config_key("loss", choices=("bce", "bpr"))
    client: str = config_key("client")
    local_epochs: int = config_key("local-epochs", minimum=1)
    batch_size: int = config_key("batch-size", minimum=1)
    learning_rate: float = config_key("learning-rate", minimum=0.0)
    optimizer: str = config_key("optimizer", choices=("sgd", "adam"))
    num_train_negatives: int = config_key("num-train-negatives", minimum=1)
    device: str = config_key("device")
    rho_shared: float = config_key("rho-shared", minimum=0.0)
    rho_private: float = config_key("rho-private", minimum=0.0)
    item_learning_rate: float = config_key("item-learning-rate", minimum=0.0)

    @property
    def mlp_layer_sizes(self) -> tuple[int, ...]:
        """The NCF tower sizes of ``mlp-layers`` as integers, e.g. ``(64, 32, 16)``."""
        return int_list("mlp-layers", self.mlp_layers)

    def _check_training(self) -> None:
        """``mlp-layers`` (for NCF) and the form of ``device``; called by
        :meth:`fedrec_flwr.config.RunConfig.from_mapping`.

        Raises:
            ConfigError: naming the key and value.
        """
        if self.model == "ncf":
            self.mlp_layer_sizes  # noqa: B018 - validates
        if not (self.device in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"run-config key 'device' = {self.device!r}: must be cpu, cuda, cuda:N or auto")

    def _check_device_here(self) -> None:
        """Whether the CUDA device ``device`` names exists on this machine, where the clients train.

        Raises:
            ConfigError: ``device`` names a CUDA device this machine lacks.
        """
        if self.device.startswith("cuda"):  # the clients train here: the device must exist here
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = int(self.device.split(":")[1]) if ":" in self.device else 0
            if index >= count:
                raise ConfigError(
                    f"run-config key 'device' = {self.device!r}: this machine has {count} CUDA "
                    "device(s); use 'cpu' or 'auto'"
                )
