"""Name -> class registries for client algorithms and strategies, plus ``module:Class`` plug-ins.

A run config names its client algorithm (``client``) and server strategy (``strategy``) either by a registered name or
as any importable ``"package.module:ClassName"``, so a new algorithm plugs in without editing this package::

    flwr run . --run-config "strategy='experiments.example_strategy:ServerLrItemFedAvg'"

Registered names map to ``"module:Class"`` strings, imported on first use (so importing the registry stays cheap).
"""

from __future__ import annotations

import importlib
from typing import Any

from fedrec_flwr.errors import ConfigError

LOGGER_ROOTS = ("fedrec_flwr", "experiments", "plugins")
"""The top-level packages whose loggers are ours: this package (its clients and strategies included), the experiments and
the ``plugins/`` folder where third-party clients and strategies live. The ServerApp prints their records as
``LEVEL logger: message`` (INFO and above) and the launcher's default output keeps those lines."""

CLIENTS: dict[str, str] = {
    "fedrec": "fedrec_flwr.clients.fedrec:FedRecClient",
    "fedrecgel": "fedrec_flwr.clients.fedrecgel:FedRecGELClient",
    "pfedrec": "fedrec_flwr.clients.pfedrec:PFedRecClient",
    "fedau2": "fedrec_flwr.clients.fedau2:FedAU2Client",
    "fedau2-gel": "fedrec_flwr.clients.fedau2:FedAU2GELClient",
}
"""Client algorithms (``flwr.client.NumPyClient`` subclasses taking ``(runtime, user, state)``)."""

STRATEGIES: dict[str, str] = {
    "item-fedavg": "fedrec_flwr.strategies.item_fedavg:ItemEmbeddingFedAvg",
    "server-optimizer": "fedrec_flwr.strategies.server_optimizer:ServerOptimizerStrategy",
    "curious-item-fedavg": "fedrec_flwr.strategies.curious:CuriousItemFedAvg",
}
"""Server strategies (``flwr.serverapp.strategy.Strategy`` subclasses with a ``from_run_config`` class method)."""

FLOWER_ADAPTER = "fedrec_flwr.strategies.flower_adapter:FlowerStrategyAdapter"
"""What runs a Flower strategy that has no ``from_run_config`` (any ``flwr.serverapp.strategy`` class, or a user's own
``Strategy``): :class:`fedrec_flwr.strategies.flower_adapter.FlowerStrategyAdapter`."""


def register(kind: str, name: str, target: str) -> None:
    """Register ``target`` (``"module:Class"``) under ``name`` in the ``"client"`` or ``"strategy"`` registry."""
    _table(kind)[name] = target


