"""How far the unlearning phase moves along HF-KCU's step (``line-search``; ours, see
:mod:`fedrec_flwr.strategies.unlearning`): a line search on the remaining users' loss (``"remaining-loss"``) or the
membership-margin calibration (``"membership-margin"``, :mod:`fedrec_flwr.unlearning.margin`).

Each function takes the running phase (``phase``, a :class:`~fedrec_flwr.strategies.unlearning.ClientUnlearning`)
and queries the nodes through it; nodes answer sums only, never a per-user value.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from fedrec_flwr.unlearning.krylov import LineSearchResult, ladder_line_search
from fedrec_flwr.unlearning.margin import bracket_root, dominated_items, popularity_bins
from fedrec_flwr.wire import ARRAYS, METRICS, UNLEARN_COUNTS, UNLEARN_LOSS, UNLEARN_MARGIN

from .unlearning_transport import step_sums

log = logging.getLogger("fedrec_flwr.strategies.unlearning")  # the phase's logger: its lines keep their source


def remaining_loss(
    phase,
    grid: Grid,
    arrays: ArrayRecord,
    nodes,
    forget: np.ndarray,
    support: np.ndarray,
    direction: dict,
    steps: list,
) -> list[float]:
    """``[L_R(theta + a d) for a in steps]``: the remaining (with causal weighting: affected) users' summed
    influence loss along ``direction``, from one ``unlearn_loss`` query round (each node returns one scalar sum
    per step)."""
    replies = phase._query(
        grid,
        UNLEARN_LOSS,
        phase._targets(nodes, forget, {"steps": [float(a) for a in steps]}),
        arrays,
        vector=direction,
        support=support,
    )
    return step_sums(replies, UNLEARN_LOSS, "loss-sums", len(steps)).tolist()


def line_search(
    phase, grid: Grid, arrays: ArrayRecord, nodes, forget: np.ndarray, support: np.ndarray, step: dict
) -> LineSearchResult:
    """``line-search = "remaining-loss"``: the multiple ``a`` of the solver's step that minimises the remaining
    users' summed training loss ``L_R(theta + a step)`` (:func:`fedrec_flwr.unlearning.krylov.ladder_line_search`; every
    round one :meth:`remaining_loss` query)."""
    s = phase.settings
    return ladder_line_search(
        lambda steps: phase.remaining_loss(grid, arrays, nodes, forget, support, step, steps),
        max_step=s.line_search_max_step,
        max_rounds=s.line_search_rounds,
    )


def positive_counts(phase, grid: Grid, forget: np.ndarray, why: str) -> dict[str, np.ndarray]:
    """``{"remaining": (I,), "forgotten": (I,)}`` float64 training positives per item of the remaining and the
    forgotten users: one ``unlearn_counts`` round (every node; no model sent), node totals summed. Warns (naming
    ``why``, the key that asks for them) what a node's counts reveal."""
    topology = phase.strategy._topology()
    nodes = sorted({int(n) for n in topology.user_to_node.tolist()})
    exclude = [int(u) for u in forget]
    smallest = int(np.unique(topology.user_to_node, return_counts=True)[1].min())
    log.warning(
        "%s: every node sends its users' training-positive counts per item "
        "(unlearn_counts); a node serving %d user%s reveals %s (fedrec_flwr/unlearning/margin.py, 'Privacy "
        "cost')",
        why,
        smallest,
        "" if smallest == 1 else "s",
        "that user's training items" if smallest == 1 else "the sum of its users' training items",
    )
    replies = phase._query(grid, UNLEARN_COUNTS, {n: {"exclude": exclude} for n in nodes}, ArrayRecord())
    counts = {"remaining": 0.0, "forgotten": 0.0}
    for reply in replies:
        for key in counts:
            counts[key] = counts[key] + reply.content[ARRAYS][key].numpy().astype(np.float64)
    return counts


def margin_step(phase, grid: Grid, arrays: ArrayRecord, forget: np.ndarray, step: dict, report: dict) -> float:
    """``line-search = "membership-margin"``: the multiple ``a`` of the solver's step at which the forgotten
    users' mean membership margin on the items they dominate reaches 0 (:mod:`fedrec_flwr.unlearning.margin`). One
    ``unlearn_counts`` round (every node; no model sent), then :func:`fedrec_flwr.unlearning.margin.bracket_root`'s
    ``unlearn_margin`` rounds (the forgotten users' nodes), at most ``line-search-rounds`` of them, up to
    ``line-search-max-step``. Returns ``a`` (1 when no forgotten positive is a dominated item)."""
    s = phase.settings
    topology = phase.strategy._topology()
    counts = positive_counts(phase, grid, forget, "line-search = 'membership-margin'")
    bins = popularity_bins(counts["remaining"])
    dominated = dominated_items(counts["remaining"], counts["forgotten"])
    groups = topology.group(np.asarray(forget, dtype=np.int64))
    common = {"bins": [int(b) for b in bins], "dominated": [int(i) for i in dominated]}
    found: dict = {}

    def evaluate(steps) -> list[float]:
        if not steps:
            return []
        got = phase._query(
            grid,
            UNLEARN_MARGIN,
            {n: {"users": us, "steps": [float(a) for a in steps], **common} for n, us in groups.items()},
            arrays,
            vector=step,
        )
        sums = step_sums(got, UNLEARN_MARGIN, "margin-sums", len(steps))
        count = found["count"] = sum(int(reply.content[METRICS]["margin-count"]) for reply in got)
        return (sums / count).tolist() if count else [0.0] * len(steps)

    report["margin-dominated-items"] = int(dominated.size)
    if not np.intersect1d(dominated, np.flatnonzero(counts["forgotten"])).size:
        report.update({"margin-step": 1.0, "margin-termination": "no-dominated-items", "margin-rounds": 0})
        return 1.0
    result = bracket_root(evaluate, max_step=s.line_search_max_step, rounds=s.line_search_rounds)
    report.update(result.summary())
    report["margin-terms"] = int(found.get("count", 0))
    return result.step
