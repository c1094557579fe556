"""AdamW with fp32 master weights and moments: the optimizer state the memory model counts.

``torch.optim.AdamW`` on bf16 parameters keeps bf16 moments and no master copy (4 B per
parameter of state); the accounting (:func:`lab_utils.memory.state_bytes`) assumes mixed
precision training as it is done at scale: 16-bit weights and gradients, fp32 master
weights and two fp32 moments (12 B per parameter beside the 16-bit weight and gradient).
A fit is confirmed with this optimizer so that prediction and run hold the same state.

The update is torch's single-tensor AdamW (decoupled weight decay, bias-corrected), applied
to the fp32 master one parameter at a time from the upcast 16-bit gradient; the rounded
master is written back into the parameter.  The step's transient is one parameter's fp32
gradient and denominator.  For fp32 parameters the parameter is its own master.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lab_utils.core.config import check_float


class MasterAdamW:
    """AdamW over fp32 masters of ``params`` (see the module note); ``step`` and ``zero_grad``
    as torch's optimizers, ``state_bytes`` the bytes it holds per class."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        check_float("lr", lr, min=0)
        check_float("eps", eps, min=0)
        check_float("weight_decay", weight_decay, min=0)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.params = [p for p in params if p.requires_grad]
        with torch.no_grad():
            self.master = [p if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        b1, b2 = self.betas
        step_size = self.lr / (1 - b1**self.steps)
        bc2_sqrt = math.sqrt(1 - b2**self.steps)
        for p, m, ea, eas in zip(self.params, self.master, self.exp_avg, self.exp_avg_sq):
            if p.grad is None:
                continue
            g = p.grad.float()  # the same tensor for fp32 parameters, a transient copy otherwise
            m.mul_(1 - self.lr * self.weight_decay)
            ea.lerp_(g, 1 - b1)
            eas.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (eas.sqrt() / bc2_sqrt).add_(self.eps)
            m.addcdiv_(ea, denom, value=-step_size)
            if m is not p:
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the two moments ("optimizer") and of the masters kept beside 16-bit
        parameters ("master_weights"), as :func:`lab_utils.memory.state_bytes` names them."""
        moments = sum(t.untyped_storage().nbytes() for t in (*self.exp_avg, *self.exp_avg_sq))
        masters = sum(m.untyped_storage().nbytes() for m, p in zip(self.master, self.params) if m is not p)
        return {"optimizer": moments, "master_weights": masters}
