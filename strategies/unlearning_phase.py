"""The client-unlearning phase inside a training run (``unlearning``, :mod:`fedrec_flwr.strategies.unlearning`):
the forget set from the run config, the ``retrain`` record, and the phase after ``unlearn-round`` (evaluate the
model before it, unlearn, write ``unlearning.json`` and ``before-unlearning.npz``)."""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import ArrayRecord

from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.io import atomic_save_npz, atomic_write_json
from fedrec_flwr.unlearning.settings import PHASE_METHODS
from fedrec_flwr.wire import Topology

log = logging.getLogger("fedrec_flwr.strategies.item_fedavg")  # the strategy's logger: its lines keep their source


def settings_from_config(config: RunConfig, topology: Topology | None):
    """The :class:`~fedrec_flwr.strategies.unlearning.UnlearningSettings` of ``config``, or ``None`` without a forget
    set or unlearning method; warns when a forget set is given with ``unlearning = "none"`` (those users still train).

    Raises:
        ConfigError: a forget set is configured but ``topology`` is unknown, or a forgotten user is out of range.
    """
    if config.unlearning == "none" and not config.forget_user_ids and not config.forget_fraction > 0:
        return None
    from .unlearning import UnlearningSettings

    if topology is None:
        raise ConfigError("a forget set (forget-users / forget-fraction) needs the federation's topology")
    settings = UnlearningSettings.from_config(config, topology.num_users)
    if config.unlearning == "none":
        count = len(settings.forget)
        log.warning(
            "forget-users / forget-fraction set with unlearning = 'none': %s still train%s and %s "
            "only left out of evaluation",
            f"those {count} users" if count != 1 else "that 1 user",
            "" if count != 1 else "s",
            "are" if count != 1 else "is",
        )
    return settings


def record_retrain(folder: Path, settings) -> None:
    """Write ``unlearning.json`` of a ``retrain`` run (its forgotten users) into ``folder`` (created if needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "unlearning.json", {"method": "retrain", "forget-users": list(settings.forget)})


def phase_due(strategy, server_round: int) -> bool:
    """Whether ``strategy``'s unlearning phase runs after ``server_round`` (a phase method, its round, not yet run)."""
    u = strategy.unlearning
    return (
        u is not None and u.method in PHASE_METHODS and server_round == u.round and strategy.unlearning_report is None
    )


def run_phase(strategy, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
    """Run ``strategy``'s unlearning phase on ``arrays`` after ``server_round``
    (:class:`fedrec_flwr.strategies.unlearning.ClientUnlearning`), as
    :meth:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg.run_unlearning` describes; returns the new arrays.

    Raises:
        UnlearningFailed: a node failed during the phase (``unlearning.json`` then records the error).
    """
    from .unlearning import ClientUnlearning, UnlearningFailed, describe_before

    assert strategy._grid is not None and strategy.unlearning is not None
    settings, folder = strategy.unlearning, strategy._results_folder
    if folder is not None:
        atomic_save_npz(folder / "before-unlearning.npz", **{k.replace("/", "_"): v.numpy() for k, v in arrays.items()})
    before = strategy.evaluate_arrays(strategy._grid, arrays, server_round)
    if line := describe_before(before, server_round):
        log.info("%s", line)
    saved_train = dict(strategy.last_train)
    try:
        new, report = ClientUnlearning(strategy, settings, timeout=strategy.round_timeout).run(
            strategy._grid, arrays, server_round
        )
    except UnlearningFailed as err:
        if folder is not None:
            atomic_write_json(
                folder / "unlearning.json",
                {
                    "method": settings.method,
                    "round": server_round,
                    "forget-users": list(settings.forget),
                    "error": str(err),
                    "before": before,
                },
            )
        raise
    strategy.last_train = saved_train
    strategy.removed_users = frozenset(strategy.removed_users) | set(settings.forget)
    strategy.adopt_arrays(new)
    report["before"] = before
    strategy.unlearning_report = report
    if folder is not None:
        atomic_write_json(folder / "unlearning.json", report)
        log.info(
            "unlearning report (every figure of the phase) written to %s; the model before it to %s",
            folder / "unlearning.json",
            folder / "before-unlearning.npz",
        )
    return new
