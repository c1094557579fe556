"""Training telemetry that can stay on, a NaN/Inf locator, and a numerics diff of two runs.

Design note
-----------
:class:`Telemetry` attaches to an MMDiT from the outside (forward hooks on the blocks found
by ``named_modules()``, and a wrapper around the model's ``ops.qk_norm_rope`` seam, the last
point where each stream's normed and rotated q / k exist before attention) and records, on
every ``every``-th step:

* ``act_rms`` / ``act_max`` per block and stream (``img`` / ``txt`` after a double block,
  ``joint`` after a single block);
* ``logit_max``: the largest pre-softmax attention logit ``q·k/sqrt(Dh)`` per head group,
  recomputed from the buffered q / k of the block (masking is ignored: a bound);
* ``grad_norm`` per block and ``total``; ``update_ratio`` ||ΔW||/||W|| and
  ``lost_update_frac`` (updates below half an ulp of the stored weight) per block, from the
  optimizer's statistics (:class:`lab_utils.stability.training.StabilityAdamW`) or, for any other
  optimizer, from a weight snapshot;
* ``loss`` and ``loss_bucket`` (per timestep bucket of the rectified-flow t).

Values stay on the device until :meth:`Telemetry.end_step` gathers them with one copy, so a
sampled step synchronises once.  Rows are tidy: (step, block, stream, stat, value).

:class:`NaNLocator` names the first module whose output (forward), input gradient or
parameter gradient (backward) is non-finite, with hooks on every module and parameter.  It is
meant for a one-step replay of the step that went non-finite (same batch, same weights), not
for the whole run: no anomaly mode, no per-op overhead while training is healthy.

Two runs' telemetry are compared by :mod:`lab_utils.stability.numdiff` (``perflab numdiff A B``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lab_utils.core.config import ConfigError, check_int

NAN_PHASES = ("forward", "backward", "weight")
BLOCK_RE = re.compile(r"^(double_blocks|single_blocks)\.(\d+)")
STATS = ("act_rms", "act_max", "logit_max", "grad_norm", "update_ratio", "lost_update_frac", "loss", "loss_bucket")
FRAME_COLUMNS = ["step", "block", "stream", "stat", "value"]


def block_of(name: str) -> str:
    """The block a module belongs to ("double_blocks.1" for "double_blocks.1.img_mlp.fc2"),
    else the module's top-level name ("model" for the root)."""
    m = BLOCK_RE.match(name)
    if m:
        return m.group(0)
    return name.split(".")[0] if name else "model"


def block_sort_key(block: str) -> tuple:
    """Depth order: double blocks, single blocks, then everything else (globals last)."""
    m = BLOCK_RE.match(block)
    if m:
        return (0 if m.group(1) == "double_blocks" else 1, int(m.group(2)), "")
    return (2, 0, block)


def block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if BLOCK_RE.fullmatch(n)]


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