def resolve(kind: str, spec: str) -> type[Any]:
    """The class a registry name or ``"module:Class"`` spec denotes.

    Args:
        kind: ``"client"`` or ``"strategy"`` (names the run-config key in errors).
        spec: a registered name, or ``"dotted.module:ClassName"``.

    Raises:
        ConfigError: the name is not registered, the module cannot be imported, or it has no such class.
    """
    table = _table(kind)
    target = table.get(spec, spec)
    if ":" not in target:
        guess = did_you_mean(kind, spec)
        raise ConfigError(
            f"run-config key '{kind}' = {spec!r}: not a registered {kind} ({sorted(table)}) nor 'module:Class'"
            + (f"; did you mean {guess!r}?" if guess else "")
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        missing = getattr(err, "name", None)
        if missing and missing != module_name and not module_name.startswith(missing + "."):
            # the module was found, but an import inside it fails: name the line that imports it
            raise ConfigError(
                f"run-config key '{kind}' = {spec!r}: module '{module_name}' fails on import: "
                f"{type(err).__name__}: {err}{_import_site(err)}"
            ) from err
        raise ConfigError(f"run-config key '{kind}' = {spec!r}: cannot import module '{module_name}': {err}") from err
    except Exception as err:  # the module itself fails (NameError, SyntaxError, ...): name its file and line
        raise ConfigError(
            f"run-config key '{kind}' = {spec!r}: module '{module_name}' fails on import: "
            f"{type(err).__name__}: {err}{_import_site(err)}"
        ) from err
    try:
        cls = getattr(module, class_name)
    except AttributeError:
        import difflib

        names = [n for n in dir(module) if isinstance(getattr(module, n, None), type)]
        found = difflib.get_close_matches(class_name, names, n=1, cutoff=0.75)
        raise ConfigError(
            f"run-config key '{kind}' = {spec!r}: module '{module_name}' has no '{class_name}'"
            + (f"; did you mean '{module_name}:{found[0]}'?" if found else "")
        ) from None
    if not isinstance(cls, type):
        raise ConfigError(f"run-config key '{kind}' = {spec!r}: '{target}' is not a class")
    return cls


FLOWER_STRATEGIES = "flwr.serverapp.strategy"
"""The module of Flower's own strategies (``FedAvg``, ``FedAdam``, ``FedProx``, ...), which run through the adapter."""


def did_you_mean(kind: str, spec: str) -> str | None:
    """The closest registered name, or for a strategy also a Flower strategy as ``"flwr.serverapp.strategy:Name"``
    (``"FedAdam"``, ``"fedadam"`` -> ``"flwr.serverapp.strategy:FedAdam"``), to an unknown ``spec``; ``None`` if
    nothing is close (:func:`difflib.get_close_matches`, case-insensitive)."""
    import difflib

    candidates = {name.lower(): name for name in _table(kind)}
    if kind == "strategy":
        try:
            from flwr.serverapp import strategy as flower
            from flwr.serverapp.strategy import Strategy

            for name in getattr(flower, "__all__", dir(flower)):
                value = getattr(flower, name, None)
                if isinstance(value, type) and issubclass(value, Strategy) and value is not Strategy:
                    candidates.setdefault(name.lower(), f"{FLOWER_STRATEGIES}:{name}")
        except ImportError:  # pragma: no cover - Flower is a dependency
            pass
    found = difflib.get_close_matches(str(spec).lower(), list(candidates), n=1, cutoff=0.75)
    return candidates[found[0]] if found else None


def _import_site(err: BaseException) -> str:
    """`` (file, line N)`` of the last frame of ``err``'s traceback outside Python's import machinery (a
    ``SyntaxError``: its own file and line), else ``""``."""
    import traceback

    if isinstance(err, SyntaxError) and err.filename:
        return f" ({err.filename}, line {err.lineno})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen")]
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def resolve_strategy(spec: str) -> type[Any]:
    """The class that builds the strategy ``spec`` names: the class itself when it has ``from_run_config``; for a
    Flower strategy without it (e.g. ``"flwr.serverapp.strategy:FedAdam"``), the adapter that runs it
    (:data:`FLOWER_ADAPTER`).

    Raises:
        ConfigError: as :func:`resolve`, or the class is neither.
    """
    from flwr.serverapp.strategy import Strategy

    cls = resolve("strategy", spec)
    if hasattr(cls, "from_run_config"):
        return cls
    if issubclass(cls, Strategy):
        return resolve("strategy", FLOWER_ADAPTER)
    raise ConfigError(
        f"run-config key 'strategy' = {spec!r}: {cls.__name__} is not a flwr.serverapp.strategy.Strategy "
        "and has no from_run_config(config, layout, topology) class method"
    )


def _table(kind: str) -> dict[str, str]:
    if kind == "client":
        return CLIENTS
    if kind == "strategy":
        return STRATEGIES
    raise ValueError(f"unknown registry kind {kind!r}; use 'client' or 'strategy'")


def check_components(config) -> None:
    """Let the configured client class and strategy class check the run config before anything runs.

    Each may define a class method ``check_config(config)`` raising :class:`ConfigError` for settings it cannot
    serve (e.g. a strategy that needs gradient uploads and a client that sends parameters). Called by the ServerApp
    right after the config is validated, so a bad combination fails at start with one clear message instead of as
    failed replies from every node.
    """
    if config.strategy_args and resolve_strategy(config.strategy) is not resolve("strategy", FLOWER_ADAPTER):
        raise ConfigError(
            f"run-config key 'strategy-args' = {config.strategy_args!r} is for a Flower strategy's "
            f"constructor; strategy {config.strategy!r} takes its settings from its own keys"
        )
    for kind, spec in (("client", config.client), ("strategy", config.strategy)):
        cls = resolve_strategy(spec) if kind == "strategy" else resolve(kind, spec)
        check = getattr(cls, "check_config", None)
        if check is None:
            continue
        try:
            check(config)
        except ConfigError:
            raise
        except Exception as err:  # a plug-in's hook that raised something else: still one clear line, exit 2
            raise ConfigError(
                f"{kind} {spec!r} refused the run config in {cls.__qualname__}.check_config: "
                f"{type(err).__name__}: {err} (a check_config hook should raise "
                f"fedrec_flwr.errors.ConfigError)"
            ) from err
