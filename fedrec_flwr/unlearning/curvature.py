"""Curvature products of a loss with ``torch.func``, never forming the matrix: gradients, Hessian-vector products
(Pearlmutter 1994; forward-over-reverse), the generalised Gauss-Newton product of a :class:`CompositeLoss`
(Schraudolph 2002; Martens 2010) and its diagonal, the preconditioner of the trust-region solver
(:func:`fedrec_flwr.unlearning.krylov.steihaug_cg`). The operators HF-KCU's Krylov solvers are run on
(``curvature``: :data:`CURVATURES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Params = dict[str, torch.Tensor]


def gradient(loss_fn: Callable[[Params], torch.Tensor], params: Mapping[str, torch.Tensor]) -> Params:
    """``∇ loss_fn(params)`` as a dict shaped like ``params`` (``torch.func.grad``; no graph is kept)."""
    return {k: v.detach() for k, v in torch.func.grad(loss_fn)(dict(params)).items()}


def hessian_vector_product(
    loss_fn: Callable[[Params], torch.Tensor], params: Mapping[str, torch.Tensor], vector: Mapping[str, torch.Tensor]
) -> Params:
    """``H v`` where ``H = ∇² loss_fn(params)``, without forming ``H``.

    Forward-over-reverse: the directional derivative of the gradient, ``d/dt ∇L(params + t v)`` at ``t = 0``
    (``torch.func.jvp`` of ``torch.func.grad``; Pearlmutter 1994). Costs about two gradient evaluations and keeps no
    autograd graph afterwards, so memory stays flat over any number of products. Works through ``nn.Embedding``
    lookups (the rows not looked up get exactly 0).

    Args:
        loss_fn: ``params -> scalar`` (e.g. a ``torch.func.functional_call`` of the model and a loss).
        params: name -> tensor at which the Hessian is taken.
        vector: name -> tensor, same keys and shapes as ``params``.
    Returns:
        name -> ``(H v)[name]``.
    Raises:
        ValueError: ``vector``'s keys or shapes differ from ``params``'.
    """
    _check_vector("hessian_vector_product", params, vector)
    primals = dict(params)
    tangents = {k: vector[k].to(dtype=v.dtype, device=v.device) for k, v in primals.items()}
    _, product = torch.func.jvp(torch.func.grad(loss_fn), (primals,), (tangents,))
    return {k: v.detach() for k, v in product.items()}


CURVATURES = ("gauss-newton", "hessian")
"""Values of ``curvature``: the generalised Gauss-Newton matrix (:func:`gauss_newton_vector_product`) and the exact
Hessian (:func:`hessian_vector_product`)."""


@dataclass(frozen=True)
class CompositeLoss:
    """A loss written as ``output_loss(outputs(params)) + regulariser(params)``, so that its generalised Gauss-Newton
    matrix is defined (Schraudolph 2002; Martens 2010, "Deep learning via Hessian-free optimization").

    Attributes:
        outputs: ``params -> z``, the model's outputs (logits / scores), a tensor of any shape.
        output_loss: ``z -> scalar``, convex in ``z`` (then the Gauss-Newton matrix is positive semi-definite).
        regulariser: ``params -> scalar`` (e.g. L2 weight decay) whose exact Hessian is added, or ``None``.
    """

    outputs: Callable[[Params], torch.Tensor]
    output_loss: Callable[[torch.Tensor], torch.Tensor]
    regulariser: Callable[[Params], torch.Tensor] | None = None
    output_curvature: Callable[[torch.Tensor], torch.Tensor] | None = None
    """``z -> diag(H_z)`` (shaped like ``z``), the diagonal of ``output_loss``'s Hessian; needed by
    :func:`gauss_newton_diagonal` only."""
    row_keys: tuple = ()
    """Keys of row tables (item embeddings) from which each output reads exactly one row, ``example_rows[j]``."""
    example_rows: torch.Tensor | None = None
    """``(n_out,)`` int64: the row of the ``row_keys`` tables output ``j`` reads."""
    example_outputs: Callable[[Params], torch.Tensor] | None = None
    """``outputs`` with every ``row_keys`` table replaced by an ``(n_out, ...)`` table whose row ``j`` is the row output
    ``j`` reads: so ``∂z_j / ∂(row j)`` is the per-example Jacobian block, from one backward pass."""

    def __call__(self, params: Params) -> torch.Tensor:
        loss = self.output_loss(self.outputs(params))
        return loss if self.regulariser is None else loss + self.regulariser(params)


def gauss_newton_vector_product(
    loss: CompositeLoss, params: Mapping[str, torch.Tensor], vector: Mapping[str, torch.Tensor]
) -> Params:
    """``G v = J^T H_z J v + ∇²R v``: the generalised Gauss-Newton (GGN) matrix of ``loss`` times ``vector``.

    ``J = ∂z/∂params`` is the Jacobian of ``loss.outputs``, ``H_z = ∇²_z output_loss`` the loss Hessian with respect
    to the outputs and ``R`` the regulariser (Schraudolph 2002; Martens 2010, Sec. 4.2). It drops the Hessian's term
    ``sum_j (∂ℓ/∂z_j) ∇² z_j`` (the outputs' own curvature, what makes NCF's Hessian indefinite away from a minimum),
    so for a convex ``output_loss`` and a convex ``R`` the matrix is positive semi-definite whatever ``params`` are.
    For BCE on logits ``H_z`` is diagonal, ``w_j sigma(z_j) (1 - sigma(z_j))``; for BPR on pairs ``d = z_+ - z_-``
    it is ``w sigma(d) (1 - sigma(d)) [[1, -1], [-1, 1]]`` per pair (both computed here by differentiation, not by
    hand). For a model linear in ``params`` given the private embeddings (MF's score ``p_u . q_i`` in ``q_i``) the
    GGN equals the Hessian.

    Computed matrix-free with ``torch.func``: ``J v`` by ``jvp`` of ``outputs``, ``H_z (J v)`` by ``jvp`` of
    ``grad(output_loss)``, ``J^T (.)`` by ``vjp`` of ``outputs``; no graph is kept afterwards.

    Args:
        loss: the loss in its composite form.
        params: name -> tensor at which the matrix is taken.
        vector: name -> tensor, same keys and shapes as ``params``.
    Returns:
        name -> ``(G v)[name]``.
    Raises:
        ValueError: ``vector``'s keys or shapes differ from ``params'``.
    """
    _check_vector("gauss_newton_vector_product", params, vector)
    primals = dict(params)
    tangents = {k: vector[k].to(dtype=v.dtype, device=v.device) for k, v in primals.items()}
    z, jv = torch.func.jvp(loss.outputs, (primals,), (tangents,))
    z = z.detach()
    _, hjv = torch.func.jvp(torch.func.grad(loss.output_loss), (z,), (jv.detach(),))
    _, pullback = torch.func.vjp(loss.outputs, primals)
    (product,) = pullback(hjv.detach())
    product = {k: v.detach() for k, v in product.items()}
    if loss.regulariser is not None:
        extra = hessian_vector_product(loss.regulariser, params, vector)
        product = {k: product[k] + extra[k] for k in product}
    return product


def gauss_newton_diagonal(
    loss: CompositeLoss,
    params: Mapping[str, torch.Tensor],
    *,
    probes: int = 8,
    generator: torch.Generator | None = None,
) -> Params:
    """``diag(G)``: the diagonal of the generalised Gauss-Newton matrix ``G = J^T H_z J + ∇²R`` of
    :func:`gauss_newton_vector_product`, for a preconditioner (ours).

    ``diag(J^T H_z J)_k = sum_j H_z[j, j] (∂z_j / ∂theta_k)^2`` wherever at most one output's row of ``theta`` is
    touched per entry's cross term, which holds exactly on the ``row_keys`` tables: each output reads one row, so the
    cross terms ``H_z[j, l] J_jk J_lk`` (``j != l``) of ``diag(J^T H_z J)`` vanish there unless outputs ``j, l`` read
    the same row *and* ``H_z[j, l] != 0``; for BCE (diagonal ``H_z``) never; for BPR (``H_z`` couples a positive
    with its negative) only if a pair's two items were the same row, which the negative sampler excludes. One
    backward pass of ``sum_j eps_j z_j`` with respect to the per-example tables (``example_outputs``) gives
    ``eps_j ∂z_j / ∂(row j)`` for every ``j`` at once; squared with ``eps_j^2 = H_z[j, j]`` and summed into the rows
    read, it is the exact row diagonal. On the other (dense) keys, every output touches every entry, so the diagonal
    is estimated by Monte Carlo: ``E[(J^T eps)^2] = diag(J^T E[eps eps^T] J)`` with ``eps_j = s_j sqrt(H_z[j, j])``
    and Rademacher signs ``s`` (the MC Gauss-Newton diagonal, cf. Martens, Sutskever & Swersky 2012, "Estimating
    the Hessian by back-propagating curvature"), averaged over ``probes`` draws: unbiased when ``H_z`` is diagonal
    (BCE); for BPR it leaves out each pair's cross term ``2 H_z[+, -] J_+k J_-k`` (ours: a preconditioner only needs
    the scale). The regulariser's diagonal is ``∇²R 1`` (exact for an L2 term, whose Hessian is diagonal).

    Args:
        loss: a :class:`CompositeLoss` with ``output_curvature``, ``example_rows`` and ``example_outputs`` set.
        params: name -> tensor at which the matrix is taken (row tables ``(T, ...)``).
        probes: sign draws for the dense keys (>= 1; one draw suffices when every key is a row table).
        generator: the random stream of the signs (``None``: torch's global one).
    Returns:
        name -> ``diag(G)[name]`` (>= 0), shaped like ``params``.
    Raises:
        ValueError: ``loss`` lacks the per-example parts, or ``probes < 1``.
    """
    if loss.output_curvature is None or loss.example_outputs is None or loss.example_rows is None:
        raise ValueError("gauss_newton_diagonal: the loss needs output_curvature, example_rows and example_outputs")
    if isinstance(probes, bool) or int(probes) != probes or probes < 1:
        raise ValueError(f"gauss_newton_diagonal: probes must be an int >= 1, got {probes!r}")
    rows = loss.example_rows
    with torch.no_grad():
        z = loss.outputs(dict(params))
        scale = loss.output_curvature(z).clamp_min(0.0).sqrt()
    expanded = {k: (v.index_select(0, rows) if k in loss.row_keys else v) for k, v in params.items()}
    _, pullback = torch.func.vjp(loss.example_outputs, expanded)
    dense = [k for k in params if k not in loss.row_keys]
    draws = int(probes) if dense else 1
    out = {k: torch.zeros_like(v) for k, v in params.items()}
    for draw in range(draws):
        signs = torch.randint(0, 2, tuple(z.shape), generator=generator).to(z) * 2.0 - 1.0
        (grads,) = pullback((signs * scale).detach())
        for key, value in grads.items():
            if key in loss.row_keys:
                if draw == 0:  # exact: the same in every draw
                    out[key].index_add_(0, rows, value.detach() ** 2)
            else:
                out[key] += value.detach() ** 2 / draws
    if loss.regulariser is not None:
        extra = hessian_vector_product(loss.regulariser, params, {k: torch.ones_like(v) for k, v in params.items()})
        out = {k: out[k] + extra[k] for k in out}
    return out


def curvature_vector_product(
    loss_fn: Callable[[Params], torch.Tensor],
    params: Mapping[str, torch.Tensor],
    vector: Mapping[str, torch.Tensor],
    curvature: str,
) -> Params:
    """``C v`` for ``curvature`` in :data:`CURVATURES`: the GGN (``loss_fn`` must be a :class:`CompositeLoss`) or the
    exact Hessian.

    Raises:
        ValueError: an unknown curvature, or ``"gauss-newton"`` for a loss that is not a :class:`CompositeLoss`.
    """
    if curvature == "hessian":
        return hessian_vector_product(loss_fn, params, vector)
    if curvature == "gauss-newton":
        if not isinstance(loss_fn, CompositeLoss):
            raise ValueError("curvature 'gauss-newton' needs the loss as a CompositeLoss (outputs, output_loss)")
        return gauss_newton_vector_product(loss_fn, params, vector)
    raise ValueError(f"curvature must be one of {CURVATURES}, got {curvature!r}")


def _check_vector(name: str, params: Mapping[str, torch.Tensor], vector: Mapping[str, torch.Tensor]) -> None:
    if set(vector) != set(params):
        raise ValueError(f"{name}: vector keys {sorted(vector)} differ from params {sorted(params)}")
    for key, value in params.items():
        if tuple(vector[key].shape) != tuple(value.shape):
            raise ValueError(
                f"{name}: vector[{key!r}] has shape {tuple(vector[key].shape)}, expected {tuple(value.shape)}"
            )
