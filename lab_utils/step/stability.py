"""Lab 07 on any step: telemetry per detected block, the NaN/Inf locator by module, and
loss spikes with skip / clip / rewind.

* telemetry: :class:`lab_utils.stability.telemetry.Telemetry` on the step's blocks (activation
  RMS / max of each block output, gradient norm per block and in total, update ratio and the
  fraction of lost updates per block from a weight snapshot around the optimizer step) and
  :class:`StepTelemetry`'s attention logit max per block, from every
  ``scaled_dot_product_attention`` call the block makes (any model: no seam needed);
* the locator replays one step under :class:`~lab_utils.stability.telemetry.NaNLocator`
  (hooks on every module and parameter) and names the first module whose output or gradient
  is non-finite;
* spikes: the robust z-score detector of :mod:`lab_utils.stability.training`; a spike is
  provoked by scaling the loss of one step (the batch is the factory's, opaque here).  ``skip``
  drops the update, ``clip`` clips the gradient norm to the window's median, ``rewind``
  restores the last checkpoint (every ``ckpt_every`` steps) and skips the batch.
"""

from __future__ import annotations

import copy
import math

import pandas as pd
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from lab_utils.core.config import ConfigError, check_choice, check_float, check_int
from lab_utils.stability.telemetry import NaNLocator, NonFiniteReport, Telemetry, inject_nonfinite
from lab_utils.stability.training import SPIKE_POLICIES, SpikeDetector
from lab_utils.step.contract import StepFactory, blocks

#: Rewinds at most this many times per run (a spike that comes back each replay ends it).
MAX_REWINDS = 3


