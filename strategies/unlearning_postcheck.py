"""``unlearning-post-check = "on"``: after an approximate unlearning step (``hfkcu``, ``gradient-ascent``), check it
with :func:`fedrec_flwr.unlearning.postcheck.post_check` and fall back when it fails.

**The check.** Utility: the remaining users' (the run's evaluation users, the forget set left out) HR@k and NDCG@k on
their *validation* item (``holdout-validation``; never the test item), ``k`` 10 (else the largest of ``ks``), before
and after the step; each may fall by at most ``post-check-max-hr-drop`` / ``post-check-max-ndcg-drop`` (absolute).
Influence: the forgotten users' mean training loss (their own clients compute it, ``unlearn_gradient``) before the
step minus after it, passed as the check's ``margin``, must be at most ``-post-check-min-loss-rise``: the step must
not have fit the forgotten data better (ours: an in-run proxy; the target exposure of a promotion attack needs every
user's scores of every item, which no query returns).

**The fallback.** A failed check undoes the step (the model before it is restored); then, with the stored
contributions (``unlearning-history``), the phase runs ``rollback`` (:mod:`.unlearning_rollback`, with the run's rollback keys) from the
model before the step; without them the model stays as it was before the step and the report records that a
retraining run is needed (``unlearning = "retrain"``: the forgotten users never train, from round 1, which a run
cannot do after the fact). ``unlearning.json``'s ``post-check`` says what was measured, which method's result the
run kept (``kept``) and why.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from fedrec_flwr.unlearning.postcheck import Expectations, post_check

log = logging.getLogger("fedrec_flwr.strategies.unlearning")  # the phase's logger: its lines keep their source


def validation_metrics(strategy, grid: Grid, arrays: ArrayRecord, server_round: int) -> dict[str, float]:
    """The remaining users' mean metrics on their validation item at ``arrays`` (one federated evaluation)."""
    saved = strategy.evaluate_split
    strategy.evaluate_split = "val"
    try:
        return strategy.evaluate_arrays(grid, arrays, server_round)
    finally:
        strategy.evaluate_split = saved


def cut_off(metrics: dict[str, float]) -> int:
    """The check's ``k``: 10 when ``HR@10`` was measured, else the largest measured ``HR@k``.

    Raises:
        ValueError: no ``HR@k`` was measured (no evaluation user).
    """
    ks = sorted(int(k[3:]) for k in metrics if k.startswith("HR@") and k[3:].isdigit())
    if not ks:
        raise ValueError("the post-check measured no HR@k on the validation item (no evaluation user?)")
    return 10 if 10 in ks else ks[-1]


def check_and_fall_back(
    phase, grid: Grid, before: ArrayRecord, after: ArrayRecord, server_round: int, report: dict
) -> ArrayRecord:
    """Check the step from ``before`` to ``after`` (module docstring) and return the arrays the run keeps;
    ``report["post-check"]`` gets the check (``passed``, ``reasons``, ``measured``), ``kept`` (the method whose result
    the run keeps: the step's, ``"rollback"`` or ``"none"``) and ``why``; a fallback's own report is
    ``report["fallback"]``.

    Raises:
        UnlearningFailed: a node failed during the check or the fallback.
    """
    from .unlearning import ClientUnlearning

    strategy, s = phase.strategy, phase.settings
    messages = phase.messages
    utility_before = validation_metrics(strategy, grid, before, server_round)
    utility_after = validation_metrics(strategy, grid, after, server_round)
    forget = np.asarray(s.forget, dtype=np.int64)
    _, loss_after = phase.gradient(grid, after, forget)
    margin = float(report["forget-loss"]) - float(loss_after)
    expectations = Expectations(
        max_hr_drop=s.post_check_max_hr_drop,
        max_ndcg_drop=s.post_check_max_ndcg_drop,
        max_margin=-s.post_check_min_loss_rise,
    )
    check = post_check(utility_before, utility_after, expectations, margin=margin, k=cut_off(utility_before))
    result = check.as_dict()
    result["measured"]["forget-loss-after"] = float(loss_after)
    result["queries"] = phase.messages - messages
    report["post-check"] = result
    if check.passed:
        result.update({"kept": s.method, "why": "every expectation held"})
        return after
    log.warning("unlearning: the post-check of %s failed (%s); the step is undone", s.method, "; ".join(check.reasons))
    if strategy.contribution_log is None:
        result.update(
            {
                "kept": "none",
                "why": "the check failed and no contributions were stored (unlearning-history = 'off'): the model "
                "before the step is kept; retraining without the forgotten users (unlearning = 'retrain') is needed",
                "retraining-needed": True,
            }
        )
        log.warning("unlearning: no stored contributions to roll back; a retraining run is needed")
        return before
    fallback = ClientUnlearning(strategy, s.replace(method="rollback"), timeout=phase.timeout)
    new, fallback_report = fallback.run(grid, before, server_round)
    report["fallback"] = fallback_report
    result.update({"kept": "rollback", "why": "the check failed; rolled back with the stored contributions"})
    return new
