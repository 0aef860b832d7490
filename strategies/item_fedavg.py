"""Item-embedding FedAvg: Flower's FedAvg with per-user sampling and row-wise averaging of item tables.

* Dense shared parameters (the score function) are averaged weighted by ``num-examples`` with Flower's own
  ``aggregate_arrayrecords`` (McMahan et al. 2017, FedAvg): replies carry the node's example-weighted mean, so the
  result is exact however users are grouped into nodes (:mod:`fedrec_flwr.wire`).
* Each item-embedding row is averaged over the users that updated it this round; rows nobody touched keep their
  value (:func:`fedrec_flwr.wire.merge_rows`, ``item-aggregation = "touched"``, the default). This is the per-row
  aggregation of federated recommenders where a user only updates the rows of the items it trained on (e.g. FedNCF,
  Perifanis & Efraimidis 2022). ``item-aggregation = "selected"`` averages full tables over the round's users instead
  (PFedRec's server).
* Users, not nodes, are sampled: :func:`fedrec_flwr.wire.sample_users` draws them from ``(seed, round)``, and each
  message names the users of that node to train, so the same seed trains the same users whatever the number of nodes,
  ``users-per-node`` or Ray workers.
* Replies are checked before they touch the model: one carrying a private parameter raises
  :class:`~fedrec_flwr.wire.PrivacyViolation` (the round fails); one with unknown keys, wrong shapes, NaN/Inf or zero
  weight, or (with ``max-update-norm`` > 0) an update longer than that (:meth:`ItemEmbeddingFedAvg.update_norm`) is
  rejected with a logged reason; failed clients are counted and logged; fewer accepted replies than
  ``min-train-fraction`` of the sampled nodes raises :class:`RoundFailed`.
* Faults: a node that dies costs its replies (the round goes on with the others, within ``round-timeout``); a node
  that (re)joins later with a new node id takes over its users (:meth:`ItemEmbeddingFedAvg.refresh_topology`). The
  strategy's state goes into server checkpoints (:meth:`ItemEmbeddingFedAvg.checkpoint_state`).
* Client unlearning (``unlearning``, :mod:`fedrec_flwr.strategies.unlearning`): after round ``unlearn-round`` the strategy runs the
  unlearning phase (HF-KCU, gradient ascent or continued training) on the aggregated model, evaluates the model before
  and after it, and writes ``unlearning.json`` and ``before-unlearning.npz``; the forgotten users train no more
  (``retrain``: never), and federated evaluation always leaves them out when a forget set is configured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedrec_flwr.config import RunConfig
from fedrec_flwr.wire import ARRAYS, CONFIG, ModelLayout, Topology

from . import aggregation, checkpointing, evaluation, nodes, replies, sampling, unlearning_phase
from .history_recording import ContributionLog
from .train_round import RoundFailed, aggregate_round

__all__ = ["ItemEmbeddingFedAvg", "RoundFailed", "Topology"]

log = logging.getLogger(__name__)


class ItemEmbeddingFedAvg(FedAvg):
    """FedAvg for federated recommenders with per-user private embeddings. See the module docstring.

    Its parts are modules beside it: :mod:`.sampling`, :mod:`.nodes` (topology, messages), :mod:`.replies` (checks,
    failures), :mod:`.train_round`, :mod:`.aggregation`, :mod:`.evaluation`, :mod:`.checkpointing`, and
    :mod:`.unlearning_phase`.

    Args:
        layout: the model's keys (:class:`fedrec_flwr.wire.ModelLayout`).
        topology: which node serves each user (set later with :meth:`set_topology` if not known yet).
        seed: the run's seed (fixes the sampled users).
        fraction_train / fraction_evaluate: fraction of users sampled for training / evaluation.
        min_train_fraction: a round with fewer accepted replies than this fraction of the sampled nodes fails.
        eval_every: federated evaluation every N rounds and after ``num_rounds``.
        num_rounds: the run's last round (always evaluated).
        evaluate_split: ``"test"``, ``"val"`` or ``"test+val"``: which held-out item federated evaluation ranks.
        item_aggregation: ``"touched"``, ``"selected"`` (:func:`fedrec_flwr.wire.merge_rows`) or ``"auto"``
            (:attr:`default_item_aggregation`).
        unlearning: :class:`fedrec_flwr.strategies.unlearning.UnlearningSettings`, or ``None`` without a forget set.
        round_timeout: seconds to wait for a round's replies.
        max_update_norm: replies whose :meth:`update_norm` exceeds it are rejected (0: no bound).

    Attributes:
        failures / evaluation_failures: failed training / evaluation replies per node id (error, rejected, none).
        isolated_users: per phase, round -> users the nodes left out for non-finite private state (``summary.json``).
        removed_users: users no longer sampled for training (the forgotten ones once forgotten; ``retrain``: all along).
        trained: ``(num_users,)`` bool, the users whose training replies were accepted so far (in server checkpoints,
            :func:`fedrec_flwr.state.checkpoint.check_client_state`).
        adversary_step: FedAU²'s server step (:class:`.adversary.AdversaryServerStep`) or ``None``.
        message_config: keys sent in the config of every message (the ServerApp sets ``run`` and ``durable-round``).

    Raises:
        ValueError: an unknown ``item_aggregation`` or a negative ``max_update_norm``.
    """

    default_item_aggregation = "touched"
    """What ``item-aggregation = "auto"`` means for this strategy."""

    replies_carry_gradients = False
    """Whether train replies hold gradients of the shared parameters rather than updated values (for
    :meth:`update_norm`)."""

    def __init__(
        self,
        layout: ModelLayout,
        *,
        topology: Topology | None = None,
        seed: int = 0,
        fraction_train: float = 0.1,
        fraction_evaluate: float = 1.0,
        min_train_fraction: float = 0.5,
        eval_every: int = 1,
        num_rounds: int = 1,
        evaluate_split: str = "test",
        item_aggregation: str = "auto",
        unlearning=None,
        round_timeout: float = 600.0,
        max_update_norm: float = 0.0,
    ) -> None:
        keys = {"arrayrecord_key": ARRAYS, "configrecord_key": CONFIG}
        super().__init__(fraction_train, fraction_evaluate, 1, 1 if fraction_evaluate > 0 else 0, 1, **keys)
        self.layout, self.topology, self.seed = layout, topology, seed
        self.min_train_fraction, self.eval_every, self.num_rounds = min_train_fraction, eval_every, num_rounds
        self.evaluate_split = evaluate_split
        self.item_aggregation = aggregation.item_aggregation(item_aggregation, self.default_item_aggregation)
        self._current: ArrayRecord | None = None
        self._sampled_nodes: dict[int, list[int]] = {}
        self.last_train: dict[str, float] = {}
        self.last_evaluate: dict[str, float] = {}
        self.failures: dict[int, int] = {}
        self.evaluation_failures: dict[int, int] = {}
        self.isolated_users: dict[str, dict[str, int]] = {"train": {}, "evaluate": {}}
        self._evaluated_nodes: dict[int, list[int]] = {}
        self.unlearning = unlearning
        self.round_timeout = round_timeout
        self.max_update_norm = replies.max_update_norm(max_update_norm)
        self.removed_users: frozenset[int] = sampling.removed_from_start(unlearning)
        self.contribution_log = None  # unlearning-history's store (.history_recording.ContributionLog)
        self.unlearning_report: dict | None = None
        self.trained: np.ndarray | None = None
        self._grid: Grid | None = None
        self._train_started = 0.0
        self._results_folder: Path | None = None
        self._rejected_nodes: set[int] = set()
        self.adversary_step = None
        self.message_config: dict = {}

    @classmethod
    def from_run_config(cls, config: RunConfig, layout: ModelLayout, topology: Topology | None = None):
        """Build the strategy from the validated run config (the hook every pluggable strategy provides); raises
        ``ConfigError`` as :func:`.unlearning_phase.settings_from_config` does."""
        options = cls.options_from_config(config)
        settings = unlearning_phase.settings_from_config(config, topology)
        if settings is not None:
            options["unlearning"] = settings
        strategy = cls(layout, topology=topology, **options)
        strategy.contribution_log = ContributionLog.from_config(config, layout, strategy.item_aggregation)
        from .adversary import AdversaryServerStep

        strategy.adversary_step = AdversaryServerStep.from_config(config, layout)
        return strategy

    def attach_results(self, folder: Path) -> None:
        """Called by the ServerApp with the run's results folder (the unlearning phase writes its files there; a
        ``retrain`` run records its forgotten users in ``unlearning.json`` now)."""
        self._results_folder = Path(folder)
        if self.unlearning is not None and self.unlearning.method == "retrain":
            unlearning_phase.record_retrain(self._results_folder, self.unlearning)

    def adopt_arrays(self, arrays: ArrayRecord) -> None:
        """Take ``arrays`` as the current shared parameters after a change outside a training round (the unlearning
        phase). Stateless here; a strategy that keeps its own copy of the parameters (server optimizer) overrides it."""

    def checkpoint_state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The strategy's state for a server checkpoint (:func:`.checkpointing.strategy_state`): JSON-able facts and
        arrays; subclasses (an optimizer's moments) extend what ``super()`` returns."""
        return checkpointing.strategy_state(self)

    def restore_checkpoint_state(self, state: Mapping, arrays: Mapping[str, np.ndarray], shared: ArrayRecord) -> None:
        """Inverse of :meth:`checkpoint_state`; ``shared`` holds the checkpoint's shared parameters."""
        checkpointing.restore_strategy_state(self, state, arrays, shared)
        self.adopt_arrays(shared)

    @classmethod
    def options_from_config(cls, config: RunConfig) -> dict:
        """The constructor's keyword arguments that come from the run config (subclasses add theirs)."""
        return {
            "seed": config.seed,
            "fraction_train": config.fraction_train,
            "fraction_evaluate": config.fraction_evaluate,
            "min_train_fraction": config.min_train_fraction,
            "eval_every": config.eval_every,
            "num_rounds": config.num_server_rounds,
            "evaluate_split": "test+val" if config.evaluate_validation else "test",
            "item_aggregation": config.item_aggregation,
            "round_timeout": config.round_timeout,
            "max_update_norm": config.max_update_norm,
        }

    def set_topology(self, topology: Topology) -> None:
        """Set which node serves each user (learned by the ServerApp's identify phase)."""
        self.topology = topology

    def refresh_topology(self, grid: Grid) -> list[int]:
        """Let SuperNodes that joined since the identify phase take over their users (:func:`.nodes.refresh_topology`:
        a node that reports the run's dataset takes over its block of users; one that cannot serve it is not asked
        again). Called at the start of every training and evaluation round; returns the node ids that joined."""
        topology = self._topology()
        if grid is None:  # called outside a running federation (unit tests of message building)
            return []
        new, joined = nodes.refresh_topology(topology, grid, self._rejected_nodes, self.round_timeout)
        if new is not None:
            self.topology = new
        return joined

    # ------------------------------------------------------------------------------------------------ train
    def sample_train_users(self, server_round: int) -> np.ndarray:
        """The users trained in ``server_round`` (``(m,)`` int64, sorted): the seeded draw, less :attr:`removed_users`
        (:func:`.sampling.train_users`)."""
        num_users = self._topology().num_users
        return sampling.train_users(self.seed, server_round, num_users, self.fraction_train, self.removed_users)

    def planned_train_rounds(self) -> list[int]:
        """Every round whose train replies the strategy will aggregate, as the run is configured
        (:func:`.sampling.planned_train_rounds`; ``unlearning = "continue"`` adds its rounds after the last)."""
        return sampling.planned_train_rounds(self.num_rounds, self.unlearning)

    def planned_train_users(self, server_round: int) -> np.ndarray:
        """The users ``server_round`` will train as the run is configured, known before round 1:
        :meth:`sample_train_users`, less the forget set after the unlearning phase, whose end removes them; the reply
        counts checked before round 1 (:meth:`.flower_adapter.FlowerStrategyAdapter.check_round_sizes`)."""
        return sampling.planned_train_users(self.sample_train_users(server_round), self.unlearning, server_round)

    def evaluation_users(self, server_round: int) -> np.ndarray:
        """The users evaluated in ``server_round``: the seeded draw, less the forget set when one is configured
        (:func:`.sampling.evaluation_users`)."""
        num_users = self._topology().num_users
        return sampling.evaluation_users(self.seed, server_round, num_users, self.fraction_evaluate, self.unlearning)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per node that serves a sampled user, naming those users."""
        self._current, self._grid = arrays, grid
        self._train_started = time.perf_counter()
        self.refresh_topology(grid)
        self._sampled_nodes = self._topology().group(self.sample_train_users(server_round))
        config = nodes.with_adversary_config(config, self.adversary_step)  # the adaptive rule's eps, if any
        return self._messages(server_round, arrays, config, self._sampled_nodes, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, then average dense parameters by examples and item rows by the users who touched them
        (:func:`.train_round.aggregate_round`; raises ``PrivacyViolation`` or :class:`RoundFailed` as it does)."""
        return aggregate_round(self, server_round, replies)

    def _record_trained(self, nodes: Iterable[int]) -> None:
        """Mark the users these nodes were asked to train as trained (:attr:`trained`)."""
        if self.trained is None:
            self.trained = np.zeros(self._topology().num_users, dtype=bool)
        for node in nodes:
            self.trained[np.asarray(self._sampled_nodes[node], dtype=np.int64)] = True

    def _count_failure(self, server_round: int, node: int, reason: str, reasons: list[str]) -> None:
        replies.count_failure(self.failures, server_round, node, reason, reasons)

    # ------------------------------------------------------------------------------------------------ unlearning
    def _phase_due(self, server_round: int) -> bool:
        return unlearning_phase.phase_due(self, server_round)

    def run_unlearning(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """The unlearning phase after ``server_round`` (:func:`.unlearning_phase.run_phase`): evaluate, unlearn, write
        ``unlearning.json`` and ``before-unlearning.npz``; the forgotten users train no more. Returns the new arrays."""
        return unlearning_phase.run_phase(self, server_round, arrays)

    def evaluate_arrays(
        self, grid: Grid, arrays: ArrayRecord, server_round: int, users: np.ndarray | None = None
    ) -> dict[str, float]:
        """Evaluate ``arrays`` now on ``users`` (default :meth:`evaluation_users`), leaving :attr:`last_evaluate`."""
        return evaluation.evaluate_now(self, grid, arrays, server_round, users)

    def validate_reply(self, content: RecordDict) -> RecordDict:
        """Check a reply (:func:`.replies.check_reply`); returns it or raises ``ReplyError`` / ``PrivacyViolation``."""
        return replies.check_reply(content, self.layout, self.max_update_norm, self.update_norm)

    def update_norm(self, content: RecordDict) -> float:
        """L2 norm of a (validated) reply's update against the sent arrays (:func:`.aggregation.update_norm`; the mean
        gradients' norm where replies carry gradients: :attr:`replies_carry_gradients`, the adversary step's keys)."""
        assert self._current is not None, "configure_train must run before replies are validated"
        gradient_keys = () if self.adversary_step is None else self.adversary_step.keys
        carries = lambda key: self.replies_carry_gradients or key in gradient_keys  # noqa: E731
        return aggregation.update_norm(content, self.layout, self._current, carries)

    def aggregate_arrays(self, accepted: list[RecordDict]) -> ArrayRecord:
        """The new shared arrays from accepted replies (:func:`.aggregation.aggregate_arrays`)."""
        assert self._current is not None, "configure_train must run before aggregate_train"
        return aggregation.aggregate_arrays(accepted, self.layout, self._current, self.item_aggregation)

    @staticmethod
    def row_updates(accepted: list[RecordDict], key: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The ``(rows, sums, counts)`` of item table ``key`` in each accepted reply."""
        return aggregation.row_updates(accepted, key)

    @staticmethod
    def replied_users(accepted: list[RecordDict]) -> float:
        """How many users the accepted replies cover (their ``num-users`` metrics)."""
        return aggregation.replied_users(accepted)

    # ------------------------------------------------------------------------------------------------ evaluate
    def is_evaluation_round(self, server_round: int) -> bool:
        """Evaluate every ``eval-every`` rounds, after the last round and in the unlearning phase's round."""
        u, rounds = self.unlearning, self.num_rounds
        return sampling.is_evaluation_round(server_round, self.fraction_evaluate, self.eval_every, rounds, u)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation messages for ``fraction-evaluate`` of users, on evaluation rounds only."""
        self.last_evaluate = {}
        self._evaluated_nodes = {}
        if not self.is_evaluation_round(server_round):
            return []
        self.refresh_topology(grid)
        config = ConfigRecord(dict(config))
        config.setdefault("split", self.evaluate_split)
        self._evaluated_nodes = self._topology().group(self.evaluation_users(server_round))
        return self._messages(server_round, arrays, config, self._evaluated_nodes, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Mean metrics over evaluated users, with failures counted in :attr:`evaluation_failures`
        (:func:`.evaluation.aggregate_evaluation`)."""
        return evaluation.aggregate_evaluation(self, server_round, replies)

    # ------------------------------------------------------------------------------------------------ helpers
    def _topology(self) -> Topology:
        if self.topology is None:
            raise RuntimeError("the strategy has no topology yet: call set_topology() first")
        return self.topology

    def _canonical_order(self, replies: Iterable[Message]) -> list[Message]:
        """Replies sorted by the first user their node serves (:func:`.nodes.canonical_order`)."""
        return nodes.canonical_order(replies, self._topology())

    def _messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, groups: Mapping, kind: str):
        return nodes.node_messages(server_round, arrays, config, groups, kind, self.message_config)

    def summary(self) -> None:
        """Log the configuration."""
        log.info(
            "%s: fraction-train %.3f, fraction-evaluate %.3f, min-train-fraction %.2f, eval-every %d, %d item tables "
            "(%s rows)",
            type(self).__name__,
            self.fraction_train,
            self.fraction_evaluate,
            self.min_train_fraction,
            self.eval_every,
            len(self.layout.item_keys),
            self.item_aggregation,
        )
