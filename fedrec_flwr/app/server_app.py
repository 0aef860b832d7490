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
   ``final_arrays.npz``, ``summary.json`` and ``learning_curves.png``, each written atomically. A run that fails
   (raises) once its folder exists writes ``failed.json`` there instead of ``summary.json``: the error and the round
   (:func:`fedrec_flwr.state.results.write_failure`); a later run of the same ``run-name`` replaces such a folder
   (:func:`fedrec_flwr.state.results.check_results_folder`).

Every ``checkpoint-every`` rounds a server checkpoint (``checkpoint.npz``, :mod:`fedrec_flwr.state.checkpoint`) is written
there too; ``resume-from`` continues an interrupted run from it (Flower's round loop over the later rounds,
:class:`ShiftedRounds`). Every message carries the run's name and the last checkpoint's round, which clients keeping
their private state in files (``client-state-dir``, :mod:`fedrec_flwr.state.client_state`) need.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from fedrec_flwr.app.message_window import is_simulation_grid, windowed
from fedrec_flwr.app.preflight import Preflight, build_strategy, default_run_name, preflight  # noqa: F401 - default_run_name: importable from here too
from fedrec_flwr.app.runtime import build_shared_model
from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError, FedRecError, OneLineRecords, reply_error_line
from fedrec_flwr.io import remove_dead_temporaries
from fedrec_flwr.registry import LOGGER_ROOTS
from fedrec_flwr.state.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    check_client_state,
    check_same_data,
    save_checkpoint,
)
from fedrec_flwr.state.client_state import DURABLE_ROUND_KEY, NEW_RUN_KEY, RESUME_ROUND_KEY, RUN_KEY, ClientStateStore
from fedrec_flwr.state.results import (
    FAILED_FILE,
    PROGRESS,
    FolderLock,
    RunRecorder,
    check_results_folder,
    describe_failure,
    read_failure,
    write_failure,
)
from fedrec_flwr.unlearning.settings import PHASE_METHODS
from fedrec_flwr.wire import CONFIG, IDENTIFY, ModelLayout, Topology

log = logging.getLogger(__name__)

IDENTIFY_TIMEOUT = 300.0
"""The least time the identify phase waits for replies (seconds): a SuperNode's first message includes installing the
app and loading the dataset, which can take longer than ``round-timeout`` allows a training round."""


def _setup_logging() -> None:
    for name in LOGGER_ROOTS:  # a plug-in's logger too, or its lines reach no handler with a level
        root = logging.getLogger(name)
        if not root.handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            handler.addFilter(OneLineRecords())  # one record, one line: the quiet console keeps whole records
            root.addHandler(handler)
            root.setLevel(logging.INFO)
            root.propagate = False
    if not PROGRESS.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        PROGRESS.addHandler(handler)
        PROGRESS.propagate = False
        PROGRESS.setLevel(logging.INFO)


def identify_nodes(
    grid: Grid, nodes, timeout: float, query: Mapping[str, Any] | None = None
) -> tuple[list[dict], list[tuple[int, str]]]:
    """Send the ``identify`` query to ``nodes``; returns ``(facts, errors)``: each answering node's reported facts
    (its ``partition-id``, ``first-user``, ``num-users``, the dataset's shape and fingerprint) with ``"node"`` added,
    and ``(node, reason)`` for each node that answered with an error (e.g. a bad ``partition-id``). ``query``: the
    query's config (a resume's: the run, ``resume-round``, ... so each node checks its users' state files)."""
    content = RecordDict({CONFIG: ConfigRecord(dict(query))}) if query else RecordDict()
    replies = list(
        grid.send_and_receive(
            [Message(content, dst_node_id=n, message_type=f"{MessageType.QUERY}.{IDENTIFY}") for n in nodes],
            timeout=timeout,
        )
    )
    errors = [(int(m.metadata.src_node_id), reply_error_line(m.error.reason)) for m in replies if m.has_error()]
    facts = [dict(m.content[CONFIG]) | {"node": m.metadata.src_node_id} for m in replies if not m.has_error()]
    return facts, errors


