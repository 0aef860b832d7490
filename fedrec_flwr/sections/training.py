"""The model and local-training section of the run configuration: the recommender, its client algorithm and how
each client trains (epochs, batches, learning rate, optimizer, negatives, SAM's radii, the device).

:class:`TrainingSection` declares the keys of the ``model and local training`` group of ``[tool.flwr.app.config]``
(their defaults and meanings are there); :class:`fedrec_flwr.config.RunConfig` inherits it. No torch at import: the
configuration is read by processes that never train.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.fields import config_key, int_list

MODEL_LEARNING_RATES: dict[str, float] = {"ncf": 0.01, "pfedrec": 0.01, "mf": 0.03}
"""What ``learning-rate = 0`` (the default) means for each model. ``ncf`` (and ``pfedrec``, unchanged): 0.01, chosen
on the validation item for FedNCF on MovieLens-100K in the first release. ``mf``: 0.03, chosen on the validation item
(HR@10 at round 100, seed 0) across the four shipped datasets, not on one (``experiments/tuning``):

==============  =====  =====  =====  =====
rate            0.01   0.03   0.1    0.3
==============  =====  =====  =====  =====
MovieLens-100K  0.423  0.436  0.443  0.562
FilmTrust       0.906  0.902  0.782  0.733
Lastfm-2K       0.666  0.668  0.459  0.457
Amazon-Video    0.624  0.630  0.554  n/a
==============  =====  =====  =====  =====

0.3, MovieLens-100K's best, loses 0.17-0.21 on FilmTrust and Lastfm-2K and its training loss climbs above ln 2 (to
1.0-1.4 from round 8 on MovieLens-100K); 0.03 is best or within 0.004 of it on the other three and leaves ln 2 at once
on MovieLens-100K (loss 0.683 / 0.657 / 0.647 in rounds 1 / 3 / 5). On the three smaller datasets the loss still
stays near ln 2 for about 8 rounds at 0.03 (an initialisation effect, see README). Set ``learning-rate = 0.3`` on
MovieLens-100K for its validation-best FedMF, ``0.01`` for the first release's."""


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