# ------------------------------------------------------------------------------------ telemetry
class Telemetry:
    """Per-step, per-block statistics of a training run (see the module note).

    Use around a step: ``begin_step(i)``, forward, backward, ``after_backward(scale)``,
    ``before_step()``, optimizer step, ``after_step(stats)``, ``log_loss(t, per_sample)``,
    ``end_step()``.  ``close()`` removes every hook and restores the attention seam."""

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = 1,
        head_groups: int = 1,
        timestep_buckets: int = 4,
        blocks: list[tuple[str, nn.Module]] | None = None,
    ):
        """``blocks``: (name, module) of any model's repeated blocks (``lab_utils.step``
        detects them); by default the MMDiT's double / single blocks.  A generic block's
        outputs are streams ``out0``, ``out1``, ..."""
        check_int("telemetry_every", every, min=1)
        check_int("head_groups", head_groups, min=1)
        check_int("timestep_buckets", timestep_buckets, min=1)
        heads = getattr(getattr(model, "cfg", None), "num_heads", head_groups)
        if heads % head_groups:
            raise ConfigError("head_groups", head_groups, f"a divisor of the model's num_heads = {heads}")
        self.model, self.every, self.head_groups, self.buckets = model, every, head_groups, timestep_buckets
        self.generic = blocks is not None
        self.blocks = list(blocks) if blocks is not None else block_modules(model)
        self.block_names = {n for n, _ in self.blocks}
        self.block_params: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for name, p in model.named_parameters():
            self.block_params.setdefault(self._block_of(name), []).append((name, p))
        self.rows: list[dict] = []
        self.step = -1
        self.active = False
        self._pending: list[tuple[str, str, str, torch.Tensor]] = []
        self._current: str | None = None
        self._qk: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._seen: set[str] = set()
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._handles = []
        for name, mod in self.blocks:
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(mod.register_forward_hook(self._post_hook(name)))
        self._ops = getattr(model, "ops", None)
        self._orig_qk = getattr(self._ops, "qk_norm_rope", None)
        if self._orig_qk is not None:
            self._ops.qk_norm_rope = self._wrap_qk(self._orig_qk)

    def _block_of(self, name: str) -> str:
        if not self.generic:
            return block_of(name)
        return next((b for b in self.block_names if name.startswith(b + ".")), name.split(".")[0])

    # hooks ------------------------------------------------------------------------------
    def _pre_hook(self, name):
        def hook(mod, args):
            self._current = name
            self._qk = []

        return hook

    def _wrap_qk(self, fn: Callable) -> Callable:
        def qk_norm_rope(q, k, *args, **kwargs):
            out = fn(q, k, *args, **kwargs)
            if self.active and self._current is not None and self._current not in self._seen:
                self._qk.append((out[0].detach(), out[1].detach()))
            return out

        return qk_norm_rope

    def _post_hook(self, name):
        def hook(mod, args, out):
            self._current = None
            # activation checkpointing reruns a block's forward in backward: count it once
            if not self.active or name in self._seen:
                return
            self._seen.add(name)
            outs = _tensors(out)
            if self.generic:
                streams = [f"out{i}" for i in range(len(outs))]
            else:
                streams = ["img", "txt"] if len(outs) == 2 else ["joint"]
            with torch.no_grad():
                for stream, t in zip(streams, outs):
                    x = t.detach().float()
                    self._pending.append((name, stream, "act_rms", x.square().mean().sqrt()))
                    self._pending.append((name, stream, "act_max", x.abs().max()))
                if self._qk:
                    for g, v in enumerate(self._logit_max(self._qk)):
                        self._pending.append((name, f"g{g}", "logit_max", v))
            self._qk = []

        return hook

    def _logit_max(self, qk: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Max of q·k/sqrt(Dh) over batch, queries and keys, per head group (G,)."""
        q = torch.cat([a for a, _ in qk], dim=2).float()  # B H L Dh
        k = torch.cat([b for _, b in qk], dim=2).float()
        scale = q.shape[-1] ** -0.5
        per_head = torch.stack([(q[:, h] @ k[:, h].transpose(-1, -2)).amax() for h in range(q.shape[1])])  # H
        return per_head.view(self.head_groups, -1).amax(dim=1) * scale

    # the step ---------------------------------------------------------------------------
    def sampled(self, step: int) -> bool:
        return step % self.every == 0

    def begin_step(self, step: int) -> bool:
        self.step, self.active = step, self.sampled(step)
        self._pending, self._seen, self._snapshot = [], set(), None
        return self.active

    def after_backward(self, grad_scale: float = 1.0) -> None:
        """Gradient norm per block and in total (grads divided by ``grad_scale``)."""
        if not self.active:
            return
        with torch.no_grad():
            sq_total = None
            for blk, params in self.block_params.items():
                sq = [p.grad.detach().float().square().sum() for _, p in params if p.grad is not None]
                if not sq:
                    continue
                s = torch.stack(sq).sum() / (grad_scale * grad_scale)
                sq_total = s if sq_total is None else sq_total + s
                if blk in self.block_names:
                    self._pending.append((blk, "", "grad_norm", s.sqrt()))
            if sq_total is not None:
                self._pending.append(("total", "", "grad_norm", sq_total.sqrt()))

    def before_step(self) -> None:
        """Snapshot block weights (only needed for optimizers that give no statistics)."""
        if self.active:
            self._snapshot = {n: p.detach().clone() for _, ps in self._block_items() for n, p in ps}

    def _block_items(self):
        return [(b, ps) for b, ps in self.block_params.items() if b in self.block_names]

    def after_step(self, stats: dict | None = None) -> None:
        """Update ratio and lost-update fraction per block.  ``stats``: {param: (update_sq,
        weight_sq, lost, numel)} from the optimizer (``lost``: the tensor's count of lost
        updates, or an estimate of it scaled to ``numel``); without it, from the snapshot (an
        element counts as lost when its gradient was non-zero and its stored value did not
        move).  A block's fraction is sum(lost) / sum(numel): each tensor weighs by its size."""
        if not self.active:
            return
        with torch.no_grad():
            for blk, params in self._block_items():
                u2, w2, lost, n = [], [], [], 0
                for name, p in params:
                    if stats is not None and p in stats:
                        a, b, c, m = stats[p]
                    elif self._snapshot is not None and name in self._snapshot:
                        old = self._snapshot[name].float()
                        d = p.detach().float() - old
                        a, b = d.square().sum(), old.square().sum()
                        if p.grad is None:
                            c, m = torch.zeros((), device=p.device), 0
                        else:
                            c, m = ((d == 0) & p.grad.detach().ne(0)).sum(), p.numel()
                    else:
                        continue
                    u2.append(a), w2.append(b), lost.append(c.float())
                    n += m
                if not u2:
                    continue
                ratio = torch.stack(u2).sum().sqrt() / torch.stack(w2).sum().sqrt().clamp_min(1e-30)
                self._pending.append((blk, "", "update_ratio", ratio))
                if n:
                    self._pending.append((blk, "", "lost_update_frac", torch.stack(lost).sum().float() / n))
        self._snapshot = None

    def log_loss(self, t: torch.Tensor, per_sample: torch.Tensor) -> None:
        """Loss in total and per timestep bucket (t in [0, 1], ``per_sample`` (B,))."""
        if not self.active:
            return
        with torch.no_grad():
            per = per_sample.detach().float()
            self._pending.append(("", "", "loss", per.mean()))
            idx = (t.detach().float() * self.buckets).long().clamp(0, self.buckets - 1)
            for b in range(self.buckets):
                sel = idx == b
                if bool(sel.any()):
                    label = f"t{b / self.buckets:.2f}-{(b + 1) / self.buckets:.2f}"
                    self._pending.append(("", label, "loss_bucket", per[sel].mean()))

    def end_step(self) -> None:
        if self.active and self._pending:
            vals = torch.stack([v.detach().float().reshape(()) for *_, v in self._pending]).cpu().tolist()
            for (blk, stream, stat, _), v in zip(self._pending, vals):
                self.rows.append(dict(step=self.step, block=blk, stream=stream, stat=stat, value=float(v)))
        self._pending, self.active = [], False

    def drop_steps(self, steps: Iterable[int]) -> None:
        """Forget the rows of these steps: a rewound run replays them, and keeps one row per
        (step, block, stream, stat), the replay's."""
        gone = set(steps)
        self.rows = [r for r in self.rows if r["step"] not in gone]

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=FRAME_COLUMNS)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._orig_qk is not None:
            self._ops.qk_norm_rope = self._orig_qk
            self._orig_qk = None


