"""Any Flower strategy on a recommender: run ``flwr.serverapp.strategy`` classes unchanged.

``strategy = "flwr.serverapp.strategy:FedAdam"`` (or any ``module:Class`` naming a ``flwr.serverapp.strategy.Strategy``
without our ``from_run_config``) runs that strategy inside our ServerApp through :class:`FlowerStrategyAdapter`. Its
constructor arguments come from the run-config key ``strategy-args`` (``"eta=0.01,beta_1=0.9"``, checked against the
constructor's signature, see :func:`build_flower_strategy`); the class and every resolved argument are recorded in the
run's ``config.json`` (``"strategy"``).

What the wrapped strategy sees, per round:

* ``configure_train`` / ``configure_evaluate`` get the full shared arrays keyed like the model (what our server always
  sends) and a grid whose nodes are the nodes serving the round's users (:class:`RoundNodes`); with the sampling
  arguments the adapter sets (``fraction_train = 1``, ``min_*_nodes = 1``) the strategy addresses all of them. The
  adapter then adds to each of its messages the users that node trains (``"users"``) and the run's keys.
* ``aggregate_train`` gets one **dense** reply per node: every shared key with its full shape, the node's
  ``num-examples`` weight and its metrics. Dense parameters (the score function) are the node's example-weighted mean,
  as sent. An item table ``"<key>"`` travels row-sparse (:mod:`fedrec_flwr.wire`: ``#rows``, ``#sum``, ``#count``)
  and is expanded to **the mean over the node's trained users of their full tables, a row a user did not touch
  counting as the round's global value**::

      dense_c[i] = global[i] + (sum_c[i] - count_c[i] * global[i]) / m_c          (m_c = the node's "num-users")

  With one user per node (``users-per-node = 1``) this is exactly that user's table after local training: rows it
  trained hold its new values, every other row the global value it received. ``FedAvg`` over such replies gives
  ``sum_c n_c dense_c / sum_c n_c``: every sampled user counts in every row, as in ``item-aggregation = "selected"``,
  but weighted by examples; it equals ``item-fedavg`` with ``"selected"`` (a plain mean over users) when the nodes'
  ``num-examples`` are proportional to their numbers of users (e.g. users with equal example counts; tested), and
  otherwise differs by that weighting. Coordinate-wise rules (FedMedian, FedTrimmedAvg) see, for an item that fewer
  than half of the sampled users trained, mostly the global value, so such rows barely move; distance rules (Krum)
  compare full tables.
* Its hooks, state and Flower's ``Strategy.start`` loop run untouched; the adapter casts the arrays it returns back to
  the model's dtypes, and a round where it returns no arrays keeps the model. Krum, MultiKrum and Bulyan need enough
  replies per round (:func:`robust_aggregation_shortfall`): a config whose rounds sample too few nodes is refused
  before round 1, a round left with too few by failures fails (Bulyan would silently skip it). The server-side DP
  wrappers calibrate their noise to ``num_sampled_clients`` replies (Flower only warns each round they differ): a
  config whose rounds do not all have that many nodes is refused before round 1 (:func:`dp_sample_size_mismatch`).
  Both checks count every round the strategy aggregates as the run is configured
  (:meth:`~fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg.planned_train_users`): after ``unlearn-round`` without the
  forgotten users, and ``unlearning = "continue"``'s own rounds.

What stays around it (inherited from :class:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg`): user sampling by
``(seed, round)``, reply validation (key scheme, shapes, NaN, ``max-update-norm``) and the privacy check before
anything reaches the wrapped strategy, failure counting and ``min-train-fraction``, topology refresh, federated
evaluation on the same users and rounds, the unlearning phase and server checkpoints of our own state. Given up:
the wrapped strategy's own state (FedAdam's moments, FedAvgM's momentum, adaptive clipping norms) is not in
checkpoints (a resumed run restarts it; a warning says so), and an override of ``start`` itself is not used.

Keys a strategy adds to the train config (FedProx's ``"proximal-mu"``, client-side DP's clipping norm) must be
honoured by the client: a non-zero value for a key the configured client class does not list in its
``strategy_config_keys`` stops the run before it starts (:class:`~fedrec_flwr.errors.ConfigError`, from a dry round
1 in :meth:`FlowerStrategyAdapter.check_config`, which :mod:`fedrec_flwr.app.preflight` runs; round 1 checks again). Our
clients list FedProx's ``"proximal-mu"`` (:class:`fedrec_flwr.clients.fedrec.FedRecClient`: the paper's proximal term on the shared
parameters; PFedRec does not, see :class:`fedrec_flwr.clients.pfedrec.PFedRecClient`); the client-side DP wrappers are refused
(their guarantee needs clipping on the client).

Bytes: what travels is unchanged (the server sends the full shared arrays, a node replies row-sparse); the dense
replies exist only in the server's memory: per round ``num_nodes * sum_k size(k) * 4`` bytes, e.g. 10 replies of a
FedNCF on MovieLens-100K (two 1682 x 32 tables) hold 4.3 MB.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.registry import resolve
from fedrec_flwr.wire import ARRAYS, CONFIG, COUNT, GRADIENT_USERS, METRICS, ModelLayout, ReplyError, Topology

from .flower_args import SET_BY_ADAPTER, build_flower_strategy, parse_strategy_args
from .flower_checks import (
    check_round_sizes,
    check_sent_keys,
    dp_sample_size_mismatch,
    node_level_dp_warning,
    refuse_unhonoured,
    robust_aggregation_shortfall,
    server_side_dp,
)
from .flower_views import RoundNodes, dense_reply, with_users
from .history_recording import refuse_history
from .item_fedavg import ItemEmbeddingFedAvg, RoundFailed

__all__ = [
    "FlowerStrategyAdapter",
    "RoundNodes",
    "build_flower_strategy",
    "check_sent_keys",
    "dense_reply",
    "dp_sample_size_mismatch",
    "node_level_dp_warning",
    "parse_strategy_args",
    "robust_aggregation_shortfall",
    "server_side_dp",
]

log = logging.getLogger(__name__)


class FlowerStrategyAdapter(ItemEmbeddingFedAvg):
    """Runs a Flower strategy (``wrapped``) on our row-sparse federation; see the module docstring.

    Args:
        layout: the model's keys.
        wrapped: the Flower strategy (built with :func:`build_flower_strategy`, or by hand with ``fraction_train = 1``,
            ``min_*_nodes = 1`` and the record keys ``"arrays"`` / ``"config"``).
        client_config_keys: the message-config keys the client honours beyond ours (its ``strategy_config_keys``).
        arguments: the wrapped strategy's constructor arguments, for the record.
        **options: :class:`~fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg`'s (seed, fraction-train, ...).
    """

    def __init__(
        self,
        layout: ModelLayout,
        *,
        wrapped: Strategy,
        client_config_keys: Iterable[str] = (),
        arguments: Mapping[str, Any] | None = None,
        **options,
    ) -> None:
        super().__init__(layout, **options)
        if isinstance(wrapped, ItemEmbeddingFedAvg) or not isinstance(wrapped, Strategy):
            raise TypeError(f"wrapped must be a flwr.serverapp.strategy.Strategy of Flower's kind, got {wrapped!r}")
        self.wrapped = wrapped
        self.client_config_keys = frozenset(client_config_keys)
        self.arguments = dict(arguments or {})
        self.wrapped_metrics: MetricRecord | None = None
        """The metrics the wrapped strategy's ``aggregate_train`` returned last round."""
        self._replies: dict[int, Message] = {}
        self._round = 0
        if type(wrapped).start is not Strategy.start:
            log.warning(
                "%s overrides start(); the adapter runs Flower's Strategy.start loop with its hooks instead",
                type(wrapped).__name__,
            )

    @property
    def name(self) -> str:
        return f"{type(self.wrapped).__module__}:{type(self.wrapped).__name__}"

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        """Build the configured Flower strategy once, so a bad ``strategy-args`` fails before any node is asked, and
        let it configure a dry round (:func:`check_sent_keys`: a key the client ignores fails here, not in round 1);
        ``item-aggregation`` must stay ``"auto"`` and ``unlearning-history`` ``"off"`` (the wrapped strategy
        aggregates the dense replies itself)."""
        if getattr(config, "adversary", "none") != "none" and getattr(config, "adversary_training", "") == "server":
            raise ConfigError(
                f"adversary-training = 'server' needs an item-fedavg-derived strategy (its replies carry "
                f"the adversary's gradients); {config.strategy} would average them as parameters"
            )
        refuse_history(config, "aggregates the replies by its own rule")
        if config.item_aggregation != "auto":
            raise ConfigError(
                f"run-config key 'item-aggregation' = {config.item_aggregation!r} does not apply to "
                f"{config.strategy}: it aggregates dense replies itself (see strategies/flower_adapter.py)"
            )
        wrapped, _ = build_flower_strategy(
            resolve("strategy", config.strategy), parse_strategy_args(config.strategy_args)
        )
        client = resolve("client", config.client)
        sent = check_sent_keys(wrapped, getattr(client, "strategy_config_keys", ()))
        if hasattr(client, "check_strategy_config"):  # the values of the keys it honours (e.g. proximal-mu >= 0)
            for values in sent:
                client.check_strategy_config(values, strategy=config.strategy)

    @classmethod
    def from_run_config(cls, config: RunConfig, layout: ModelLayout, topology: Topology | None = None):
        """As :meth:`ItemEmbeddingFedAvg.from_run_config`; with the topology known (the preflight with the data, the
        ServerApp after its identify query), a round too small for a Byzantine-robust strategy is refused here,
        before round 1 (:meth:`check_round_sizes`)."""
        strategy = super().from_run_config(config, layout, topology)
        if topology is not None:
            strategy.check_round_sizes(config.users_per_node)
        return strategy

    def check_round_sizes(self, users_per_node: int) -> None:
        """Refuse a run in which some round's train replies would be too few for the wrapped strategy, or would not
        number a server-side DP wrapper's ``num_sampled_clients`` (:func:`.flower_checks.check_round_sizes`).

        Raises:
            ConfigError: naming the condition, the first such round and its numbers of users and nodes.
        """
        check_round_sizes(self, users_per_node)

    @classmethod
    def options_from_config(cls, config: RunConfig) -> dict:
        """Our options, plus the Flower strategy ``config.strategy`` built with ``config.strategy_args``
        (:func:`build_flower_strategy`) and the client's ``strategy_config_keys``."""
        options = super().options_from_config(config)
        wrapped, arguments = build_flower_strategy(
            resolve("strategy", config.strategy), parse_strategy_args(config.strategy_args)
        )
        client_keys = getattr(resolve("client", config.client), "strategy_config_keys", ())
        if config.resume_from:
            log.warning(
                "resuming with %s: its own state (e.g. optimizer moments) is not in checkpoints and restarts",
                config.strategy,
            )
        warning = node_level_dp_warning(wrapped, config.users_per_node)
        if warning:
            log.warning("%s", warning)
        return {**options, "wrapped": wrapped, "arguments": arguments, "client_config_keys": client_keys}

    def run_info(self) -> dict[str, Any]:
        """What ``config.json`` records: the wrapped class, its constructor arguments and the item-table semantics."""
        return {
            "wrapped": self.name,
            "arguments": self.arguments,
            "set-by-adapter": {k: v for k, v in SET_BY_ADAPTER.items() if k in self.arguments},
            "item-rows": "dense reply = mean over the node's users of their full tables (untouched rows = the "
            "round's global value); weight = num-examples",
        }

    # ------------------------------------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's train messages for the nodes of this round's users, each naming its users."""
        super().configure_train(server_round, arrays, config, grid)  # samples users, sets _sampled_nodes, _current
        self._round = server_round
        groups = dict(self._sampled_nodes)
        view = RoundNodes(grid, groups, self.name)
        messages = self.wrapped.configure_train(server_round, arrays, ConfigRecord(dict(config)), view)
        out = self._address(server_round, messages, groups, config)
        self._sampled_nodes = {int(m.metadata.dst_node_id): groups[int(m.metadata.dst_node_id)] for m in out}
        return out

    def validate_reply(self, content: RecordDict) -> RecordDict:
        """Our checks (key scheme, privacy, shapes, NaN, weight, ``max-update-norm``), plus: the reply names its
        users (``num-users`` >= every row count) and carries updated parameters, not gradients."""
        content = super().validate_reply(content)
        metrics = content[METRICS]
        users = metrics.get("num-users", 0)
        if not isinstance(users, (int, float)) or not users >= 1:
            raise ReplyError(f"'num-users' must be >= 1, got {users!r}")
        if metrics.get(GRADIENT_USERS, 0):
            raise ReplyError(f"{metrics[GRADIENT_USERS]} users sent gradients; a Flower strategy averages parameters")
        for key in self.layout.item_keys:
            counts = content[ARRAYS][key + COUNT].numpy()
            if counts.size and counts.max() > users:
                raise ReplyError(f"'{key}{COUNT}' counts {counts.max():g} users but the reply has num-users {users}")
        return content

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Our validation and failure accounting (:meth:`ItemEmbeddingFedAvg.aggregate_train`), with the accepted
        replies aggregated by the wrapped strategy (:meth:`aggregate_arrays`)."""
        replies = list(replies)
        self._replies = {id(m.content): m for m in replies if not m.has_error()}
        try:
            return super().aggregate_train(server_round, replies)
        finally:
            self._replies = {}

    def aggregate_arrays(self, accepted: list[RecordDict]) -> ArrayRecord:
        """The wrapped strategy's ``aggregate_train`` over the accepted replies made dense (:func:`dense_reply`);
        its arrays cast to the model's dtypes, or the current arrays when it returns none."""
        assert self._current is not None, "configure_train must run before aggregate_train"
        dense = []
        for content in accepted:
            reply = self._replies[id(content)]  # the reply's own metadata (its node) stays with it
            dense.append(Message(content=dense_reply(content, self.layout, self._current), metadata=reply.metadata))
        problem = robust_aggregation_shortfall(self.wrapped, len(dense))
        if problem:  # the start-up check counted the sampled nodes; failed or rejected replies make fewer
            raise RoundFailed(
                f"round {self._round}: {self.name}: {problem}, but this round has {len(dense)} "
                f"accepted replies of the {len(self._sampled_nodes)} sampled nodes"
            )
        new, self.wrapped_metrics = self.wrapped.aggregate_train(self._round, dense)
        if new is None:
            log.warning("round %d: %s returned no arrays; the model stays as it was", self._round, self.name)
            return self._current
        expected = {k: tuple(s) for k, s in self.layout.shared_shapes.items()}
        found = {k: tuple(v.shape) for k, v in new.items()}
        if found != expected:
            raise RoundFailed(f"round {self._round}: {self.name} returned arrays {found}, expected {expected}")
        out = {}
        for key, value in new.items():
            array = value.numpy().astype(self._current[key].numpy().dtype)
            if not np.isfinite(array).all():
                raise RoundFailed(f"round {self._round}: {self.name} returned NaN or Inf in '{key}'")
            out[key] = Array(array)
        return ArrayRecord(out)

    # ------------------------------------------------------------------------------------------------ evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """On evaluation rounds, the wrapped strategy's evaluate messages for the nodes of the evaluated users."""
        ours = super().configure_evaluate(server_round, arrays, config, grid)
        if not ours:
            return []
        groups = {int(m.metadata.dst_node_id): list(m.content[CONFIG]["users"]) for m in ours}
        config = ConfigRecord(dict(config))
        config.setdefault("split", self.evaluate_split)
        messages = self.wrapped.configure_evaluate(server_round, arrays, config, RoundNodes(grid, groups, self.name))
        out = self._address(server_round, messages, groups, config)
        # the nodes whose replies aggregate_evaluate expects: those the wrapped strategy addressed
        self._evaluated_nodes = {int(m.metadata.dst_node_id): groups[int(m.metadata.dst_node_id)] for m in out}
        return out

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The wrapped strategy's evaluation metrics; :attr:`last_evaluate` is ours (mean over evaluated users)."""
        replies = list(replies)
        ours = super().aggregate_evaluate(server_round, replies)
        theirs = self.wrapped.aggregate_evaluate(server_round, [with_users(m) for m in replies])
        return theirs if theirs is not None else ours

    # ------------------------------------------------------------------------------------------------ helpers
    def _address(
        self, server_round: int, messages: Iterable[Message], groups: Mapping[int, list[int]], config: ConfigRecord
    ) -> list[Message]:
        """Each of the wrapped strategy's messages, with its own content record and the users of its node added.

        Raises:
            ConfigError: a message goes to a node outside the round's, or the strategy added a config key the
                client does not honour with a value that is not zero / empty.
        """
        out = []
        for message in messages:
            node = int(message.metadata.dst_node_id)
            if node not in groups:
                raise ConfigError(
                    f"{self.name} addressed node {node}, which serves none of round {server_round}'s users"
                )
            content = RecordDict(dict(message.content.items()))
            theirs = dict(content[CONFIG]) if CONFIG in content else {}
            refuse_unhonoured(self.name, {k: v for k, v in theirs.items() if k not in config}, self.client_config_keys)
            content[CONFIG] = ConfigRecord(
                {**self.message_config, **theirs, "server-round": server_round, "users": list(groups[node])}
            )
            out.append(Message(content=content, message_type=message.metadata.message_type, dst_node_id=node))
        return out

    def summary(self) -> None:
        log.info(
            "%s running %s %s: fraction-train %.3f, fraction-evaluate %.3f, min-train-fraction %.2f, eval-every "
            "%d, %d item tables (dense replies, untouched rows = the round's value)",
            type(self).__name__,
            self.name,
            self.arguments,
            self.fraction_train,
            self.fraction_evaluate,
            self.min_train_fraction,
            self.eval_every,
            len(self.layout.item_keys),
        )
        self.wrapped.summary()