def sdpa_logit_max(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The largest pre-softmax logit ``q·kᵀ·scale`` of one ``scaled_dot_product_attention`` call
    (its own q, k and ``scale``, default ``1/sqrt(E)``; grouped-query keys repeated to the query
    heads; the mask is ignored, so a bound), one head at a time (an (L, S) matrix at most)."""
    q = args[0] if args else kwargs["query"]
    k = args[1] if len(args) > 1 else kwargs["key"]
    q, k = q.detach().float(), k.detach().float()
    scale = kwargs.get("scale", args[6] if len(args) > 6 else None) or q.shape[-1] ** -0.5
    if q.dim() < 3:
        return (q @ k.transpose(-1, -2)).amax() * scale
    if k.shape[-3] != q.shape[-3]:
        if q.shape[-3] % k.shape[-3]:
            return None  # heads that do not group: not an attention this reads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    heads = [(q[..., h, :, :] @ k[..., h, :, :].transpose(-1, -2)).amax() for h in range(q.shape[-3])]
    return torch.stack(heads).amax() * scale


class _AttentionCalls(TorchFunctionMode):
    """While entered, hands every ``scaled_dot_product_attention`` call to ``note``."""

    def __init__(self, note):
        super().__init__()
        self.note = note

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.note(args, kwargs)
        return func(*args, **kwargs)


class StepTelemetry(Telemetry):
    """:class:`Telemetry` on a step's detected blocks, plus ``logit_max`` per block (stream
    ``attn``): the largest logit of the ``scaled_dot_product_attention`` calls made inside the
    block during a sampled step's forward (and a checkpointed block's recompute: the same
    values), by :func:`sdpa_logit_max`.  A model that calls no SDPA gets no such rows."""

    def __init__(self, step: StepFactory, *, every: int = 1):
        super().__init__(step.model, every=every, head_groups=1, blocks=blocks(step))
        self.current: list[str] = []  # the blocks whose forward is running, innermost last
        self.logit_max: dict[str, torch.Tensor] = {}
        self.mode: _AttentionCalls | None = None
        self.hooks = []
        for name, mod in self.blocks:
            self.hooks.append(mod.register_forward_pre_hook(self.enter(name)))
            self.hooks.append(mod.register_forward_hook(self.leave))

    def enter(self, name: str):
        def hook(mod, args) -> None:
            self.current.append(name)

        return hook

    def leave(self, mod, args, out) -> None:  # returns None: the block's output stays its own
        if self.current:
            self.current.pop()

    def note(self, args: tuple, kwargs: dict) -> None:
        if self.current:
            with torch.no_grad():
                v = sdpa_logit_max(args, kwargs)
            if v is None:
                return
            b = self.current[-1]
            self.logit_max[b] = v if b not in self.logit_max else torch.maximum(self.logit_max[b], v)

    def begin_step(self, step: int) -> bool:
        active = super().begin_step(step)
        self.logit_max, self.current = {}, []
        if active and self.mode is None:
            self.mode = _AttentionCalls(self.note)
            self.mode.__enter__()
        return active

    def stop(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None

    def after_backward(self, grad_scale: float = 1.0) -> None:
        self.stop()
        super().after_backward(grad_scale)

    def end_step(self) -> None:
        self.stop()
        step, active = self.step, self.active
        super().end_step()
        if active:
            vals = {b: float(v) for b, v in self.logit_max.items()}
            self.rows += [dict(step=step, block=b, stream="attn", stat="logit_max", value=v) for b, v in vals.items()]
        self.logit_max = {}

    def close(self) -> None:
        self.stop()
        for h in self.hooks:
            h.remove()
        self.hooks = []
        super().close()


def telemetry(step: StepFactory, *, every: int = 1) -> StepTelemetry:
    """Telemetry hooked on the step's detected blocks, attention logit max included (``close()``
    it when done)."""
    return StepTelemetry(step, every=every)


def locate(step: StepFactory, k: int, *, module: str | None = None, phase: str = "forward"):
    """Replay step ``k`` (forward and backward, gradients discarded) under a NaN locator and
    return its (forward, backward) reports; ``module``: first inject a NaN there (``phase``
    forward / backward / weight: :func:`lab_utils.stability.telemetry.inject_nonfinite`)."""
    hook = inject_nonfinite(step.model, module, phase) if module else None
    try:
        batch = step.make_batch(k)
        with NaNLocator(step.model) as loc:
            loss = step.loss(step.model, batch)
            if loss.requires_grad:
                loss.backward()
    finally:
        if hook is not None:
            hook.remove()
        step.optimizer.zero_grad(set_to_none=True)
    return loc.forward, loc.backward


def _grad_norm(params) -> float:
    return float(torch.nn.utils.clip_grad_norm_(params, math.inf))


def run(
    step: StepFactory,
    steps: int,
    *,
    spike_policy: str = "none",
    provoke_step: int | None = None,
    provoke_scale: float = 1e3,
    ckpt_every: int = 4,
    detector: SpikeDetector | None = None,
    progress: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame, list[tuple[int, NonFiniteReport | None]]]:
    """Train ``steps`` steps (batches 1..steps) with telemetry and spike handling; returns the
    per-step rows (loss, grad_norm, spike, z-scores, action), the telemetry frame and the
    non-finite events (step, first report of its replay)."""
    check_int("steps", steps, min=1)
    check_choice("spike_policy", spike_policy, SPIKE_POLICIES)
    check_float("provoke_scale", provoke_scale, min=0, min_exclusive=True)
    check_int("ckpt_every", ckpt_every, min=1)
    if provoke_step is not None and not 0 <= provoke_step < steps:
        raise ConfigError("provoke_step", provoke_step, f"a step in 0..{steps - 1}")
    params = [p for p in step.model.parameters() if p.requires_grad]
    tel = telemetry(step)
    det = detector or SpikeDetector(8, 6.0, 6, 4)  # a window of 8 steps, z > 6
    rows: dict[int, dict] = {}
    events: list[tuple[int, NonFiniteReport | None]] = []
    skipped: set[int] = set()
    ckpt, rewinds, i = None, 0, 0
    bar = tqdm(total=steps, desc="steps", disable=not progress, leave=False)
    try:
        while i < steps:
            if spike_policy == "rewind" and (ckpt is None or (i % ckpt_every == 0 and ckpt[0] != i)):
                ckpt = (i, copy.deepcopy(step.model.state_dict()), copy.deepcopy(step.optimizer.state_dict()),
                        det.state())  # fmt: skip
            if i in skipped:
                rows[i] = dict(step=i, loss=math.nan, grad_norm=math.nan, spike=False, action="rewound: batch skipped")
                i, _ = i + 1, bar.update(1)
                continue
            scale = provoke_scale if i == provoke_step else 1.0
            batch = step.make_batch(i + 1)
            tel.begin_step(i)
            loss = step.loss(step.model, batch) * scale
            loss.backward()
            tel.after_backward()
            lv, gn = float(loss.detach()), _grad_norm(params)
            row = dict(step=i, loss=lv, grad_norm=gn, action="step")
            if not (math.isfinite(lv) and math.isfinite(gn)):
                step.optimizer.zero_grad(set_to_none=True)
                tel.end_step()
                events.append((i, _first(locate(step, i + 1))))
                rows[i] = row | dict(spike=True, action="non-finite: skipped")
                i, _ = i + 1, bar.update(1)
                continue
            chk = det.observe(lv, gn)
            row.update(spike=chk.spike, z_loss=chk.z_loss, z_grad=chk.z_grad)
            apply = True
            if chk.spike and spike_policy == "skip":
                apply, row["action"] = False, "spike: skipped"
            elif chk.spike and spike_policy == "clip":
                torch.nn.utils.clip_grad_norm_(params, det.median_grad())
                row["action"] = "spike: clipped"
            elif chk.spike and spike_policy == "rewind" and rewinds < MAX_REWINDS:
                skipped.add(i)
                rewinds += 1
                step.model.load_state_dict(ckpt[1])
                step.optimizer.load_state_dict(ckpt[2])
                det.restore(ckpt[3])
                step.optimizer.zero_grad(set_to_none=True)
                tel.end_step()
                tel.drop_steps(range(ckpt[0], i))
                i = ckpt[0]
                continue
            if apply:
                tel.before_step()
                step.optimizer.step()
                tel.after_step()
            step.optimizer.zero_grad(set_to_none=True)
            tel.end_step()
            rows[i] = row
            i, _ = i + 1, bar.update(1)
    finally:
        bar.close()
        tel.close()
    return pd.DataFrame([rows[k] for k in sorted(rows)]), tel.frame(), events


def _first(reports) -> NonFiniteReport | None:
    return reports[0] or reports[1]


def locator_lines(step: StepFactory, modules: list[str] | None = None, k: int = 1) -> list[str]:
    """For each module (default: the first detected block, and the first linear layer of the
    last block: a last block's first output may not reach the loss), a NaN injected forward
    and backward, and what the locator names; raises when it names another module."""
    if modules is None:
        bl = blocks(step)
        if not bl:
            raise ConfigError("step", step.name, "a model with repeated blocks (none detected; give block_class)")
        last, mod = bl[-1]
        lin = next((f"{last}.{n}" for n, m in mod.named_modules() if isinstance(m, torch.nn.Linear)), last)
        modules = [bl[0][0], lin]
    out = []
    for m in modules:
        for phase in ("forward", "backward"):
            fwd, bwd = locate(step, k, module=m, phase=phase)
            got = fwd if phase == "forward" else bwd
            if got is None or not (got.module == m or got.module.startswith(m + ".")):
                raise AssertionError(f"NaN injected {phase} into {m!r}; the locator named {got}")
            out.append(f"NaN injected {phase} into {m}: located in {got.module} ({got.tensor})")
    return out


def spike_check_lines(results: dict[str, pd.DataFrame], provoke_step: int) -> list[str]:
    """Each policy's verdict on the provoked spike; raises when a policy does not find it."""
    out = []
    for pol, df in results.items():
        row = df[df.step == provoke_step]
        if row.empty:
            raise AssertionError(f"spike policy {pol!r}: no row for the provoked step {provoke_step}")
        r = row.iloc[0]
        if not bool(r.spike) and "rewound" not in str(r.action):
            raise AssertionError(f"spike policy {pol!r}: the loss scaled at step {provoke_step} was not a spike")
        out.append(f"{pol}: step {provoke_step} {r.action}")
    return out
