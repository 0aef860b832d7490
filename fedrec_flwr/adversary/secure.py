"""How a node's round vector of the server-trained ``h_w`` reaches the server: in the clear, or only as a sum over the
round's nodes by secure aggregation (``secure-aggregation = "secagg+"``, :mod:`fedrec_flwr.privacy.secagg`).

**The round vector.** With ``adversary-training = "server"`` each node contributes, per server step of ``h_w``, the
vector ``v_i = (sum_u n_u g_u, sum_u n_u[, s_i])`` over its users ``u`` (``g_u``: the user's ``h_w`` gradient under
``h_w``'s keys, ``n_u``: its weight, the train reply's ``num-examples`` per user or 1 in an ``adversary_gradient``
query) and, in the train step with ``adversary-weight-rule = "adaptive"``, ``s_i``, the sum of its users'
:func:`fedrec_flwr.adversary.adaptive.adversary_statistics` (``(4 C,)``, with the round's global ``h_w`` at the
users' embeddings after training). The server needs only ``sum_i v_i``: the mean gradient is the summed gradient over
the summed weight, and the controller reads the summed statistics.

**In the clear** (``"off"``): the train reply carries the node's mean gradient ``sum_u n_u g_u / sum_u n_u`` under
``h_w``'s keys (its weight is ``num-examples``), and with ``"adaptive"`` ``s_i`` as the ArrayRecord
:data:`STATISTICS_KEY`: the server then sees each node's per-class user counts (with one user per node, that user's
label) and per-class sums of ``h_w``'s scores.

**Secure** (``"secagg+"``): no reply carries ``v_i`` or any part of it. The train reply has zeros under ``h_w``'s keys
and no statistics; an ``adversary_gradient`` query with :data:`SECURE_KEY` is answered with ``num-examples`` only.
The node keeps ``v_i`` in its node state (``context.state``: the ArrayRecord :data:`VECTOR_RECORD`, tagged with the round
and the step in the ConfigRecord :data:`VECTOR_TAG`; not a per-user record) until the server runs SecAgg+'s four stages as
``query.secagg`` messages (:mod:`fedrec_flwr.privacy.secagg_records`); in the masked-vector stage the node contributes
``v_i / S`` (``S``: the largest weight of the step's nodes, sent by the server, so every element stays within the
clipping range whatever the users per node) and forgets ``v_i``. The server multiplies the sum back by ``S``.
Quantization: each element of the sum is within ``nodes * S * 2c / (Q - 1)`` of the exact sum (``c``:
``secure-aggregation-clipping-range``, ``Q``: ``secure-aggregation-quantization-range``; module docstring of
:mod:`fedrec_flwr.privacy.secagg`). A step with fewer than two nodes left, or fewer than the threshold, takes no
secure step of ``h_w`` (a one-node "sum" is that node's vector).

Everything here is a pure helper of the node handlers (:mod:`fedrec_flwr.app.client_app`,
:mod:`fedrec_flwr.app.queries`) and of the server step (:mod:`fedrec_flwr.strategies.adversary`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedrec_flwr.adversary.prior import uses_aggregate_prior
from fedrec_flwr.privacy.secagg import SecAggError

VECTOR_RECORD = "adversary-vector"
"""Name of the node-state ArrayRecord of the vector."""
VECTOR_TAG = "adversary-vector-tag"
"""Name of the node-state ConfigRecord of the vector's ``round`` and ``step``."""
WEIGHT_KEY = "adversary-weight"
"""The vector's ``(1,)`` entry ``sum_u n_u``."""
STATISTICS_KEY = "adversary-statistics"
"""The vector's ``(4 C,)`` summed adaptive statistics; also the clear train reply's ArrayRecord of them."""
SECURE_KEY = "secure-aggregation"
"""Config flag of an ``adversary_gradient`` query: keep the vector on the node, reply with ``num-examples`` only."""
EPSILON_KEY = "adaptive-epsilon"
"""Train-message config key: the round's GRL weight under ``adversary-weight-rule = "adaptive"``."""
SCALE_KEY = "vector-scale"
"""Masked-vector stage config key: the divisor ``S`` of every node's vector."""


