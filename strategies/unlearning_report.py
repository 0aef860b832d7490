"""The console lines of an unlearning phase: its report (:func:`describe_unlearning`) and the ranking metrics just
before it (:func:`describe_before`)."""

from __future__ import annotations

from collections.abc import Mapping

from fedrec_flwr.unlearning.krylov import TERMINATIONS


def describe_unlearning(report: Mapping) -> str:
    """One console line for an unlearning phase's ``report`` (the dict written to ``unlearning.json``): the method,
    the users, the cost, why the Krylov solve stopped (``cg-termination``: ``"tolerance"``, ``"iterations"``,
    ``"negative-curvature"``, ``"boundary"``, ``"zero-rhs"``; :class:`fedrec_flwr.unlearning.krylov.CGResult`), the line search's
    step and why it stopped, and the size of the change (``relative-update``: ``||step|| / ||theta||``). Keys a method
    does not produce are left out, so this serves ``continue``, ``gradient-ascent`` and ``hfkcu``."""
    parts = [
        f"unlearning ({report.get('method')}) of {len(report.get('forget-users', ()))} users after round "
        f"{report.get('round')}: {float(report.get('seconds', 0.0)):.2f} s, {report.get('messages', 0)} messages"
    ]
    if "cg-iterations" in report:
        solve = f"CG {report['cg-iterations']} it, relative residual {float(report['cg-residual']):.2e}"
        if report.get("cg-termination"):
            solve += f", stopped on {report['cg-termination']}"
            if report["cg-termination"] in TERMINATIONS:
                solve += f" ({TERMINATIONS[report['cg-termination']]})"
        parts.append(solve)
    if "line-search-step" in report:
        parts.append(
            f"line search step {float(report['line-search-step']):.3g} ({report.get('line-search-termination', '')})"
        )
    if "relative-update" in report:
        parts.append(f"update {100 * float(report['relative-update']):.3g}% of the model's norm")
    return "; ".join(parts)


def describe_before(before: Mapping, server_round: int) -> str:
    """The console line of the ranking metrics measured just before the unlearning phase after ``server_round``
    (``before``: metric name -> value, e.g. ``{"HR@10": 0.41}``), saying that the metrics logged from that round's
    evaluation on (that round's included) are those of the unlearned model; ``""`` when ``before`` has no ranking
    metric."""
    shown = {k: float(v) for k, v in before.items() if "@" in k and isinstance(v, (int, float))}
    if not shown:
        return ""
    order = sorted(shown, key=lambda k: (k.split("@")[0], int(k.split("@")[1]) if k.split("@")[1].isdigit() else 0))
    return (
        "before unlearning: "
        + ", ".join(f"{k} {shown[k]:.4f}" for k in order)
        + f"; every evaluation from round {server_round} on is of the unlearned model"
    )
