"""The parts of :class:`fedrec_flwr.strategies.adversary.AdversaryServerStep`'s round that ``secure-aggregation``
and ``adversary-weight-rule = "adaptive"`` add (:mod:`fedrec_flwr.adversary.secure`): the SecAgg+ sum of the nodes'
kept ``h_w`` vectors over ``query.secagg`` messages and the step on it, the summed statistics in the clear, the
controller's step of ``eps`` and its checkpointed state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedrec_flwr.adversary.adaptive import AdaptiveEpsilon, AdaptiveEpsilonConfig, statistics_length
from fedrec_flwr.adversary.secure import SCALE_KEY, STATISTICS_KEY, WEIGHT_KEY
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.privacy.secagg import SecAggError, secure_sum
from fedrec_flwr.privacy.secagg_records import grid_sender

log = logging.getLogger("fedrec_flwr.strategies.adversary")

ADAPTIVE_PREFIX = "adaptive/"
"""Prefix of the controller's entries in the step's checkpoint arrays."""


def adaptive_from_config(config, num_classes: int) -> AdaptiveEpsilon | None:
    """The controller of ``adversary-weight-rule = "adaptive"`` (the ``adaptive-*`` keys, starting at
    ``adversary-epsilon``), else ``None``.

    Raises:
        ConfigError: a setting outside its range for ``num_classes`` classes (e.g. ``adaptive-target-delta >= 1 - 1/C``).
    """
    if config.adversary_weight_rule != "adaptive":
        return None
    try:
        return AdaptiveEpsilon(
            AdaptiveEpsilonConfig(
                num_classes=int(num_classes),
                target_delta=config.adaptive_target_delta,
                rate=config.adaptive_rate,
                epsilon_min=config.adaptive_epsilon_min,
                epsilon_max=config.adaptive_epsilon_max,
                signal=config.adaptive_signal,
                smoothing=config.adaptive_smoothing,
            ),
            float(config.adversary_epsilon),
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def clear_statistics(accepted: list[RecordDict]) -> np.ndarray | None:
    """The sum of the accepted train replies' :data:`~fedrec_flwr.adversary.secure.STATISTICS_KEY` records
    (``(4 C,)`` float64; secure aggregation off), or ``None`` when none carries one."""
    found = [r.array_records[STATISTICS_KEY][STATISTICS_KEY].numpy() for r in accepted if STATISTICS_KEY in r]
    return np.sum(np.stack(found).astype(np.float64), axis=0) if found else None


def step_epsilon(adaptive: AdaptiveEpsilon, server_round: int, statistics: np.ndarray | None) -> None:
    """One controller step on the round's summed statistics (negative quantization residue clipped to 0); with none
    this round, ``eps`` stays (logged)."""
    if statistics is None:
        log.warning("round %d: no summed adversary statistics; eps stays %.4g", server_round, adaptive.epsilon)
        return
    before = adaptive.epsilon
    adaptive.step(np.maximum(np.asarray(statistics, dtype=np.float64), 0.0))
    log.info(
        "round %d: adaptive eps %.4g -> %.4g (signal %.4f)",
        server_round,
        before,
        adaptive.epsilon,
        adaptive.last_signal,
    )


def step_on_total(step, arrays: ArrayRecord, total: Mapping[str, np.ndarray]) -> ArrayRecord:
    """``step.step`` from ``arrays``' ``h_w`` on the mean gradient ``total[key] / total[weight]`` of a secure sum;
    returns ``arrays`` with ``h_w``'s keys replaced."""
    weight = float(total[WEIGHT_KEY][0])
    new = step.step({k: arrays[k].numpy() for k in step.keys}, {k: total[k] / weight for k in step.keys})
    return ArrayRecord({k: Array(new[k]) if k in step.keys else v for k, v in arrays.items()})


