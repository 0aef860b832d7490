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

import ast
import inspect
import logging
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedrec_flwr.app.message_window import GridProxy
from fedrec_flwr.app.preflight import quiet
from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.registry import resolve
from fedrec_flwr.state.client_state import DURABLE_ROUND_KEY, RUN_KEY
from fedrec_flwr.wire import (
    ARRAYS,
    CONFIG,
    COUNT,
    GRADIENT_USERS,
    METRICS,
    NUM_EXAMPLES,
    ROWS,
    SUM,
    ModelLayout,
    ReplyError,
    Topology,
)

from .item_fedavg import ItemEmbeddingFedAvg, RoundFailed

__all__ = [
    "FlowerStrategyAdapter",
    "RoundNodes",
    "build_flower_strategy",
    "check_sent_keys",
    "dense_reply",
    "dp_sample_size_mismatch",
    "parse_strategy_args",
    "robust_aggregation_shortfall",
    "server_side_dp",
]

log = logging.getLogger(__name__)

SET_BY_ADAPTER: dict[str, Any] = {
    "fraction_train": 1.0,
    "fraction_evaluate": 1.0,
    "min_train_nodes": 1,
    "min_evaluate_nodes": 1,
    "min_available_nodes": 1,
    "arrayrecord_key": ARRAYS,
    "configrecord_key": CONFIG,
}
"""Constructor arguments the adapter sets (when the constructor has them): the strategy addresses every node of the
round's users (who trains is decided by ``fraction-train`` and the seed), and uses our record keys. Setting one of
them in ``strategy-args`` is an error."""

DEFAULTS: dict[str, Any] = {"weighted_by_key": NUM_EXAMPLES, "train_loss_key": "train-loss"}
"""Constructor arguments the adapter defaults to our metric names (``strategy-args`` may override them)."""

OUR_CONFIG_KEYS = frozenset({"server-round", "users", "split", RUN_KEY, DURABLE_ROUND_KEY})
"""Message-config keys our clients read (any other key a strategy adds must be honoured by the client)."""

REPLY_WEIGHT_KEYS = (NUM_EXAMPLES, "num-users")
"""The counts every train and evaluate reply carries in its metrics (an evaluate reply gets ``num-users`` from
:func:`_with_users`): what a Flower strategy's ``weighted_by_key`` may name."""

ARGUMENT_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "weighted_by_key": (
        lambda v: v in REPLY_WEIGHT_KEYS,
        f"must name a count every reply carries, {' or '.join(map(repr, REPLY_WEIGHT_KEYS))}",
    ),
    "train_loss_key": (lambda v: v == "train-loss", "must be 'train-loss', the train replies' loss metric"),
    "eta": (lambda v: v > 0, "must be > 0 (the server learning rate)"),
    "tau": (lambda v: v > 0, "must be > 0 (it keeps the step's denominator sqrt(v) + tau away from 0)"),
    "beta_1": (lambda v: 0 <= v < 1, "must be in [0, 1) (the first moment's decay)"),
    "beta_2": (lambda v: 0 <= v < 1, "must be in [0, 1) (the second moment's decay)"),
    "server_learning_rate": (lambda v: v > 0, "must be > 0"),
    "server_momentum": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "client_learning_rate": (lambda v: v > 0, "must be > 0 (QFedAvg's Lipschitz constant is 1 / client_learning_rate)"),
    "q": (lambda v: v >= 0, "must be >= 0 (q = 0 is FedAvg)"),
    "num_malicious_nodes": (lambda v: v >= 0, "must be >= 0"),
    "num_nodes_to_select": (lambda v: v >= 1, "must be >= 1 (MultiKrum averages that many replies)"),
}
"""Values a constructor argument of Flower's own strategies must have here, by the argument's name (checked only for
arguments a ``flwr`` class declares): each passes the signature's type, but would fail once replies arrive (a metric
our replies do not carry, a division by zero) or quietly do something else (a negative learning rate)."""

REFUSED = {
    "FedXgbBagging": "FedXgbBagging aggregates XGBoost boosters serialized in one byte array (it refuses any "
    "ArrayRecord with more than one array); it cannot aggregate a recommender's parameters",
}
"""Flower strategies (by class name, subclasses included) that cannot serve any model of this package, and why."""


