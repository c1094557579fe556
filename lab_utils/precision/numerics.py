"""Error analysis of low-precision formats: metrics, test distributions, real tensors, grids.

* :func:`error_stats` quantizes a tensor (``lab_kernels.quant``) and returns SQNR (dB),
  relative Frobenius error, max abs / max rel error, the fraction of non-zero
  elements flushed to zero and the fraction saturated (clipped at the format's largest
  magnitude by more than a quarter of its last step).
* :func:`make_tensor` draws the synthetic distributions (Gaussian, Laplace,
  Student-t, outlier channels); :func:`capture_linear_tensors` records the real
  weights, activations (inputs of ``nn.Linear``) and gradients (of their outputs)
  of a model during one forward/backward pass (the MMDiT of the training-step lab).
* :func:`sqnr_table` sweeps formats x tensors into tidy rows;
  :func:`format_grid_histogram` says which of a format's representable values a
  tensor's (scaled) elements land on: the format explorer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import pandas as pd
import torch
from torch import nn

import lab_kernels
from lab_kernels import lowp_matmul as L
from lab_kernels import quant as Q
from lab_utils.core.checks import rel_error, sqnr_db
from lab_utils.core.session import Session
from lab_utils.core.timing import try_bench

DISTRIBUTIONS = ("gaussian", "laplace", "student_t", "outlier_channels")

#: (name, kwargs for fake_quantize): the format variants the lab compares by default.
FORMAT_VARIANTS: dict[str, dict] = {
    "fp8_e4m3/tensor": dict(fmt="fp8_e4m3", granularity="tensor"),
    "fp8_e4m3/row": dict(fmt="fp8_e4m3", granularity="row"),
    "fp8_e4m3/block128": dict(fmt="fp8_e4m3", granularity="block"),
    "fp8_e5m2/tensor": dict(fmt="fp8_e5m2", granularity="tensor"),
    "mxfp8_e4m3/floor": dict(fmt="mxfp8_e4m3", scale_rule="floor"),
    "mxfp8_e4m3/rceil": dict(fmt="mxfp8_e4m3", scale_rule="rceil"),
    "mxfp8_e5m2/floor": dict(fmt="mxfp8_e5m2", scale_rule="floor"),
    "mxfp4/floor": dict(fmt="mxfp4", scale_rule="floor"),
    "mxfp4/rceil": dict(fmt="mxfp4", scale_rule="rceil"),
    "mxfp4/floor+hadamard32": dict(fmt="mxfp4", scale_rule="floor", hadamard=32),
    "nvfp4": dict(fmt="nvfp4"),
    "nvfp4+hadamard16": dict(fmt="nvfp4", hadamard=16),
}


@dataclass(frozen=True)
class ErrorStats:
    sqnr_db: float
    rel_fro: float
    max_abs: float
    max_rel: float
    flushed_frac: float
    saturated_frac: float
    numel: int

    def as_dict(self) -> dict:
        return asdict(self)


_MAX_CODE = {"e4m3": 0x7E, "e5m2": 0x7B, "e2m1": 0x7}


def error_metrics(q: torch.Tensor, x: torch.Tensor) -> dict:
    """SQNR, relative Frobenius, max abs and max relative (over non-zero x) error of q vs x."""
    xd, qd = x.detach().double(), q.detach().double()
    d = (qd - xd).abs()
    nz = xd != 0
    return dict(
        sqnr_db=sqnr_db(qd, xd),
        rel_fro=rel_error(qd, xd),
        max_abs=float(d.max()) if d.numel() else 0.0,
        max_rel=float((d[nz] / xd[nz].abs()).max()) if bool(nz.any()) else 0.0,
    )


def _codes_like(qt: Q.QuantizedTensor, x: torch.Tensor) -> torch.Tensor:
    """The element codes of ``qt`` in ``x``'s layout (``codes()`` is the quantized axis last,
    padded to whole blocks; a 2-D tiling pads the rows too): crop, then move the axis back."""
    moved = x.movedim(qt.axis, -1).shape
    rows = math.prod(moved[:-1])
    c = qt.codes()
    c = c.reshape(-1, c.shape[-1])[:rows, : moved[-1]]
    return c.reshape(moved).movedim(-1, qt.axis)


def error_stats(x: torch.Tensor, fmt: str, **kw) -> ErrorStats:
    """Quantize ``x`` (``fake_quantize`` keywords) and measure the error; NaN/Inf inputs refused."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError("parameter 'x' has NaN/Inf elements: error statistics need finite input")
    had = kw.pop("hadamard", None)
    q = Q.fake_quantize(x.float(), fmt, hadamard=had, **kw)
    m = error_metrics(q, x)
    xd = x.detach().float()
    flushed = float(((xd != 0) & (q == 0)).sum()) / max(1, xd.numel())
    if had is None:
        qt = Q.quantize(x.float(), fmt, pad=True, **kw)
        F = Q.FORMATS[fmt]
        codes = _codes_like(qt, x)
        at_max = (codes & ((1 << (F.elem_format.ebits + F.elem_format.mbits)) - 1)) == _MAX_CODE[F.elem]
        step = 2.0 ** -(F.elem_format.mbits + 2)
        sat = at_max & (xd.abs() > q.abs() * (1 + step))
        saturated = float(sat.sum()) / max(1, xd.numel())
    else:
        saturated = float("nan")  # clipping happens in the rotated basis; not attributed per element
    return ErrorStats(m["sqnr_db"], m["rel_fro"], m["max_abs"], m["max_rel"], flushed, saturated, x.numel())


