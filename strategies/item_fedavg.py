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
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords, aggregate_metricrecords

from fedrec_flwr.arrays import decode_array, decode_record
from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError, reply_error_line
from fedrec_flwr.io import atomic_save_npz, atomic_write_json
from fedrec_flwr.state.checkpoint import TRAINED_KEY
from fedrec_flwr.wire import (
    ARRAYS,
    CONFIG,
    COUNT,
    GRADIENT_USERS,
    ISOLATED_USERS,
    ITEM_AGGREGATIONS,
    METRICS,
    NUM_EXAMPLES,
    ROWS,
    SUM,
    ModelLayout,
    ReplyError,
    Topology,
    check_reply_keys,
    merge_rows,
    sample_users,
)

__all__ = ["ItemEmbeddingFedAvg", "RoundFailed", "Topology"]

log = logging.getLogger(__name__)


class RoundFailed(RuntimeError):
    """Too few valid replies arrived for a round to count."""


class ItemEmbeddingFedAvg(FedAvg):
    """FedAvg for federated recommenders with per-user private embeddings. See the module docstring.

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
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=1,
            min_evaluate_nodes=1 if fraction_evaluate > 0 else 0,
            min_available_nodes=1,
            arrayrecord_key=ARRAYS,
            configrecord_key=CONFIG,
        )
        self.layout = layout
        self.topology = topology
        self.seed = seed
        self.min_train_fraction = min_train_fraction
        self.eval_every = eval_every
        self.num_rounds = num_rounds
        self.evaluate_split = evaluate_split
        if item_aggregation == "auto":
            item_aggregation = self.default_item_aggregation
        if item_aggregation not in ITEM_AGGREGATIONS:
            raise ValueError(f"item_aggregation must be one of {ITEM_AGGREGATIONS}, got {item_aggregation!r}")
        self.item_aggregation = item_aggregation
        self._current: ArrayRecord | None = None
        self._sampled_nodes: dict[int, list[int]] = {}
        self.last_train: dict[str, float] = {}
        self.last_evaluate: dict[str, float] = {}
        self.failures: dict[int, int] = {}
        """Failed training replies per node id (an error reply, a rejected reply, or none within round-timeout)."""
        self.evaluation_failures: dict[int, int] = {}
        self.isolated_users: dict[str, dict[str, int]] = {"train": {}, "evaluate": {}}
        """Per phase, round -> how many requested users the nodes left out for non-finite private state (the
        nodes' ``isolated-users`` reply metric; each node's log names them); written to ``summary.json``."""
        """Failed evaluation replies per node id (an error reply or none within round-timeout)."""
        self._evaluated_nodes: dict[int, list[int]] = {}
        self.unlearning = unlearning
        """:class:`fedrec_flwr.strategies.unlearning.UnlearningSettings`, or ``None`` without a forget set."""
        self.round_timeout = round_timeout
        if not max_update_norm >= 0:
            raise ValueError(f"max_update_norm must be >= 0, got {max_update_norm!r}")
        self.max_update_norm = float(max_update_norm)
        self.removed_users: frozenset[int] = frozenset(
            unlearning.forget if unlearning is not None and unlearning.method == "retrain" else ()
        )
        """Users no longer sampled for training (the forgotten ones, once forgotten; from the start for ``retrain``)."""
        self.unlearning_report: dict | None = None
        self.trained: np.ndarray | None = None
        """``(num_users,)`` bool: the users whose training replies were accepted in some round so far (so their
        clients saved private state, where nodes keep ``client-state-dir`` files); in server checkpoints, where a
        resume checks the nodes' state files against it (:func:`fedrec_flwr.state.checkpoint.check_client_state`)."""
        self._grid: Grid | None = None
        self._train_started = 0.0
        self._results_folder: Path | None = None
        self._rejected_nodes: set[int] = set()
        self.adversary_step = None
        """FedAU²'s server step of the attribute adversary (:class:`fedrec_flwr.strategies.adversary.AdversaryServerStep`), set by
        :meth:`from_run_config` for ``adversary-training = "server"``; ``None`` otherwise."""
        self.message_config: dict = {}
        """Keys sent in the config of every message of the run (the ServerApp sets the run's name, ``run``, and the
        round of its last checkpoint, ``durable-round``, which clients with ``client-state-dir`` need)."""

    @classmethod
    def from_run_config(cls, config: RunConfig, layout: ModelLayout, topology: Topology | None = None):
        """Build the strategy from the validated run config (the hook every pluggable strategy provides).

        Raises:
            ConfigError: a forget set is configured but ``topology`` is unknown, or a forgotten partition id is out of
                range.
        """
        options = cls.options_from_config(config)
        if config.unlearning != "none" or config.forget_user_ids or config.forget_fraction > 0:
            from .unlearning import UnlearningSettings

            if topology is None:
                raise ConfigError("a forget set (forget-users / forget-fraction) needs the federation's topology")
            options["unlearning"] = UnlearningSettings.from_config(config, topology.num_users)
            if config.unlearning == "none":
                count = len(options["unlearning"].forget)
                log.warning(
                    "forget-users / forget-fraction set with unlearning = 'none': %s still train%s and %s "
                    "only left out of evaluation",
                    f"those {count} users" if count != 1 else "that 1 user",
                    "" if count != 1 else "s",
                    "are" if count != 1 else "is",
                )
        strategy = cls(layout, topology=topology, **options)
        from .adversary import AdversaryServerStep

        strategy.adversary_step = AdversaryServerStep.from_config(config, layout)
        return strategy

    def attach_results(self, folder: Path) -> None:
        """Called by the ServerApp with the run's results folder (the unlearning phase writes its files there; a
        ``retrain`` run records its forgotten users in ``unlearning.json`` now)."""
        self._results_folder = Path(folder)
        if self.unlearning is not None and self.unlearning.method == "retrain":
            self._results_folder.mkdir(parents=True, exist_ok=True)
            atomic_write_json(
                self._results_folder / "unlearning.json",
                {"method": "retrain", "forget-users": list(self.unlearning.forget)},
            )

    def adopt_arrays(self, arrays: ArrayRecord) -> None:
        """Take ``arrays`` as the current shared parameters after a change outside a training round (the unlearning
        phase). Stateless here; a strategy that keeps its own copy of the parameters (server optimizer) overrides it."""

    def checkpoint_state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The strategy's state for a server checkpoint (:mod:`fedrec_flwr.state.checkpoint`): JSON-able facts (failure
        counts per node, users no longer trained, the unlearning report) and arrays (none here; subclasses with an
        optimizer add its moments). Subclasses extend what ``super()`` returns."""
        state = {
            "failures": {str(k): v for k, v in self.failures.items()},
            "evaluation-failures": {str(k): v for k, v in self.evaluation_failures.items()},
            "removed-users": sorted(int(u) for u in self.removed_users),
            "unlearning-report": self.unlearning_report,
            "isolated-users": self.isolated_users,
        }
        arrays = (
            {}
            if self.adversary_step is None
            else {f"adversary-step/{k}": v for k, v in self.adversary_step.state_arrays().items()}
        )
        if self.trained is not None:
            arrays[TRAINED_KEY] = self.trained.copy()
        return state, arrays

    def restore_checkpoint_state(self, state: Mapping, arrays: Mapping[str, np.ndarray], shared: ArrayRecord) -> None:
        """Inverse of :meth:`checkpoint_state`; ``shared`` holds the checkpoint's shared parameters."""
        self.failures = {int(k): int(v) for k, v in state.get("failures", {}).items()}
        self.evaluation_failures = {int(k): int(v) for k, v in state.get("evaluation-failures", {}).items()}
        if self.topology is not None:
            current = {int(n) for n in np.unique(self.topology.user_to_node)}
            gone = sorted((set(self.failures) | set(self.evaluation_failures)) - current)
            if gone:
                log.warning(
                    "resumed failure counts name node ids %s that are not connected now (a restarted "
                    "SuperNode gets a new id): their counts stay under the old ids, and the new nodes' "
                    "counts start at 0",
                    gone,
                )
        self.removed_users = frozenset(int(u) for u in state.get("removed-users", []))
        self.unlearning_report = state.get("unlearning-report")
        self.isolated_users = {
            phase: {str(k): int(v) for k, v in state.get("isolated-users", {}).get(phase, {}).items()}
            for phase in ("train", "evaluate")
        }
        self.trained = np.asarray(arrays[TRAINED_KEY], dtype=bool).copy() if TRAINED_KEY in arrays else None
        if self.adversary_step is not None:
            prefix = "adversary-step/"
            self.adversary_step.load_state_arrays(
                shared, {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            )
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
        """Let SuperNodes that joined since the identify phase take over their users (a restarted SuperNode gets a
        new node id from the SuperLink, so without this its users would stay mapped to the dead id). Called at the
        start of every training and evaluation round; costs one ``get_node_ids`` call when nothing changed.

        A new node is sent the ``identify`` query; if it reports the run's dataset (same fingerprint and users), the
        block of users it serves is mapped to it and logged. A node that fails to identify, or reports another
        dataset, is logged and not asked again. Returns the node ids that joined."""
        topology = self._topology()
        if grid is None:  # called outside a running federation (unit tests of message building)
            return []
        known = {int(n) for n in np.unique(topology.user_to_node)} | self._rejected_nodes
        new = sorted(int(n) for n in grid.get_node_ids() if int(n) not in known)
        if not new:
            return []
        from fedrec_flwr.app.server_app import identify_nodes

        facts, errors = identify_nodes(grid, new, timeout=min(self.round_timeout, 60.0))
        for node, reason in errors:
            log.warning("node %d joined but cannot serve this run: %s", node, reason)
            self._rejected_nodes.add(node)
        joined = []
        user_to_node = topology.user_to_node.copy()
        for fact in facts:
            node = int(fact["node"])
            if fact.get("fingerprint") != topology.fingerprint or fact.get("num-users-total") != topology.num_users:
                log.warning(
                    "node %d joined with another dataset (%s users, fingerprint %s); ignored",
                    node,
                    fact.get("num-users-total"),
                    fact.get("fingerprint"),
                )
                self._rejected_nodes.add(node)
                continue
            block = slice(int(fact["first-user"]), int(fact["first-user"]) + int(fact["num-users"]))
            replaced = sorted({int(n) for n in user_to_node[block]})
            user_to_node[block] = node
            joined.append(node)
            log.info(
                "node %d joined: partition-id %s, users %d..%d (before: node %s)",
                node,
                fact.get("partition-id"),
                block.start,
                block.stop - 1,
                ", ".join(map(str, replaced)),
            )
        self.topology = Topology(user_to_node, topology.fingerprint)
        return joined

    # ------------------------------------------------------------------------------------------------ train
    def sample_train_users(self, server_round: int) -> np.ndarray:
        """The users trained in ``server_round`` (``(m,)`` int64, sorted): the seeded draw, less :attr:`removed_users`
        (so a run without some users trains every other user in exactly the same rounds)."""
        users = sample_users(self.seed, server_round, self._topology().num_users, self.fraction_train, tag=0)
        if self.removed_users:
            users = users[~np.isin(users, np.fromiter(self.removed_users, dtype=np.int64))]
        return users

    def planned_train_rounds(self) -> list[int]:
        """Every round whose train replies the strategy will aggregate, as the run is configured: ``1 ..
        num_rounds``, and with ``unlearning = "continue"`` its phase's ``continue-rounds`` rounds, numbered after the
        last (:meth:`fedrec_flwr.strategies.unlearning.ClientUnlearning._continue`)."""
        rounds = list(range(1, self.num_rounds + 1))
        u = self.unlearning
        if u is not None and u.method == "continue":
            rounds += range(self.num_rounds + 1, self.num_rounds + u.continue_rounds + 1)
        return rounds

    def planned_train_users(self, server_round: int) -> np.ndarray:
        """The users ``server_round`` will train as the run is configured, known before round 1:
        :meth:`sample_train_users`, less the forget set after the unlearning phase's round (``unlearn-round``), whose
        end removes them (:meth:`run_unlearning`; ``retrain`` removes them from the start, already in
        :attr:`removed_users`). The reply-count checks count these
        (:meth:`fedrec_flwr.strategies.flower_adapter.FlowerStrategyAdapter.check_round_sizes`)."""
        from .unlearning import PHASE_METHODS

        users = self.sample_train_users(server_round)
        u = self.unlearning
        if u is not None and u.method in PHASE_METHODS and u.forget and server_round > u.round:
            users = users[~np.isin(users, np.asarray(u.forget, dtype=np.int64))]
        return users

    def evaluation_users(self, server_round: int) -> np.ndarray:
        """The users evaluated in ``server_round``: the seeded draw, less the forget set when one is configured (so
        every method is scored on the same remaining users)."""
        users = sample_users(self.seed, server_round, self._topology().num_users, self.fraction_evaluate, tag=1)
        if self.unlearning is not None and self.unlearning.forget:
            users = users[~np.isin(users, np.asarray(self.unlearning.forget, dtype=np.int64))]
        return users

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per node that serves a sampled user, naming those users."""
        self._current = arrays
        self._grid = grid
        self._train_started = time.perf_counter()
        self.refresh_topology(grid)
        users = self.sample_train_users(server_round)
        self._sampled_nodes = self._topology().group(users)
        if self.adversary_step is not None and self.adversary_step.train_config():  # the adaptive rule's eps
            config = ConfigRecord({**dict(config), **self.adversary_step.train_config()})
        return self._messages(server_round, arrays, config, self._sampled_nodes, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, then average dense parameters by examples and item rows by the users who touched them.

        Raises:
            PrivacyViolation: a reply carries a private parameter.
            RoundFailed: fewer accepted replies than ``min-train-fraction`` of the sampled nodes.
        """
        replies = self._canonical_order(replies)
        accepted: list[RecordDict] = []
        reasons: list[str] = []
        accepted_nodes: list[int] = []
        answered: set[int] = set()
        unattributed: list[str] = []
        for message in replies:
            node = int(message.metadata.src_node_id)
            if message.has_error() and node not in self._sampled_nodes:
                # the SuperLink answers for a node that stopped sending heartbeats (src: the SuperLink itself)
                unattributed.append(message.error.reason)
                continue
            answered.add(node)
            if message.has_error():
                self._count_failure(server_round, node, message.error.reason, reasons)
                continue
            try:
                accepted.append(self.validate_reply(message.content))
                accepted_nodes.append(node)
            except ReplyError as err:
                log.warning("round %d: rejected the reply of node %d: %s", server_round, node, err)
                reasons.append(f"node {node}'s reply rejected: {err}")
        for node in sorted(set(self._sampled_nodes) - answered):
            reason = (
                unattributed.pop(0) if unattributed else f"no reply within round-timeout ({self.round_timeout:g} s)"
            )
            self._count_failure(server_round, node, reason, reasons)
        expected = len(self._sampled_nodes)
        needed = max(1, math.ceil(self.min_train_fraction * expected))
        if len(accepted) < needed:
            raise RoundFailed(
                f"round {server_round}: {len(accepted)} valid replies of {expected} sampled nodes "
                f"(min-train-fraction {self.min_train_fraction} needs {needed}); "
                f"{len(answered)} nodes answered, {len(reasons)} failed or were rejected"
                + (f"; first problem: {reasons[0]}" if reasons else "")
            )
        self._record_trained(accepted_nodes)
        arrays = self.aggregate_arrays(accepted)
        if self.adversary_step is not None:  # h_w's keys carry gradients: its server steps (strategies/adversary.py)
            arrays = self.adversary_step.round_steps(self, server_round, arrays, accepted, accepted_nodes)
            self.adopt_arrays(arrays)
        metrics = aggregate_metricrecords(accepted, NUM_EXAMPLES)
        isolated = self._isolated(server_round, accepted, metrics, "train")
        train_users = self.replied_users(accepted)
        if "num-users" in metrics:
            del metrics["num-users"]  # a weighted mean of counts means nothing; the total is below
        metrics["train-users"] = train_users
        self.last_train = {
            "train-loss": float(metrics.get("train-loss", float("nan"))),
            "train-users": train_users,
            "num-replies": float(len(accepted)),
            "num-failures": float(expected - len(accepted)),
            "train-seconds": time.perf_counter() - self._train_started,
        }
        if isolated:  # the column appears in metrics.csv from the first round a node left users out
            self.last_train[ISOLATED_USERS] = float(isolated)
        # clients' own metrics (UserUpdate.metrics): weighted means over the round's users, as the nodes sent them
        standard = {NUM_EXAMPLES, "num-users", "train-users", "train-loss", GRADIENT_USERS}
        self.last_train.update(
            {k: float(v) for k, v in metrics.items() if k not in standard and isinstance(v, (int, float))}
        )
        if self._phase_due(server_round):
            arrays = self.run_unlearning(server_round, arrays)
        return arrays, metrics

    def _record_trained(self, nodes: Iterable[int]) -> None:
        """Mark the users these nodes were asked to train as trained (:attr:`trained`)."""
        if self.trained is None:
            self.trained = np.zeros(self._topology().num_users, dtype=bool)
        for node in nodes:
            self.trained[np.asarray(self._sampled_nodes[node], dtype=np.int64)] = True

    def _count_failure(self, server_round: int, node: int, reason: str, reasons: list[str]) -> None:
        self.failures[node] = self.failures.get(node, 0) + 1
        log.debug("round %d: node %d failed, whole reason: %s", server_round, node, reason)
        reason = reply_error_line(reason)
        log.warning("round %d: node %d failed: %s", server_round, node, reason)
        reasons.append(f"node {node} failed: {reason}")

    # ------------------------------------------------------------------------------------------------ unlearning
    def _phase_due(self, server_round: int) -> bool:
        from .unlearning import PHASE_METHODS

        u = self.unlearning
        return (
            u is not None and u.method in PHASE_METHODS and server_round == u.round and self.unlearning_report is None
        )

    def run_unlearning(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """The unlearning phase after ``server_round`` (:class:`fedrec_flwr.strategies.unlearning.ClientUnlearning`): evaluate the
        model, unlearn, write ``unlearning.json`` (report, metrics before) and ``before-unlearning.npz``; from then on
        the forgotten users are not trained. Returns the new arrays."""
        from .unlearning import ClientUnlearning, UnlearningFailed, describe_before

        assert self._grid is not None and self.unlearning is not None
        if self._results_folder is not None:
            atomic_save_npz(
                self._results_folder / "before-unlearning.npz",
                **{k.replace("/", "_"): v.numpy() for k, v in arrays.items()},
            )
        before = self.evaluate_arrays(self._grid, arrays, server_round)
        if line := describe_before(before, server_round):
            log.info("%s", line)
        saved_train = dict(self.last_train)
        try:
            new, report = ClientUnlearning(self, self.unlearning, timeout=self.round_timeout).run(
                self._grid, arrays, server_round
            )
        except UnlearningFailed as err:
            if self._results_folder is not None:
                atomic_write_json(
                    self._results_folder / "unlearning.json",
                    {
                        "method": self.unlearning.method,
                        "round": server_round,
                        "forget-users": list(self.unlearning.forget),
                        "error": str(err),
                        "before": before,
                    },
                )
            raise
        self.last_train = saved_train
        self.removed_users = frozenset(self.removed_users) | set(self.unlearning.forget)
        self.adopt_arrays(new)
        report["before"] = before
        self.unlearning_report = report
        if self._results_folder is not None:
            atomic_write_json(self._results_folder / "unlearning.json", report)
            log.info(
                "unlearning report (every figure of the phase) written to %s; the model before it to %s",
                self._results_folder / "unlearning.json",
                self._results_folder / "before-unlearning.npz",
            )
        return new

    def evaluate_arrays(
        self, grid: Grid, arrays: ArrayRecord, server_round: int, users: np.ndarray | None = None
    ) -> dict[str, float]:
        """Federated evaluation of ``arrays`` now, on ``users`` (default: :meth:`evaluation_users`); mean metrics.
        Leaves :attr:`last_evaluate` as it was."""
        if self.fraction_evaluate <= 0 and users is None:
            return {}
        users = self.evaluation_users(server_round) if users is None else np.asarray(users, dtype=np.int64)
        config = ConfigRecord({"split": self.evaluate_split})
        self._evaluated_nodes = self._topology().group(users)
        messages = self._messages(server_round, arrays, config, self._evaluated_nodes, MessageType.EVALUATE)
        saved = self.last_evaluate
        try:
            self.aggregate_evaluate(server_round, grid.send_and_receive(messages, timeout=self.round_timeout))
            return dict(self.last_evaluate)
        finally:
            self.last_evaluate = saved

    def validate_reply(self, content: RecordDict) -> RecordDict:
        """Check one reply's content; returns it, or raises ``ReplyError`` / ``PrivacyViolation``."""
        if ARRAYS not in content.array_records or METRICS not in content.metric_records:
            raise ReplyError(f"reply must hold '{ARRAYS}' and '{METRICS}' records, got {list(content.keys())}")
        arrays = decode_record(content[ARRAYS], copy=False)
        check_reply_keys(arrays, self.layout)
        weight = content[METRICS].get(NUM_EXAMPLES, 0)
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ReplyError(f"'{NUM_EXAMPLES}' must be a positive number, got {weight!r}")
        loss = content[METRICS].get("train-loss", 0.0)
        if not math.isfinite(float(loss)):
            raise ReplyError(f"'train-loss' is not finite: {loss!r}")
        if self.max_update_norm > 0:
            norm = self.update_norm(content)
            if not norm <= self.max_update_norm:
                raise ReplyError(f"update norm {norm:.4g} exceeds max-update-norm {self.max_update_norm:g}")
        return content

    def update_norm(self, content: RecordDict) -> float:
        """L2 norm of a (validated) reply's update: the node's example-weighted mean of its dense parameters minus
        the sent ones, and each returned item row's mean over its users (``sum / count``) minus the sent row; for a
        strategy whose clients upload gradients (:attr:`replies_carry_gradients`), the norm of those mean gradients.
        With one user per node this is that user's update; with more, the node's mean (bounding each user's update
        would need per-user values, which the sum-and-count scheme deliberately does not send)."""
        assert self._current is not None, "configure_train must run before replies are validated"
        arrays, total = content[ARRAYS], 0.0
        for key in self.layout.shared_shapes:
            if key in self.layout.item_keys:
                rows = decode_array(arrays[key + ROWS], copy=False)
                sums = decode_array(arrays[key + SUM], copy=False).astype(np.float64)
                counts = decode_array(arrays[key + COUNT], copy=False).astype(np.float64)
                value = sums / counts.reshape(-1, *[1] * (sums.ndim - 1))
                reference = decode_array(self._current[key], copy=False)[rows]
            else:
                value = decode_array(arrays[key], copy=False).astype(np.float64)
                reference = decode_array(self._current[key], copy=False)
            gradient = self.replies_carry_gradients or (
                self.adversary_step is not None and key in self.adversary_step.keys
            )
            delta = value if gradient else value - reference
            total += float(np.sum(delta**2))
        return math.sqrt(total)

    def aggregate_arrays(self, accepted: list[RecordDict]) -> ArrayRecord:
        """The new shared arrays from accepted replies (pure math; subclasses may post-process the result)."""
        assert self._current is not None, "configure_train must run before aggregate_train"
        dense_keys = self.layout.dense_keys
        dense_records = [
            RecordDict({ARRAYS: ArrayRecord({k: r[ARRAYS][k] for k in dense_keys}), METRICS: r[METRICS]})
            for r in accepted
        ]
        dense = aggregate_arrayrecords(dense_records, NUM_EXAMPLES) if dense_keys else ArrayRecord()
        num_users = self.replied_users(accepted)
        out: dict[str, np.ndarray] = {}
        for key in self.layout.shared_shapes:
            if key in self.layout.item_keys:
                out[key], _ = merge_rows(
                    self._current[key].numpy(), self.row_updates(accepted, key), self.item_aggregation, num_users
                )
            else:
                out[key] = dense[key].numpy().astype(np.float32)
        return ArrayRecord({k: Array(v) for k, v in out.items()})

    @staticmethod
    def row_updates(accepted: list[RecordDict], key: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The ``(rows, sums, counts)`` of item table ``key`` in each accepted reply."""
        return [
            tuple(decode_array(r[ARRAYS][key + suffix], copy=False) for suffix in (ROWS, SUM, COUNT)) for r in accepted
        ]

    @staticmethod
    def replied_users(accepted: list[RecordDict]) -> float:
        """How many users the accepted replies cover (their ``num-users`` metrics)."""
        return float(sum(float(r[METRICS].get("num-users", 0)) for r in accepted))

    # ------------------------------------------------------------------------------------------------ evaluate
    def is_evaluation_round(self, server_round: int) -> bool:
        """Evaluate every ``eval-every`` rounds and after the last round."""
        phase = (
            self.unlearning is not None and self.unlearning.method != "none" and server_round == self.unlearning.round
        )
        return self.fraction_evaluate > 0 and (
            server_round % self.eval_every == 0 or server_round == self.num_rounds or phase
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation messages for ``fraction-evaluate`` of users, on evaluation rounds only."""
        self.last_evaluate = {}
        self._evaluated_nodes = {}
        if not self.is_evaluation_round(server_round):
            return []
        self.refresh_topology(grid)
        users = self.evaluation_users(server_round)
        config = ConfigRecord(dict(config))
        config.setdefault("split", self.evaluate_split)
        self._evaluated_nodes = self._topology().group(users)
        return self._messages(server_round, arrays, config, self._evaluated_nodes, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Mean metrics over evaluated users (each reply is weighted by its number of users).

        A node that answers with an error, or not at all within ``round-timeout``, is logged by node id with the users
        it left out, and counted in :attr:`evaluation_failures` (``eval-failures`` in the round's metrics when > 0), as
        training failures are; an error the SuperLink sends for an unavailable node is put on a sent-to node that did
        not answer."""
        replies = self._canonical_order(replies)
        ok = [m.content for m in replies if not m.has_error()]
        known = set(self._topology().user_to_node.tolist())
        answered: set[int] = set()
        unattributed: list[str] = []
        failed = 0
        for message in replies:
            node = int(message.metadata.src_node_id)
            if message.has_error() and node not in known and node not in self._evaluated_nodes:
                unattributed.append(message.error.reason)
                continue
            answered.add(node)
            if message.has_error():
                failed += 1
                self._count_evaluation_failure(server_round, node, message.error.reason)
        for node in sorted(set(self._evaluated_nodes) - answered):
            reason = (
                unattributed.pop(0) if unattributed else f"no reply within round-timeout ({self.round_timeout:g} s)"
            )
            failed += 1
            self._count_evaluation_failure(server_round, node, reason)
        for reason in unattributed:  # not matched to a node we sent to (no record of the sent nodes)
            failed += 1
            log.warning(
                "round %d: evaluation failed on a node the SuperLink reports unavailable: %s", server_round, reason
            )
        self._evaluated_nodes = {}
        if not ok:
            if failed:
                self.last_evaluate = {"eval-failures": float(failed)}
            return None
        metrics = aggregate_metricrecords(ok, NUM_EXAMPLES)
        isolated = self._isolated(server_round, ok, metrics, "evaluate")
        self.last_evaluate = {k: float(v) for k, v in metrics.items()}
        if isolated:
            self.last_evaluate[f"eval-{ISOLATED_USERS}"] = float(isolated)
        self.last_evaluate["eval-users"] = float(sum(float(r[METRICS][NUM_EXAMPLES]) for r in ok))
        if failed:  # the column appears in metrics.csv from the first evaluation a node failed
            self.last_evaluate["eval-failures"] = float(failed)
        return metrics

    def _isolated(self, server_round: int, replies: list[RecordDict], metrics: MetricRecord, phase: str) -> int:
        """The users the ``replies``' nodes left out for non-finite private state (their ``isolated-users``), taken
        out of the averaged ``metrics`` (a mean of counts means nothing), counted in :attr:`isolated_users` and
        logged; returns their number."""
        isolated = int(sum(float(r[METRICS].get(ISOLATED_USERS, 0)) for r in replies))
        if ISOLATED_USERS in metrics:
            del metrics[ISOLATED_USERS]
        if isolated:
            self.isolated_users[phase][str(server_round)] = isolated
            log.warning(
                "round %d: %d user(s) left out of %s for non-finite private state (their nodes' logs name "
                "them; the other users went on)",
                server_round,
                isolated,
                "training" if phase == "train" else "evaluation",
            )
        return isolated

    def _count_evaluation_failure(self, server_round: int, node: int, reason: str) -> None:
        self.evaluation_failures[node] = self.evaluation_failures.get(node, 0) + 1
        users = self._evaluated_nodes.get(node, [])
        left_out = f" ({len(users)} users not evaluated: {users[0]}..{users[-1]})" if users else ""
        log.debug("round %d: evaluation failed on node %d, whole reason: %s", server_round, node, reason)
        log.warning(
            "round %d: evaluation failed on node %d%s: %s", server_round, node, left_out, reply_error_line(reason)
        )

    # ------------------------------------------------------------------------------------------------ helpers
    def _topology(self) -> Topology:
        if self.topology is None:
            raise RuntimeError("the strategy has no topology yet: call set_topology() first")
        return self.topology

    def _canonical_order(self, replies: Iterable[Message]) -> list[Message]:
        """Replies sorted by the first user their node serves: float sums then do not depend on arrival order,
        so runs with any number of workers give bit-identical models."""
        first_user: dict[int, int] = {}
        for user, node in enumerate(self._topology().user_to_node.tolist()):
            first_user.setdefault(int(node), user)
        return sorted(replies, key=lambda m: first_user.get(int(m.metadata.src_node_id), -1))

    def _messages(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, groups: Mapping[int, list[int]], kind: str
    ) -> list[Message]:
        messages = []
        for node_id, users in groups.items():
            node_config = ConfigRecord({**self.message_config, **dict(config)})
            node_config["server-round"] = server_round
            node_config["users"] = users
            content = RecordDict({ARRAYS: arrays, CONFIG: node_config})
            messages.append(Message(content=content, message_type=kind, dst_node_id=node_id))
        return messages

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
