"""One user's data on its node, defined once for the per-user client (:class:`fedrec_flwr.clients.fedrec.FedRecClient`)
and the vectorized block engine (:mod:`fedrec_flwr.local.block_engine`, :mod:`fedrec_flwr.local.blocks`): its private
record in the node's ``context.state``, its training examples of a round, its evaluation phases and the
:class:`~fedrec_flwr.wire.UserUpdate` it uploads. The two paths read and write the same records and draw the same
examples, so a node may serve a user per user in one round and in a block the next.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from fedrec_flwr.arrays import decode_record, encode_array
from fedrec_flwr.data import sample_train_negatives
from fedrec_flwr.seeding import TAG_SHUFFLE, TAG_USER_INIT, torch_generator
from fedrec_flwr.state.client_state import STATE_PREFIX
from fedrec_flwr.wire import ModelLayout, UserUpdate

if TYPE_CHECKING:
    from fedrec_flwr.app.runtime import Runtime
    from fedrec_flwr.data import Split
    from fedrec_flwr.models.base import RecModel

EVALUATION_SPLITS = ("test", "val", "test+val")
"""The values of an evaluate message's ``"split"`` key (:func:`evaluation_phases`)."""


# ---------------------------------------------------------------------------------------------- private record
def user_state_key(user: int) -> str:
    """User ``user``'s key of its private parameters in ``context.state``: ``"user:<user>"``."""
    return f"{STATE_PREFIX}{user}"


def state_record(state: RecordDict, key: str) -> ArrayRecord | None:
    """The ``ArrayRecord`` stored under ``key`` in the node's ``state``, or ``None`` (also for another record type).

    A direct lookup: the state's ``array_records`` view rebuilds a dict of every record on each access, which costs
    O(users per node).
    """
    record = state.get(key) if key in state else None
    return record if isinstance(record, ArrayRecord) else None


def load_private(model: RecModel, state: RecordDict, user: int, seed: int) -> None:
    """Load ``user``'s private parameters from ``state`` into the one-user ``model``, or, on the user's first visit
    (no record), initialise them by :meth:`RecModel.reset_private` from the stream ``(seed, TAG_USER_INIT, user)``."""
    record = state_record(state, user_state_key(user))
    if record is None:
        model.reset_private(torch_generator(seed, TAG_USER_INIT, user))
    else:
        model.load_private_state(decode_record(record))


def save_private(model: RecModel, state: RecordDict, user: int) -> None:
    """Write the one-user ``model``'s private parameters to ``user``'s record in ``state`` (the node's own state:
    they never leave it)."""
    arrays = {k: encode_array(v.detach().cpu().numpy()) for k, v in model.private_state().items()}
    state[user_state_key(user)] = ArrayRecord(arrays)


# ---------------------------------------------------------------------------------------------- one round
@dataclass(frozen=True)
class RoundExamples:
    """One user's training examples of one round, in the compact item rows it trains.

    Attributes:
        items: ``(T,)`` int64 sorted global item rows: the user's positives and the round's sampled negatives.
        positives: ``(P,)`` the positives' local rows (indices into ``items``).
        negatives: ``(P * num-train-negatives,)`` the sampled negatives' local rows, in sampling order.
        generator: the round's shuffle stream ``(seed, TAG_SHUFFLE, user, round)``.
    """

    items: np.ndarray
    positives: np.ndarray
    negatives: np.ndarray
    generator: torch.Generator


def round_examples(runtime: Runtime, user: int, server_round: int) -> RoundExamples:
    """User ``user``'s :class:`RoundExamples` of round ``server_round`` (1-based): its training positives and
    ``num-train-negatives`` negatives per positive from :func:`fedrec_flwr.data.sample_train_negatives`."""
    cfg, split = runtime.config, runtime.split
    positives = split.positives(user)
    negatives = sample_train_negatives(split, user, server_round, cfg.num_train_negatives, cfg.seed)
    items = np.union1d(positives, negatives).astype(np.int64)
    generator = torch_generator(cfg.seed, TAG_SHUFFLE, user, server_round)
    return RoundExamples(items, np.searchsorted(items, positives), np.searchsorted(items, negatives), generator)


def evaluation_phases(split: Split, config: Mapping[str, Any]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The leave-one-out phases an evaluate message asks for: ``(metric prefix, targets (U,), negatives (U, C-1))``,
    test before validation.

    Args:
        split: the run's :class:`~fedrec_flwr.data.split.Split` (``test_items`` / ``test_negatives``, and
            ``val_items`` / ``val_negatives`` with ``holdout-validation``).
        config: ``"split"`` = ``"test"`` (default), ``"val"`` or ``"test+val"`` (both; the validation metrics are
            prefixed ``"val-"``).

    Raises:
        ValueError: an unknown split, or ``"val"`` without validation items.
    """
    which = str(config.get("split", "test"))
    if which not in EVALUATION_SPLITS:
        raise ValueError(f"evaluation split must be 'test', 'val' or 'test+val', got {which!r}")
    if "val" in which and split.val_items is None:
        raise ValueError(f"evaluation on {which!r} needs holdout-validation = true")
    phases = []
    if which in ("test", "test+val"):
        phases.append(("", split.test_items, split.test_negatives))
    if which in ("val", "test+val"):
        phases.append(("val-" if which == "test+val" else "", split.val_items, split.val_negatives))
    return phases


def user_update(
    model: RecModel,
    layout: ModelLayout,
    values: Mapping[str, torch.Tensor],
    result,
    weight: float | None = None,
    is_gradient: bool = False,
) -> UserUpdate:
    """A :class:`UserUpdate` of shared ``values`` (parameters or gradients, shaped as ``model``'s current
    parameters): dense keys whole, item tables cut to the rows the user trained on.

    Args:
        model: the one-user model; inside :meth:`RecModel.item_subset` its item tables (and so ``values``) are compact
            and indexed through the subset, else full ``(num_items, d)``.
        layout: the run's :class:`~fedrec_flwr.wire.ModelLayout` (dense and item keys).
        values: shared key -> tensor.
        result: the local training's result: ``touched_items`` (``(T,)`` global item ids), ``num_examples``, ``loss``.
        weight, is_gradient: as :class:`UserUpdate`'s fields.
    """
    arrays = {k: v.detach().cpu().numpy() for k, v in values.items()}
    touched = np.asarray(result.touched_items, dtype=np.int64)
    subset = model.active_item_subset
    index = touched if subset is None else np.searchsorted(subset, touched)
    return UserUpdate(
        dense={k: arrays[k] for k in layout.dense_keys},
        rows={k: (touched, arrays[k][index]) for k in layout.item_keys},
        num_examples=int(result.num_examples),
        loss=float(result.loss),
        weight=weight,
        is_gradient=is_gradient,
    )