def discover_topology(grid: Grid, config: RunConfig, timeout: float, query: Mapping[str, Any] | None = None):
    """Ask every node which users it serves; returns ``(Topology, num_items, dataset facts)``. ``query``: see
    :func:`identify_nodes`; the facts' ``client-state-problems`` list the nodes reporting damaged state files or
    users without a state version of the resumed round (partition-id, node, folder, user ids).

    Raises:
        ConfigError: the number of nodes does not match ``ceil(users / users-per-node)``, a node reports a bad or
            missing ``partition-id`` (its message is passed on), two nodes serve the same users, or nodes disagree
            on the dataset.
    """
    started = time.monotonic()
    deadline = started + timeout
    last_count, last_change = -1, time.monotonic()
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) != last_count:
            last_count, last_change = len(nodes), time.monotonic()
        settled = getattr(grid, "nodes_settled", False)  # a SerialGrid has all its nodes from the start
        if nodes and (settled or time.monotonic() - last_change > 2.0 or time.monotonic() > deadline):
            break
        time.sleep(0.5)
    connected = time.monotonic()
    facts, errors = identify_nodes(grid, nodes, timeout, query)
    log.info(
        "identify: %d of %d SuperNodes answered in %.1f s (%.1f s waiting for them to connect)",
        len(facts),
        len(nodes),
        time.monotonic() - connected,
        connected - started,
    )
    if errors:
        raise ConfigError(f"node {errors[0][0]} cannot serve this run: {errors[0][1]}")
    if not facts:
        raise ConfigError(f"no SuperNode answered the identify query within {timeout:.0f} s ({len(nodes)} connected)")
    shapes = {
        (f["num-users-total"], f["num-items"], f["fingerprint"], f.get("num-attribute-classes", 0)) for f in facts
    }
    if len(shapes) != 1:
        raise ConfigError(
            f"SuperNodes disagree on the dataset (users, items, fingerprint, attribute classes): {sorted(shapes)}"
        )
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
    split = json.loads(facts[0].get("split-facts", "{}"))  # equal on every node: the fingerprint covers it
    without_state = sorted(int(f["partition-id"]) for f in facts if not f.get("client-state", False))
    state_problems = [
        {
            "partition-id": int(f["partition-id"]),
            "node": int(f["node"]),
            "folder": f["client-state-folder"],
            "damaged": list(f.get("client-state-damaged", [])),
            "absent": list(f.get("client-state-absent", [])),
            "earlier": list(f.get("client-state-earlier", [])),
        }
        for f in sorted(facts, key=lambda f: f["partition-id"])
        if "client-state-folder" in f
    ]
    return (
        Topology(user_to_node, fingerprint),
        int(num_items),
        {
            "num-users": int(num_users),
            "num-items": int(num_items),
            "split-fingerprint": fingerprint,
            "num-attribute-classes": int(num_classes),
            "split": split,
            "nodes-without-client-state": without_state,
            "client-state-problems": state_problems,
        },
    )


@dataclass
class RoundView:
    """What an ``on_round`` hook sees after a round (in-process callers only; see :func:`main`)."""

    server_round: int
    grid: Grid
    strategy: Any
    """The running strategy (e.g. to run an unlearning phase variant, :class:`fedrec_flwr.strategies.unlearning.ClientUnlearning`)."""
    arrays: ArrayRecord
    """The shared parameters after the round."""
    config: RunConfig
    folder: Path


@dataclass
class Progress:
    """Where a run is, for its failure record (:func:`fedrec_flwr.state.results.write_failure`)."""

    round: int | None = None
    """The round running now; ``None`` before round 1 and after the last."""
    completed: int = 0
    """The last round whose metrics are recorded."""
    training: bool = False
    """Whether the rounds have begun (an error of bad input before that is a refusal: no ``failed.json``)."""