def make_tensor(
    dist: str,
    shape=(256, 512),
    *,
    seed: int = 0,
    scale: float = 1.0,
    df: int = 3,
    n_outliers: int = 4,
    outlier_scale: float = 50.0,
) -> torch.Tensor:
    """A fixed-seed fp32 test tensor.  ``outlier_channels``: Gaussian with ``n_outliers``
    columns (features along the last, quantized axis) scaled by ``outlier_scale``, the
    pattern of transformer activations."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(
            f"parameter 'dist' = {dist!r} is not allowed: expected one of " + ", ".join(map(repr, DISTRIBUTIONS))
        )
    g = torch.Generator().manual_seed(seed)
    if dist == "gaussian":
        x = torch.randn(shape, generator=g)
    elif dist == "laplace":
        u = torch.rand(shape, generator=g) - 0.5
        x = -torch.sign(u) * torch.log1p(-2 * u.abs()) / math.sqrt(2)
    elif dist == "student_t":
        z = torch.randn(shape, generator=g)
        chi2 = (torch.randn((*shape, int(df)), generator=g) ** 2).sum(-1)  # integer df
        x = z / torch.sqrt(chi2 / df)
    else:
        x = torch.randn(shape, generator=g)
        cols = torch.randperm(shape[-1], generator=g)[:n_outliers]
        x[..., cols] *= outlier_scale
    return (x * scale).float()


@dataclass
class CapturedTensors:
    """Real tensors of one training step, keyed ``"<kind>:<module name>"`` with kind in
    weight | activation | gradient."""

    tensors: dict[str, torch.Tensor]

    def by_kind(self, kind: str) -> dict[str, torch.Tensor]:
        return {k.split(":", 1)[1]: v for k, v in self.tensors.items() if k.startswith(kind + ":")}

    def summary(self) -> pd.DataFrame:
        rows = []
        for k, v in self.tensors.items():
            kind, name = k.split(":", 1)
            rows.append(
                dict(
                    kind=kind,
                    module=name,
                    shape="x".join(map(str, v.shape)),
                    absmax=float(v.abs().max()),
                    rms=float(v.float().pow(2).mean().sqrt()),
                )
            )
        return pd.DataFrame(rows)


def capture_linear_tensors(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    *,
    names: Iterable[str] | None = None,
    max_modules: int | None = None,
    max_rows: int = 1024,
) -> CapturedTensors:
    """Run ``loss_fn()`` forward + backward once and record, for every ``nn.Linear`` (or
    those in ``names``): its weight, its input (activation, flattened to (tokens, K)) and
    the gradient of its output (flattened to (tokens, N)), first ``max_rows`` rows."""
    want = set(names) if names is not None else None
    out: dict[str, torch.Tensor] = {}
    handles = []
    count = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or (want is not None and name not in want):
            continue
        if max_modules is not None and count >= max_modules:
            break
        count += 1
        out[f"weight:{name}"] = mod.weight.detach().float().clone()

        def fwd_hook(m, inp, outp, name=name):
            out[f"activation:{name}"] = inp[0].detach().reshape(-1, inp[0].shape[-1])[:max_rows].float().clone()

        def bwd_hook(m, gin, gout, name=name):
            if gout[0] is not None:
                out[f"gradient:{name}"] = gout[0].detach().reshape(-1, gout[0].shape[-1])[:max_rows].float().clone()

        handles.append(mod.register_forward_hook(fwd_hook))
        handles.append(mod.register_full_backward_hook(bwd_hook))
    try:
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return CapturedTensors(out)


def sqnr_table(
    tensors: Mapping[str, torch.Tensor], variants: Mapping[str, dict] | Iterable[str] | None = None
) -> pd.DataFrame:
    """Tidy rows (tensor, variant, fmt, metric columns) for every tensor x format variant."""
    if variants is None:
        variants = FORMAT_VARIANTS
    elif not isinstance(variants, Mapping):
        variants = {v: FORMAT_VARIANTS[v] for v in variants}
    rows = []
    for tname, x in tensors.items():
        for vname, kw in variants.items():
            kw = dict(kw)
            fmt = kw.pop("fmt")
            s = error_stats(x, fmt, **kw)
            rows.append(dict(tensor=tname, variant=vname, fmt=fmt, bits=Q.FORMATS[fmt].bits_per_elem, **s.as_dict()))
    return pd.DataFrame(rows)


def format_grid_histogram(x: torch.Tensor, fmt: str, **kw) -> pd.DataFrame:
    """How a tensor's scaled elements fill the format's grid.

    One row per representable magnitude (the element grid, in units of the group
    scale) with ``count`` / ``frac`` of elements that round to it; ``value`` 0 gathers
    the zeros (flushed or exact), the largest value the saturated ones.  Sign merged."""
    qt = Q.quantize(x.float(), fmt, pad=True, **kw)
    F = Q.FORMATS[fmt].elem_format
    nb = F.ebits + F.mbits
    codes = _codes_like(qt, x).reshape(-1).to(torch.int64) & ((1 << nb) - 1)
    n_real = x.numel()
    counts = torch.bincount(codes, minlength=1 << nb).double()
    vals = Q.decode_codes(torch.arange(1 << nb, dtype=torch.uint8), F.name).double()
    keep = torch.isfinite(vals)
    df = pd.DataFrame(
        dict(code=torch.arange(1 << nb)[keep].tolist(), value=vals[keep].tolist(), count=counts[keep].tolist())
    )
    df["frac"] = df["count"] / max(1, n_real)
    df["log2_value"] = [math.log2(v) if v > 0 else float("nan") for v in df["value"]]
    df["subnormal"] = df["value"] < 2.0**F.emin
    return df


# --------------------------------------------------------------------------- matmul sweep


GEMM_ONLY = "GEMM only (operands pre-quantized)"


def _record_path(rec, variant: str, t, e: dict | None, *, shape, dtype, flops: float, note=None) -> None:
    """One matmul path's timing and its SQNR against the float64 product (from its error
    figures ``e``; None: the timing alone) as records."""
    if rec is None:
        return
    extra = {} if note is None else {"note": note}
    rec.add_timing("matmul", variant, t, shape=shape, dtype=dtype, flops=flops, **extra)
    if e is not None:
        rec.add("matmul", variant, "sqnr", e["sqnr_db"], "dB", shape=shape, dtype=dtype)


def matmul_sweep(
    shapes, formats, session: Session | None = None, *, reps: int = 10, budget_s: float = 5.0
) -> pd.DataFrame:
    """Per shape (M, K, N) and format: error vs float64 of the emulated path (and of
    ``torch._scaled_mm`` where it runs), and the time of bf16 ``F.linear``, the emulated
    path (quantize + dequantize + fp32 matmul: on CPU this times *emulation*, not a
    low-precision unit) and ``_scaled_mm``, on ``session.device`` with inputs from
    ``session.seed``.  Rows go to ``session.rec`` when given."""
    session = session or Session()
    rec, seed = session.rec, session.seed
    triton_fp8 = lab_kernels.get_variant("lowp_matmul", "triton")
    dev = torch.device(session.device)
    rows = []
    for M, K, N in shapes:
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(M, K, generator=g).to(dev)
        b = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dev)
        ref = L.reference_matmul(a, b)
        shape = (M, K, N)
        flops = 2.0 * M * K * N
        ab, bb = a.bfloat16(), b.bfloat16()
        t = try_bench(
            lambda ab=ab, bb=bb: torch.nn.functional.linear(ab, bb),
            name="bf16",
            device=dev,
            reps=reps,
            budget_s=budget_s,
        )
        e_bf16 = error_metrics(torch.nn.functional.linear(ab, bb).float(), ref.float())
        rows.append(
            dict(shape=shape, path="bf16 linear", fmt="bf16", time_ms=getattr(t, "median_ms", math.nan), **e_bf16)
        )
        _record_path(rec, "bf16 linear", t, e_bf16, shape=shape, dtype="bfloat16", flops=flops)
        for fmt in formats:
            y = L.emulated_matmul(a, b, fmt, out_dtype=torch.float32)
            e = error_metrics(y, ref)
            t = try_bench(
                lambda a=a, b=b, fmt=fmt: L.emulated_matmul(a, b, fmt),
                name=f"emulated {fmt}",
                device=dev,
                reps=reps,
                budget_s=budget_s,
            )
            rows.append(dict(shape=shape, path="emulated", fmt=fmt, time_ms=getattr(t, "median_ms", math.nan), **e))
            note = "quantize+dequantize+fp32 matmul (emulation)"
            _record_path(rec, f"emulated {fmt}", t, e, shape=shape, dtype=fmt, flops=flops, note=note)
            if dev.type == "cuda" and fmt in ("fp8_e4m3", "fp8_e5m2") and not triton_fp8.why_not(dev, fmt=fmt):
                p = L.prepare_scaled_mm_any(a, b, fmt, granularity="tensor")
                y = L.fp8_matmul_forward(p[1], p[2], p[3], p[4])
                e = error_metrics(y, ref)
                t = try_bench(
                    lambda p=p: L.fp8_matmul_forward(p[1], p[2], p[3], p[4], out_dtype=torch.bfloat16),
                    name=f"triton {fmt}",
                    device=dev,
                    reps=reps,
                    budget_s=budget_s,
                )
                rows.append(
                    dict(shape=shape, path="triton fp8/tensor", fmt=fmt, time_ms=getattr(t, "median_ms", math.nan), **e)
                )
                _record_path(rec, f"triton {fmt}/tensor", t, None, shape=shape, dtype=fmt, flops=flops, note=GEMM_ONLY)
            for gran in ("tensor", "row"):
                why = L.scaled_mm_why_not(dev, fmt=fmt, granularity=gran)
                if why:
                    continue
                p = L.prepare_scaled_mm(a, b, fmt, granularity=gran)
                y = L.scaled_mm(a, b, fmt, granularity=gran, out_dtype=torch.float32, prepared=p)
                e = error_metrics(y, ref)
                t = try_bench(
                    lambda a=a, b=b, fmt=fmt, gran=gran, p=p: L.scaled_mm(
                        a, b, fmt, granularity=gran, out_dtype=torch.bfloat16, prepared=p
                    ),
                    name=f"_scaled_mm {fmt}/{gran}",
                    device=dev,
                    reps=reps,
                    budget_s=budget_s,
                )
                rows.append(
                    dict(
                        shape=shape, path=f"_scaled_mm/{gran}", fmt=fmt, time_ms=getattr(t, "median_ms", math.nan), **e
                    )
                )
                _record_path(rec, f"_scaled_mm {fmt}/{gran}", t, e, shape=shape, dtype=fmt, flops=flops, note=GEMM_ONLY)
    df = pd.DataFrame(rows)
    df["shape"] = df["shape"].map(lambda s: "x".join(map(str, s)))
    return df


def accumulation_sweep(
    ks, accumulations, *, m: int = 64, n: int = 64, seed: int = 0, fmt: str = "fp8_e4m3"
) -> pd.DataFrame:
    """Relative error vs float64 of the accumulation models as K grows (operands in ``fmt``,
    so only the accumulation differs between rows of one K; the fp32 row is the floor)."""
    rows = []
    for K in ks:
        g = torch.Generator().manual_seed(seed)
        a = Q.fake_quantize(torch.randn(m, K, generator=g).abs(), fmt)  # same-sign: worst case for sums
        b = Q.fake_quantize(torch.randn(n, K, generator=g).abs(), fmt)
        ref = L.reference_matmul(a, b)
        for acc in accumulations:
            y = L.accumulate_matmul(a, b, acc)
            rows.append(dict(K=K, accumulation=acc, rel_error=rel_error(y, ref), sqnr_db=sqnr_db(y, ref)))
    return pd.DataFrame(rows)
