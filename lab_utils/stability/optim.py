"""The optimizer side of training stability: rounding of low-precision updates and loss scaling.

* :class:`StabilityAdamW` is AdamW whose update ``u`` is always computed in float32 and then
  stored one of three ways: ``plain`` (round to nearest into the parameter's dtype: pure bf16
  training when the parameters are bf16), ``master`` (an fp32 master copy accumulates the
  updates; the parameter is its rounded copy) or ``stochastic`` (stochastic rounding of
  ``w + u`` into bf16, unbiased: E[SR(x)] = x).  With ``track=True`` it returns, per
  parameter, ||u||², ||w||² and how many elements' updates are below half an ulp of the
  stored weight (:func:`lost_update_mask`): the updates that round away.
* :class:`DynamicLossScaler` is fp16's dynamic loss scaling: multiply the loss, unscale the
  gradients, skip the step and halve the scale on overflow, double it after N good steps.

:mod:`lab_utils.stability.training` uses both in its training loop.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from lab_utils.core.config import ConfigError, check_choice, check_float, check_int

# mantissa bits and the smallest normal exponent of the storage formats
_FLOAT_BITS = {torch.float32: (23, -126), torch.bfloat16: (7, -126), torch.float16: (10, -14)}


# ------------------------------------------------------------------------------ rounding
def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 -> bfloat16 with stochastic rounding: round the magnitude up with probability
    equal to the dropped fraction of a bf16 ulp (add 16 random low bits, then truncate)."""
    bits = x.detach().float().contiguous().view(torch.int32)
    r = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    out = ((bits + r) & -65536).view(torch.float32)
    out = torch.where(torch.isfinite(x), out, x.float())  # NaN/Inf pass through
    return out.to(torch.bfloat16)  # exact: the low 16 bits are zero


