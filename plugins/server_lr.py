"""A worked plug-in strategy with its own run-config key: item-embedding FedAvg with a server learning rate.

Run it with::

    bash experiments/quickstart.sh strategy=plugins.server_lr:ServerLrItemFedAvg server-lr=0.3

``server-lr`` (eta) scales the FedAvg step (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 1 with a plain
SGD server optimizer): ``theta <- theta + eta * (avg - theta)``. With ``eta = 1`` it is exactly
:class:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg`.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, RecordDict

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg


class ServerLrItemFedAvg(ItemEmbeddingFedAvg):
    """Item-embedding FedAvg with a server learning rate ``server-lr`` on every shared array."""

    config_keys = {"server-lr": (0.5, "server learning rate eta of the FedAvg step, in (0, 1]")}
    """This plug-in's own run-config keys: ``{key: (default, meaning)}``."""

    server_lr: float = 0.5

    @classmethod
    def check_config(cls, config) -> None:
        """Raises ConfigError unless ``0 < server-lr <= 1``."""
        super_check = getattr(super(), "check_config", None)
        if super_check is not None:
            super_check(config)
        eta = config.extra["server-lr"]
        if not 0 < eta <= 1:
            raise ConfigError(f"run-config key 'server-lr' = {eta!r}: must be in (0, 1]")

    @classmethod
    def from_run_config(cls, config, layout, topology=None):
        strategy = super().from_run_config(config, layout, topology)
        strategy.server_lr = float(config.extra["server-lr"])
        return strategy

    def aggregate_arrays(self, accepted: list[RecordDict]) -> ArrayRecord:
        averaged = super().aggregate_arrays(accepted)
        out = {}
        for key, new in averaged.items():
            old = self._current[key].numpy()
            out[key] = Array((old + self.server_lr * (new.numpy() - old)).astype(old.dtype))
        return ArrayRecord(out)