def secure_total(
    step, strategy, server_round: int, h_w_step: int, weights: Mapping[int, float], arrays: ArrayRecord
) -> dict[str, np.ndarray] | None:
    """The sum over ``weights``' nodes of the vectors they kept for ``(round, h_w_step)``, by SecAgg+
    (:func:`fedrec_flwr.privacy.secagg.secure_sum` through ``query.secagg`` messages on ``strategy``'s grid, each
    stage within its ``round_timeout``): each node's vector divided by the largest weight ``S`` (sent as
    ``vector-scale``) and the sum multiplied back (:mod:`fedrec_flwr.adversary.secure`). ``None`` (with a warning)
    when fewer than two nodes are left or too few survive a stage; a node that drops is left out of the sum.

    Args:
        step: the :class:`~fedrec_flwr.strategies.adversary.AdversaryServerStep` (``keys``, ``secure``, ``adaptive``,
            ``seed``). weights: node -> its weight (``num-examples``). arrays: the current shared arrays (shapes).

    Returns:
        ``{h_w key: (shape) float64, "adversary-weight": (1,)[, "adversary-statistics": (4 C,) in the train step]}``.

    Raises:
        ConfigError: the protocol's parameters do not fit this many nodes (e.g. ``nodes * (Q - 1) >= 2**32``).
    """
    nodes = sorted(int(n) for n in weights)
    where = f"round {server_round}, h_w step {h_w_step + 1}"
    if len(nodes) < 2:
        log.warning("%s: %d node(s) to sum; secure aggregation needs 2, so h_w takes no step", where, len(nodes))
        return None
    scale = max(float(w) for w in weights.values())
    spec = {k: tuple(arrays[k].shape) for k in step.keys}
    spec[WEIGHT_KEY] = (1,)
    if h_w_step == 0 and step.wants_statistics:
        spec[STATISTICS_KEY] = (statistics_length(step.adaptive.config.num_classes),)
    base = grid_sender(strategy._grid, timeout=strategy.round_timeout)
    common = {"server-round": server_round, "adversary-step": h_w_step, SCALE_KEY: scale}

    def send(stage, contents):
        return base(stage, {nid: {**common, **config} for nid, config in contents.items()})

    cfg = step.secure
    try:
        result = secure_sum(
            send,
            nodes,
            spec,
            threshold=cfg.shamir_threshold(len(nodes)),
            clipping_range=cfg.clipping_range,
            quantization_range=cfg.quantization_range,
            num_shares=cfg.neighbourhood(len(nodes)),
            seed=int(np.random.SeedSequence([step.seed, server_round, h_w_step]).generate_state(1)[0]),
        )
    except SecAggError as err:
        log.warning("%s: secure aggregation failed, h_w takes no step: %s", where, err)
        return None
    except ValueError as err:
        raise ConfigError(f"secure-aggregation with {len(nodes)} nodes: {err}") from None
    left = sorted(set(nodes) - set(result.contributors))
    if left:
        log.warning("%s: nodes %s dropped out of the secure sum", where, left)
    if result.clipped:
        log.warning(
            "%s: %d vector elements were clipped to +-%g (raise secure-aggregation-clipping-range)",
            where,
            result.clipped,
            cfg.clipping_range,
        )
    total = {k: v * scale for k, v in result.arrays.items()}
    return total if total[WEIGHT_KEY][0] > 0 else None


def adaptive_state_arrays(adaptive: AdaptiveEpsilon | None) -> dict[str, np.ndarray]:
    """The controller's state as checkpoint arrays (``adaptive/epsilon``, ``adaptive/steps``, ``adaptive/discounted``,
    ``adaptive/last-signal``); ``{}`` without one."""
    if adaptive is None:
        return {}
    return {f"{ADAPTIVE_PREFIX}{k}": np.asarray(v, dtype=np.float64) for k, v in adaptive.state_dict().items()}


def restore_adaptive(
    adaptive: AdaptiveEpsilon | None, arrays: Mapping[str, np.ndarray]
) -> tuple[AdaptiveEpsilon | None, dict[str, np.ndarray]]:
    """Inverse of :func:`adaptive_state_arrays`: ``(the restored controller (or ``adaptive`` itself when ``arrays``
    hold none), the other arrays)``."""
    state = {k[len(ADAPTIVE_PREFIX) :]: v for k, v in arrays.items() if k.startswith(ADAPTIVE_PREFIX)}
    rest = {k: v for k, v in arrays.items() if not k.startswith(ADAPTIVE_PREFIX)}
    if adaptive is None or not state:
        return adaptive, rest
    restored = AdaptiveEpsilon.from_state(
        adaptive.config,
        {
            "epsilon": float(state["epsilon"]),
            "steps": int(state["steps"]),
            "discounted": np.asarray(state["discounted"]).reshape(-1).tolist(),
            "last-signal": float(state["last-signal"]),
        },
    )
    return restored, rest
