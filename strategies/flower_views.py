"""What a Flower strategy run through :class:`~fedrec_flwr.strategies.flower_adapter.FlowerStrategyAdapter` sees:
the round's nodes as its grid (:class:`RoundNodes`), and our row-sparse replies as dense ones (:func:`dense_reply`,
:func:`with_users`). The formulas are in :mod:`fedrec_flwr.strategies.flower_adapter`'s docstring."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedrec_flwr.app.message_window import GridProxy
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.wire import ARRAYS, COUNT, METRICS, NUM_EXAMPLES, ROWS, SUM, ModelLayout

__all__ = ["RoundNodes", "dense_reply", "with_users"]


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


def with_users(reply: Message) -> Message:
    """An evaluation reply with ``num-users`` in its metrics (= its ``num-examples``, the users it evaluated), so a
    strategy weighting by ``num-users`` (``strategy-args = "weighted_by_key=num-users"``) finds its key."""
    if reply.has_error() or METRICS not in reply.content or "num-users" in reply.content[METRICS]:
        return reply
    metrics = MetricRecord({**dict(reply.content[METRICS]), "num-users": reply.content[METRICS][NUM_EXAMPLES]})
    return Message(content=RecordDict({**dict(reply.content.items()), METRICS: metrics}), metadata=reply.metadata)
