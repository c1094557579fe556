"""Numerical stability of training: rounding of low-precision updates, loss scaling, spike
detection and the policies that answer a spike, and a training loop that uses them.

Design note
-----------
* :class:`StabilityAdamW` (AdamW whose float32 update is stored plain, into an fp32 master or
  by stochastic rounding, and says which updates round away) and :class:`DynamicLossScaler`
  (fp16's dynamic loss scaling) live in :mod:`lab_utils.stability.optim`.
* :class:`SpikeDetector` scores the loss and gradient norm by a robust z-score (median and
  MAD over a window of accepted steps).  The policies production runs use answer a spike:
  ``skip`` the update, ``clip`` the gradient harder (:func:`clip_target`, below), or ``rewind``
  to the last good in-memory checkpoint and skip the batch.  A checkpoint is held by value, so a rewind replays
  exactly what ``skip`` computes (same weights, moments, detector window and loss scale):
  the replayed steps' losses equal the skip policy's, and their telemetry and NaN events
  are kept once, from the replay.
* :func:`train_run` runs one :class:`RunSpec` (preset, precision mode, recipe, QK-norm,
  AdamW settings, provoked spike or NaN) on a fixed pool of synthetic batches with noise and
  timesteps seeded per step, so two runs from the same seed see the same data: differences
  are the setting's.  Non-finite steps are replayed once under the NaN locator and skipped.

The clip policy
---------------
A spike's gradient (raw norm ``n``) is clipped to ``ref * min(1, median / n)``, where ``median``
is the window's median raw norm and ``ref = min(grad_clip, median)`` the norm a typical step of
the window is applied at (the median of the clipped norms).  Two cases, and the row says which
(``clip_ref``): with ``grad_clip`` off or above the median (``"median"``) the spike gets a
typical step's norm times median / n; with ``grad_clip`` at or below the median (``"grad_clip"``,
production's clip of 1.0 early in training) every step, the spike's too, leaves the global clip at
``grad_clip``.  A clip to a norm, however chosen from the clipped norms, then does nothing to the
spike (the trajectory is ``none``'s): what tells the spike from a typical step is its raw norm's
excess over the window, so the policy divides that out, in both cases alike: the spike's update
counts median / n of a typical one (a x8 spike an eighth), between ``none`` (all of it) and
``skip`` (none of it).  A spike whose norm is not above the median (a loss spike alone) is left
as it is (action ``clip no-op``).  ``clipped_norm``: the norm of the gradient after both clips,
measured, on every step.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from lab_utils.core.config import LabConfig, check_bool, check_choice, check_float, check_int
from lab_utils.model.mmdit import build_model
from lab_utils.model.train import rf_loss, synthetic_batch
from lab_utils.stability.optim import DynamicLossScaler, StabilityAdamW
from lab_utils.stability.telemetry import (
    NAN_PHASES,
    NonFiniteReport,
    Telemetry,
    disable_qk_norm,
    inject_nonfinite,
    locate_nonfinite,
)

PRECISIONS = ("fp32", "bf16_autocast", "bf16", "bf16_master", "bf16_sr", "fp16_scaled")
SPIKE_POLICIES = ("none", "skip", "clip", "rewind")
PROVOKE = ("none", "batch", "lr")


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
        """The window's median gradient norm (of the raw, unclipped norms of accepted steps)."""
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


@dataclass(frozen=True)
class ClipTarget:
    """What the clip policy does to a spike of raw norm ``norm`` (the module's note)."""

    norm: float  # the spike's raw gradient norm
    median: float  # the window's median raw norm
    grad_clip: float  # the global clip (inf: off)
    ref: float  # min(grad_clip, median): a typical step's applied norm
    case: str  # "grad_clip" (grad_clip <= median) or "median"
    target: float  # ref * min(1, median / norm)


def clip_target(norm: float, median: float, grad_clip: float) -> ClipTarget:
    """The clip policy's target norm for a spike step (``grad_clip`` <= 0 or inf: no global clip)."""
    clip = grad_clip if 0 < grad_clip < math.inf else math.inf
    case = "grad_clip" if clip <= median else "median"
    ref = min(clip, median)
    return ClipTarget(norm, median, clip, ref, case, ref * min(1.0, median / norm))


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
    steps: pd.DataFrame  # step, loss, grad_norm, clipped_norm, lr, spike, action, z_loss, z_grad, loss_scale, clip_*
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
    return _Run(spec).train(progress)