@dataclasses.dataclass(frozen=True)
class SecureSettings:
    """The ``secure-aggregation-*`` keys (module docstring).

    Args:
        threshold: fraction in ``(0, 1]`` of each neighbourhood. num_shares: odd >= 3, or 0 (every node).
        clipping_range: ``c`` > 0. quantization_range: ``Q`` >= 2.
    """

    threshold: float
    num_shares: int
    clipping_range: float
    quantization_range: int

    @classmethod
    def from_config(cls, config) -> SecureSettings | None:
        """The settings for ``secure-aggregation = "secagg+"``, else ``None``."""
        if config.secure_aggregation == "off":
            return None
        return cls(
            threshold=float(config.secure_aggregation_threshold),
            num_shares=int(config.secure_aggregation_num_shares),
            clipping_range=float(config.secure_aggregation_clipping_range),
            quantization_range=int(config.secure_aggregation_quantization_range),
        )

    def neighbourhood(self, nodes: int) -> int:
        """The neighbourhood size for ``nodes`` nodes: ``min(num_shares, nodes)``, or ``nodes`` with 0."""
        return nodes if not self.num_shares else min(self.num_shares, nodes)

    def shamir_threshold(self, nodes: int) -> int:
        """``t = min(k, max(2, ceil(threshold * k)))`` for the neighbourhood size ``k``."""
        k = self.neighbourhood(nodes)
        return min(k, max(2, math.ceil(self.threshold * k - 1e-9)))

    def error_bound(self, contributors: int, scale: float) -> float:
        """The bound ``contributors * scale * 2c / (Q - 1)`` on every element of a rescaled sum."""
        return contributors * float(scale) * 2.0 * self.clipping_range / (self.quantization_range - 1)


def store_vector(state: RecordDict, server_round: int, step: int, arrays: Mapping[str, np.ndarray]) -> None:
    """Keep a node's round vector (``{key: float array}``) in ``state`` for the secure sum of ``(round, step)``,
    replacing any earlier one."""
    state.array_records[VECTOR_RECORD] = ArrayRecord(
        {k: Array(np.ascontiguousarray(np.asarray(v, dtype=np.float64))) for k, v in arrays.items()}
    )
    state.config_records[VECTOR_TAG] = ConfigRecord({"round": int(server_round), "step": int(step)})


def take_vector(state: RecordDict, server_round: int, step: int, scale: float) -> dict[str, np.ndarray]:
    """The vector :func:`store_vector` kept for ``(round, step)``, divided by ``scale``, removed from ``state``.

    Raises:
        SecAggError: no vector, or one kept for another round or step (the node answers with an error: dropped).
    """
    tag = dict(state.config_records.get(VECTOR_TAG, {}))
    if VECTOR_RECORD not in state.array_records or (tag.get("round"), tag.get("step")) != (server_round, step):
        raise SecAggError(
            f"secagg: the node holds no h_w vector of round {server_round}, step {step} (it has {tag or 'none'})"
        )
    if not (math.isfinite(scale) and scale > 0):
        raise SecAggError(f"secagg: the vector scale must be a positive number, got {scale!r}")
    arrays = {k: a.numpy().astype(np.float64) / scale for k, a in state.array_records[VECTOR_RECORD].items()}
    del state.array_records[VECTOR_RECORD]
    del state.config_records[VECTOR_TAG]
    return arrays


def route_train_vector(
    config,
    state: RecordDict,
    server_round: int,
    keys,
    dense_sum: Mapping[str, np.ndarray],
    weight: float,
    packed: dict[str, np.ndarray],
    statistics: np.ndarray | None,
) -> dict[str, ArrayRecord]:
    """A train reply's ``h_w`` part under the run's ``secure-aggregation`` (module docstring).

    Args:
        config: the run config. state: the node's ``context.state``. keys: ``h_w``'s shared keys.
        dense_sum: the node's ``sum_u n_u theta_u`` per dense key (``h_w``'s keys: the weighted gradient sums).
        weight: ``sum_u n_u``. packed: the reply's arrays, changed in place (``h_w``'s keys zeroed when secure).
        statistics: the node's summed adaptive statistics, or ``None``.

    Returns:
        extra reply records: ``{STATISTICS_KEY: ArrayRecord}`` in the clear with statistics, else ``{}``.
    """
    if config.secure_aggregation == "off":
        if statistics is None:
            return {}
        return {STATISTICS_KEY: ArrayRecord({STATISTICS_KEY: Array(np.asarray(statistics, dtype=np.float64))})}
    vector = {key: np.asarray(dense_sum[key], dtype=np.float64) for key in keys}
    vector[WEIGHT_KEY] = np.array([float(weight)])
    if statistics is not None:
        vector[STATISTICS_KEY] = np.asarray(statistics, dtype=np.float64)
    store_vector(state, server_round, 0, vector)
    for key in keys:
        packed[key] = np.zeros_like(packed[key])
    return {}


def wants_statistics(config) -> bool:
    """Whether the nodes add their users' summed :func:`fedrec_flwr.adversary.adaptive.adversary_statistics` to the
    train step's vector: a server-trained ``h_w`` with ``adversary-weight-rule = "adaptive"`` (the controller's
    signal) or ``adversary-class-prior = "aggregate"`` (its ``users`` block, the class counts)."""
    if config.adversary == "none" or config.adversary_training != "server":
        return False
    return config.adversary_weight_rule == "adaptive" or uses_aggregate_prior(config)
