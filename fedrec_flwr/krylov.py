"""Hessian-free Krylov tools: conjugate gradient on a damped operator, Hessian-vector products with ``torch.func``, and
the row-sparse vectors of shared parameters that unlearning messages carry.

Used by HF-KCU (Mahdavi, Zamanifar, Farhadi, Kashefi, "Causal Unlearning in Collaborative Optimization: Exact and
Approximate Influence Reversal under Adversarial Contributions", arXiv:2605.20341): the unlearning step solves
``(H + damping * I) x = g`` with conjugate gradient, touching the Hessian ``H`` only through products ``H v``
(Pearlmutter 1994; forward-over-reverse differentiation), so ``H`` is never formed. Pure numpy / PyTorch, no Flower.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)


CURVATURE_EPS = 1e-10
"""A direction's curvature counts as non-positive below this fraction of the largest seen (``p^T A p / p^T p``), so
the null directions of a singular operator, whose curvature is 0 up to rounding, stop CG instead of blowing it up."""


@dataclass
class CGResult:
    """Outcome of :func:`conjugate_gradient`.

    Attributes:
        x: the last iterate, shaped like ``b``.
        iterations: operator products done (0 when ``b`` = 0).
        residual: relative residual ``||b - (A + damping I) x|| / ||b||`` of the last iterate (CG's recursive
            residual; 0 when ``b`` = 0).
        converged: ``residual <= tolerance``.
        negative_curvature: CG met a direction ``p`` with ``p^T (A + damping I) p <= 0``, or 0 up to rounding
            (:data:`CURVATURE_EPS`): the damped operator is not positive definite. It stopped there; ``x`` is the
            iterate before that direction.
    """

    x: np.ndarray
    iterations: int
    residual: float
    converged: bool
    negative_curvature: bool

    def summary(self) -> dict:
        """The scalar facts, for logs and ``unlearning.json``."""
        return {"cg-iterations": self.iterations, "cg-residual": self.residual, "cg-converged": self.converged,
                "cg-negative-curvature": self.negative_curvature}


def conjugate_gradient(matvec: Callable[[np.ndarray], np.ndarray], b: np.ndarray, *, iterations: int = 10,
                       damping: float = 0.0, tolerance: float = 1e-6) -> CGResult:
    """Solve ``(A + damping * I) x = b`` for a symmetric operator ``A`` given only as ``matvec(v) = A v``.

    Hestenes & Stiefel (1952); Nocedal & Wright, *Numerical Optimization* (2nd ed.), Algorithm 5.2, started at
    ``x0 = 0``. In exact arithmetic it solves an ``n``-dimensional positive definite system in at most ``n``
    iterations (at most the number of distinct eigenvalues). It stops early, with a flag, on non-positive curvature
    (Nocedal & Wright, Algorithm 7.1's test), which is how an indefinite Hessian without enough damping shows.

    Args:
        matvec: ``v -> A v`` on float64 arrays shaped like ``b``.
        b: the right-hand side (any shape; float64 is used inside).
        iterations: at most this many products (CG's ``k``; >= 1).
        damping: ``lambda >= 0`` added to the diagonal.
        tolerance: stop when the relative residual ``||r|| / ||b||`` is at most this.

    Returns:
        :class:`CGResult`. A non-converged result is returned (and logged by the caller), never hidden.

    Raises:
        ValueError: ``iterations < 1``, a negative or non-finite ``damping`` / ``tolerance``, a non-finite ``b``, or
            ``matvec`` returning a wrong shape or a non-finite value.
    """
    if isinstance(iterations, bool) or int(iterations) != iterations or iterations < 1:
        raise ValueError(f"conjugate_gradient: iterations must be an int >= 1, got {iterations!r}")
    for name, value in (("damping", damping), ("tolerance", tolerance)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"conjugate_gradient: {name} must be a finite number >= 0, got {value!r}")
    b = np.asarray(b, dtype=np.float64)
    if not np.isfinite(b).all():
        raise ValueError("conjugate_gradient: the right-hand side b contains NaN or Inf")
    x = np.zeros_like(b)
    b_norm = float(np.linalg.norm(b))
    if b_norm == 0.0:
        return CGResult(x, 0, 0.0, True, False)
    r = b.copy()
    p = r.copy()
    rs = float(np.vdot(r, r))
    done = 0
    negative = False
    largest = 0.0  # the largest Rayleigh quotient p^T A p / p^T p seen: the operator's scale
    for _ in range(int(iterations)):
        ap = np.asarray(matvec(p), dtype=np.float64)
        if ap.shape != b.shape:
            raise ValueError(f"conjugate_gradient: matvec returned shape {ap.shape}, expected {b.shape}")
        if not np.isfinite(ap).all():
            raise ValueError("conjugate_gradient: matvec returned NaN or Inf")
        ap = ap + damping * p
        done += 1
        p_norm2 = float(np.vdot(p, p))
        curvature = float(np.vdot(p, ap))
        largest = max(largest, curvature / p_norm2)
        if curvature <= CURVATURE_EPS * largest * p_norm2:  # <= 0, or 0 up to rounding (a singular operator)
            negative = True
            break
        alpha = rs / curvature
        x += alpha * p
        r -= alpha * ap
        rs_new = float(np.vdot(r, r))
        if math.sqrt(rs_new) <= tolerance * b_norm:
            rs = rs_new
            break
        p = r + (rs_new / rs) * p
        rs = rs_new
    residual = math.sqrt(rs) / b_norm
    return CGResult(x, done, residual, residual <= tolerance, negative)


# ---------------------------------------------------------------------------------------------- products
Params = dict[str, torch.Tensor]


def gradient(loss_fn: Callable[[Params], torch.Tensor], params: Mapping[str, torch.Tensor]) -> Params:
    """``∇ loss_fn(params)`` as a dict shaped like ``params`` (``torch.func.grad``; no graph is kept)."""
    return {k: v.detach() for k, v in torch.func.grad(loss_fn)(dict(params)).items()}


def hessian_vector_product(loss_fn: Callable[[Params], torch.Tensor], params: Mapping[str, torch.Tensor],
                           vector: Mapping[str, torch.Tensor]) -> Params:
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
    if set(vector) != set(params):
        raise ValueError(f"hessian_vector_product: vector keys {sorted(vector)} differ from params {sorted(params)}")
    for key, value in params.items():
        if tuple(vector[key].shape) != tuple(value.shape):
            raise ValueError(f"hessian_vector_product: vector[{key!r}] has shape {tuple(vector[key].shape)}, "
                             f"expected {tuple(value.shape)}")
    primals = dict(params)
    tangents = {k: vector[k].to(dtype=v.dtype, device=v.device) for k, v in primals.items()}
    _, product = torch.func.jvp(torch.func.grad(loss_fn), (primals,), (tangents,))
    return {k: v.detach() for k, v in product.items()}


# ---------------------------------------------------------------------------------------------- vectors
def flatten(vector: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]) -> np.ndarray:
    """Concatenate ``vector``'s arrays in ``shapes``' key order into one float64 array."""
    return np.concatenate([np.asarray(vector[k], dtype=np.float64).reshape(-1) for k in shapes]) if shapes else \
        np.zeros(0)


def unflatten(flat: np.ndarray, shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """Inverse of :func:`flatten`.

    Raises:
        ValueError: ``flat`` has the wrong length.
    """
    sizes = [int(np.prod(s)) for s in shapes.values()]
    if flat.size != sum(sizes):
        raise ValueError(f"unflatten: got {flat.size} values, the shapes need {sum(sizes)}")
    out, start = {}, 0
    for (key, shape), size in zip(shapes.items(), sizes):
        out[key] = flat[start:start + size].reshape(shape)
        start += size
    return out