def disable_qk_norm(model: nn.Module) -> nn.Module:
    """Turn QK-norm off from the outside: the model's ``qk_norm_rope`` seam applies RoPE only
    (the q_norm / k_norm weights then get no gradient).  Call before attaching telemetry."""
    rope = model.ops.rope

    def rope_only(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
        return rope(q, k, cos, sin)

    model.ops.qk_norm_rope = rope_only
    model.seams["qk_norm"] = "off (rope only)"
    return model


# ------------------------------------------------------------------------------ any model's attention
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


class SdpaTelemetry(Telemetry):
    """:class:`Telemetry` on any model's repeated blocks, plus ``logit_max`` per block (stream
    ``attn``): the largest logit of the ``scaled_dot_product_attention`` calls made inside the
    block during a sampled step's forward (and a checkpointed block's recompute: the same
    values), by :func:`sdpa_logit_max`; no seam needed.  A model that calls no SDPA gets no such rows."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]], *, every: int = 1):
        super().__init__(model, every=every, head_groups=1, blocks=blocks)
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


def telemetry_of(model: nn.Module, blocks: list[tuple[str, nn.Module]], *, every: int = 1, head_groups: int = 1):
    """Telemetry for a model: perflab's MMDiT through its ``qk_norm_rope`` seam (logit max per
    head group), any other model's ``blocks`` with the logit max of its SDPA calls (``close()`` it
    when done)."""
    if getattr(getattr(model, "ops", None), "qk_norm_rope", None) is not None:
        return Telemetry(model, every=every, head_groups=head_groups)
    return SdpaTelemetry(model, blocks, every=every)


# ------------------------------------------------------------------------------ NaN locator
@dataclass
class NonFiniteReport:
    """The first non-finite tensor of a step: where (module, its block), in which direction."""

    phase: str  # "forward" | "backward"
    module: str
    block: str
    tensor: str  # "output[0]", "input[1]" (forward), "grad of input[0]" or "grad of weight" (backward)
    nan: int
    inf: int
    shape: tuple

    def __str__(self) -> str:
        return (
            f"first non-finite in {self.phase}: module {self.module!r} (block {self.block}), {self.tensor} "
            f"{'x'.join(map(str, self.shape))}: {self.nan} NaN, {self.inf} Inf"
        )


def _report(phase, name, what, t) -> NonFiniteReport:
    t = t.detach()
    return NonFiniteReport(
        phase, name or "model", block_of(name), what, int(t.isnan().sum()), int(t.isinf().sum()), tuple(t.shape)
    )


def _finite(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex()) or bool(torch.isfinite(t).all())


class NaNLocator:
    """Context manager: hooks on every module; ``forward`` / ``backward`` hold the first
    :class:`NonFiniteReport` of each direction (``None`` while everything is finite).

    Forward: the first module, in execution order, whose input or output is non-finite (inner
    modules finish first, so the deepest producer is named).  Backward: the first module whose
    *input* gradient or whose own parameter's gradient is non-finite, i.e. the module whose
    backward produced it (a weight gradient can overflow alone, with every activation
    gradient finite: fp16's usual case)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.forward: NonFiniteReport | None = None
        self.backward: NonFiniteReport | None = None
        self._handles = []

    def __enter__(self) -> NaNLocator:
        for name, mod in self.model.named_modules():
            self._handles.append(mod.register_forward_hook(self._hook(name)))
            for pname, p in mod.named_parameters(recurse=False):
                if p.requires_grad:
                    self._handles.append(p.register_hook(self._grad_hook(name, f"grad of {pname}")))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def first(self) -> NonFiniteReport | None:
        return self.forward or self.backward

    def _hook(self, name):
        def hook(mod, args, out):
            ins = _tensors(args)
            if self.forward is None:
                for i, t in enumerate(ins):
                    if not _finite(t):
                        self.forward = _report("forward", name, f"input[{i}]", t)
                        break
            if self.forward is None:
                for i, t in enumerate(_tensors(out)):
                    if not _finite(t):
                        self.forward = _report("forward", name, f"output[{i}]", t)
                        break
            if torch.is_grad_enabled():
                for i, t in enumerate(ins):
                    if t.requires_grad:
                        t.register_hook(self._grad_hook(name, f"grad of input[{i}]"))

        return hook

    def _grad_hook(self, name, what):
        def hook(grad):
            if self.backward is None and not _finite(grad):
                self.backward = _report("backward", name, what, grad)

        return hook


def locate_nonfinite(model: nn.Module, step_fn: Callable[[], torch.Tensor]) -> NonFiniteReport | None:
    """Replay one step (``step_fn`` runs forward and returns the loss) under a
    :class:`NaNLocator`, backward included; gradients of the replay are discarded."""
    with NaNLocator(model) as loc:
        loss = step_fn()
        if loss.requires_grad and loc.forward is None:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return loc.first


class _PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g.view(-1)[0] = float("nan")
        return g


def inject_nonfinite(model: nn.Module, module: str, phase: str = "forward"):
    """Make ``module``'s first output carry a NaN (``phase="forward"``), its gradient turn
    NaN on the way back (``"backward"``), or its first parameter's gradient carry an Inf and
    nothing else (``"weight"``: every activation gradient stays finite).  Returns the hook
    handle (``.remove()`` to stop)."""
    names = dict(model.named_modules())
    if module not in names:
        raise ConfigError("nan_module", module, "the name of a module of the model (e.g. 'double_blocks.1')")
    if phase not in NAN_PHASES:
        raise ConfigError("nan_phase", phase, "'forward', 'backward' or 'weight'")
    if phase == "weight":
        params = [p for p in names[module].parameters() if p.requires_grad]
        if not params:
            raise ConfigError("nan_module", module, "a module with a trainable parameter (for nan_phase 'weight')")

        def overflow(g):
            g = g.clone()
            g.view(-1)[0] = float("inf")
            return g

        return params[0].register_hook(overflow)

    def poison(t):
        if phase == "backward":
            return _PoisonGrad.apply(t)
        t = t.clone()
        t.view(-1)[0] = float("nan")
        return t

    def hook(mod, args, out):
        if isinstance(out, torch.Tensor):
            return poison(out)
        return (poison(out[0]), *out[1:])

    return names[module].register_forward_hook(hook, prepend=True)