def half_ulp(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Half the spacing of ``dtype`` (default: ``w``'s) above |w|, float32; at zero and in the
    subnormal range, half the subnormal step.  Read from the exponent bits (a few cheap ops:
    the telemetry computes it for every weight of a sampled step)."""
    dtype = dtype or w.dtype
    if dtype not in _FLOAT_BITS:
        raise ConfigError("dtype", dtype, "float32, bfloat16 or float16")
    mbits, emin = _FLOAT_BITS[dtype]
    pow2 = (w.detach().float().contiguous().view(torch.int32) & 0x7F800000).view(torch.float32)  # 2^floor(log2|w|)
    return pow2.clamp_min(2.0**emin) * 2.0 ** -(mbits + 1)


def lost_update_mask(w: torch.Tensor, u: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Elements whose update ``u`` is smaller than half an ulp of the stored weight ``w``:
    round-to-nearest storage drops them entirely.  Below a power of two the spacing halves,
    so an update towards zero from one is compared with a quarter of the ulp above."""
    dtype = dtype or w.dtype
    wf, uf = w.detach().float().contiguous(), u.detach().float()
    hu = half_ulp(wf, dtype)
    down = (
        ((wf.view(torch.int32) & 0x007FFFFF) == 0) & (wf.abs() > 2.0 ** _FLOAT_BITS[dtype][1]) & ((uf < 0) != (wf < 0))
    )
    return uf.abs() < torch.where(down, hu * 0.5, hu)


# ------------------------------------------------------------------------------ optimizer
class StabilityAdamW(torch.optim.Optimizer):
    """AdamW with float32 math and a choice of how the update is stored (see module note).

    ``mode``: "plain" | "master" | "stochastic".  ``track``: fill ``last_stats`` {param:
    (update_sq, weight_sq, lost, numel)} on the next steps (tensors, no sync).  The lost
    updates are counted on every ``lost_stride``-th element of tensors larger than 4096
    elements (an estimate of the fraction, standard error below 1e-3 for a 4M-element
    weight at stride 16; the exact count costs more than the rest of the optimizer step)
    and scaled to the whole tensor: ``lost`` estimates the tensor's count out of ``numel``,
    so summing over tensors weighs each by its size (small tensors, counted in full, would
    otherwise weigh ``lost_stride`` times their share).

    :meth:`snapshot` / :meth:`restore` checkpoint the state (moments, master copies, the
    stochastic-rounding generators) by value: torch's ``load_state_dict`` keeps references
    to the loaded tensors and casts them to the parameter's dtype (fp32 moments and master
    weights of bf16 parameters would come back in bf16)."""

    MODES = ("plain", "master", "stochastic")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        *,
        mode="plain",
        seed: int = 0,
        lost_stride: int = 16,
    ):
        check_float("lr", lr, min=0, min_exclusive=True)
        check_float("beta1", betas[0], min=0, max=0.999999)
        check_float("beta2", betas[1], min=0, max=0.999999)
        check_float("eps", eps, min=0, min_exclusive=True)
        check_float("weight_decay", weight_decay, min=0)
        check_choice("mode", mode, self.MODES)
        check_int("lost_stride", lost_stride, min=1)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.mode, self.seed, self.track, self.lost_stride = mode, seed, False, lost_stride
        self.last_stats: dict = {}
        self._gen: dict[torch.device, torch.Generator] = {}

    def _generator(self, device) -> torch.Generator:
        if device not in self._gen:
            self._gen[device] = torch.Generator(device).manual_seed(self.seed)
        return self._gen[device]

    def snapshot(self) -> dict:
        """A copy of everything the next steps depend on (not shared with the optimizer)."""
        return dict(
            state={p: _clone_state(st) for p, st in self.state.items()},
            lr=[g["lr"] for g in self.param_groups],
            gen={d: g.get_state() for d, g in self._gen.items()},
        )

    def restore(self, snap: dict) -> None:
        """Back to ``snap`` (copied again: a snapshot survives any number of restores)."""
        self.state.clear()
        for p, st in snap["state"].items():
            self.state[p] = _clone_state(st)
        for g, lr in zip(self.param_groups, snap["lr"]):
            g["lr"] = lr
        for d in list(self._gen):
            if d in snap["gen"]:
                self._gen[d].set_state(snap["gen"][d])
            else:
                del self._gen[d]  # created after the snapshot: starts again from the seed

    @torch.no_grad()
    def step(self, closure=None):
        self.last_stats = {}
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p, dtype=torch.float32)
                    st["v"] = torch.zeros_like(p, dtype=torch.float32)
                    if self.mode == "master" and p.dtype != torch.float32:
                        st["master"] = p.detach().float().clone()
                st["step"] += 1
                g = p.grad.float()
                st["m"].lerp_(g, 1 - b1)
                st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                t = st["step"]
                w32 = st["master"] if "master" in st else p.float()
                mhat = st["m"] / (1 - b1**t)
                vhat = st["v"] / (1 - b2**t)
                u = -lr * (mhat / (vhat.sqrt() + eps) + wd * w32)
                store = torch.float32 if "master" in st else p.dtype
                if self.track:
                    n = u.numel()
                    k = self.lost_stride if n > 4096 else 1
                    wl, ul = w32.reshape(-1)[::k], u.reshape(-1)[::k]
                    lost = lost_update_mask(wl, ul, store).sum()  # w32 is exact in `store`
                    if wl.numel() != n:  # the sample's fraction stands for the whole tensor
                        lost = lost.float() * (n / wl.numel())
                    self.last_stats[p] = (u.square().sum(), w32.square().sum(), lost, n)
                if "master" in st:
                    st["master"].add_(u)
                    p.copy_(st["master"])
                elif self.mode == "stochastic" and p.dtype == torch.bfloat16:
                    p.copy_(stochastic_round_bf16(w32 + u, self._generator(p.device)))
                else:
                    p.copy_(w32 + u)
        return None


def _clone_state(st: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in st.items()}


# ------------------------------------------------------------------------------ loss scaling
@dataclass
class DynamicLossScaler:
    """fp16 dynamic loss scaling: ``scale`` the loss, :meth:`unscale_` the gradients (returns
    False on overflow), :meth:`update` after the step (halve on overflow, double after
    ``growth_interval`` good steps).  ``history``: (step, scale, skipped)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 10
    scale: float = field(init=False)
    history: list[tuple[int, float, bool]] = field(init=False, default_factory=list)

    def __post_init__(self):
        check_float("init_scale", self.init_scale, min=0, min_exclusive=True)
        check_float("growth_factor", self.growth_factor, min=1, min_exclusive=True)
        check_float("backoff_factor", self.backoff_factor, min=0, max=1, min_exclusive=True)
        check_int("growth_interval", self.growth_interval, min=1)
        self.scale, self._good = float(self.init_scale), 0

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        for g in grads:
            g.div_(self.scale)
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True

    def state(self) -> tuple[float, int, int]:
        return self.scale, self._good, len(self.history)

    def restore(self, state: tuple[float, int, int]) -> None:
        """Back to a :meth:`state` (a rewind): the later history is dropped, the replay writes it again."""
        self.scale, self._good = state[0], state[1]
        del self.history[state[2] :]

    def update(self, step: int, finite: bool) -> None:
        self.history.append((step, self.scale, not finite))
        if not finite:
            self.scale *= self.backoff_factor
            self._good = 0
        else:
            self._good += 1
            if self._good % self.growth_interval == 0:
                self.scale *= self.growth_factor
