"""The server's store of every user's per-round contribution (``unlearning-history``), for history-based unlearning
(``unlearning = "rollback"``, :mod:`.unlearning_rollback`).

FRU's design (Yuan et al., WSDM 2023): the server keeps each user's update of every round it trained in, so that a
user who leaves can be rolled back. That is a privacy cost the users opt into with the key: the server holds
per-user updates (with one user per node it receives them anyway; with ``users-per-node`` > 1 each node adds its
users' own contributions to its train reply, the :data:`~fedrec_flwr.unlearning.history.CONTRIBUTIONS` record,
which it sends only when the key is on). The store stays on the server: it goes into server checkpoints (exact
resume) and is never sent to a client nor written to the results folder, where only its size appears
(:meth:`ContributionLog.storage`).

:class:`ContributionLog` holds the :class:`~fedrec_flwr.unlearning.history.ContributionHistory` and the shared
parameters before its first stored round (``theta_0`` of :func:`fedrec_flwr.unlearning.rollback.rollback`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from fedrec_flwr.arrays import decode_record
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.unlearning.history import (
    CONTRIBUTIONS,
    ContributionHistory,
    delta_from_reply,
    unpack_user_contributions,
)
from fedrec_flwr.wire import ARRAYS, METRICS, NUM_EXAMPLES, ModelLayout, ReplyError

log = logging.getLogger("fedrec_flwr.strategies.item_fedavg")  # the strategy's logger: its lines keep their source

HISTORY_PREFIX = "history/"
"""Prefix of the stored contributions among a checkpoint's strategy arrays."""

START_PREFIX = "history-start/"
"""Prefix of the parameters before the first stored round among a checkpoint's strategy arrays."""


def refuse_history(config, why: str) -> None:
    """For a strategy whose rounds are not parameter averages (a ``check_config`` hook): ``unlearning-history``
    must be ``"off"``.

    Raises:
        ConfigError: it is not, naming the strategy and ``why``.
    """
    if config.unlearning_history != "off":
        raise ConfigError(
            f"run-config key 'unlearning-history' = {config.unlearning_history!r} replays parameter averages, but "
            f"strategy {config.strategy!r} {why}; use strategy = 'item-fedavg' or unlearning-history = 'off'"
        )


def user_uploads(
    content: RecordDict, node: int, asked: Sequence[int]
) -> dict[int, tuple[dict[str, np.ndarray], float]]:
    """User -> (its own one-user reply arrays, its aggregation weight) of a train reply of ``node``, which was asked
    to train ``asked``: the :data:`CONTRIBUTIONS` record when the reply has one, else the reply itself (one user).

    Raises:
        ReplyError: a node asked to train several users sent no :data:`CONTRIBUTIONS` record, or one that names a
            user it was not asked to train.
    """
    asked = [int(u) for u in asked]
    if CONTRIBUTIONS in content.array_records:
        per_user = unpack_user_contributions(decode_record(content[CONTRIBUTIONS], copy=False))
        unknown = sorted(set(per_user) - set(asked))
        if unknown:
            raise ReplyError(f"node {node}'s '{CONTRIBUTIONS}' names users {unknown} it was not asked to train")
        return per_user
    if len(asked) != 1:
        raise ReplyError(
            f"node {node} trained {len(asked)} users but sent no '{CONTRIBUTIONS}' record "
            "(unlearning-history needs each user's own contribution)"
        )
    return {asked[0]: (decode_record(content[ARRAYS], copy=False), float(content[METRICS][NUM_EXAMPLES]))}


class ContributionLog:
    """The server's contribution store of one run (module docstring).

    Args:
        layout: the model's keys.
        dtype: storage dtype of the deltas (``unlearning-history``: ``"float32"``, ``"float16"`` or ``"float64"``).
        mode: the strategy's ``item-aggregation`` (``"touched"`` or ``"selected"``).

    Attributes:
        history: the stored contributions.
        start: shared key -> float32 array, the parameters before the first stored round (``None`` before it).
    """

    def __init__(self, layout: ModelLayout, dtype: str, mode: str) -> None:
        self.layout = layout
        self.history = ContributionHistory.from_layout(layout, dtype=dtype, mode=mode)
        self.start: dict[str, np.ndarray] | None = None

    @classmethod
    def from_config(cls, config, layout: ModelLayout, mode: str) -> ContributionLog | None:
        """The store ``config``'s ``unlearning-history`` asks for, or ``None`` when it is ``"off"``."""
        if config.unlearning_history == "off":
            return None
        return cls(layout, config.unlearning_history, mode)

    def record(
        self,
        server_round: int,
        current: ArrayRecord,
        accepted: Sequence[RecordDict],
        nodes: Sequence[int],
        sent: Mapping[int, Sequence[int]],
    ) -> None:
        """Store the contributions of round ``server_round``'s accepted replies.

        Args:
            current: the shared parameters the round sent (every delta is against them).
            accepted: the accepted reply contents, ``nodes`` their node ids, ``sent`` node id -> the users it was
                asked to train.

        Raises:
            ReplyError: as :func:`user_uploads`.
        """
        theta = decode_record(current, copy=False)
        if self.start is None:
            self.start = {k: np.array(v, dtype=np.float32) for k, v in theta.items()}
        for content, node in zip(accepted, nodes, strict=True):
            for user, (arrays, weight) in user_uploads(content, node, sent[int(node)]).items():
                rows, row_delta, dense_delta = delta_from_reply(arrays, theta, self.layout, 1)
                self.history.record(server_round, user, rows, row_delta, dense_delta, weight)

    def storage(self) -> dict:
        """The store's size for the results (bytes): ``bytes`` (the checkpoint form, metadata included), ``dtype``,
        ``rounds``, ``users``, ``bytes-per-round`` (round -> bytes) and ``bytes-per-user`` (mean and max over users)."""
        per_user = self.history.nbytes_per_user()
        values = list(per_user.values())
        return {
            "dtype": self.history.dtype.name,
            "bytes": self.history.nbytes(),
            "rounds": len(self.history.rounds()),
            "users": len(per_user),
            "bytes-per-round": {str(t): b for t, b in self.history.nbytes_per_round().items()},
            "bytes-per-user": {
                "mean": float(np.mean(values)) if values else 0.0,
                "max": int(max(values)) if values else 0,
            },
        }

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The store as checkpoint arrays (names under :data:`HISTORY_PREFIX` and :data:`START_PREFIX`)."""
        out = self.history.to_arrays(HISTORY_PREFIX)
        for key, value in (self.start or {}).items():
            out[f"{START_PREFIX}{key}"] = value
        return out

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Inverse of :meth:`state_arrays` (a checkpoint without the store leaves it empty)."""
        if f"{HISTORY_PREFIX}rounds" in arrays:
            self.history = ContributionHistory.from_arrays(arrays, HISTORY_PREFIX)
        start = {k[len(START_PREFIX) :]: np.asarray(v) for k, v in arrays.items() if k.startswith(START_PREFIX)}
        self.start = start or None
