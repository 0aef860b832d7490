"""PFedRec's client: a private score function and a personalised view of the shared item embedding.

Source: Zhang, Long, Zhou, Luo, Jiang, Yang, Qin (2023), "Dual Personalization on Federated Recommendation", IJCAI,
Alg. 1, and its code (Zhangcx19/IJCAI-23-PFedRec, ``engine.py``): no user embedding; the score function stays on the
client; each round the client takes the server's item embedding, and per mini-batch first updates its score function,
then the item embedding (:class:`PFedRecTrainer`, plain SGD); the server averages the uploaded item
embeddings over the round's clients (use ``item-aggregation = "selected"`` for its full-table average).

Personalised view: PFedRec evaluates each user with the item table it fine-tuned when it last trained. Keeping a full
table per user does not scale (Amazon-Video: 8,072 users x 11,830 items), so this client keeps only the rows it
fine-tuned (the items it trained on) in ``context.state``, and evaluates with the current server table with those
rows replaced by its own. Rows it never trained on therefore follow the server, where PFedRec's code would keep the
stale table of the user's last round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Array, ArrayRecord

from fedrec_flwr.clients.fedrec import FedRecClient
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer
from fedrec_flwr.state.client_state import ROWS_PREFIX
from fedrec_flwr.wire import UserUpdate

LR_ETA = 80
"""PFedRec's ``lr_eta``: its item-embedding rate is ``lr * num_items * lr_eta`` (``train.py`` default)."""


class PFedRecTrainer(LocalTrainer):
    """PFedRec's local update (Zhang et al. 2023, Alg. 1; its code's ``fed_train_single_batch``): per mini-batch,
    first an SGD step of the private score function (rate ``cfg.learning_rate``), then, with the loss recomputed,
    an SGD step of the item embedding (rate ``item_learning_rate``).

    Args:
        model: a :class:`~fedrec_flwr.models.PFedRecModel`. cfg: local hyper-parameters (``optimizer`` is ignored:
            PFedRec uses plain SGD). item_learning_rate: the item embedding's SGD rate (PFedRec: ``lr * num_items *
            lr_eta`` with ``lr_eta = 80``, because its BCE is a batch mean).
    """

    def __init__(self, model, cfg: LocalTrainConfig, *, item_learning_rate: float) -> None:
        super().__init__(model, cfg)
        if not math.isfinite(item_learning_rate) or item_learning_rate <= 0:
            raise ValueError(f"PFedRecTrainer: item_learning_rate must be > 0, got {item_learning_rate!r}")
        self.item_learning_rate = float(item_learning_rate)
        self._item_optimizer: torch.optim.Optimizer | None = None

    def make_optimizer(self) -> torch.optim.Optimizer:
        """SGD over the private score function."""
        return torch.optim.SGD(self.model.private_parameters(), lr=self.cfg.learning_rate)

    def step(self, users: torch.Tensor, items: torch.Tensor, labels: torch.Tensor) -> float:
        """Score-function step, then item-embedding step on the same batch; returns the second loss."""
        if self._item_optimizer is None:
            self._item_optimizer = torch.optim.SGD(self.model.shared_parameters(), lr=self.item_learning_rate)
        value = self.optimizer_step(self.optimizer, users, items, labels)
        if not math.isfinite(value):
            return value
        return self.optimizer_step(self._item_optimizer, users, items, labels)


class PFedRecClient(FedRecClient):
    """One user's PFedRec client (model ``pfedrec``). See the module docstring.

    Run-config keys: ``learning-rate`` (score function SGD rate; PFedRec: 0.1), ``item-learning-rate`` (item
    embedding SGD rate; 0 = ``learning-rate * num-items * 80``), ``batch-size`` (PFedRec: 256), ``local-epochs``.
    """

    strategy_config_keys = ()
    """No FedProx (ours): PFedRec steps its item rows at ``learning-rate * num-items * 80`` (about 13,000 on
    MovieLens-100K), sized for the tiny per-row gradients of a mean loss; FedProx's proximal gradient ``mu (w - w_0)``
    at that rate diverges (train loss inf in round 2 at ``mu = 0.1``, measured), so the adapter refuses
    ``proximal-mu`` > 0 for this client before the run starts."""

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if config.model != "pfedrec":
            raise ConfigError(f"client 'pfedrec' needs model = 'pfedrec', got model = {config.model!r}")

    def __init__(self, runtime, user, state) -> None:
        self.check_config(runtime.config)
        super().__init__(runtime, user, state)

    @property
    def rows_key(self) -> str:
        return f"{ROWS_PREFIX}{self.user}"

    def make_trainer(self, config: Mapping[str, Any]) -> PFedRecTrainer:
        cfg = self.runtime.config
        item_lr = cfg.item_learning_rate or cfg.learning_rate * self.runtime.split.num_items * LR_ETA
        return PFedRecTrainer(self.model, self.runtime.train_config, item_learning_rate=item_lr)

    def shared_update(self, trainer, result, config: Mapping[str, Any]) -> UserUpdate:
        update = super().shared_update(trainer, result, config)
        key = self.runtime.layout.item_keys[0]
        rows, values = update.rows[key]
        self.state[self.rows_key] = ArrayRecord({"rows": Array(rows.copy()), "values": Array(values.copy())})
        return update

    def prepare_evaluation(self) -> None:
        """Overwrite the server's item rows with the user's fine-tuned ones (if it ever trained)."""
        record = self.state_record(self.rows_key)
        if record is None:
            return
        table = self.model.item_embedding.weight
        self.mark_shared_modified(self.runtime.layout.item_keys)
        with torch.no_grad():
            rows = torch.as_tensor(record["rows"].numpy(), device=table.device)
            table[rows] = torch.as_tensor(record["values"].numpy(), device=table.device)