def main(
    grid: Grid,
    context: Context,
    run_config: Mapping[str, Any] | None = None,
    *,
    on_round: Callable[[RoundView], None] | None = None,
) -> Path:
    """Run one federated experiment (see the module docstring); returns the results folder.

    ``on_round(view)``, if given (in-process callers only, e.g. an experiment's per-round attack on a
    :class:`~fedrec_flwr.serial.SerialGrid`), is called after every round, once its metrics are recorded, with a
    :class:`RoundView`.

    The run holds its results folder's lock (:class:`fedrec_flwr.state.results.FolderLock`) from the preflight's end until
    it returns: a second run of that folder is refused with a ConfigError naming this one.

    A run that raises once its results folder exists records why in ``failed.json`` there
    (:func:`fedrec_flwr.state.results.write_failure`: the error, the round) before the error goes on, unless it was refused
    (a :class:`~fedrec_flwr.errors.FedRecError` before the rounds began: a resume on changed data leaves the
    interrupted run's folder as it was); a ``KeyboardInterrupt``
    or ``SystemExit`` (Ctrl-C, SIGTERM) is an interruption and writes none.
    """
    _setup_logging()
    plan = preflight(RunConfig.from_mapping(context.run_config or run_config or {}))  # no data here: the nodes have it
    progress = Progress(completed=plan.resume.server_round if plan.resume is not None else 0)
    # the folder is this run's until it returns: a second run of it is refused (before it touches the folder)
    lock = FolderLock(
        plan.folder,
        *(("resume-from", plan.config.resume_from) if plan.resume is not None else ("run-name", plan.folder.name)),
    ).acquire()
    patched = False
    try:
        patched = _fast_link_state(plan.config, grid)
        return _run(plan, grid, on_round, progress)
    except Exception as err:  # noqa: BLE001 - recorded, then raised as it was (Ctrl-C / SIGTERM: interrupted, not failed)
        refused = isinstance(err, FedRecError) and not progress.training
        if plan.folder.is_dir() and not refused:  # a run refused before training leaves the folder as it was
            try:
                write_failure(
                    plan.folder,
                    err,
                    server_round=progress.round,
                    rounds_completed=progress.completed,
                    num_server_rounds=plan.config.num_server_rounds,
                )
                log.info(
                    "the run failed%s: %s records it",
                    f" in round {progress.round}" if progress.round else "",
                    plan.folder / FAILED_FILE,
                )
            except OSError as problem:  # the run's own error matters more than its record
                log.warning("could not write %s: %s", plan.folder / FAILED_FILE, problem)
        raise
    finally:
        lock.release()
        if patched:  # Flower's own method back for whatever runs next in this process (a test, a second app)
            from fedrec_flwr.app import flower_patches

            flower_patches.restore()


def _fast_link_state(config: RunConfig, grid: Grid) -> bool:
    """Apply :mod:`fedrec_flwr.app.flower_patches` on Flower's simulation engine when ``fast-link-state`` is on (logs
    it, or why Flower's own lookup is kept); returns whether this call put it in place."""
    if not is_simulation_grid(grid):
        return False
    from fedrec_flwr.app import flower_patches

    if not config.fast_link_state:
        log.info("fast-link-state = false: Flower's own message lookup")
        return False

    if flower_patches.active():
        return False
    if flower_patches.apply():
        log.info(
            "fast-link-state: each node's next message is looked up by its destination first "
            "(fedrec_flwr/app/flower_patches.py)"
        )
        return True
    return False


