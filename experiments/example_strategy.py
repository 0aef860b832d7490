"""A worked example of plugging in a strategy without editing the package.

Run it with::

    bash experiments/quickstart.sh "strategy='experiments.example_strategy:ServerLrItemFedAvg'"

``ServerLrItemFedAvg`` applies a server learning rate ``eta`` to the item-embedding FedAvg step
(Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 1 with a plain SGD server optimizer):
``theta <- theta + eta * (avg - theta)``. With ``eta = 1`` it is exactly :class:`ItemEmbeddingFedAvg`. It overrides
one hook, :meth:`aggregate_arrays`, and inherits sampling, reply checks and evaluation.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord
from flwr.app import RecordDict

from strategies.item_fedavg import ItemEmbeddingFedAvg


class ServerLrItemFedAvg(ItemEmbeddingFedAvg):
    """Item-embedding FedAvg with a server learning rate ``server_lr`` (default 0.5) on every shared array."""

    server_lr: float = 0.5

    def aggregate_arrays(self, accepted: list[RecordDict]) -> ArrayRecord:
        averaged = super().aggregate_arrays(accepted)
        out = {}
        for key, new in averaged.items():
            old = self._current[key].numpy()
            out[key] = Array((old + self.server_lr * (new.numpy() - old)).astype(old.dtype))
        return ArrayRecord(out)
