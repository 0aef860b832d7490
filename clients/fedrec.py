"""The base federated-recommendation client: one user, FedNCF (``model = "ncf"``) or FedMF (``model = "mf"``).

Sources: FedNCF — Perifanis & Efraimidis, "Federated Neural Collaborative Filtering", Knowledge-Based Systems 2022;
FedMF — Chai et al., "Secure Federated Matrix Factorization", IEEE Intelligent Systems 2020 (our FedMF is without its
homomorphic encryption: updates travel in clear, as in the FedRecGEL and PFedRec comparisons).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict
from flwr.client import NumPyClient

from fedrec_flwr.app.runtime import Runtime
from fedrec_flwr.clients import fedrec_checks
from fedrec_flwr.local import user_data
from fedrec_flwr.local.blocks import check_block_config
from fedrec_flwr.local.training import LocalTrainer, ProximalTerm, evaluate_user
from fedrec_flwr.state.client_state import STATE_PREFIX
from fedrec_flwr.unlearning import user_queries
from fedrec_flwr.unlearning.influence import influence_examples, influence_objective
from fedrec_flwr.unlearning.krylov import CGResult
from fedrec_flwr.wire import UserUpdate

__all__ = ["STATE_PREFIX", "FedRecClient", "UserUpdate"]


class FedRecClient(NumPyClient):
    """A Flower ``NumPyClient`` for one user: private user embedding, shared item embeddings and score function.

    The user's private parameters live in the node's ``context.state`` under ``"user:<id>"`` (an ``ArrayRecord`` of
    the model's private state); on the first visit they are initialised from the stream ``(seed, TAG_USER_INIT,
    user)``. :meth:`fit` trains locally and returns only shared parameters; the private ones are written back to the
    state and never returned.

    Subclasses (SAM, PFedRec, adversarial unlearning) override :meth:`make_trainer` (the local step),
    :meth:`shared_update` (what is uploaded), :meth:`prepare_evaluation` and, when they carry more private state,
    :meth:`load_private` / :meth:`save_private`.

    Args:
        runtime: the process's config, split and one-user model (:func:`fedrec_flwr.app.runtime.get_runtime`).
        user: the user's index (its partition id when ``users-per-node = 1``).
        state: the node's ``context.state`` (a ``RecordDict``); a ``NumPyClient`` has no context of its own.
    """

    uploads_gradients = False
    """Whether this client can answer a train message with ``"upload" = "gradient"`` (see
    :class:`fedrec_flwr.strategies.server_optimizer.ServerOptimizerStrategy`)."""

    strategy_config_keys = ("proximal-mu",)
    """Train-config keys a wrapped Flower strategy may send that this client honours
    (:mod:`fedrec_flwr.strategies.flower_adapter` refuses a non-zero value of any other): FedProx's ``"proximal-mu"``, applied
    to the shared parameters by :meth:`fit_named` (:class:`fedrec_flwr.local.training.ProximalTerm`, for every subclass's
    trainer)."""

    @classmethod
    def check_strategy_config(cls, config: Mapping[str, Any], strategy: str = "") -> None:
        """Check the values of the :attr:`strategy_config_keys` a wrapped Flower strategy would send (the preflight's
        dry round 1, :meth:`fedrec_flwr.strategies.flower_adapter.FlowerStrategyAdapter.check_config`).

        Raises:
            ConfigError: ``"proximal-mu"`` is not a finite number >= 0 (names the strategy and ``strategy-args``).
        """
        fedrec_checks.check_proximal_mu(config, strategy)

    unlearns_attributes = False
    """Whether this client trains an attribute adversary and applies ``user-embedding-noise``
    (:class:`fedrec_flwr.clients.fedau2.AttributeUnlearning`)."""

    block_training = "plain"
    """The vectorized block trainer (:mod:`fedrec_flwr.local.blocks`) that reproduces this class's local step: ``"plain"``
    (:class:`LocalTrainer`), ``"sam"`` (FedRecGEL) or ``None`` (per-user only). Only a class's own declaration counts
    (:func:`fedrec_flwr.local.blocks.block_kind`): a subclass that does not set it is served per-user, since it may override
    hooks the block path does not call. Selected by the run-config key ``block-training``."""

    @classmethod
    def check_config(cls, config) -> None:
        """Raise :class:`~fedrec_flwr.errors.ConfigError` for run-config settings this client cannot serve (called
        by the ServerApp at start, :func:`fedrec_flwr.registry.check_components`). Subclasses that override it call
        ``super().check_config(config)`` first. The base client refuses only the attribute-unlearning keys
        (``adversary``, ``user-embedding-noise``) unless :attr:`unlearns_attributes`: they would be silently ignored
        (:func:`fedrec_flwr.clients.fedrec_checks.refuse_attribute_keys`), then the block-training keys
        (:func:`fedrec_flwr.local.blocks.check_block_config`).
        """
        if not cls.unlearns_attributes:
            fedrec_checks.refuse_attribute_keys(config)
        check_block_config(cls, config)

    def __init__(self, runtime: Runtime, user: int, state: RecordDict) -> None:
        if not 0 <= user < runtime.split.num_users:
            raise ValueError(f"user {user} out of range [0, {runtime.split.num_users})")
        self.runtime = runtime
        self.user = int(user)
        self.state = state
        self.model = runtime.model

    # ------------------------------------------------------------------------------------------------ private state
    @property
    def state_key(self) -> str:
        """This user's key in ``context.state`` (:func:`fedrec_flwr.local.user_data.user_state_key`)."""
        return user_data.user_state_key(self.user)

    def state_record(self, key: str) -> ArrayRecord | None:
        """The ``ArrayRecord`` under ``key`` in the node's state, or ``None``
        (:func:`fedrec_flwr.local.user_data.state_record`)."""
        return user_data.state_record(self.state, key)

    def load_private(self) -> None:
        """Load the user's private parameters from the state, or initialise them on the first visit
        (:func:`fedrec_flwr.local.user_data.load_private`)."""
        user_data.load_private(self.model, self.state, self.user, self.runtime.config.seed)

    def save_private(self) -> None:
        """Write the user's private parameters back to the state (only the user's own node ever holds them)."""
        user_data.save_private(self.model, self.state, self.user)

    def load_shared(self, shared: Mapping[str, np.ndarray], *, will_modify: Iterable[str] = ()) -> None:
        """Load the server's shared parameters into the process's model, cheaply.

        A message's users share one ``shared`` mapping. The first user loads (and validates) all of it; the next ones
        reload only the keys changed since (:attr:`Runtime.dirty_shared`): the dense score function after a training
        (item tables are trained in a compact copy, :meth:`RecModel.item_subset`, so the full tables stay as loaded),
        nothing after an evaluation.

        Args:
            shared: shared key -> array (the message's arrays).
            will_modify: the shared keys the caller is about to change in place (reloaded for the next user). A hook
                that changes others must call :meth:`mark_shared_modified`.
        """
        runtime = self.runtime
        if runtime.loaded_shared is shared:
            if runtime.dirty_shared:
                self.model.load_shared_state({k: shared[k] for k in runtime.dirty_shared}, partial=True)
        else:
            self.model.load_shared_state(dict(shared))
        runtime.loaded_shared = shared
        runtime.dirty_shared = set(will_modify)

    def mark_shared_modified(self, keys: Iterable[str] | None = None) -> None:
        """Record that shared parameters ``keys`` (default: all) were changed outside :meth:`load_shared`."""
        self.runtime.dirty_shared |= set(self.runtime.layout.shared_shapes if keys is None else keys)

    # ------------------------------------------------------------------------------------------------ hooks
    def make_trainer(self, config: Mapping[str, Any]) -> LocalTrainer:
        """The local training loop (plain SGD/Adam on BCE or BPR); subclasses return their own ``LocalTrainer``.

        Args:
            config: the server's train config of this round (``"server-round"``, strategy-specific keys).
        """
        return LocalTrainer(self.model, self.runtime.train_config)

    def shared_update(self, trainer: LocalTrainer, result, config: Mapping[str, Any]) -> UserUpdate:
        """What the user uploads after training: its updated shared parameters, the item tables only for the rows
        it trained on (``result.touched_items``)."""
        return self.update_from(self.model.shared_state(), result)

    def update_from(
        self, values: Mapping[str, torch.Tensor], result, weight: float | None = None, is_gradient: bool = False
    ) -> UserUpdate:
        """A :class:`UserUpdate` of shared ``values`` (parameters or gradients, shaped as the model's current
        parameters): dense keys whole, item tables cut to the rows the user trained on (``result.touched_items``,
        global ids; :func:`fedrec_flwr.local.user_data.user_update`)."""
        return user_data.user_update(self.model, self.runtime.layout, values, result, weight, is_gradient)

    def prepare_evaluation(self) -> None:
        """Hook run after the shared and private parameters are loaded for evaluation (PFedRec applies the user's
        personalised item rows here; a hook that changes shared parameters must call :meth:`mark_shared_modified`).
        The base client does nothing."""

    # ------------------------------------------------------------------------------------------------ by name
    def fit_named(self, shared: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> UserUpdate:
        """Train on this user's data starting from the server's shared parameters.

        Args:
            shared: shared key -> array, as in :class:`fedrec_flwr.wire.ModelLayout` (``item_embedding*.weight``
                ``(num_items, d)`` and the score function).
            config: needs ``"server-round"`` (int, 1-based); a ``"proximal-mu"`` > 0 (FedProx through
                :mod:`fedrec_flwr.strategies.flower_adapter`) adds :class:`~fedrec_flwr.local.training.ProximalTerm` on the shared
                parameters to every mini-batch loss (and so to the reported ``train-loss``).

        Returns:
            The user's :class:`UserUpdate`; its private parameters are saved to the state, not returned.

        Raises:
            ValueError: ``"proximal-mu"`` is negative or not finite.
        """
        server_round = int(config["server-round"])
        self.load_shared(shared, will_modify=self.runtime.layout.dense_keys)
        self.load_private()
        examples = user_data.round_examples(self.runtime, self.user, server_round)
        items = examples.items
        with self.model.item_subset(items):  # train on the user's rows only: O(rows) instead of O(catalogue)
            self.trainer = self.make_trainer(config)
            mu = float(config.get("proximal-mu", 0.0) or 0.0)
            if mu:  # FedProx (Li et al. 2020, Eq. 2): stay near the round's global shared parameters
                self.trainer.loss_terms.append(ProximalTerm(self.model.shared_parameters(), mu))
            result = self.trainer.train(0, examples.positives, examples.negatives, examples.generator)
            result.touched_items = items[result.touched_items]
            self.save_private()
            return self.shared_update(self.trainer, result, config)

    def evaluate_named(self, shared: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> dict[str, float]:
        """Rank the user's held-out item among its negatives with the current shared and private parameters.

        Args:
            shared: as in :meth:`fit_named`.
            config: ``"split"`` = ``"test"`` (default), ``"val"`` (needs ``holdout-validation``) or ``"test+val"``
                (both; the validation metrics are prefixed ``"val-"``).

        Returns:
            ``{"HR@K": 0/1, "NDCG@K": ..., ...}`` for the configured ``ks`` (plus ``"val-HR@K"``, ... for
            ``"test+val"``).

        Raises:
            ValueError: an unknown split, or ``"val"`` without a validation item.
        """
        phases = user_data.evaluation_phases(self.runtime.split, config)
        self.load_shared(shared)
        self.load_private()
        self.prepare_evaluation()
        ks = self.runtime.config.k_values
        out: dict[str, float] = {}
        with torch.no_grad():
            for prefix, targets, negatives in phases:
                metrics = evaluate_user(self.model, 0, int(targets[self.user]), negatives[self.user], ks=ks)
                out.update({prefix + k: v for k, v in metrics.items()})
        return out

    # ------------------------------------------------------------------------------------------------ unlearning
    def influence_examples(self) -> tuple[np.ndarray, np.ndarray]:
        """``(positives, negatives)`` of this user's influence loss: its training positives and a fixed negative
        sample (:func:`fedrec_flwr.unlearning.influence.influence_examples`)."""
        return influence_examples(self.runtime, self.user)

    def influence_items(self) -> np.ndarray:
        """``(T,)`` sorted item rows of this user's influence loss (:meth:`influence_examples`)."""
        return np.union1d(*self.influence_examples()).astype(np.int64)

    def influence_objective(self, shared: Mapping[str, np.ndarray], extra_rows: np.ndarray | None = None):
        """This user's loss ``L_u(theta)`` as a function of the shared parameters, its private ones held fixed: a
        context manager yielding ``(loss_fn, params, items)`` (:func:`fedrec_flwr.unlearning.influence.influence_objective`)."""
        return influence_objective(self.runtime, [self], shared, extra_rows)

    def influence_gradient(self, shared: Mapping[str, np.ndarray]) -> tuple[dict, dict, float]:
        """``∇_theta L_u`` at the server's shared parameters: ``(dense, rows, loss)`` (rows: item key ->
        ``(row ids (T,), values (T, d))``; :func:`fedrec_flwr.unlearning.user_queries.influence_gradient`). The
        gradient of the user's own loss; its data never leaves."""
        return user_queries.influence_gradient(self, shared)

    def influence_hvp(
        self,
        shared: Mapping[str, np.ndarray],
        direction: Mapping[str, np.ndarray],
        group: list | None = None,
        curvature: str = "hessian",
    ) -> tuple[dict, dict]:
        """``H_u v``: this user's loss Hessian or Gauss-Newton matrix (``curvature``) at the shared parameters times
        ``direction``; with ``group`` (clients of this node's users, this one included), of their summed losses
        (:func:`fedrec_flwr.unlearning.user_queries.influence_hvp`)."""
        return user_queries.influence_hvp(self, shared, direction, group, curvature)

    def influence_solve(
        self,
        shared: Mapping[str, np.ndarray],
        rhs: Mapping[str, np.ndarray],
        *,
        iterations: int,
        damping: float,
        tolerance: float,
        curvature: str = "hessian",
        solver: str = "cg",
        radius: float | None = None,
    ) -> tuple[dict, dict, CGResult]:
        """Local CG (HF-KCU's Algorithm 1, client side): ``x_u ≈ (H_u + damping I)^{-1} rhs`` on this user's own
        curvature, as ``(dense, rows, CGResult)`` (:func:`fedrec_flwr.unlearning.user_queries.influence_solve`).

        Raises:
            ValueError: ``damping`` is 0 and ``rhs`` has rows this user's loss never touches (singular system).
        """
        return user_queries.influence_solve(
            self,
            shared,
            rhs,
            iterations=iterations,
            damping=damping,
            tolerance=tolerance,
            curvature=curvature,
            solver=solver,
            radius=radius,
        )

    # ------------------------------------------------------------------------------------------------ NumPyClient
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        """The model's shared parameters, in :attr:`ModelLayout.shared_shapes` order."""
        state = self.model.shared_state()
        return [state[k].detach().cpu().numpy() for k in self.runtime.layout.shared_shapes]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        """NumPyClient form of :meth:`fit_named`: ``parameters`` in layout order; returns the dense shared values
        in layout order followed by, per item table, its updated rows' values (positional, for legacy callers; the
        ClientApp uses :meth:`fit_named`)."""
        shared = dict(zip(self.runtime.layout.shared_shapes, parameters, strict=True))
        update = self.fit_named(shared, config)
        out = [update.dense[k] for k in self.runtime.layout.dense_keys]
        out += [update.rows[k][1] for k in self.runtime.layout.item_keys]
        return out, update.num_examples, {"train-loss": update.loss}

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict]:
        """NumPyClient form of :meth:`evaluate_named`. Returns ``(1 - NDCG@K, 1, metrics)`` with K = 10 when ``ks``
        has it, else its first (:func:`fedrec_flwr.state.results.headline_k`): a ranking task has no natural evaluation
        loss, so the loss slot carries a lower-is-better ranking score."""
        from fedrec_flwr.state.results import headline_k

        shared = dict(zip(self.runtime.layout.shared_shapes, parameters, strict=True))
        metrics = self.evaluate_named(shared, config)
        return 1.0 - metrics.get(f"NDCG@{headline_k(None, [metrics])}", 0.0), 1, metrics