def _run(plan: Preflight, grid: Grid, on_round: Callable[[RoundView], None] | None, progress: Progress) -> Path:
    """:func:`main` after the preflight: identify, build, run the rounds, write the results; keeps ``progress``."""
    config, folder, resume = plan.config, plan.folder, plan.resume
    lookup = "none (no simulation link state)"  # config.json: how Flower's engine found each node's messages
    if is_simulation_grid(grid):
        from fedrec_flwr.app import flower_patches

        lookup = "by destination (fast-link-state)" if flower_patches.active() else "Flower's own"
    grid = windowed(grid, config.max_in_flight)  # every phase's messages, ours and a wrapped Flower strategy's
    removed = remove_dead_temporaries(folder, any_writer=True)  # this run holds the folder's lock: nobody else writes
    if removed:
        log.info(
            "removed %d temporary file(s) an earlier run left in %s when it was killed mid-write (e.g. %s)",
            len(removed),
            folder,
            removed[0].name,
        )
    if resume is None:
        check_results_folder(folder)  # clears what an interrupted run of this name left
    query = (
        {RUN_KEY: folder.name, NEW_RUN_KEY: True}
        if resume is None
        else {  # each node checks its users' state
            RUN_KEY: folder.name,
            RESUME_ROUND_KEY: resume.server_round,  # files (client_app.identify)
            "resume-resets-client-state": config.resume_resets_client_state,
        }
    )
    topology, num_items, facts = discover_topology(
        grid, config, timeout=max(config.round_timeout, IDENTIFY_TIMEOUT), query=query
    )
    without_state = facts.pop("nodes-without-client-state")
    state_problems = facts.pop("client-state-problems")
    earlier = [node for node in state_problems if node["earlier"]]
    if resume is None and earlier:  # before anything is trained or written
        first = earlier[0]
        files = sum(len(node["earlier"]) for node in earlier)
        raise ConfigError(
            f"run-config key 'run-name' = {folder.name!r}: the clients' state folder {first['folder']!r} "
            f"(node {first['node']}, partition-id {first['partition-id']}) already holds state files of "
            f"an earlier run of this name ({files} user file(s) on {len(earlier)} node(s), e.g. "
            f"{ClientStateStore(first['folder']).path(first['earlier'][0]).name}); a new run would mix "
            "them with its own: continue that run with 'resume-from', delete the folder, or set another "
            "'run-name'"
        )
    split_facts = facts.pop("split", {})
    data = {
        "source-sha256": split_facts.get("source-sha256"),
        "num-users": facts["num-users"],
        "num-items": facts["num-items"],
        "num-interactions": split_facts.get("num-interactions"),
        "fingerprint": facts["split-fingerprint"],
    }
    if resume is not None:
        check_same_data(resume, data, "as the nodes report")  # before anything is built from the data
        reset = check_client_state(resume, without_state, config.resume_resets_client_state, state_problems)
        if reset is not None:
            log.warning("%s", reset)
    model = build_shared_model(config, num_items, num_classes=facts["num-attribute-classes"])
    layout = ModelLayout.from_model(model)
    initial = ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in model.shared_state().items()})
    if resume is not None:
        initial = _checkpoint_arrays(resume, layout)

    strategy = build_strategy(config, layout, topology)  # a Flower one: adapted
    if hasattr(strategy, "attach_results"):  # a strategy that writes files of its own (e.g. an attack's log)
        strategy.attach_results(folder)
    first_round = 1
    if resume is not None:
        if hasattr(strategy, "restore_checkpoint_state"):
            strategy.restore_checkpoint_state(resume.strategy_state, resume.strategy_arrays, initial)
        first_round = resume.server_round + 1
        log.info("resuming %s after round %d (checkpoint %s)", folder.name, resume.server_round, resume.folder)
        failure = read_failure(folder)
        if failure is not None:  # the interrupted run failed after its last checkpoint; this run goes on from it
            log.warning(
                "results folder %s held a failed run (%s): its failed.json is removed",
                folder,
                describe_failure(failure),
            )
            (folder / FAILED_FILE).unlink(missing_ok=True)
    # Sent with every message: the run's name (clients' state files) and the last checkpoint's round (which of their
    # saved versions clients may drop; -1 = no checkpoints, keep the newest only).
    message_config = {
        RUN_KEY: folder.name,
        DURABLE_ROUND_KEY: (first_round - 1) if config.checkpoint_every or resume else -1,
    }
    if hasattr(strategy, "message_config"):
        strategy.message_config = message_config

    # a split without timestamps has no ties to break: config.json says what ordered the held-out items instead
    tie_rule = (
        config.tie_rule
        if split_facts.get("tie-rule-applied", True)
        else f"not applied: {split_facts.get('held-out-order', 'no timestamps')}"
    )
    # the folder's name: the run config's run-name, or the generated one when that is empty
    window = getattr(grid, "window", None)  # max-in-flight as applied (fedrec_flwr.app.message_window); None: no window
    info = {
        "run-folder": folder.name,
        "dataset": facts,
        "split": split_facts,
        "tie-rule": tie_rule,
        "messages-in-flight": window if window is not None else "all",
        "link-state-lookup": lookup,
    }
    if hasattr(strategy, "run_info"):  # e.g. a wrapped Flower strategy's class and constructor arguments
        info["strategy"] = strategy.run_info()
    recorder = RunRecorder(folder, config.to_dict(), info, rows=resume.rows if resume is not None else ())
    log.info(
        "%s: %d users on %d nodes, %d items; results in %s",
        config.dataset,
        facts["num-users"],
        len(set(topology.user_to_node.tolist())),
        num_items,
        folder,
    )
    if window is not None:
        log.info(
            "at most %d messages in flight (max-in-flight = %d%s)",
            window,
            config.max_in_flight,
            ": auto on Flower's simulation engine" if config.max_in_flight == 0 else "",
        )

    def record_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round >= first_round:
            recorder.record(server_round, strategy.last_train, strategy.last_evaluate)
            if config.checkpoint_every and server_round % config.checkpoint_every == 0:
                _write_checkpoint(
                    folder,
                    server_round,
                    config,
                    arrays,
                    strategy,
                    recorder.rows,
                    client_state=not without_state,
                    data=data,
                )
                message_config[DURABLE_ROUND_KEY] = server_round
            if on_round is not None:
                on_round(RoundView(server_round, grid, strategy, arrays, config, folder))
            progress.completed = server_round
            progress.round = server_round + 1 if server_round < config.num_server_rounds else None
        return None

    progress.round = first_round if first_round <= config.num_server_rounds else None
    progress.training = True

    runner = strategy if first_round == 1 else ShiftedRounds(strategy, first_round - 1)
    result = runner.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=config.num_server_rounds - first_round + 1,
        timeout=config.round_timeout,
        train_config=ConfigRecord(message_config),
        evaluate_config=ConfigRecord(message_config),
        evaluate_fn=runner.shift_evaluate_fn(record_round) if runner is not strategy else record_round,
    )
    if result.arrays is None:  # no round ran (resumed after the last round): the checkpoint's arrays are final
        result.arrays = initial
    if config.unlearning in PHASE_METHODS and getattr(strategy, "unlearning_report", None) is None:
        raise RuntimeError(
            f"unlearning = {config.unlearning!r} was configured but strategy {config.strategy!r} never ran "
            "its phase (does it override aggregate_train without calling super()?)"
        )
    final = {k: v.numpy() for k, v in result.arrays.items()} if result.arrays is not None else {}
    extra = {
        "client-failures": {str(k): v for k, v in getattr(strategy, "failures", {}).items()},
        "evaluation-failures": {str(k): v for k, v in getattr(strategy, "evaluation_failures", {}).items()},
        # users left out for non-finite private state, per phase and round (their nodes' logs name them)
        "isolated-users": getattr(strategy, "isolated_users", {}),
    }
    if getattr(strategy, "unlearning_report", None) is not None:
        extra["unlearning"] = strategy.unlearning_report
    if getattr(strategy, "contribution_log", None) is not None:  # its size only: the store stays on the server
        extra["unlearning-history"] = strategy.contribution_log.storage()
    recorder.finish(final, extra)
    log.info("results written to %s", folder)
    return folder