# ---------------------------------------------------------------------------------------------- constructor arguments
def parse_strategy_args(text: str) -> dict[str, Any]:
    """``"proximal_mu=0.1,eta=1e-2,strategy=flwr.serverapp.strategy:FedAvg"`` -> ``{name: value}``.

    Values are Python literals read with :func:`ast.literal_eval` (numbers, quoted strings, ``True``/``False``,
    ``None``; ``true``/``false`` also work), or else kept as plain strings (e.g. a ``module:Class``). Commas inside
    brackets or quotes do not split.

    Raises:
        ConfigError: an entry is not ``name=value``, is empty (``"a=1,,b=2"``, a trailing comma), a name repeats,
            or a quote or bracket is left open (names the entry).
    """
    entries, depth, quote, current = [], 0, "", ""
    for char in str(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            entries.append(current)
            current = ""
            continue
        current += char
    entries.append(current)
    if quote or depth:
        raise ConfigError(
            f"run-config key 'strategy-args' = {text!r}: "
            + (f"the quote {quote} is never closed" if quote else "its brackets do not balance")
        )
    if not str(text).strip():
        return {}
    out: dict[str, Any] = {}
    for number, entry in enumerate((e.strip() for e in entries), start=1):
        if not entry:
            raise ConfigError(
                f"run-config key 'strategy-args' = {text!r}: entry {number} of {len(entries)} is "
                "empty (two commas in a row, or a comma at an end); give name=value entries "
                "separated by single commas"
            )
        name, sep, raw = entry.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or not name.isidentifier():
            raise ConfigError(
                f"run-config key 'strategy-args': {entry!r} is not name=value (e.g. \"proximal_mu=0.1,eta=0.01\")"
            )
        if name in out:
            raise ConfigError(f"run-config key 'strategy-args': {name!r} is given twice")
        lowered = raw.lower()
        if lowered in ("true", "false"):
            out[name] = lowered == "true"
            continue
        try:
            out[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[name] = raw
    return out


def _coerce(cls: type, name: str, value: Any, annotation: Any) -> Any:
    """``value`` checked against the parameter's annotation (float, int, str, bool, a Strategy, or ``X | None``)."""
    where = f"run-config key 'strategy-args': {cls.__name__}({name}=...)"
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, _UNION) else (annotation,)
    if value is None and type(None) in options:
        return None
    kinds = [o for o in options if o is not type(None)]
    text = " | ".join(getattr(k, "__name__", str(k)) for k in kinds)
    if any("Callable" in str(k) or typing.get_origin(k) is _CALLABLE for k in kinds):
        raise ConfigError(
            f"{where}: takes a callable, which strategy-args cannot give; subclass the strategy and set "
            "it in the subclass's __init__"
        )
    for kind in kinds:
        if kind is inspect.Parameter.empty or kind is Any:
            return value
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(f"{where}: {value!r} is not finite")
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if isinstance(kind, type) and issubclass(kind, Strategy) and isinstance(value, str):
            try:
                inner = resolve("strategy", value)
            except ConfigError as err:  # resolve names the outer key 'strategy'; the bad value is in strategy-args
                raise ConfigError(f"{where}: {value!r}: {str(err).split(': ', 1)[-1]}") from None
            if not issubclass(inner, Strategy):
                raise ConfigError(f"{where}: {value!r} is not a flwr.serverapp.strategy.Strategy")
            return build_flower_strategy(inner, {})[0]
    raise ConfigError(f"{where}: {value!r} ({type(value).__name__}) does not fit the parameter's type {text}")


_UNION = type(int | None)
_CALLABLE = typing.get_origin(typing.Callable)


def build_flower_strategy(cls: type, args: Mapping[str, Any]) -> tuple[Strategy, dict[str, Any]]:
    """Construct the Flower strategy ``cls`` with ``args`` (from ``strategy-args``), the adapter's sampling and
    record-key arguments (:data:`SET_BY_ADAPTER`) and our metric names (:data:`DEFAULTS`).

    A parameter annotated with a ``Strategy`` (the DP wrappers' ``strategy``) takes a ``"module:Class"``, built the
    same way with default arguments.

    Returns:
        ``(strategy, arguments)``: the instance and every constructor argument it got (defaults included), JSON-able.

    Raises:
        ConfigError: ``cls`` cannot serve our models (:data:`REFUSED`); an argument is unknown, set by the adapter,
            of the wrong type, a callable or a value :data:`ARGUMENT_RULES` rules out; a required argument is
            missing; or the constructor rejects a value (its message is passed on).
    """
    for base in cls.__mro__:
        if base.__name__ in REFUSED:
            raise ConfigError(f"strategy {cls.__module__}:{cls.__name__}: {REFUSED[base.__name__]}")
    signature = inspect.signature(cls.__init__)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: fall back to the raw ones
        hints = {}
    params = {
        n: p for n, p in list(signature.parameters.items())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    kwargs: dict[str, Any] = {}
    for name, value in args.items():
        if name in SET_BY_ADAPTER and name in params:
            raise ConfigError(
                f"run-config key 'strategy-args': {name!r} is set by the adapter ({name} = "
                f"{SET_BY_ADAPTER[name]!r}); choose users with 'fraction-train' / 'fraction-evaluate'"
            )
        if name not in params and not takes_any:
            raise ConfigError(
                f"run-config key 'strategy-args': {cls.__name__} has no argument {name!r}; it takes "
                f"{sorted(n for n in params if n not in SET_BY_ADAPTER)}"
            )
        kwargs[name] = _coerce(cls, name, value, hints.get(name, params[name].annotation if name in params else Any))
        _check_value(cls, name, kwargs[name])
    for name, value in {**DEFAULTS, **SET_BY_ADAPTER}.items():
        if name in params and name not in kwargs:
            kwargs[name] = value
    missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs]
    if missing:
        raise ConfigError(
            f"strategy {cls.__name__} needs {missing}: give them in run-config key 'strategy-args', "
            f'e.g. strategy-args = "{missing[0]}=..."'
        )
    try:
        strategy = cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"run-config key 'strategy-args': strategy {cls.__name__}({kwargs}) refused its arguments: {err}"
        ) from None
    for name in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"):
        if getattr(strategy, name, 1) > 1:  # a constructor that fixes it (FedXgbCyclic: 2) would wait for nodes
            setattr(strategy, name, 1)
    bound = signature.bind_partial(None, **kwargs)
    bound.apply_defaults()
    record: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:  # **kwargs: the arguments it took, by their own names
            record.update({n: _jsonable(v) for n, v in value.items()})
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            record[name] = _jsonable(value)
    return strategy, record


