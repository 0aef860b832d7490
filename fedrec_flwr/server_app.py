"""The ServerApp: validate the config, learn the federation's layout, run the strategy, write the results folder.

Phases of :func:`main`:

1. ``context.run_config`` -> one validated :class:`~fedrec_flwr.config.RunConfig` (bad keys fail here, by name).
2. Identify (a ``query.identify`` message to every node): each node answers which users it serves and the dataset's
   shape and fingerprint. The server checks that the nodes cover every user exactly once and agree on the data; a
   ``num-supernodes`` that does not match the users (with ``users-per-node``) is an error here, before any training.
   The server never reads the interaction data itself.
3. The strategy (registry name or ``module:Class``) runs ``num-server-rounds``; federated evaluation on the clients
   every ``eval-every`` rounds and after the last; one progress line per round.
4. The results folder (``results-dir/<run-name>/``) holds ``config.json``, ``metrics.csv``, ``metrics.json``,
   ``final_arrays.npz``, ``summary.json`` and ``learning_curves.png``, each written atomically.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from .client_app import IDENTIFY
from .config import RunConfig
from .errors import ConfigError
from .registry import check_components, resolve
from .results import PROGRESS, RunRecorder, check_results_folder
from .runtime import build_shared_model
from .wire import CONFIG, ModelLayout, Topology

log = logging.getLogger(__name__)

NODE_SETTLE_SECONDS = 20.0
"""How long the node count may stay unchanged, below the needed count, before the identify phase gives up."""


def _setup_logging() -> None:
    for name in ("fedrec_flwr", "strategies", "clients"):
        root = logging.getLogger(name)
        if not root.handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
            root.propagate = False
    if not PROGRESS.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        PROGRESS.addHandler(handler)
        PROGRESS.propagate = False
        PROGRESS.setLevel(logging.INFO)


def discover_topology(grid: Grid, config: RunConfig, timeout: float):
    """Ask every node which users it serves; returns ``(Topology, num_items, dataset facts)``.

    Raises:
        ConfigError: the number of nodes does not match ``ceil(users / users-per-node)``, a node reports a bad or
            missing ``partition-id`` (its message is passed on), two nodes serve the same users, or nodes disagree
            on the dataset.
    """
    deadline = time.monotonic() + timeout
    last_count, last_change = -1, time.monotonic()
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) != last_count:
            last_count, last_change = len(nodes), time.monotonic()
        settled = getattr(grid, "nodes_settled", False)  # a SerialGrid has all its nodes from the start
        if nodes and (settled or time.monotonic() - last_change > 2.0 or time.monotonic() > deadline):
            break
        time.sleep(0.5)
    replies = list(grid.send_and_receive(
        [Message(RecordDict(), dst_node_id=n, message_type=f"{MessageType.QUERY}.{IDENTIFY}") for n in nodes],
        timeout=timeout,
    ))
    errors = [m for m in replies if m.has_error()]
    if errors:
        raise ConfigError(f"node {errors[0].metadata.src_node_id} cannot serve this run: {errors[0].error.reason}")
    facts = [dict(m.content[CONFIG]) | {"node": m.metadata.src_node_id} for m in replies]
    if not facts:
        raise ConfigError("no SuperNode answered the identify query")
    shapes = {(f["num-users-total"], f["num-items"], f["fingerprint"], f.get("num-attribute-classes", 0))
              for f in facts}
    if len(shapes) != 1:
        raise ConfigError(f"SuperNodes disagree on the dataset (users, items, fingerprint, attribute classes): "
                          f"{sorted(shapes)}")
    num_users, num_items, fingerprint, num_classes = shapes.pop()
    needed = -(-num_users // config.users_per_node)
    if len(facts) != needed:
        raise ConfigError(
            f"{len(facts)} SuperNodes answered, but {config.dataset} has {num_users} users and users-per-node = "
            f"{config.users_per_node}, which needs exactly {needed} (set num-supernodes={needed} in simulation, or "
            f"start {needed} SuperNodes with partition-id 0..{needed - 1})"
        )
    user_to_node = np.zeros(num_users, dtype=np.uint64)  # node ids are unsigned 64-bit
    covered = np.zeros(num_users, dtype=bool)
    for fact in facts:
        block = slice(fact["first-user"], fact["first-user"] + fact["num-users"])
        if covered[block].any():
            raise ConfigError(f"two SuperNodes have partition-id {fact['partition-id']}")
        user_to_node[block], covered[block] = fact["node"], True
    if not covered.all():
        raise ConfigError(f"no SuperNode serves user {int(np.flatnonzero(~covered)[0])}")
    return Topology(user_to_node), int(num_items), {"num-users": int(num_users), "num-items": int(num_items),
                                                      "split-fingerprint": fingerprint,
                                                      "num-attribute-classes": int(num_classes)}


def default_run_name(config: RunConfig) -> str:
    """``<dataset>-<model>-<client>-<strategy>-<UTC time>`` unless ``run-name`` is set."""
    if config.run_name:
        return config.run_name
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    client = config.client.rsplit(":", 1)[-1].lower()
    strategy = config.strategy.rsplit(":", 1)[-1].lower()
    return f"{config.dataset}-{config.model}-{client}-{strategy}-{stamp}"


@dataclass
class RoundView:
    """What an ``on_round`` hook sees after a round (in-process callers only; see :func:`main`)."""

    server_round: int
    grid: Grid
    strategy: Any
    """The running strategy (e.g. to run an unlearning phase variant, :class:`strategies.unlearning.ClientUnlearning`)."""
    arrays: ArrayRecord
    """The shared parameters after the round."""
    config: RunConfig
    folder: Path


def main(grid: Grid, context: Context, run_config: Mapping[str, Any] | None = None, *,
         on_round: Callable[[RoundView], None] | None = None) -> Path:
    """Run one federated experiment (see the module docstring); returns the results folder.

    ``on_round(view)``, if given (in-process callers only, e.g. an experiment's per-round attack on a
    :class:`~fedrec_flwr.serial.SerialGrid`), is called after every round, once its metrics are recorded, with a
    :class:`RoundView`.
    """
    _setup_logging()
    config = RunConfig.from_mapping(context.run_config or run_config or {})
    check_components(config)
    folder = Path(config.results_dir).expanduser().resolve() / default_run_name(config)
    check_results_folder(folder)
    topology, num_items, facts = discover_topology(grid, config, timeout=config.round_timeout)
    model = build_shared_model(config, num_items, num_classes=facts["num-attribute-classes"])
    layout = ModelLayout.from_model(model)
    initial = ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in model.shared_state().items()})

    strategy_cls = resolve("strategy", config.strategy)
    if not hasattr(strategy_cls, "from_run_config"):
        raise ConfigError(f"strategy {config.strategy!r} has no from_run_config(config, layout, topology) class method")
    strategy = strategy_cls.from_run_config(config, layout, topology)
    if config.unlearning != "none" and not hasattr(strategy, "run_unlearning"):
        raise ConfigError(f"run-config key 'unlearning' = {config.unlearning!r}: strategy {config.strategy!r} has no "
                          "unlearning phase (use a strategy derived from ItemEmbeddingFedAvg, e.g. 'item-fedavg')")
    if hasattr(strategy, "attach_results"):  # a strategy that writes files of its own (e.g. an attack's log)
        strategy.attach_results(folder)

    recorder = RunRecorder(folder, config.to_dict(), {"dataset": facts, "tie-rule": config.tie_rule})
    log.info("%s: %d users on %d nodes, %d items; results in %s", config.dataset, facts["num-users"],
             len(set(topology.user_to_node.tolist())), num_items, folder)

    def record_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round > 0:
            recorder.record(server_round, strategy.last_train, strategy.last_evaluate)
            if on_round is not None:
                on_round(RoundView(server_round, grid, strategy, arrays, config, folder))
        return None

    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=config.num_server_rounds,
        timeout=config.round_timeout,
        train_config=ConfigRecord(),
        evaluate_config=ConfigRecord(),
        evaluate_fn=record_round,
    )
    if config.unlearning in ("continue", "hfkcu", "gradient-ascent") and \
            getattr(strategy, "unlearning_report", None) is None:
        raise RuntimeError(f"unlearning = {config.unlearning!r} was configured but strategy {config.strategy!r} never ran "
                           "its phase (does it override aggregate_train without calling super()?)")
    final = {k: v.numpy() for k, v in result.arrays.items()} if result.arrays is not None else {}
    extra = {"client-failures": {str(k): v for k, v in getattr(strategy, "failures", {}).items()}}
    if getattr(strategy, "unlearning_report", None) is not None:
        extra["unlearning"] = strategy.unlearning_report
    recorder.finish(final, extra)
    log.info("results written to %s", folder)
    return folder


def make_server_app(run_config: Mapping[str, Any] | None = None) -> ServerApp:
    """Build the ServerApp; ``run_config`` is used when Flower passes an empty ``context.run_config``
    (its in-process ``flwr.simulation.run_simulation`` does)."""
    server_app = ServerApp()
    server_app.main()(partial(_main_with_config, run_config))
    return server_app


def _main_with_config(run_config, grid: Grid, context: Context) -> None:
    main(grid, context, run_config)


app = make_server_app()
"""The ServerApp ``flwr run`` loads (``[tool.flwr.app.components] serverapp``)."""
