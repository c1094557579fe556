"""Numerical stability of training: rounding of low-precision updates, loss scaling, spike
detection and the policies that answer a spike, and a training loop that uses them.

Design note
-----------
* :class:`StabilityAdamW` is AdamW whose update ``u`` is always computed in float32 and then
  stored one of three ways: ``plain`` (round to nearest into the parameter's dtype: pure bf16
  training when the parameters are bf16), ``master`` (an fp32 master copy accumulates the
  updates; the parameter is its rounded copy) or ``stochastic`` (stochastic rounding of
  ``w + u`` into bf16, unbiased: E[SR(x)] = x).  With ``track=True`` it returns, per
  parameter, ||u||², ||w||² and how many elements' updates are below half an ulp of the
  stored weight (:func:`lost_update_mask`): the updates that round away.
* :class:`DynamicLossScaler` is fp16's dynamic loss scaling: multiply the loss, unscale the
  gradients, skip the step and halve the scale on overflow, double it after N good steps.
* :class:`SpikeDetector` scores the loss and gradient norm by a robust z-score (median and
  MAD over a window of accepted steps).  The policies production runs use answer a spike:
  ``skip`` the update, ``clip`` the gradient harder (to the window's median norm, before
  ``grad_clip``: the step's norm becomes the smaller of the two; when ``grad_clip`` is at
  or below the median every step is clipped to the same norm already and the policy has
  nothing to do: the step's action says so), or ``rewind`` to the last good in-memory
  checkpoint and skip the batch.  A checkpoint is held by value, so a rewind replays
  exactly what ``skip`` computes (same weights, moments, detector window and loss scale):
  the replayed steps' losses equal the skip policy's, and their telemetry and NaN events
  are kept once, from the replay.
* :func:`train_run` runs one :class:`RunSpec` (preset, precision mode, recipe, QK-norm,
  AdamW settings, provoked spike or NaN) on a fixed pool of synthetic batches with noise and
  timesteps seeded per step, so two runs from the same seed see the same data: differences
  are the setting's.  Non-finite steps are replayed once under the NaN locator and skipped.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from lab_utils.core.config import ConfigError, LabConfig, check_bool, check_choice, check_float, check_int
from lab_utils.model.mmdit import build_model
from lab_utils.model.train import rf_loss, synthetic_batch
from lab_utils.stability.telemetry import (
    NAN_PHASES,
    NonFiniteReport,
    Telemetry,
    disable_qk_norm,
    inject_nonfinite,
    locate_nonfinite,
)

# mantissa bits and the smallest normal exponent of the storage formats
_FLOAT_BITS = {torch.float32: (23, -126), torch.bfloat16: (7, -126), torch.float16: (10, -14)}
PRECISIONS = ("fp32", "bf16_autocast", "bf16", "bf16_master", "bf16_sr", "fp16_scaled")
SPIKE_POLICIES = ("none", "skip", "clip", "rewind")
PROVOKE = ("none", "batch", "lr")


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


# ------------------------------------------------------------------------------ spikes
@dataclass
class SpikeCheck:
    spike: bool
    z_loss: float
    z_grad: float


class SpikeDetector:
    """Robust z-score z = (x - median) / (1.4826 * MAD) of the loss and the gradient norm
    over the last ``window`` accepted steps; a spike when either exceeds ``threshold``
    (only upward) or a value is non-finite.  Spikes do not enter the window."""

    def __init__(self, window: int = 16, threshold: float = 6.0, min_history: int = 6, patience: int = 4):
        check_int("spike_window", window, min=3)
        check_float("spike_threshold", threshold, min=0, min_exclusive=True)
        check_int("min_history", min_history, min=3, max=window)
        check_int("spike_patience", patience, min=1)
        self.window, self.threshold, self.min_history, self.patience = window, threshold, min_history, patience
        self.loss: list[float] = []
        self.grad: list[float] = []
        self.run = 0  # consecutive spikes

    def _z(self, hist: list[float], x: float) -> float:
        if not math.isfinite(x):
            return math.inf
        if len(hist) < self.min_history:
            return 0.0
        h = np.asarray(hist[-self.window :])
        med = float(np.median(h))
        mad = 1.4826 * float(np.median(np.abs(h - med)))
        return (x - med) / max(mad, 1e-3 * abs(med), 1e-12)

    def observe(self, loss: float, grad_norm: float) -> SpikeCheck:
        zl, zg = self._z(self.loss, loss), self._z(self.grad, grad_norm)
        spike = zl > self.threshold or zg > self.threshold
        self.run = self.run + 1 if spike else 0
        if spike and self.run > self.patience and math.isfinite(loss) and math.isfinite(grad_norm):
            # more than `patience` spikes in a row is a new level, not a spike: start a new window
            self.loss, self.grad, self.run, spike = [], [], 0, False
        if not spike:
            self.loss.append(loss)
            self.grad.append(grad_norm)
        return SpikeCheck(spike, zl, zg)

    def median_grad(self) -> float:
        return float(np.median(self.grad[-self.window :])) if self.grad else math.inf

    def state(self) -> tuple[list[float], list[float], int]:
        return list(self.loss), list(self.grad), self.run

    def restore(self, state: tuple[list[float], list[float], int]) -> None:
        self.loss, self.grad, self.run = list(state[0]), list(state[1]), state[2]


# ------------------------------------------------------------------------------ one run
@dataclass(frozen=True)
class RunSpec(LabConfig):
    """One training run of the stability lab.  Two specs that differ in one field see the
    same initialisation, batches, noise and timesteps."""

    name: str = "baseline"
    preset: str = "tiny"
    device: str = "cpu"
    steps: int = 30
    batch_size: int = 4
    resolution: int = 64
    txt_len: int = 8
    num_batches: int = 8
    seed: int = 0
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0 = no clipping
    precision: str = "fp32"
    recipe: str = "bf16"
    qk_norm: bool = True
    telemetry_every: int = 1
    head_groups: int = 2
    spike_policy: str = "none"
    spike_window: int = 16
    spike_threshold: float = 6.0
    spike_patience: int = 4
    ckpt_every: int = 5
    provoke: str = "none"
    provoke_step: int = 15
    poison_scale: float = 30.0
    lr_jump: float = 30.0
    nan_module: str = ""
    nan_phase: str = "forward"
    nan_step: int = -1
    loss_scale_init: float = 2.0**16
    loss_scale_interval: int = 10

    def __post_init__(self):
        check_int("steps", self.steps, min=1)
        check_int("batch_size", self.batch_size, min=1)
        check_int("resolution", self.resolution, min=16)
        check_int("txt_len", self.txt_len, min=1)
        check_int("num_batches", self.num_batches, min=1)
        check_int("seed", self.seed, min=0)
        check_float("lr", self.lr, min=0, min_exclusive=True)
        check_float("beta1", self.beta1, min=0, max=0.999999)
        check_float("beta2", self.beta2, min=0, max=0.999999)
        check_float("eps", self.eps, min=0, min_exclusive=True)
        check_float("weight_decay", self.weight_decay, min=0)
        check_float("grad_clip", self.grad_clip, min=0)
        check_choice("precision", self.precision, PRECISIONS)
        check_bool("qk_norm", self.qk_norm)
        check_int("telemetry_every", self.telemetry_every, min=1)
        check_int("head_groups", self.head_groups, min=1)
        check_choice("spike_policy", self.spike_policy, SPIKE_POLICIES)
        check_int("spike_patience", self.spike_patience, min=1)
        check_int("ckpt_every", self.ckpt_every, min=1)
        check_choice("provoke", self.provoke, PROVOKE)
        check_int("provoke_step", self.provoke_step, min=0)
        check_float("poison_scale", self.poison_scale, min=0, min_exclusive=True)
        check_float("lr_jump", self.lr_jump, min=0, min_exclusive=True)
        check_choice("nan_phase", self.nan_phase, NAN_PHASES)
        check_int("nan_step", self.nan_step, min=-1)
        check_float("loss_scale_init", self.loss_scale_init, min=1)
        check_int("loss_scale_interval", self.loss_scale_interval, min=1)


MAX_REWINDS = 3  # per run; a spike after that is applied
CLIP_NOOP = "spike: clip no-op (norm already at or below the window median)"


@dataclass
class _Checkpoint:
    """An in-memory checkpoint for the rewind policy, held by value (never aliased by the
    model or the optimizer, so that any number of rewinds to it restore the same state)."""

    step: int
    model: dict
    optimizer: dict
    detector: tuple
    scaler: tuple | None


@dataclass
class RunResult:
    spec: RunSpec
    steps: pd.DataFrame  # step, loss, grad_norm, lr, spike, action, z_loss, z_grad, loss_scale
    telemetry: pd.DataFrame  # step, block, stream, stat, value
    nonfinite: list[tuple[int, NonFiniteReport | None]] = field(default_factory=list)
    replayed_steps: int = 0

    @property
    def losses(self) -> np.ndarray:
        return self.steps["loss"].to_numpy()

    def final_loss(self, tail: float = 0.25) -> float:
        """Mean of the finite losses over the last ``tail`` of the steps (a step skipped early
        does not move the window: a rewind and a skip of the same batch end on one number)."""
        x = self.steps["loss"].to_numpy(dtype=float)
        x = x[-max(1, int(len(x) * tail)) :]
        x = x[np.isfinite(x)]
        return float(x.mean()) if len(x) else math.nan


_MODEL_DTYPE = {"bf16": torch.bfloat16, "bf16_master": torch.bfloat16, "bf16_sr": torch.bfloat16}
_OPT_MODE = {"bf16_master": "master", "bf16_sr": "stochastic"}
_AUTOCAST = {"bf16_autocast": torch.bfloat16, "fp16_scaled": torch.float16}


def make_batches(spec: RunSpec, dtype: torch.dtype, device) -> list:
    g = torch.Generator().manual_seed(spec.seed + 1000)
    return [
        synthetic_batch(
            spec.preset,
            spec.batch_size,
            height=spec.resolution,
            width=spec.resolution,
            txt_len=spec.txt_len,
            generator=g,
            dtype=dtype,
        ).to(device)
        for _ in range(spec.num_batches)
    ]


def train_run(spec: RunSpec, *, progress: bool = False) -> RunResult:
    """Train ``spec.steps`` steps of one :class:`RunSpec`; see the module note."""
    dev = torch.device(spec.device)
    dtype = _MODEL_DTYPE.get(spec.precision, torch.float32)
    model = build_model(spec.preset, dev, dtype, seed=spec.seed, recipe=spec.recipe).train()
    if not spec.qk_norm:
        disable_qk_norm(model)
    tel = Telemetry(model, every=spec.telemetry_every, head_groups=spec.head_groups)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = StabilityAdamW(
        params,
        lr=spec.lr,
        betas=(spec.beta1, spec.beta2),
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        mode=_OPT_MODE.get(spec.precision, "plain"),
        seed=spec.seed,
    )
    scaler = None
    if spec.precision == "fp16_scaled":
        scaler = DynamicLossScaler(spec.loss_scale_init, growth_interval=spec.loss_scale_interval)
    detector = SpikeDetector(spec.spike_window, spec.spike_threshold, min(6, spec.spike_window), spec.spike_patience)
    batches = make_batches(spec, dtype, dev)
    ac = _AUTOCAST.get(spec.precision)
    poison = None
    if spec.nan_module:
        poison = (spec.nan_module, spec.nan_phase)
    rows: dict[int, dict] = {}
    events: list[tuple[int, NonFiniteReport | None]] = []
    skipped_batches: set[int] = set()
    rewound: dict[int, dict] = {}
    ckpt = None
    replayed, rewinds, i = 0, 0, 0
    bar = tqdm(total=spec.steps, desc=spec.name, disable=not progress, leave=False)
    try:
        while i < spec.steps:
            if spec.spike_policy == "rewind" and (ckpt is None or (i % spec.ckpt_every == 0 and ckpt.step != i)):
                ckpt = _Checkpoint(
                    i,
                    copy.deepcopy(model.state_dict()),
                    opt.snapshot(),
                    detector.state(),
                    scaler.state() if scaler else None,
                )
            if i in skipped_batches:
                rows[i] = rewound[i] | dict(loss=math.nan, grad_norm=math.nan, action="rewound: batch skipped")
                i += 1
                bar.update(1)
                continue
            batch = batches[i % spec.num_batches]
            if spec.provoke == "batch" and i == spec.provoke_step:
                batch = copy.copy(batch)
                batch.img = batch.img * spec.poison_scale
            lr = spec.lr * (spec.lr_jump if spec.provoke == "lr" and i == spec.provoke_step else 1.0)
            for grp in opt.param_groups:
                grp["lr"] = lr
            hook = inject_nonfinite(model, *poison) if poison and i == spec.nan_step else None

            def forward(batch=batch, i=i):
                g = torch.Generator(dev).manual_seed(spec.seed * 100_003 + i)
                with torch.autocast(dev.type, dtype=ac or torch.bfloat16, enabled=ac is not None):
                    return rf_loss(model, batch, g, return_parts=True)

            tel.begin_step(i)
            parts = forward()
            loss = parts.loss
            (loss * (scaler.scale if scaler else 1.0)).backward()
            finite = scaler.unscale_(params) if scaler else True
            tel.after_backward()
            gn = torch.nn.utils.clip_grad_norm_(params, spec.grad_clip if spec.grad_clip > 0 else math.inf)
            loss_v, gn_v = float(loss.detach()), float(gn)
            finite = finite and math.isfinite(loss_v) and math.isfinite(gn_v)
            row = dict(step=i, loss=loss_v, grad_norm=gn_v, lr=lr, action="step")
            if scaler:
                row["loss_scale"] = scaler.scale
            if not finite and scaler is None:
                opt.zero_grad(set_to_none=True)
                events.append((i, locate_nonfinite(model, lambda: forward().loss)))
                row["action"] = "non-finite: skipped"
            elif not finite:
                row["action"] = "overflow: skipped"
            check = detector.observe(loss_v, gn_v) if finite else SpikeCheck(False, 0.0, 0.0)
            row.update(spike=check.spike, z_loss=check.z_loss, z_grad=check.z_grad)
            apply = finite
            if finite and check.spike and spec.spike_policy == "skip":
                apply, row["action"] = False, "spike: skipped"
            elif finite and check.spike and spec.spike_policy == "clip":
                # the gradient has been clipped to grad_clip already: the policy acts when the
                # window's median norm is below the norm left after that
                to = detector.median_grad()
                if to < (min(gn_v, spec.grad_clip) if spec.grad_clip > 0 else gn_v):
                    torch.nn.utils.clip_grad_norm_(params, to)
                    row["action"] = "spike: clipped"
                else:
                    row["action"] = CLIP_NOOP
            elif finite and check.spike and spec.spike_policy == "rewind" and rewinds < MAX_REWINDS:
                skipped_batches.add(i)
                rewound[i] = row
                rewinds += 1
                replayed += i - ckpt.step
                model.load_state_dict(ckpt.model)  # copies into the parameters
                opt.restore(ckpt.optimizer)  # copies too: the checkpoint stays as it was taken
                detector.restore(ckpt.detector)
                if scaler:
                    scaler.restore(ckpt.scaler)
                opt.zero_grad(set_to_none=True)
                tel.end_step()
                # the steps from the checkpoint on run again: keep the replay's rows only (a
                # skipped batch is not replayed: its rows are the only ones it has)
                tel.drop_steps(s for s in range(ckpt.step, i) if s not in skipped_batches)
                events = [(s, e) for s, e in events if not ckpt.step <= s < i]
                i = ckpt.step
                if hook is not None:
                    hook.remove()
                continue
            if apply:
                opt.track = tel.active
                opt.step()
                tel.after_step(opt.last_stats)
            if scaler:
                scaler.update(i, finite)
            opt.zero_grad(set_to_none=True)
            if finite:
                with torch.no_grad():
                    per = (parts.pred.detach().float() - parts.target.float()).square().mean(dim=(1, 2))
                tel.log_loss(parts.t, per)
            tel.end_step()
            if hook is not None:
                hook.remove()
            rows[i] = row
            i += 1
            bar.update(1)
    finally:
        bar.close()
        tel.close()
    steps = pd.DataFrame([rows[k] for k in sorted(rows)])
    return RunResult(spec, steps, tel.frame(), events, replayed)
