"""Attention paths behind one calling convention, and the registry of what each supports.

Design note
-----------
``attend(q, k, v, path=..., mask=..., cu_seqlens=...)`` runs the same problem on any
path:

* layout "bhld": q (B, H, Lq, Dh), k/v (B, H, Lk, Dh)  -> (B, H, Lq, Dh)
* layout "packed": q/k/v (T, H, Dh) with ``cu_seqlens`` (n+1,), 0 .. T  -> (T, H, Dh);
  every sequence attends only inside itself, and ``mask`` applies to positions *inside*
  each sequence (``b`` of a mask_mod is the sequence index there).

``mask``: None (full), "full" / "causal", a :class:`lab_utils.attention.masks.Mask`, or a boolean
tensor broadcastable to (B, H, Lq, Lk) with True = may attend (SDPA's convention; the
model passes its key-padding mask this way).

Paths (``PATHS``): "reference" (dense, computed in float64, cast back), "sdpa"
(torch's own backend choice), "math" / "flash" / "efficient" / "cudnn" (SDPA with that
backend forced), "flex" (compiled FlexAttention), "flex_eager" (uncompiled debug path:
materialises the scores), "triton" (lab_kernels.attention), "flash_attn" (the
flash-attn library when installed).  Which path honours which mask, layout, dtype,
device and backward is in :data:`REGISTRY` (``path_table()`` shows it); SDPA backends
are probed once per (device, dtype, head dim) on a tiny problem, so the table lists
what *this* device has.  A problem a path cannot run raises :class:`AttentionError`
naming the parameter — never a silently different computation.

Mask preprocessing (the dense boolean mask for SDPA, the BlockMask for flex) is cached
per Mask object and shape, so timings after the first call measure attention only;
``lab_utils.attention.masks.flex_block_mask`` is timed separately as the block-mask build cost.

The paths and their registry live in :mod:`lab_utils.attention.paths` (re-exported here);
the input checks in :mod:`lab_utils.attention.inputs` (re-exported too); this module holds
the entry point, the float64 checks and the timing sweep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd
import torch

from lab_utils.attention.inputs import Problem, check_inputs, normalize_mask
from lab_utils.attention.masks import Mask, attention_flops, flex_block_mask, make_mask
from lab_utils.attention.paths import (
    LAYOUTS,
    MASK_KINDS,
    PATHS,
    REGISTRY,
    AttentionError,
    AttentionPath,
    clear_caches,
    get_path,
)
from lab_utils.core.checks import compare, tolerance
from lab_utils.core.dtypes import dtype_name
from lab_utils.core.session import Session
from lab_utils.core.timing import try_bench

__all__ = [
    "GRAD_SCALE",
    "LAYOUTS",
    "MASK_KINDS",
    "MATERIALISING",
    "PATHS",
    "REGISTRY",
    "AttentionError",
    "AttentionPath",
    "CheckResult",
    "Problem",
    "attend",
    "attention_bytes",
    "available_paths",
    "check_inputs",
    "check_path",
    "clear_caches",
    "get_path",
    "path_table",
    "random_qkv",
    "SweepGrid",
    "SweepOptions",
    "sweep",
]


def available_paths(
    device="cpu",
    dtype=torch.float32,
    *,
    mask="full",
    layout="bhld",
    head_dim=64,
    backward=False,
    include_reference: bool = True,
) -> list[str]:
    """Paths that can run this problem here."""
    out = []
    for name, p in REGISTRY.items():
        if not include_reference and p.kind == "reference":
            continue
        if (
            p.why_not(device=device, dtype=dtype, mask=mask, layout=layout, head_dim=head_dim, backward=backward)
            is None
        ):
            out.append(name)
    return out


def path_table(device="cpu", dtype=torch.float32, head_dim: int = 64):
    """One row per path x mask kind x layout x direction: supported here, or why not."""
    rows = []
    for name, p in REGISTRY.items():
        for layout in LAYOUTS:
            for mk in MASK_KINDS:
                for bwd in (False, True):
                    r = p.why_not(device=device, dtype=dtype, mask=mk, layout=layout, head_dim=head_dim, backward=bwd)
                    rows.append(
                        dict(
                            path=name,
                            kind=p.kind,
                            layout=layout,
                            mask=mk,
                            direction="fwd+bwd" if bwd else "fwd",
                            supported=r is None,
                            why_not=r or "",
                        )
                    )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- the entry point
def attend(
    q,
    k,
    v,
    *,
    path: str | AttentionPath = "sdpa",
    mask=None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Attention on ``path``; see the module docstring for layouts and masks.
    Raises :class:`AttentionError` naming the parameter when the input is malformed or
    the path cannot honour the problem.  ``path`` is a name or an :class:`AttentionPath`
    already looked up (the model's seam resolves its path once)."""
    p = path if isinstance(path, AttentionPath) else get_path(path)
    path = p.name
    mask = normalize_mask(mask)
    prob = check_inputs(q, k, v, mask=mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    reason = p.why_not(**prob.as_check())
    if reason:
        param = (
            "mask"
            if prob.mask_kind not in p.masks
            else "cu_seqlens"
            if prob.layout not in p.layouts
            else "q"
            if (p.dtypes is not None and prob.dtype not in p.dtypes)
            or (p.head_dims is not None and prob.head_dim not in p.head_dims)
            else "path"
        )
        raise AttentionError(param, _describe(param, mask, q, path), f"a problem path {path!r} can run: {reason}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise AttentionError("scale", scale, "None or a positive number")
    return p.fn(q, k, v, mask, scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def _describe(param, mask, q, path):
    if param == "mask":
        return (
            mask.name
            if isinstance(mask, Mask)
            else "a dense boolean tensor"
            if isinstance(mask, torch.Tensor)
            else mask
        )
    if param == "q":
        return f"{dtype_name(q.dtype)} (B,H,L,Dh)={tuple(q.shape)}"
    if param == "cu_seqlens":
        return "packed layout"
    return path


# --------------------------------------------------------------------------- correctness
def random_qkv(
    B: int,
    H: int,
    L: int,
    head_dim: int,
    *,
    dtype=torch.float32,
    device="cpu",
    seed: int | None = None,
    lengths: list[int] | None = None,
    requires_grad: bool = True,
):
    """Fresh random q, k, v (and dO): (B, H, L, Dh), or packed (sum(lengths), H, Dh) +
    cu_seqlens when ``lengths`` is given.  Returns dict(q, k, v, do, cu_seqlens)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (sum(lengths), H, head_dim) if lengths else (B, H, L, head_dim)
    ts = [torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for _ in range(4)]
    for t in ts[:3]:
        t.requires_grad_(requires_grad)
    cu = None
    if lengths:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(q=ts[0], k=ts[1], v=ts[2], do=ts[3], cu_seqlens=cu)


#: gradients accumulate L products rounded to the dtype; allow this multiple of the
#: dtype's forward tolerance for dq/dk/dv (float32/float64 keep 1x... see GRAD_SCALE).
GRAD_SCALE = {torch.float64: 1.0, torch.float32: 2.0, torch.float16: 4.0, torch.bfloat16: 4.0}


@dataclass(frozen=True)
class CheckResult:
    path: str
    tensor: str  # out | dq | dk | dv
    ok: bool | None  # None = skipped
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    note: str = ""
    bound: float = math.nan  # the bound max_abs is held to (CloseReport.max_abs_bound): passes while <= it


def check_path(path: str, inputs: dict, *, mask=None, backward: bool = True, scale=None) -> list[CheckResult]:
    """Run ``path`` and the float64 reference on the same inputs; compare output and
    (with ``backward``) dq/dk/dv at the dtype's tolerance.  Inputs are poisoned-free
    fresh tensors (see ``random_qkv``); gradients are computed with torch.autograd.grad."""
    q, k, v, do, cu = (inputs[n] for n in ("q", "k", "v", "do", "cu_seqlens"))
    dtype = q.dtype
    p = get_path(path)
    prob = check_inputs(q, k, v, mask=normalize_mask(mask), cu_seqlens=cu)
    chk = prob.as_check()
    names = ["out", "dq", "dk", "dv"] if backward else ["out"]
    why = p.why_not(**{**chk, "backward": False})
    if why:
        return [CheckResult(path, n, None, math.nan, math.nan, math.nan, math.nan, why) for n in names]
    why_bwd = p.why_not(**{**chk, "backward": True}) if backward else None
    skipped = []
    if why_bwd:  # forward checked, gradients listed as skipped with the reason
        skipped = [CheckResult(path, n, None, math.nan, math.nan, math.nan, math.nan, why_bwd) for n in names[1:]]
        names, backward = ["out"], False
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    with torch.enable_grad() if backward else torch.no_grad():
        ref = attend(q64, k64, v64, path="reference", mask=mask, scale=scale, cu_seqlens=cu)
        qq, kk, vv = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
        out = attend(qq, kk, vv, path=path, mask=mask, scale=scale, cu_seqlens=cu)
        got = [out]
        want = [ref]
        if backward:
            got += list(torch.autograd.grad(out, (qq, kk, vv), do))
            want += list(torch.autograd.grad(ref, (q64, k64, v64), do.double()))
    res = []
    for n, a, e in zip(names, got, want):
        atol, rtol = tolerance(dtype, 1.0 if n == "out" else GRAD_SCALE.get(dtype, 1.0))
        r = compare(a, e, atol=atol, rtol=rtol, name=f"{path}:{n}")
        res.append(
            CheckResult(path, n, r.ok, r.max_abs, r.max_rel, atol, rtol, "" if r.ok else r.message, r.max_abs_bound)
        )
    return res + skipped


# --------------------------------------------------------------------------- speed sweep
#: paths that materialise the (B, H, Lq, Lk) scores; the sweep skips them above ``score_limit_gb``
MATERIALISING = ("reference", "math", "flex_eager")


def attention_bytes(B: int, H: int, Lq: int, Lk: int, head_dim: int, dtype, backward: bool = False) -> float:
    """Fewest bytes attention must move: fwd reads q, k, v and writes o; the backward
    reads q, k, v, o, dO and writes dq, dk, dv (scores never leave the chip)."""
    elt = torch.empty((), dtype=dtype).element_size()
    fwd = B * H * head_dim * elt * (2 * Lq + 2 * Lk)
    bwd = B * H * head_dim * elt * (4 * Lq + 4 * Lk)
    return float(fwd + (bwd if backward else 0))


@dataclass(frozen=True)
class SweepGrid:
    """The cases :func:`sweep` times: every (seq_len, head_dim, mask) x path x direction, at
    batch ``batch`` and ``heads`` heads in ``dtype``."""

    paths: tuple[str, ...]
    masks: tuple[str, ...]
    seq_lens: tuple[int, ...]
    head_dims: tuple[int, ...]
    directions: tuple[str, ...] = ("fwd", "fwd+bwd")
    batch: int = 1
    heads: int = 8
    dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class SweepOptions:
    """How :func:`sweep` times: ``reps`` samples within ``budget_s`` per case; the block-mask
    build timed too (``block_mask_cost``); paths that materialise the scores skipped above
    ``score_limit_gb``; the backward's FLOPs by ``flop_convention`` ("kernel" or "model")."""

    reps: int = 10
    budget_s: float = 30.0
    block_mask_cost: bool = True
    score_limit_gb: float = 8.0
    flop_convention: str = "kernel"


def sweep(
    grid: SweepGrid,
    session: Session | None = None,
    options: SweepOptions | None = None,
    *,
    progress: Callable[[list], Iterable] | None = None,
) -> list[dict]:
    """Time every case of ``grid`` that can run on ``session.device``.

    FLOPs are mask-aware (``masks.attention_flops``: allowed pairs only) and their backward
    follows ``options.flop_convention`` (``lab_utils.core.flops``: "kernel" = 2.5x forward, the
    matmuls a flash backward runs; "model" = 2x, what MFU counts), recorded on every row;
    TFLOP/s and % of the measured matmul ceiling go to ``session.rec``
    (``Recorder.add_timing``) as rows of experiment "sweep"; the block-mask build time of each
    mask as experiment "block_mask_build".  Returns one summary dict per case (with the reason
    when a case did not run).  Triton on CPU is never timed (interpreter).  ``progress`` wraps
    the list of (seq_len, head_dim, mask) cases (e.g. ``tqdm``) to show progress."""
    return _Sweep(grid, session or Session(), options or SweepOptions()).run(progress)


@dataclass
class _Case:
    """One (seq_len, head_dim, mask) of a sweep, and the context its rows carry."""

    L: int
    D: int
    mname: str
    mask: Mask
    fl: object  # masks.AttentionFlops
    shape: str

    def base(self) -> dict:
        return dict(
            seq_len=self.L,
            head_dim=self.D,
            mask=self.mname,
            shape=self.shape,
            density=self.fl.density,
            flop_convention=self.fl.convention,
        )


class _Sweep:
    """The stages of :func:`sweep`: per case the block-mask build, then each path and
    direction: why it cannot run here, or its timing and records."""

    def __init__(self, grid: SweepGrid, session: Session, options: SweepOptions):
        self.grid, self.session, self.o = grid, session, options
        self.device = str(session.device)
        self.dev_type = torch.device(self.device).type
        self.elt = torch.empty((), dtype=grid.dtype).element_size()

    def run(self, progress) -> list[dict]:
        gr, out = self.grid, []
        g = torch.Generator().manual_seed(self.session.seed)
        cases = [(L, D, mname) for L in gr.seq_lens for D in gr.head_dims for mname in gr.masks]
        for L, D, mname in progress(cases) if progress is not None else cases:
            mask = make_mask(mname, L)
            fl = attention_flops(mask, gr.batch, gr.heads, L, L, D, convention=self.o.flop_convention)
            c = _Case(L, D, mname, mask, fl, f"B{gr.batch}xH{gr.heads}xL{L}xD{D}")
            if self.o.block_mask_cost and mask.kind != "full":
                out.append(self.block_mask_row(c))
            qkvdo = tuple(
                torch.randn(gr.batch, gr.heads, L, D, generator=g).to(device=self.device, dtype=gr.dtype)
                for _ in range(4)
            )
            for path in gr.paths:
                p = get_path(path)
                out += [self.timed_row(c, p, path, direction, qkvdo) for direction in gr.directions]
        return out

    def block_mask_row(self, c: _Case) -> dict:
        """The block mask's build time (flex's preprocessing, cached by ``attend``)."""
        gr, o, rec = self.grid, self.o, self.session.rec
        t = try_bench(
            lambda: flex_block_mask(
                c.mask, gr.batch, None, c.L, c.L, device=self.device, compile=self.dev_type == "cuda"
            ),
            name=f"block_mask/{c.mname}",
            device=self.device,
            reps=max(3, o.reps // 2),
            budget_s=o.budget_s,
            check_finite=False,
        )
        if rec is not None:
            rec.add_timing(
                "block_mask_build", "flex", t, shape=c.shape, dtype=gr.dtype, mask=c.mname, seq_len=c.L, head_dim=c.D
            )
        return dict(
            c.base(),
            path="block_mask_build",
            direction="build",
            time_ms=t.median_ms if t.ok else math.nan,
            note="" if t.ok else f"{t.kind}: {t.reason}",
        )

    def skip_reason(self, c: _Case, p: AttentionPath, path: str, bwd: bool) -> str | None:
        """Why this path cannot (or must not) be timed here, or None."""
        gr = self.grid
        why = p.why_not(
            device=self.device,
            dtype=gr.dtype,
            mask=c.mask.kind,
            layout="bhld",
            head_dim=c.D,
            lq=c.L,
            lk=c.L,
            backward=bwd,
        )
        if why is None and p.kind == "triton" and self.dev_type == "cpu":
            why = "Triton runs through the interpreter on CPU: correctness only, never timed"
        score_bytes = gr.batch * gr.heads * c.L * c.L * max(self.elt, 4)
        if why is None and path in MATERIALISING and score_bytes > self.o.score_limit_gb * 2**30:
            why = f"materialises {score_bytes / 2**30:.1f} GiB of scores (> score_limit_gb={self.o.score_limit_gb})"
        return why

    def timed_row(self, c: _Case, p: AttentionPath, path: str, direction: str, qkvdo) -> dict:
        bwd = direction == "fwd+bwd"
        row = dict(c.base(), path=path, direction=direction)
        why = self.skip_reason(c, p, path, bwd)
        if why:
            return dict(row, time_ms=math.nan, note=why)
        q, k, v, do = qkvdo
        qq, kk, vv = (t.detach().requires_grad_(bwd) for t in (q, k, v))

        def fn():
            if not bwd:
                with torch.no_grad():
                    return attend(qq, kk, vv, path=path, mask=c.mask)
            o = attend(qq, kk, vv, path=path, mask=c.mask)
            return torch.autograd.grad(o, (qq, kk, vv), do)

        flops = c.fl.fwd_bwd if bwd else c.fl.fwd
        t = try_bench(
            fn, name=f"{path}/{c.mname}/{direction}", device=self.device, reps=self.o.reps, budget_s=self.o.budget_s
        )
        ok = getattr(t, "ok", False)
        self.record(c, path, direction, t, flops)
        return dict(
            row,
            time_ms=t.median_ms if ok else math.nan,
            tflops=flops / (t.median_ms * 1e-3) / 1e12 if ok else math.nan,
            note="" if ok else f"{t.kind}: {t.reason}",
        )

    def record(self, c: _Case, path: str, direction: str, t, flops: float) -> None:
        """The timing row, and how close attention comes to the matmul units: achieved over
        measured dense-matmul TFLOP/s."""
        rec, ceilings, gr = self.session.rec, self.session.ceilings, self.grid
        if rec is None:
            return
        # the context every record of this case carries
        case = dict(
            mask=c.mname,
            direction=direction,
            seq_len=c.L,
            head_dim=c.D,
            density=c.fl.density,
            flop_convention=c.fl.convention,
        )
        bwd = direction == "fwd+bwd"
        rec.add_timing(
            "sweep",
            path,
            t,
            shape=c.shape,
            dtype=gr.dtype,
            flops=flops,
            bytes=attention_bytes(gr.batch, gr.heads, c.L, c.L, c.D, gr.dtype, bwd),
            ceilings=ceilings,
            **case,
        )
        peak = ceilings.matmul(gr.dtype) if ceilings is not None else None
        if getattr(t, "ok", False) and peak:
            rec.add(
                "sweep",
                path,
                "pct_of_matmul",
                100 * flops / (t.median_ms * 1e-3) / 1e12 / peak,
                "%",
                shape=c.shape,
                dtype=gr.dtype,
                statistic="median",
                formula=f"mask-aware {c.fl.convention}-convention flops / time / measured matmul TFLOP/s",
                **case,
            )
