"""Gradient upload with a server-side optimizer: FedRecGEL's server (and FedOpt-style training of any client that
can upload gradients).

Source: FedRecGEL (arXiv:2603.11503) and its public code (``models/fedrecgel.py``, ``modules/Server.py``): each
selected client uploads the gradient of the shared parameters (its SAM gradient); the server sums them, divides by the
number of selected clients, and takes one step of Adam over all shared parameters. Its config file says a server
learning rate of 1.5, but the code builds the server's Adam with a fixed rate of 0.001, which is therefore what its
published numbers used (``server-learning-rate = 0.001``). Server-side adaptive optimizers in FL: Reddi et al. (2021),
"Adaptive Federated Optimization", ICLR (FedAdam).

Averaging (``item-aggregation``):

* ``"selected"`` (the default here, faithful): every user of the round counts in every row's mean gradient, with a
  zero gradient for rows it did not train on (``g[i] = sum_u g_u[i] / m``), and the whole table takes a dense
  ``torch.optim.Adam`` step. **Rows nobody touched this round still move**: their gradient is zero, but Adam's first
  moment carries earlier rounds' gradients, so such a row keeps drifting (with decaying momentum) and its moments decay
  (``m <- beta1 m``, ``v <- beta2 v``); exactly what the public code does.
* ``"touched"``: a row's gradient is averaged over the users that touched it, and rows nobody touched are frozen:
  neither their values nor their Adam moments change (lazy Adam, ``torch.optim.SparseAdam``, whose bias correction
  uses the table's step count, not the row's).

Dense parameters (the score function) are averaged over users (each gradient-upload user has weight 1) and stepped
with ``torch.optim.Adam`` (or ``SGD``).

Differences from the public code: the mean is over the users whose replies were accepted (the public code has no
failures; dividing by users that never answered would shrink the step), and a round samples
``max(1, round(fraction * U))`` users where it takes ``int(fraction * U)`` (123 instead of 122 of FilmTrust's 1,227
users).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedrec_flwr.config import RunConfig
from fedrec_flwr.local.training import load_optimizer_state_arrays, optimizer_state_arrays
from fedrec_flwr.strategies.history_recording import refuse_history
from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg
from fedrec_flwr.wire import ARRAYS, GRADIENT_USERS, METRICS, NUM_EXAMPLES, ModelLayout, ReplyError, merge_rows

UPLOAD_KEY = "upload"
"""Train-config key asking clients for ``"gradient"`` uploads (see :mod:`fedrec_flwr.clients.fedrecgel`)."""


class ServerOptimizerStrategy(ItemEmbeddingFedAvg):
    """Average the clients' shared-parameter gradients and apply a server optimizer (see the module docstring).

    Args:
        layout, topology, seed, fraction_train, ...: as :class:`ItemEmbeddingFedAvg`.
        server_optimizer: ``"adam"`` or ``"sgd"``.
        server_learning_rate: its step size (> 0).
        item_aggregation: ``"selected"`` (dense Adam on every row) or ``"touched"`` (lazy Adam on touched rows).

    The optimizer state lives in the strategy for the whole run (:attr:`parameters`, :attr:`optimizers`).
    """

    default_item_aggregation = "selected"
    replies_carry_gradients = True

    def __init__(
        self, layout: ModelLayout, *, server_optimizer: str = "adam", server_learning_rate: float = 0.001, **kwargs
    ) -> None:
        super().__init__(layout, **kwargs)
        if server_optimizer not in ("adam", "sgd"):
            raise ValueError(f"server_optimizer must be 'adam' or 'sgd', got {server_optimizer!r}")
        if not server_learning_rate > 0:
            raise ValueError(f"server_learning_rate must be > 0, got {server_learning_rate!r}")
        self.server_optimizer = server_optimizer
        self.server_learning_rate = float(server_learning_rate)
        self.parameters: dict[str, torch.nn.Parameter] = {}
        self.optimizers: list[torch.optim.Optimizer] = []

    @classmethod
    def options_from_config(cls, config: RunConfig) -> dict:
        return {
            **super().options_from_config(config),
            "server_optimizer": config.server_optimizer,
            "server_learning_rate": config.server_learning_rate,
        }

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        """The configured client must upload gradients (``uploads_gradients``), e.g. ``client = 'fedrecgel'``;
        ``unlearning-history`` must be ``"off"`` (:func:`.history_recording.refuse_history`)."""
        from fedrec_flwr.errors import ConfigError
        from fedrec_flwr.registry import resolve

        refuse_history(config, "steps Adam or SGD with the mean gradient (not linear in the uploads)")
        client = resolve("client", config.client)
        if not getattr(client, "uploads_gradients", False):
            raise ConfigError(
                f"strategy {config.strategy!r} steps a server optimizer with client gradients, but "
                f"client {config.client!r} uploads parameters; use client = 'fedrecgel' (or "
                "strategy = 'item-fedavg')"
            )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        config = ConfigRecord(dict(config))
        config[UPLOAD_KEY] = "gradient"
        return super().configure_train(server_round, arrays, config, grid)

    def validate_reply(self, content: RecordDict) -> RecordDict:
        """As :meth:`ItemEmbeddingFedAvg.validate_reply`, and every user of the reply must have sent gradients (a
        client that ignores ``upload = "gradient"`` sends parameters, which must never be stepped as gradients)."""
        content = super().validate_reply(content)
        metrics = content[METRICS]
        if metrics.get(GRADIENT_USERS, 0) != metrics.get("num-users", -1):
            raise ReplyError(
                f"{metrics.get('num-users')} users replied but {metrics.get(GRADIENT_USERS, 0)} sent gradients: this "
                "strategy needs a client that uploads gradients (client = 'fedrecgel')"
            )
        return content

    def _ensure_optimizers(self, current: ArrayRecord) -> None:
        """Create the server parameters and optimizers from the first round's arrays (kept for the whole run)."""
        if self.parameters:
            return
        self.parameters = {
            k: torch.nn.Parameter(torch.tensor(current[k].numpy(), dtype=torch.float32))
            for k in self.layout.shared_shapes
        }
        lazy = self.item_aggregation == "touched" and self.server_optimizer == "adam"
        dense = [p for k, p in self.parameters.items() if not (lazy and k in self.layout.item_keys)]
        sparse = [p for k, p in self.parameters.items() if lazy and k in self.layout.item_keys]
        make = torch.optim.Adam if self.server_optimizer == "adam" else torch.optim.SGD
        self.optimizers = [make(dense, lr=self.server_learning_rate)] if dense else []
        if sparse:
            self.optimizers.append(torch.optim.SparseAdam(sparse, lr=self.server_learning_rate))

    def adopt_arrays(self, arrays: ArrayRecord) -> None:
        """Load ``arrays`` into the server parameters (keeping the optimizer's moments), so that the next step starts
        from them (e.g. after an unlearning phase)."""
        if not self.parameters:
            return
        with torch.no_grad():
            for key, param in self.parameters.items():
                param.copy_(torch.as_tensor(arrays[key].numpy(), dtype=param.dtype))

    def checkpoint_state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """As :meth:`ItemEmbeddingFedAvg.checkpoint_state`, plus each server optimizer's per-parameter state
        (Adam's moments and step counts) as ``"optimizer-<i>/<param>/<name>"`` arrays."""
        state, arrays = super().checkpoint_state()
        state["server-optimizer-started"] = bool(self.parameters)
        for i, optimizer in enumerate(self.optimizers):
            arrays.update({f"optimizer-{i}/{k}": v for k, v in optimizer_state_arrays(optimizer).items()})
        return state, arrays

    def restore_checkpoint_state(self, state, arrays, shared: ArrayRecord) -> None:
        """Rebuild the server parameters from ``shared`` and load the optimizers' saved state."""
        super().restore_checkpoint_state(state, arrays, shared)
        if not state.get("server-optimizer-started"):
            return
        self._ensure_optimizers(shared)
        for i, optimizer in enumerate(self.optimizers):
            prefix = f"optimizer-{i}/"
            load_optimizer_state_arrays(
                optimizer, {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            )

    def mean_gradients(self, accepted: list[RecordDict]) -> dict[str, torch.Tensor]:
        """Shared key -> the round's mean gradient: dense keys averaged over users; item tables per
        ``item-aggregation`` (a sparse ``(num_items, d)`` tensor of the touched rows for ``"touched"``)."""
        dense_keys = self.layout.dense_keys
        dense = (
            aggregate_arrayrecords(
                [
                    RecordDict({ARRAYS: ArrayRecord({k: r[ARRAYS][k] for k in dense_keys}), METRICS: r[METRICS]})
                    for r in accepted
                ],
                NUM_EXAMPLES,
            )
            if dense_keys
            else ArrayRecord()
        )
        num_users = self.replied_users(accepted)
        grads: dict[str, torch.Tensor] = {k: torch.tensor(dense[k].numpy()) for k in dense_keys}
        for key in self.layout.item_keys:
            zeros = np.zeros(self.layout.shared_shapes[key], dtype=np.float32)
            mean, count = merge_rows(zeros, self.row_updates(accepted, key), self.item_aggregation, num_users)
            if self.item_aggregation == "touched" and self.server_optimizer == "adam":
                rows = np.flatnonzero(count > 0)
                grads[key] = torch.sparse_coo_tensor(
                    torch.as_tensor(rows[None, :]), torch.as_tensor(mean[rows]), size=mean.shape, check_invariants=True
                ).coalesce()
            else:
                grads[key] = torch.as_tensor(mean)
        return grads

    def aggregate_arrays(self, accepted: list[RecordDict]) -> ArrayRecord:
        """One server-optimizer step with the mean gradient (replaces the parameter average)."""
        assert self._current is not None, "configure_train must run before aggregate_train"
        self._ensure_optimizers(self._current)
        grads = self.mean_gradients(accepted)
        for key, param in self.parameters.items():
            param.grad = grads[key].to(param.dtype)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return ArrayRecord({k: Array(p.detach().numpy().copy()) for k, p in self.parameters.items()})