def _check_value(cls: type, name: str, value: Any) -> None:
    """Refuse a value :data:`ARGUMENT_RULES` rules out, for an argument that a Flower class in ``cls``'s MRO declares.

    Raises:
        ConfigError: naming the strategy, the argument, the value and the rule.
    """
    rule = ARGUMENT_RULES.get(name)
    if (
        rule is None
        or value is None
        or not any(
            base.__module__.startswith("flwr.") and name in inspect.signature(base.__init__).parameters
            for base in cls.__mro__
            if base is not object
        )
    ):
        return
    check, text = rule
    try:
        ok = bool(check(value))
    except TypeError:  # e.g. a str where a number is compared (an argument without a usable annotation)
        ok = False
    if not ok:
        raise ConfigError(f"run-config key 'strategy-args': {cls.__name__}({name}={value!r}) {text}")


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Strategy):
        return f"{type(value).__module__}:{type(value).__name__}"
    return repr(value)


# ---------------------------------------------------------------------------------------------- the round's nodes
class RoundNodes(GridProxy):
    """The grid a wrapped strategy sees while it configures a round: :meth:`get_node_ids` returns the nodes that serve
    the round's sampled users; everything else is the real grid's.

    A strategy that waits for more nodes than that (``min_available_nodes`` above them) would wait for ever in
    Flower's ``sample_nodes``; after ``patience`` calls this raises :class:`~fedrec_flwr.errors.ConfigError` instead.
    """

    def __init__(self, grid: Grid | None, nodes: Iterable[int], strategy_name: str, patience: int = 5) -> None:
        self.grid = grid
        self.nodes = [int(n) for n in nodes]
        self.strategy_name = strategy_name
        self.patience = patience
        self.calls = 0

    def get_node_ids(self) -> list[int]:
        self.calls += 1
        if self.calls > self.patience:
            raise ConfigError(
                f"strategy {self.strategy_name} keeps waiting for more nodes than the {len(self.nodes)} "
                "serving this round's users (does it fix min_available_nodes above that?)"
            )
        return list(self.nodes)


