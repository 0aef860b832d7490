"""Optimizers over stacked per-user parameters ``(k, ...)`` for the vectorized block path
(:mod:`fedrec_flwr.local.block_engine`): ``torch.optim.Adam`` and plain SGD with per-user step counts, stepping the
first ``count`` users of a block in place. They never create a ``torch.optim`` optimizer, whose first use in a process
imports ``torch._dynamo`` (:data:`fedrec_flwr.local.blocks.BLOCK_MODES`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
"""``torch.optim.Adam``'s defaults, which every per-user trainer of this package uses."""

FUSED_ADAM = True
"""Step a :class:`BlockAdam` whose users share one step count (every fresh optimizer: FedNCF / FedMF, FedRecGEL's
shared group) with ``torch._fused_adam_`` (the kernel of ``torch.optim.Adam(fused=True)``: one pass over the entries
instead of eight); users with different step counts (FedRecGEL's persistent private Adam) take the per-user formula."""


class BlockAdam:
    """``torch.optim.Adam`` (defaults: betas 0.9/0.999, eps 1e-8, no weight decay, no AMSGrad) over stacked per-user
    parameters ``(k, ...)`` with per-user step counts (Kingma & Ba 2015, Algorithm 1, in the
    form of ``torch.optim.Adam``'s single-tensor update).

    Args:
        params: name -> ``(k, ...)`` tensors (updated in place by :meth:`step`).
        lr: step size.
        state: optional name -> ``(exp_avg (k, ...), exp_avg_sq (k, ...))`` and ``steps`` ``(k,)`` float32 to resume
            from (FedRecGEL's persistent private Adam); zeros otherwise.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], lr: float, state=None, steps=None) -> None:
        self.lr = float(lr)
        k = next(iter(params.values())).shape[0]
        device = next(iter(params.values())).device
        self.moments = (
            state
            if state is not None
            else {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in params.items()}
        )
        self.steps = steps if steps is not None else torch.zeros(k, dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: Mapping[str, torch.Tensor], count: int) -> None:
        """One Adam step, in place, of the first ``count`` users (``params`` and ``grads`` hold those users' rows: a
        block sorted by size has its users with a mini-batch left at the front)."""
        beta1, beta2 = ADAM_BETAS
        self.steps[:count] += 1
        if FUSED_ADAM and count and all(p.is_contiguous() for p in params.values()):
            steps = self.steps[:count]
            if count == 1 or bool((steps == steps[0]).all()):  # one step count (a fresh optimizer): fused kernel
                names = list(params)
                step = [steps[0].clone()] * len(names)  # the kernel reads each parameter's step count, never writes it
                # the kernel needs contiguous tensors; autograd gives NCF's MLP weights (used transposed in
                # batched_loss) transposed gradients, which took every NCF block to the eight-pass formula before
                torch._fused_adam_(
                    [params[n] for n in names],
                    [grads[n].contiguous() for n in names],
                    [self.moments[n][0][:count] for n in names],
                    [self.moments[n][1][:count] for n in names],
                    [],
                    step,
                    lr=self.lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=0.0,
                    eps=ADAM_EPS,
                    amsgrad=False,
                    maximize=False,
                )
                return
        step = self.steps[:count].double()
        step_size = -self.lr / (1 - beta1**step)
        correction2_sqrt = torch.sqrt(1 - beta2**step)
        for name, p in params.items():
            m, v = (t[:count] for t in self.moments[name])
            g = grads[name]
            shape = (-1, *([1] * (p.dim() - 1)))
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v.sqrt().div_(correction2_sqrt.to(p.dtype).view(shape)).add_(ADAM_EPS)
            p.addcdiv_(m * step_size.to(p.dtype).view(shape), denom)


class BlockSGD:
    """Plain SGD (``torch.optim.SGD`` without momentum) over stacked per-user parameters."""

    def __init__(self, params: Mapping[str, torch.Tensor], lr: float, state=None, steps=None) -> None:
        self.lr = float(lr)

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: Mapping[str, torch.Tensor], count: int) -> None:
        """One step, in place, of the first ``count`` users (as :meth:`BlockAdam.step`)."""
        for name, p in params.items():
            p.sub_(grads[name], alpha=self.lr)


def make_optimizer(name: str, params, lr: float, state=None, steps=None):
    """``"adam"`` -> :class:`BlockAdam`, ``"sgd"`` -> :class:`BlockSGD`."""
    return (BlockAdam if name == "adam" else BlockSGD)(params, lr, state, steps)
