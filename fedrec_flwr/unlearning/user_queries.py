"""HF-KCU's queries on one user's side: the gradient of its influence loss, a curvature-vector product, and the local
CG solve of HF-KCU's Algorithm 1 (:mod:`fedrec_flwr.strategies.unlearning`). Each is taken of the influence objective
(:func:`fedrec_flwr.unlearning.influence.influence_objective`) at the server's shared parameters and returns only the
user's (or its node's) rows and the dense parameters; the user's data never leaves.

``client`` is a :class:`fedrec_flwr.clients.fedrec.FedRecClient` (its ``runtime``, ``user``, ``influence_items()`` and
``influence_objective(shared, extra_rows)``); the per-user client's methods of the same names delegate here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedrec_flwr.unlearning.influence import compact_vector, expand_compact, influence_objective
from fedrec_flwr.unlearning.krylov import CGResult, curvature_vector_product, flatten, gradient, krylov_solve, unflatten
from fedrec_flwr.wire import support_rows


def influence_gradient(client, shared: Mapping[str, np.ndarray]) -> tuple[dict, dict, float]:
    """``∇_theta L_u`` at the server's shared parameters ``shared`` (key -> full array): ``(dense, rows, loss)``
    (dense key -> float64 array; item key -> ``(row ids (T,), values (T, d))``; ``loss`` the value ``L_u``)."""
    with client.influence_objective(shared) as (loss_fn, params, items):
        grads = gradient(loss_fn, params)
        loss = float(loss_fn(params).detach())
        dense, rows = expand_compact(grads, items, client.runtime.layout)
    return dense, rows, loss


def influence_hvp(
    client,
    shared: Mapping[str, np.ndarray],
    direction: Mapping[str, np.ndarray],
    group: list | None = None,
    curvature: str = "hessian",
) -> tuple[dict, dict]:
    """``H_u v``: the user's loss Hessian (``curvature = "hessian"``) or Gauss-Newton matrix (``"gauss-newton"``,
    :func:`fedrec_flwr.unlearning.krylov.gauss_newton_vector_product`) at ``shared`` times ``direction`` (full arrays
    by shared key), as ``(dense, rows)`` like :func:`influence_gradient`'s; non-zero only on the user's rows and the
    dense parameters. With ``group`` (clients of the node's users, ``client`` included), the product of their summed
    losses, in one batched pass."""
    runtime = client.runtime
    with influence_objective(runtime, group or [client], shared) as (loss_fn, params, items):
        vector = compact_vector(direction, items, params, runtime.layout.item_keys)
        product = curvature_vector_product(loss_fn, params, vector, curvature)
        return expand_compact(product, items, runtime.layout)


def influence_solve(
    client,
    shared: Mapping[str, np.ndarray],
    rhs: Mapping[str, np.ndarray],
    *,
    iterations: int,
    damping: float,
    tolerance: float,
    curvature: str = "hessian",
    solver: str = "cg",
    radius: float | None = None,
) -> tuple[dict, dict, CGResult]:
    """Local CG (HF-KCU's Algorithm 1, client side): ``x_u ≈ (H_u + damping I)^{-1} rhs`` on the user's own Hessian
    (or Gauss-Newton matrix: ``curvature``), by plain CG or trust-region CG within ``radius`` (``solver``,
    :func:`fedrec_flwr.unlearning.krylov.krylov_solve`). Rows of ``rhs`` outside the user's rows get ``rhs /
    damping`` (``H_u`` is 0 there), exactly as CG gives them. Returns ``(dense, rows, CGResult)``, ``dense`` and
    ``rows`` as :func:`influence_gradient`'s.

    Raises:
        ValueError: ``damping`` is 0 and ``rhs`` has rows the user's loss never touches (singular system).
    """
    layout = client.runtime.layout
    support = support_rows(rhs, layout)
    if damping == 0 and not np.isin(support, client.influence_items()).all():
        raise ValueError(
            f"user {client.user}: damping = 0 but the right-hand side has rows this user's loss never "
            "touches, where its Hessian is 0 (a singular system); use damping > 0"
        )
    with client.influence_objective(shared, extra_rows=support) as (loss_fn, params, items):
        shapes = {k: tuple(p.shape) for k, p in params.items()}
        compact = compact_vector(rhs, items, params, layout.item_keys)
        b = flatten({k: v.cpu().numpy() for k, v in compact.items()}, shapes)

        def matvec(flat: np.ndarray) -> np.ndarray:
            vector = {
                k: torch.as_tensor(v, dtype=params[k].dtype, device=params[k].device)
                for k, v in unflatten(flat, shapes).items()
            }
            product = curvature_vector_product(loss_fn, params, vector, curvature)
            return flatten({k: v.detach().cpu().numpy() for k, v in product.items()}, shapes)

        result = krylov_solve(
            matvec, b, solver=solver, iterations=iterations, damping=damping, tolerance=tolerance, radius=radius
        )
        solution = {k: torch.as_tensor(v) for k, v in unflatten(result.x, shapes).items()}
        dense, rows = expand_compact(solution, items, layout)
    return dense, rows, result
