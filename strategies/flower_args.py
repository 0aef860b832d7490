"""Constructor arguments of a Flower strategy run through :class:`~fedrec_flwr.strategies.flower_adapter.
FlowerStrategyAdapter`: the run-config key ``strategy-args`` parsed (:func:`parse_strategy_args`), checked against the
constructor's signature and our rules, and the strategy built (:func:`build_flower_strategy`)."""

from __future__ import annotations

import ast
import inspect
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.registry import resolve
from fedrec_flwr.wire import ARRAYS, CONFIG, NUM_EXAMPLES

__all__ = ["ARGUMENT_RULES", "DEFAULTS", "REFUSED", "SET_BY_ADAPTER", "build_flower_strategy", "parse_strategy_args"]

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

REPLY_WEIGHT_KEYS = (NUM_EXAMPLES, "num-users")
"""The counts every train and evaluate reply carries in its metrics (an evaluate reply gets ``num-users`` from
:func:`fedrec_flwr.strategies.flower_views.with_users`): what a Flower strategy's ``weighted_by_key`` may name."""

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