def clip_lines(result: RunResult) -> list[str]:
    """One line per step the clip policy clipped: which case of :func:`clip_target` applied and
    whether the gradient's measured norm after the clip is the rule's ``ref * median / norm``
    (raises when it is not: the policy did not do what it says)."""
    st = result.steps
    out = []
    for r in st[st.action == "spike: clipped"].itertuples():
        ct = clip_target(r.grad_norm, r.clip_median, result.spec.grad_clip)
        ok = math.isclose(r.clipped_norm, ct.target, rel_tol=1e-4)
        if ct.case == "grad_clip":
            ref = f"grad_clip = {ct.grad_clip:g} (at or below the window median norm: every step is clipped to it)"
        else:
            ref = "the window median norm " + ("(below grad_clip)" if math.isfinite(ct.grad_clip) else "(no grad_clip)")
        out.append(f"clip at step {r.step}: reference {ref}; post-clip norm = reference x median / norm: {ok}")
        if not ok:
            raise AssertionError(f"{out[-1]} (measured {r.clipped_norm:.6g}, the rule gives {ct.target:.6g})")
    return out


class _Run:
    """One run's state and its stages: build (``__init__``), checkpoint, forward and backward
    with the non-finite check, the spike policy, a rewind, the update."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.dev = dev = torch.device(spec.device)
        dtype = _MODEL_DTYPE.get(spec.precision, torch.float32)
        self.model = build_model(spec.preset, dev, dtype, seed=spec.seed, recipe=spec.recipe).train()
        if not spec.qk_norm:
            disable_qk_norm(self.model)
        self.tel = Telemetry(self.model, every=spec.telemetry_every, head_groups=spec.head_groups)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = StabilityAdamW(
            self.params,
            lr=spec.lr,
            betas=(spec.beta1, spec.beta2),
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            mode=_OPT_MODE.get(spec.precision, "plain"),
            seed=spec.seed,
        )
        self.scaler = None
        if spec.precision == "fp16_scaled":
            self.scaler = DynamicLossScaler(spec.loss_scale_init, growth_interval=spec.loss_scale_interval)
        self.detector = SpikeDetector(
            spec.spike_window, spec.spike_threshold, min(6, spec.spike_window), spec.spike_patience
        )
        self.batches = make_batches(spec, dtype, dev)
        self.ac = _AUTOCAST.get(spec.precision)
        self.poison = (spec.nan_module, spec.nan_phase) if spec.nan_module else None
        self.rows: dict[int, dict] = {}
        self.events: list[tuple[int, NonFiniteReport | None]] = []
        self.skipped_batches: set[int] = set()
        self.rewound: dict[int, dict] = {}
        self.ckpt: _Checkpoint | None = None
        self.replayed, self.rewinds = 0, 0

    def train(self, progress: bool) -> RunResult:
        spec, i = self.spec, 0
        bar = tqdm(total=spec.steps, desc=spec.name, disable=not progress, leave=False)
        try:
            while i < spec.steps:
                self.checkpoint(i)
                if i in self.skipped_batches:
                    self.rows[i] = self.rewound[i] | dict(
                        loss=math.nan, grad_norm=math.nan, clipped_norm=math.nan, action="rewound: batch skipped"
                    )
                    i += 1
                    bar.update(1)
                    continue
                back = self.step(i)
                if back is not None:
                    i = back
                    continue
                i += 1
                bar.update(1)
        finally:
            bar.close()
            self.tel.close()
        steps = pd.DataFrame([self.rows[k] for k in sorted(self.rows)])
        return RunResult(spec, steps, self.tel.frame(), self.events, self.replayed)

    def checkpoint(self, i: int) -> None:
        """Under the rewind policy: an in-memory checkpoint, held by value, every ``ckpt_every`` steps."""
        spec, ckpt = self.spec, self.ckpt
        if spec.spike_policy == "rewind" and (ckpt is None or (i % spec.ckpt_every == 0 and ckpt.step != i)):
            self.ckpt = _Checkpoint(
                i,
                copy.deepcopy(self.model.state_dict()),
                self.opt.snapshot(),
                self.detector.state(),
                self.scaler.state() if self.scaler else None,
            )

    def forward(self, batch, i: int):
        g = torch.Generator(self.dev).manual_seed(self.spec.seed * 100_003 + i)
        with torch.autocast(self.dev.type, dtype=self.ac or torch.bfloat16, enabled=self.ac is not None):
            return rf_loss(self.model, batch, g, return_parts=True)

    def step(self, i: int) -> int | None:
        """Step ``i`` (its row kept in ``rows``); returns the step to go back to when the spike
        policy rewinds, else None."""
        spec = self.spec
        batch = self.batches[i % spec.num_batches]
        if spec.provoke == "batch" and i == spec.provoke_step:
            batch = copy.copy(batch)
            batch.img = batch.img * spec.poison_scale
        lr = spec.lr * (spec.lr_jump if spec.provoke == "lr" and i == spec.provoke_step else 1.0)
        for grp in self.opt.param_groups:
            grp["lr"] = lr
        hook = inject_nonfinite(self.model, *self.poison) if self.poison and i == spec.nan_step else None
        parts, row, finite = self.forward_backward(i, batch, lr)
        if finite:  # before any policy acts: a skipped, clipped or rewound step logs the same loss rows
            self.log_loss(parts)
        check = self.detector.observe(row["loss"], row["grad_norm"]) if finite else SpikeCheck(False, 0.0, 0.0)
        row.update(spike=check.spike, z_loss=check.z_loss, z_grad=check.z_grad)
        apply = self.spike_policy(row, check, finite)
        if finite:  # what the optimizer step receives (or would, on a skipped step)
            grads = [p.grad for p in self.params if p.grad is not None]
            row["clipped_norm"] = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if apply == "rewind":
            back = self.rewind(i, row)
            if hook is not None:
                hook.remove()
            return back
        self.update(i, finite, apply)
        if hook is not None:
            hook.remove()
        self.rows[i] = row
        return None

    def forward_backward(self, i: int, batch, lr: float) -> tuple:
        """(loss parts, the step's row, whether loss and gradient norm are finite); a non-finite
        step without a loss scaler is replayed under the NaN locator."""
        tel, scaler, params = self.tel, self.scaler, self.params
        tel.begin_step(i)
        parts = self.forward(batch, i)
        loss = parts.loss
        (loss * (scaler.scale if scaler else 1.0)).backward()
        finite = scaler.unscale_(params) if scaler else True
        tel.after_backward()
        clip = self.spec.grad_clip
        gn = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
        loss_v, gn_v = float(loss.detach()), float(gn)
        finite = finite and math.isfinite(loss_v) and math.isfinite(gn_v)
        # clip_grad_norm_ scales by grad_clip / (norm + 1e-6) when that is below 1
        left = gn_v * min(1.0, clip / (gn_v + 1e-6)) if clip > 0 else gn_v
        row = dict(step=i, loss=loss_v, grad_norm=gn_v, clipped_norm=left if finite else math.nan, lr=lr)
        row["action"] = "step"
        if scaler:
            row["loss_scale"] = scaler.scale
        if not finite and scaler is None:
            self.opt.zero_grad(set_to_none=True)
            self.events.append((i, locate_nonfinite(self.model, lambda: self.forward(batch, i).loss)))
            row["action"] = "non-finite: skipped"
        elif not finite:
            row["action"] = "overflow: skipped"
        return parts, row, finite

    def spike_policy(self, row: dict, check: SpikeCheck, finite: bool) -> bool | str:
        """Whether to apply the update (True / False), or "rewind"; the row's action says why."""
        spec = self.spec
        if not (finite and check.spike):
            return finite
        if spec.spike_policy == "skip":
            row["action"] = "spike: skipped"
            return False
        if spec.spike_policy == "clip":
            ct = clip_target(row["grad_norm"], self.detector.median_grad(), spec.grad_clip)
            row.update(clip_ref=ct.case, clip_median=ct.median, clip_target=ct.target)
            if ct.target < row["clipped_norm"]:  # the norm the global clip left
                torch.nn.utils.clip_grad_norm_(self.params, ct.target)
                row["action"] = "spike: clipped"
            else:
                row["action"] = CLIP_NOOP
            return True
        if spec.spike_policy == "rewind" and self.rewinds < MAX_REWINDS:
            return "rewind"
        return True

    def rewind(self, i: int, row: dict) -> int:
        """Back to the checkpoint (weights, moments, detector, loss scale), batch ``i`` skipped."""
        ckpt = self.ckpt
        self.skipped_batches.add(i)
        self.rewound[i] = row
        self.rewinds += 1
        self.replayed += i - ckpt.step
        self.model.load_state_dict(ckpt.model)  # copies into the parameters
        self.opt.restore(ckpt.optimizer)  # copies too: the checkpoint stays as it was taken
        self.detector.restore(ckpt.detector)
        if self.scaler:
            self.scaler.restore(ckpt.scaler)
        self.opt.zero_grad(set_to_none=True)
        self.tel.end_step()
        # the steps from the checkpoint on run again: keep the replay's rows only (a
        # skipped batch is not replayed: its rows are the only ones it has)
        self.tel.drop_steps(s for s in range(ckpt.step, i) if s not in self.skipped_batches)
        self.events = [(s, e) for s, e in self.events if not ckpt.step <= s < i]
        return ckpt.step

    def log_loss(self, parts) -> None:
        """The step's loss in total and per timestep bucket, into its telemetry."""
        with torch.no_grad():
            per = (parts.pred.detach().float() - parts.target.float()).square().mean(dim=(1, 2))
        self.tel.log_loss(parts.t, per)

    def update(self, i: int, finite: bool, apply: bool) -> None:
        """The optimizer step (when applied) and the loss scale's update."""
        tel, opt = self.tel, self.opt
        if apply:
            opt.track = tel.active
            opt.step()
            tel.after_step(opt.last_stats)
        if self.scaler:
            self.scaler.update(i, finite)
        opt.zero_grad(set_to_none=True)
        tel.end_step()