# ---------------------------------------------------------------------------------------------- sparse -> dense
def dense_reply(content: RecordDict, layout: ModelLayout, current: ArrayRecord) -> RecordDict:
    """A validated row-sparse train reply as the dense reply a Flower strategy expects (module docstring).

    Args:
        content: the reply's records (``"arrays"`` in the :mod:`fedrec_flwr.wire` scheme, ``"metrics"`` with
            ``num-examples`` and ``num-users``).
        layout: the model's keys.
        current: the arrays sent this round (``(num_items, d)`` per item table).

    Returns:
        ``RecordDict`` with ``"arrays"`` (every shared key in the model's order, float32 like the model) and the
        reply's ``"metrics"``: item table ``k`` is ``current[k] + (sum - count * current[k]) / num_users`` on the
        returned rows and ``current[k]`` elsewhere.
    """
    arrays, users = content[ARRAYS], float(content[METRICS]["num-users"])
    out: dict[str, Array] = {}
    for key in layout.shared_shapes:
        if key in layout.item_keys:
            base = current[key].numpy()
            rows = arrays[key + ROWS].numpy().astype(np.int64)
            sums = arrays[key + SUM].numpy().astype(np.float64)
            counts = arrays[key + COUNT].numpy().astype(np.float64).reshape(-1, *[1] * (sums.ndim - 1))
            table = base.copy()
            old = base[rows].astype(np.float64)
            table[rows] = (old + (sums - counts * old) / users).astype(base.dtype)
            out[key] = Array(table)
        else:
            out[key] = arrays[key]
    return RecordDict({ARRAYS: ArrayRecord(out), METRICS: content[METRICS]})


def _with_users(reply: Message) -> Message:
    """An evaluation reply with ``num-users`` in its metrics (= its ``num-examples``, the users it evaluated), so a
    strategy weighting by ``num-users`` (``strategy-args = "weighted_by_key=num-users"``) finds its key."""
    if reply.has_error() or METRICS not in reply.content or "num-users" in reply.content[METRICS]:
        return reply
    metrics = MetricRecord({**dict(reply.content[METRICS]), "num-users": reply.content[METRICS][NUM_EXAMPLES]})
    return Message(content=RecordDict({**dict(reply.content.items()), METRICS: metrics}), metadata=reply.metadata)