class ShiftedRounds:
    """Flower's ``Strategy.start`` loop over rounds ``offset + 1 ..`` of ``strategy`` (a resumed run).

    ``Strategy.start`` always counts rounds from 1; this view adds ``offset`` to the round of every call the loop makes
    (configure / aggregate train and evaluate) and delegates everything else, so any ``flwr.serverapp.strategy``
    strategy resumes unchanged, and its own internal calls (e.g. the unlearning phase's) keep their true rounds.
    """

    def __init__(self, strategy, offset: int) -> None:
        self.strategy = strategy
        self.offset = int(offset)

    def configure_train(self, server_round, *args, **kwargs):
        return self.strategy.configure_train(server_round + self.offset, *args, **kwargs)

    def aggregate_train(self, server_round, *args, **kwargs):
        return self.strategy.aggregate_train(server_round + self.offset, *args, **kwargs)

    def configure_evaluate(self, server_round, *args, **kwargs):
        return self.strategy.configure_evaluate(server_round + self.offset, *args, **kwargs)

    def aggregate_evaluate(self, server_round, *args, **kwargs):
        return self.strategy.aggregate_evaluate(server_round + self.offset, *args, **kwargs)

    def summary(self) -> None:
        self.strategy.summary()

    def start(self, **kwargs):
        """Flower's own ``Strategy.start`` loop, run on this view."""
        return Strategy.start(self, **kwargs)

    def shift_evaluate_fn(self, evaluate_fn):
        """``evaluate_fn`` called with the true round (Flower's initial call, round 0, stays 0)."""
        return lambda server_round, arrays: evaluate_fn(server_round + self.offset if server_round else 0, arrays)