# ---------------------------------------------------------------------------------------------- the adapter
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
        ``item-aggregation`` must stay ``"auto"`` (the wrapped strategy aggregates the dense replies itself)."""
        if getattr(config, "adversary", "none") != "none" and getattr(config, "adversary_training", "") == "server":
            raise ConfigError(
                f"adversary-training = 'server' needs an item-fedavg-derived strategy (its replies carry "
                f"the adversary's gradients); {config.strategy} would average them as parameters"
            )
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
        """Refuse a run in which some round's train replies (one per node serving a sampled user: the sampling is
        fixed by ``(seed, round)``) would be too few for the wrapped strategy (:func:`robust_aggregation_shortfall`),
        or would not number a server-side DP wrapper's ``num_sampled_clients`` (:func:`dp_sample_size_mismatch`).

        Raises:
            ConfigError: naming the condition, the first such round and its numbers of users and nodes.
        """
        robust = robust_aggregation_shortfall(self.wrapped, 0) is not None
        dp = server_side_dp(self.wrapped)
        if not robust and dp is None:  # nothing that counts the replies
            return
        num_users = self._topology().num_users
        all_nodes = len(set(self._topology().user_to_node.tolist()))
        if robust and robust_aggregation_shortfall(self.wrapped, all_nodes):  # no fraction-train can help
            raise ConfigError(
                f"strategy {self.name}: {robust_aggregation_shortfall(self.wrapped, all_nodes)}, but the federation "
                f"has only {all_nodes} nodes ({num_users} users, users-per-node {users_per_node}); lower "
                "'users-per-node' (more nodes), or change the strategy's arguments in 'strategy-args'"
            )
        rounds: dict[int, tuple[int, int]] = {}  # nodes -> (the first round with that many, its users)
        for server_round in self.planned_train_rounds():  # after unlearn-round: without the forgotten users
            users = self.planned_train_users(server_round)
            nodes = len(self._topology().group(users))
            rounds.setdefault(nodes, (server_round, len(users)))
            problem = robust_aggregation_shortfall(self.wrapped, nodes) if robust else None
            if problem:
                raise ConfigError(
                    f"strategy {self.name}: {problem}, but round {server_round} trains {len(users)} users on {nodes} "
                    f"nodes (fraction-train {self.fraction_train:g} of {num_users} users, users-per-node "
                    f"{users_per_node}{self._forgotten_note(server_round)}); raise 'fraction-train' (or lower "
                    "'users-per-node'), or change the strategy's arguments in 'strategy-args'"
                )
        problem = (
            dp_sample_size_mismatch(
                dp,
                rounds,
                num_users=num_users,
                fraction_train=self.fraction_train,
                users_per_node=users_per_node,
                remedy=self._forgetting_remedy(rounds),
            )
            if dp is not None
            else None
        )
        if problem:
            raise ConfigError(problem)

    def _forgetting_remedy(self, rounds: Mapping[int, tuple[int, int]]) -> str | None:
        """What to change when only the rounds after the unlearning phase (trained without the forgotten users) have
        another number of train nodes than the rounds before it, which all have one; ``None`` otherwise."""
        u = self.unlearning
        late = sorted((first, nodes) for nodes, (first, _) in rounds.items() if self._forgotten_note(first))
        early = {nodes for nodes, (first, _) in rounds.items() if not self._forgotten_note(first)}
        if not late or len(early) != 1:
            return None
        first, nodes = late[0]
        which = f"round {first}" if first <= self.num_rounds else f"its continue round {first - self.num_rounds}"
        why = (
            f"the rounds after the unlearning phase of round {u.round} train without its {len(u.forget)} forgotten "
            f"users ({which}: {nodes} nodes)"
        )
        if u.method == "continue":
            return (
                f"{why}; unlearning = 'continue' always trains rounds without them (its own, after the last), so "
                "with a server-side DP wrapper use another unlearning method and unlearn-round = 0"
            )
        return f"{why}: set unlearn-round = 0 (the phase after the last round, so every round trains the same users)"

    def _forgotten_note(self, server_round: int) -> str:
        """``", without the N forgotten users after the unlearning phase of round U"`` for a round that
        :meth:`planned_train_users` trains without the forget set, else ``""`` (for the messages above)."""
        from fedrec_flwr.strategies.unlearning import PHASE_METHODS

        u = self.unlearning
        if u is None or u.method not in PHASE_METHODS or not u.forget or server_round <= u.round:
            return ""
        if server_round > self.num_rounds:  # one of unlearning = "continue"'s own rounds
            return (
                f", round {server_round - self.num_rounds} of the {u.continue_rounds} continue-rounds of the "
                f"unlearning phase after round {u.round}, without its {len(u.forget)} forgotten users"
            )
        return f", without the {len(u.forget)} forgotten users after the unlearning phase of round {u.round}"

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
        theirs = self.wrapped.aggregate_evaluate(server_round, [_with_users(m) for m in replies])
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
            _refuse_unhonoured(self.name, {k: v for k, v in theirs.items() if k not in config}, self.client_config_keys)
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


def _chain(wrapped: Strategy) -> Iterable[Strategy]:
    """``wrapped`` and the strategies it wraps (a DP wrapper's ``strategy``, and so on)."""
    seen, strategy = set(), wrapped
    while strategy is not None and id(strategy) not in seen:
        seen.add(id(strategy))
        yield strategy
        strategy = getattr(strategy, "strategy", None)


def robust_aggregation_shortfall(wrapped: Strategy, replies: int) -> str | None:
    """What a Byzantine-robust Flower strategy in ``wrapped``'s chain needs that ``replies`` train replies (``n``)
    miss, as a phrase naming the condition and its numbers, or ``None`` when nothing is missing.

    * Krum and MultiKrum (Blanchard et al. 2017, Prop. 1): ``n > 2f + 2`` for ``f = num_malicious_nodes``. Flower
      1.42 does not check it: ``select_multikrum`` scores each reply by its ``max(1, n - f - 2)`` nearest neighbours,
      so a smaller round silently scores against fewer neighbours than the rule's guarantee assumes. MultiKrum also
      needs ``num_nodes_to_select <= n`` (it takes the ``num_nodes_to_select`` best; with more it averages every
      reply, plain FedAvg).
    * Bulyan (El Mhamdi et al. 2018): ``n >= 4f + 3``; below it Flower's ``Bulyan.aggregate_train`` skips the
      aggregation (logs a warning, returns no arrays: the round leaves the model as it was).
    """
    from flwr.serverapp.strategy import Bulyan, Krum, MultiKrum

    for strategy in _chain(wrapped):
        name, f = type(strategy).__name__, getattr(strategy, "num_malicious_nodes", 0)
        if isinstance(strategy, Bulyan) and replies < 4 * f + 3:
            return (
                f"{name} needs at least 4 * num_malicious_nodes + 3 = {4 * f + 3} train replies per round "
                f"(num_malicious_nodes = {f}; El Mhamdi et al. 2018; with fewer Flower skips the aggregation)"
            )
        if isinstance(strategy, MultiKrum):
            if replies <= 2 * f + 2:
                return (
                    f"{name} needs more than 2 * num_malicious_nodes + 2 = {2 * f + 2} train replies per round "
                    f"(num_malicious_nodes = {f}; Blanchard et al. 2017)"
                )
            if not isinstance(strategy, Krum) and strategy.num_nodes_to_select > replies:
                return (
                    f"{name} with num_nodes_to_select = {strategy.num_nodes_to_select} needs at least that many "
                    "train replies per round (with fewer it averages all of them, plain FedAvg)"
                )
    return None


def server_side_dp(wrapped: Strategy) -> Strategy | None:
    """The first of Flower's server-side DP wrappers (``DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping``) in
    ``wrapped``'s chain of wrapped strategies, or ``None``."""
    from flwr.serverapp.strategy import (
        DifferentialPrivacyServerSideAdaptiveClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )

    for strategy in _chain(wrapped):
        if isinstance(
            strategy, (DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyServerSideAdaptiveClipping)
        ):
            return strategy
    return None


def dp_sample_size_mismatch(
    dp: Strategy,
    rounds: Mapping[int, tuple[int, int]],
    *,
    num_users: int,
    fraction_train: float,
    users_per_node: int,
    remedy: str | None = None,
) -> str | None:
    """Why the server-side DP wrapper ``dp`` would not get ``num_sampled_clients`` train replies in every round, as
    one message naming the keys, the values and what to change, or ``None`` when every round gets exactly that many.

    The wrapper calibrates its Gaussian noise to ``num_sampled_clients`` replies (``stdv = noise_multiplier *
    clipping_norm / num_sampled_clients``; McMahan et al. 2018, DP-FedAvg), and Flower 1.42 only logs a warning in
    each round where the number of replies differs, so a wrong value silently releases an aggregate whose noise does
    not match the claimed guarantee. A round's replies are the nodes serving its sampled users (one per node).

    Args:
        dp: a server-side DP wrapper (:func:`server_side_dp`).
        rounds: the run's numbers of train nodes per round: ``{nodes: (first round with that many, its users)}``.
        num_users, fraction_train, users_per_node: the run's, for the message.
        remedy: what to change when the rounds differ, in place of "make every round reach the same number of nodes"
            (the caller's, e.g. when the rounds after an unlearning phase train without the forgotten users).
    """
    expected = int(dp.num_sampled_clients)
    if set(rounds) <= {expected}:
        return None
    name = type(dp).__name__
    where = (
        f"run-config key 'strategy-args': {name}(num_sampled_clients={expected}) must be the number of train "
        f"replies per round (one per node serving a sampled user: fraction-train {fraction_train:g} of "
        f"{num_users} users, users-per-node {users_per_node})"
    )
    if len(rounds) == 1:
        nodes, (server_round, users) = next(iter(rounds.items()))
        return (
            f"{where}, but every round has {nodes} (round {server_round}: {users} users on {nodes} nodes); with "
            f"{expected} its noise "
            f"would be calibrated to the wrong number of replies (Flower only warns, each round): set "
            f"num_sampled_clients={nodes} in 'strategy-args'"
        )
    low, high = min(rounds), max(rounds)
    return (
        f"{where}, but the rounds have from {low} (round {rounds[low][0]}) to {high} (round {rounds[high][0]}) "
        "nodes, so no num_sampled_clients fits every round; "
        + (
            remedy
            or (
                "make every round reach the same number of nodes: users-per-node = 1 (one reply per sampled user) or "
                "fraction-train = 1 (every node every round)"
            )
        )
    )


def node_level_dp_warning(wrapped: Strategy, users_per_node: int) -> str | None:
    """The warning for a server-side DP wrapper (Flower's ``DifferentialPrivacyServerSide*Clipping``, found anywhere in
    the chain of wrapped strategies, :func:`server_side_dp`) when a node serves several users, else ``None``.

    Such a wrapper clips each *reply* and calibrates its noise to one reply's bounded contribution (McMahan et al.
    2018, DP-FedAvg). A reply here is a node's mean over its trained users, so with ``users-per-node`` > 1 the
    protected unit is a node's group of users, not one user: user-level DP needs ``users-per-node = 1``."""
    strategy = server_side_dp(wrapped)
    if strategy is not None and users_per_node > 1:
        return (
            f"{type(strategy).__name__} clips and noises each reply, and with users-per-node = {users_per_node} "
            f"a reply is the mean of up to {users_per_node} users' updates: its guarantee is per node (a group "
            "of users), not per user; use users-per-node = 1 for user-level differential privacy"
        )
    return None


def _refuse_unhonoured(name: str, sent: Mapping[str, Any], honoured: Iterable[str]) -> None:
    """Refuse a message-config key the strategy ``name`` sends (``sent``) that neither our clients read
    (:data:`OUR_CONFIG_KEYS`) nor the client honours (``honoured``: its ``strategy_config_keys``), unless its value is
    zero / empty.

    Raises:
        ConfigError: naming the strategy, the key and its value.
    """
    honoured = frozenset(honoured)
    for key, value in sent.items():
        if key in OUR_CONFIG_KEYS or key in honoured or value in (0, 0.0, False, "", None):
            continue
        raise ConfigError(
            f"run-config key 'strategy' = {name!r} sends the config key {key!r} = {value!r}, which the client does "
            f"not honour (its strategy_config_keys: {sorted(honoured)}); without it the strategy is not what it "
            "claims (e.g. FedProx without a proximal term, client-side DP without clipping). Use a client that "
            "honours it, or a value of 0 (run-config key 'strategy-args')"
        )


def check_sent_keys(wrapped: Strategy, honoured: Iterable[str]) -> list[dict[str, Any]]:
    """Let ``wrapped`` configure a round-1 train and evaluate round for one node, without sending anything, and refuse
    a config key it would send that the client does not honour (:func:`_refuse_unhonoured`), so e.g. FedProx with
    ``proximal_mu > 0`` fails before the run starts, not in round 1. ``wrapped`` must be a fresh instance (its state
    may change; :meth:`FlowerStrategyAdapter.check_config` builds one for this). Returns the config of each message
    it would send (for the client's own check of the values, ``check_strategy_config``).

    Raises:
        ConfigError: as :func:`_refuse_unhonoured`.
    """
    from flwr.supercore.task_identity import TaskIdentity

    name = f"{type(wrapped).__module__}:{type(wrapped).__name__}"
    grid = RoundNodes(None, [0], name)
    sent: list[dict[str, Any]] = []
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 0, 0  # Message() needs one, even unsent
    try:
        with quiet():  # Flower's "Sampled 1 nodes" lines: nothing is sampled
            for configure in (wrapped.configure_train, wrapped.configure_evaluate):
                for message in configure(1, ArrayRecord(), ConfigRecord(), grid):
                    sent.append(dict(message.content[CONFIG]) if CONFIG in message.content else {})
                    _refuse_unhonoured(name, sent[-1], honoured)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    return sent