def _checkpoint_arrays(checkpoint: Checkpoint, layout: ModelLayout) -> ArrayRecord:
    """The checkpoint's shared parameters, checked against the model (a checkpoint of another model is refused)."""
    expected = {k: tuple(v) for k, v in layout.shared_shapes.items()}
    found = {k: tuple(v.shape) for k, v in checkpoint.arrays.items()}
    if found != expected:
        raise ConfigError(
            f"checkpoint {checkpoint.folder}: its shared parameters {found} do not match this run's model {expected}"
        )
    return ArrayRecord({k: Array(np.asarray(checkpoint.arrays[k], dtype=np.float32)) for k in expected})


def _write_checkpoint(
    folder: Path,
    server_round: int,
    config: RunConfig,
    arrays: ArrayRecord,
    strategy,
    rows: list,
    client_state: bool | None = None,
    data: Mapping[str, Any] | None = None,
) -> None:
    state, extra = strategy.checkpoint_state() if hasattr(strategy, "checkpoint_state") else ({}, {})
    save_checkpoint(
        folder,
        Checkpoint(
            server_round=server_round,
            run_name=folder.name,
            run_config=config.to_dict(),
            arrays={k: v.numpy() for k, v in arrays.items()},
            strategy_state=state,
            strategy_arrays=extra,
            rows=list(rows),
            sampler={"seed": config.seed, "next-round": server_round + 1},
            client_state=client_state,
            data=dict(data or {}),
        ),
    )
    log.info("checkpoint of round %d written to %s", server_round, folder / CHECKPOINT_FILE)


def make_server_app(run_config: Mapping[str, Any] | None = None) -> ServerApp:
    """Build the ServerApp; ``run_config`` is used when Flower passes an empty ``context.run_config``
    (its in-process ``flwr.simulation.run_simulation`` does)."""
    server_app = ServerApp()
    server_app.main()(partial(_main_with_config, run_config))
    return server_app


SERVERAPP_ENDED = "the ServerApp has ended"
"""Logged (INFO on success, ERROR with the exception otherwise) as the ServerApp's last line under ``flwr run``:
:mod:`fedrec_flwr.launch` ends a run whose simulation is still running some time after it (a ClientApp that never
returns keeps Flower 1.42's simulation from exiting)."""


def _main_with_config(run_config, grid: Grid, context: Context) -> None:
    try:
        main(grid, context, run_config)
    except BaseException as err:
        log.error("%s: %s: %s", SERVERAPP_ENDED, type(err).__name__, err)
        raise
    log.info("%s: completed", SERVERAPP_ENDED)


app = make_server_app()
"""The ServerApp ``flwr run`` loads (``[tool.flwr.app.components] serverapp``)."""
