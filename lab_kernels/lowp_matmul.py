"""Low-precision matmuls: emulated, real ``torch._scaled_mm``, and a Triton FP8 kernel.

Design note
-----------
All paths compute ``y = a @ b.T`` with ``a`` (M, K) activations and ``b`` (N, K)
weights (``F.linear`` layout), both quantized along K.

* :func:`emulated_matmul` quantize -> dequantize (``lab_kernels.quant``) -> matmul,
  any format of the lab, on any device; the accumulation is modelled by
  :func:`accumulate_matmul`.
* :func:`scaled_mm` quantizes to FP8 (per-tensor or per-row scales, torchao
  convention ``x ≈ data / scale``) and calls ``torch._scaled_mm`` with the inverse
  scales.  Runs on CPU here (e4m3, e5m2, mixed; per tensor and per row), on CUDA
  sm_89+.  MX (E8M0 per 32, swizzled) scales need sm_100 (Blackwell); that path is
  written against torchao's ``to_blocked`` layout and gated by capability.
* :func:`fp8_matmul_forward` (also ``triton_fp8_matmul``) a tiled FP8 GEMM with an fp32 accumulator and per-tensor
  or per-row dequant scales applied in the epilogue, which also casts to the output dtype;
  ``fast_accum`` chooses Hopper's fast accumulation or promotion every BLOCK_K products, the
  two modes of ``_scaled_mm(use_fast_accum=...)``; :func:`fp8_gemm_tolerance` bounds its
  error for a given K (sm_89+ on GPU; the interpreter on CPU, for correctness only).

Accumulation model (:func:`accumulate_matmul`)
----------------------------------------------
K is walked in steps of ``inner`` products (an MMA instruction's K); each step's
partial sum is formed exactly (float64) then rounded to fp32 and added to a running
accumulator that keeps ``acc_bits`` explicit mantissa bits, rounded to nearest-even
or truncated.  ``promote_every`` adds the limited accumulator into an fp32 one every
that many K elements (DeepSeek-V3's "promotion to CUDA cores" every 128);
``split_k`` computes S independent K-slices and sums them in fp32.  Named presets in
:data:`ACCUMULATIONS`:

* ``fp32``: one fp32 matmul (the library's own order).
* ``bf16``: the accumulator rounded to bf16 (7 bits, RNE) after every 16 products.
* ``fp8_fast``: a model of Hopper FP8 "fast accumulation": ~14 significant bits
  (13 explicit), truncated, updated every 32 products, never promoted.  This is the
  behaviour reported in the DeepSeek-V3 technical report, *not* a measurement here.
* ``fp8_fast_promote128``: the same with promotion to fp32 every 128 elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _common as C
from . import quant as Q
from .registry import register


@dataclass(frozen=True)
class Accumulation:
    name: str
    acc_bits: int | None = None  # explicit mantissa bits kept; None = plain fp32 matmul
    rounding: str = "nearest"  # "nearest" | "truncate"
    inner: int = 16
    promote_every: int | None = None
    split_k: int = 1


ACCUMULATIONS: dict[str, Accumulation] = {
    "fp32": Accumulation("fp32"),
    "bf16": Accumulation("bf16", 7, "nearest", 16),
    "fp8_fast": Accumulation("fp8_fast", 13, "truncate", 32),
    "fp8_fast_promote128": Accumulation("fp8_fast_promote128", 13, "truncate", 32, promote_every=128),
}


def _err(param, value, allowed):
    return ValueError(f"parameter {param!r} = {value!r} is not allowed: expected {allowed}")


def _check_operands(a, b) -> None:
    """a (M, K), b (N, K) floating-point tensors on one device; each refusal names its parameter."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2:
            what = (
                type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} tensor of shape {tuple(t.shape)}"
            )
            raise _err(name, what, f"a 2-D floating-point tensor ({'M' if name == 'a' else 'N'}, K)")
    if a.shape[1] != b.shape[1]:
        raise _err("b", tuple(b.shape), f"a 2-D (N, K) tensor with K = a.shape[1] = {a.shape[1]}")
    if a.device != b.device:
        raise _err("b", f"on {b.device}", f"on a's device {a.device}")


def round_mantissa(x: torch.Tensor, bits: int, rounding: str = "nearest") -> torch.Tensor:
    """Round fp32 ``x`` to ``bits`` explicit mantissa bits (8-bit exponent kept)."""
    if not 0 <= bits <= 23:
        raise _err("acc_bits", bits, "an integer in [0, 23]")
    if bits == 23:
        return x.float()
    b = x.float().contiguous().view(torch.int32)
    drop = 23 - bits
    mask = ~((1 << drop) - 1)
    if rounding == "truncate":
        r = b & mask
    elif rounding == "nearest":
        lsb = (b >> drop) & 1
        r = (b + ((1 << (drop - 1)) - 1) + lsb) & mask
    else:
        raise _err("rounding", rounding, "'nearest' or 'truncate'")
    out = r.view(torch.float32)
    return torch.where(torch.isfinite(x), out, x.float())


def accumulate_matmul(
    a: torch.Tensor, b: torch.Tensor, accum: str | Accumulation = "fp32", *, split_k: int | None = None
) -> torch.Tensor:
    """``a @ b.T`` (fp32 result) with the accumulation model of the module note."""
    acc = ACCUMULATIONS.get(accum) if isinstance(accum, str) else accum
    if acc is None:
        raise _err("accum", accum, "one of " + ", ".join(map(repr, ACCUMULATIONS)))
    S = acc.split_k if split_k is None else split_k
    if not isinstance(S, int) or S < 1:
        raise _err("split_k", S, "a positive integer")
    a = a.float()
    b = b.float()
    K = a.shape[-1]
    if S > 1:
        bounds = [round(i * K / S) for i in range(S + 1)]
        out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
        for s in range(S):
            lo, hi = bounds[s], bounds[s + 1]
            out = out + accumulate_matmul(a[:, lo:hi], b[:, lo:hi], Accumulation(**{**acc.__dict__, "split_k": 1}))
        return out
    if acc.acc_bits is None:
        return a @ b.T
    outer = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    run = torch.zeros_like(outer)
    since = 0
    for lo in range(0, K, acc.inner):
        hi = min(K, lo + acc.inner)
        part = (a[:, lo:hi].double() @ b[:, lo:hi].double().T).float()
        run = round_mantissa(run + part, acc.acc_bits, acc.rounding)
        since += hi - lo
        if acc.promote_every and since >= acc.promote_every:
            outer = outer + run
            run = torch.zeros_like(run)
            since = 0
    return outer + run


def reference_matmul(a: torch.Tensor, b: torch.Tensor, **_) -> torch.Tensor:
    """float64 ``a @ b.T``: the yardstick."""
    return a.double() @ b.double().T


def emulated_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: str = "fp8_e4m3",
    *,
    fmt_b: str | None = None,
    granularity: str | None = None,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    accum: str = "fp32",
    split_k: int | None = None,
    hadamard: int | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "reference",
) -> torch.Tensor:
    """Quantize a (M, K) and b (N, K) along K, dequantize, multiply with ``accum``.

    ``granularity`` applies to FP8 formats ("tensor", "row", "block" = 1x128 for a and
    128x128 tiles for b, as in DeepSeek-V3 / torchao blockwise).  ``hadamard=n`` rotates
    both operands along K first (the rotation cancels in the product).
    """
    _check_operands(a, b)
    Q.check_format(fmt)
    if fmt_b is not None:
        Q.check_format(fmt_b, param="fmt_b")
    fmt_b = fmt_b or fmt
    gb = granularity
    if granularity == "block":
        gb = "block2d"
    if hadamard:
        a = Q.hadamard_transform(a.float(), hadamard, axis=-1)
        b = Q.hadamard_transform(b.float(), hadamard, axis=-1)
    kw = dict(scale_rule=scale_rule, rounding=rounding, backend=backend)
    qa = Q.fake_quantize(
        a.float(), fmt, axis=-1, granularity=granularity if Q.FORMATS[fmt].family == "fp8" else None, **kw
    )
    qb = Q.fake_quantize(b.float(), fmt_b, axis=-1, granularity=gb if Q.FORMATS[fmt_b].family == "fp8" else None, **kw)
    y = accumulate_matmul(qa, qb, accum, split_k=split_k)
    return y.to(out_dtype or a.dtype)


# ------------------------------------------------------------------ torch._scaled_mm


def _cuda_cap(device) -> tuple[int, int] | None:
    d = torch.device(device)
    if d.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(d)


# Row-wise FP8 _scaled_mm with float32 output: torch takes cuBLAS's row-wise (outer-vector)
# scaling, which may write float32, only on CUDA >= 12.9 builds and sm_90; elsewhere it falls
# back to its CUTLASS row-wise kernel, which has written bfloat16 only ("Only bf16 high
# precision output types are supported for row-wise scaling") in most releases.  The guard
# therefore allows float32 output with row-wise scales only on a CUDA >= 12.9 build on sm_90.
ROWWISE_FP32_OUT_MIN_CUDA = (12, 9)


def _cuda_version() -> tuple[int, ...] | None:
    v = torch.version.cuda
    return tuple(int(x) for x in v.split(".")[:2]) if v else None


def scaled_mm_why_not(
    device=None, dtype=None, granularity="tensor", fmt="fp8_e4m3", *, fmt_b=None, out_dtype=None, **_
) -> str | None:
    """None when ``torch._scaled_mm`` can run this problem here, else the reason in words.

    ``fmt``/``fmt_b``: the formats of a and b (b defaults to a's); ``out_dtype``: the
    requested output dtype (row-wise float32 output needs a recent cuBLAS, see above)."""
    dev = torch.device(device or "cpu")
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    fmt_b = fmt_b or fmt
    for name, f in (("fmt", fmt), ("fmt_b", fmt_b)):
        if f not in Q.FORMATS:
            return f"parameter {name!r} = {f!r} is not a format of the lab ({', '.join(Q.FORMATS)})"
    fam, fam_b = Q.FORMATS[fmt].family, Q.FORMATS[fmt_b].family
    if fam != fam_b:
        return f"_scaled_mm multiplies operands of one family, not {fmt} x {fmt_b}"
    if fam == "nvfp4":
        return "nvfp4 _scaled_mm needs sm_100 and swizzled e4m3 scales; not wired here"
    if dev.type == "cpu":
        if fam != "fp8" or granularity not in ("tensor", "row"):
            return f"torch._scaled_mm on CPU takes fp8 per-tensor/per-row scales, not {fmt}/{granularity}"
        return _scaled_mm_probe(dev, fmt, fmt_b, granularity, out_dtype)
    cap = _cuda_cap(dev)
    if cap is None:
        return "no CUDA device"
    if fam == "mx":
        return None if cap >= (10, 0) else f"MX scaled_mm needs sm_100+ (Blackwell); this GPU is sm_{cap[0]}{cap[1]}"
    if cap < (8, 9):
        return f"FP8 scaled_mm needs sm_89+ (Ada/Hopper); this GPU is sm_{cap[0]}{cap[1]}"
    if Q.FORMATS[fmt].elem == "e5m2" and Q.FORMATS[fmt_b].elem == "e5m2":
        return (
            "cuBLASLt refuses fp8_e5m2 x fp8_e5m2 ('Multiplication of two Float8_e5m2 matrices is not "
            "supported'); use e4m3 for one operand (e4m3 x e5m2 is the usual backward recipe)"
        )
    if granularity not in ("tensor", "row"):
        return "blockwise (1x128 / 128x128) scaled_mm is not wired here; use the emulated path"
    if granularity == "row" and out_dtype == torch.float32:
        cu = _cuda_version()
        if cu is None or cu < ROWWISE_FP32_OUT_MIN_CUDA or cap != (9, 0):
            return (
                f"row-wise _scaled_mm with float32 output needs the cuBLAS path (CUDA >= 12.9 build on sm_90); "
                f"this is CUDA {torch.version.cuda} on sm_{cap[0]}{cap[1]}: ask for out_dtype=bfloat16"
            )
    return _scaled_mm_probe(dev, fmt, fmt_b, granularity, out_dtype)


#: Verdicts of :func:`_scaled_mm_probe`, per (device, formats, granularity, output dtype).
_PROBED: dict[tuple, str | None] = {}


def _scaled_mm_probe(dev: torch.device, fmt: str, fmt_b: str, granularity: str, out_dtype) -> str | None:
    """Try ``torch._scaled_mm`` once on a 16 x 32 x 16 problem of this kind; None when it ran.

    What a torch build accepts changes between releases (torch 2.11's CPU kernel takes
    per-tensor scales only, 2.13's per-row too), so the rules above are not trusted alone:
    the call itself is tried, once per process and kind of problem."""
    key = (str(dev), fmt, fmt_b, granularity, out_dtype)
    if key not in _PROBED:
        M, K, N = 16, 32, 16
        out = out_dtype or torch.bfloat16
        try:
            da = torch.ones(M, K, device=dev).to(Q.FORMATS[fmt].elem_format.torch_dtype)
            db = torch.ones(N, K, device=dev).to(Q.FORMATS[fmt_b].elem_format.torch_dtype)
            if granularity == "row":
                sa, sb = torch.ones(M, 1, device=dev), torch.ones(1, N, device=dev)
            else:
                sa, sb = torch.ones((), device=dev), torch.ones((), device=dev)
            y = _run_scaled_mm(("fp8", da, db, sa, sb), out)
            ok = y.shape == (M, N) and y.dtype == out and bool((y.float() == K).all())
            _PROBED[key] = None if ok else f"torch._scaled_mm returned a wrong result on a {M}x{K}x{N} probe"
        except Exception as e:  # noqa: BLE001 - the refusal is the verdict
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _PROBED[key] = (
                f"torch {torch.__version__} refuses {granularity}-scaled _scaled_mm {fmt} x {fmt_b} -> "
                f"{str(out).replace('torch.', '')} on {dev.type} (a {M}x{K}x{N} probe raised {type(e).__name__}: "
                f"{first[:300]})"
            )
    return _PROBED[key]


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: str = "fp8_e4m3",
    *,
    fmt_b: str | None = None,
    granularity: str = "tensor",
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
    prepared: tuple | None = None,
) -> torch.Tensor:
    """Real ``torch._scaled_mm``: quantize a (M, K), b (N, K) along K and multiply.

    ``prepared`` = the result of :func:`prepare_scaled_mm` (to time the GEMM alone)."""
    if prepared is None:
        why = scaled_mm_why_not(a.device, granularity=granularity, fmt=fmt, fmt_b=fmt_b, out_dtype=out_dtype)
        if why:
            raise RuntimeError(why)
    p = prepared or prepare_scaled_mm(a, b, fmt, fmt_b=fmt_b, granularity=granularity)
    return _run_scaled_mm(p, out_dtype, use_fast_accum)


def prepare_scaled_mm(a, b, fmt="fp8_e4m3", *, fmt_b=None, granularity="tensor"):
    fmt_b = fmt_b or fmt
    _check_operands(a, b)
    why = scaled_mm_why_not(a.device, granularity=granularity, fmt=fmt, fmt_b=fmt_b)
    if why:
        raise RuntimeError(why)
    fam = Q.FORMATS[fmt].family
    if fam == "mx":
        from torchao.prototype.mx_formats.utils import to_blocked  # noqa: PLC0415  (optional dependency)

        qa = Q.quantize(a, fmt, axis=-1)
        qb = Q.quantize(b, fmt_b, axis=-1)
        return ("mx", qa.data, qb.data, to_blocked(qa.scale), to_blocked(qb.scale))
    qa = Q.quantize(a, fmt, axis=-1, granularity=granularity)
    qb = Q.quantize(b, fmt_b, axis=-1, granularity=granularity)
    if granularity == "tensor":
        sa, sb = (1.0 / qa.scale).float(), (1.0 / qb.scale).float()
    else:
        sa = (1.0 / qa.scale).float().reshape(-1, 1)
        sb = (1.0 / qb.scale).float().reshape(1, -1)
    return ("fp8", qa.data, qb.data, sa, sb)


def _run_scaled_mm(p, out_dtype, use_fast_accum=False):
    kind, da, db, sa, sb = p
    kw = {"use_fast_accum": use_fast_accum} if (da.is_cuda and kind == "fp8") else {}
    return torch._scaled_mm(da, db.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, **kw)


# ------------------------------------------------------------------ Triton FP8 GEMM


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_gemm_tolerance(K: int, *, fast_accum: bool, out_dtype: torch.dtype = torch.bfloat16) -> float:
    """Bound on ||y - ref||_F / ||ref||_F of an FP8 GEMM against float64 of its dequantized operands.

    Output rounding: 2^-8 for bfloat16 (2^-9 per element, doubled), 2^-11 for float16, 2^-20 for
    float32.  Accumulation (the :data:`ACCUMULATIONS` model of Hopper's fp8 adder: 13 explicit
    mantissa bits, truncated, updated every 32 products): fast accumulation is never promoted,
    so its error grows with K, (K / 32) * 2^-13; promoted accumulation keeps at most 128
    products in that adder, 4 * 2^-13, plus fp32's K * 2^-24 over the whole sum."""
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"parameter 'K' = {K!r} is not allowed: expected a positive integer")
    out = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-20}.get(out_dtype)
    if out is None:
        raise ValueError(f"parameter 'out_dtype' = {out_dtype} is not allowed: expected bfloat16, float16 or float32")
    acc = math.ceil(K / 32) * 2.0**-13 if fast_accum else 4 * 2.0**-13 + K * 2.0**-24
    return out + acc


# Hopper tiles for the FP8 GEMM (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): 128-wide
# tiles with K steps of 64+ fp8 elements and a 3-4 stage pipeline lower to wgmma on sm_90
# (tests/unit/kernels/test_lowp_matmul.py compiles each for sm_90 and checks); the autotuner picks one per
# (M, N, K) on the GPU.  The interpreter runs the small INTERPRETER_TILE (correctness only).
FP8_TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 128, 64, 4, 8),
    (128, 256, 64, 3, 8),
    (128, 128, 128, 3, 8),
    (64, 128, 64, 4, 4),
)
INTERPRETER_TILE = (32, 32, 32)


@triton.jit
def _fp8_matmul_fwd_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    ROW_SCALES: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[M, N] = (A[M, K] @ B[N, K]^T) * sa * sb with fp8 A, B and an fp32 accumulator.

    sa, sb: dequant multipliers, per tensor (scalars) or per row of A / row of B.
    ``FAST_ACCUM``: Hopper's fast accumulation (Triton's default for fp8 on sm_90: the whole K
    loop accumulates inside the tensor cores' limited-precision adder); otherwise each tile's
    BLOCK_K products are promoted into the fp32 accumulator (``max_num_imprecise_acc=BLOCK_K``),
    as ``_scaled_mm(use_fast_accum=False)`` promotes periodically.  C is stored in its own dtype
    (the epilogue casts; no second kernel).
    Traffic: M*K + N*K bytes of fp8 in (once per tile row/column with reuse), M*N*sizeof(C) out.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ka = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + ka[None, :] * stride_ak,
            mask=(rm[:, None] < M) & (ka[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + rn[None, :] * stride_bn + ka[:, None] * stride_bk,
            mask=(rn[None, :] < N) & (ka[:, None] < K),
            other=0.0,
        )
        if FAST_ACCUM:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    if ROW_SCALES:
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    else:
        acc = acc * tl.load(sa_ptr) * tl.load(sb_ptr)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, mask=(rm[:, None] < M) & (rn[None, :] < N))


#: The configs the GPU autotunes over (tests compile exactly these for sm_90).
FP8_AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=st, num_warps=nw)
    for bm, bn, bk, st, nw in FP8_TILES
]
_fp8_matmul_fwd_autotuned = triton.autotune(
    configs=FP8_AUTOTUNE_CONFIGS, key=["M", "N", "K", "ROW_SCALES", "FAST_ACCUM"]
)(_fp8_matmul_fwd_kernel)


def _check_fp8_operands(a_fp8, b_fp8, sa, sb) -> None:
    op = "lowp_matmul"
    for name, t in (("a_fp8", a_fp8), ("b_fp8", b_fp8)):
        C.check_tensor(op, name, t, dtypes=FP8_DTYPES)
        if t.dim() != 2:
            raise ValueError(
                f"{op}: parameter {name!r} must be 2-D ({'M' if name == 'a_fp8' else 'N'}, K), got {tuple(t.shape)}"
            )
    if a_fp8.shape[1] != b_fp8.shape[1]:
        raise ValueError(
            f"{op}: parameter 'b_fp8' has K = {b_fp8.shape[1]} (shape {tuple(b_fp8.shape)}), but a_fp8 has "
            f"K = {a_fp8.shape[1]}: both operands are (rows, K) with one K"
        )
    M, N = a_fp8.shape[0], b_fp8.shape[0]
    for name, t, rows in (("sa", sa, M), ("sb", sb, N)):
        C.check_tensor(op, name, t, dtypes=(torch.float32, torch.bfloat16, torch.float16))
        if t.numel() not in (1, rows):
            raise ValueError(
                f"{op}: parameter {name!r} has {t.numel()} elements; expected 1 (per tensor) or {rows} (per row)"
            )
    C.check_device(op, ("a_fp8", a_fp8), ("b_fp8", b_fp8), ("sa", sa), ("sb", sb))


def fp8_matmul_forward(
    a_fp8: torch.Tensor,
    b_fp8: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    fast_accum: bool = False,
    block: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """FP8 GEMM: a_fp8 (M, K), b_fp8 (N, K) ``torch.float8_e4m3fn``/``float8_e5m2``; sa/sb
    dequant multipliers (one element per tensor, or (M,)/(N,) per row) -> (M, N) ``out_dtype``,
    written by the kernel itself (float32, bfloat16 or float16).

    ``fast_accum``: accumulate as ``_scaled_mm(use_fast_accum=True)`` does (Hopper's fast
    accumulation, never promoted); False (default) promotes to fp32 every BLOCK_K products, the
    counterpart of ``use_fast_accum=False``.  The interpreter accumulates in fp32 either way.
    ``block`` = (BLOCK_M, BLOCK_N, BLOCK_K) runs that tile; by default the GPU autotunes over
    :data:`FP8_TILES` and the interpreter runs :data:`INTERPRETER_TILE`."""
    _check_fp8_operands(a_fp8, b_fp8, sa, sb)
    if out_dtype not in FP8_OUT_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in FP8_OUT_DTYPES)
        raise ValueError(f"lowp_matmul: parameter 'out_dtype' = {out_dtype} is not allowed: expected one of {allowed}")
    if not isinstance(fast_accum, bool):
        raise ValueError(f"lowp_matmul: parameter 'fast_accum' = {fast_accum!r} is not allowed: expected True or False")
    M, K = a_fp8.shape
    N = b_fp8.shape[0]
    c = torch.empty(M, N, dtype=out_dtype, device=a_fp8.device)
    row = sa.numel() > 1 or sb.numel() > 1
    sa_ = sa.float().reshape(-1).contiguous()
    sb_ = sb.float().reshape(-1).contiguous()
    if row:
        sa_ = sa_.expand(M).contiguous() if sa_.numel() == 1 else sa_
        sb_ = sb_.expand(N).contiguous() if sb_.numel() == 1 else sb_
    args = (a_fp8, b_fp8, c, sa_, sb_, M, N, K, *a_fp8.stride(), *b_fp8.stride(), *c.stride())
    if block is None and not C.interpreted():

        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))

        _fp8_matmul_fwd_autotuned[grid](*args, ROW_SCALES=row, FAST_ACCUM=fast_accum)
    else:
        BM, BN, BK = block or INTERPRETER_TILE
        _fp8_matmul_fwd_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            *args, ROW_SCALES=row, FAST_ACCUM=fast_accum, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK
        )
    return c


triton_fp8_matmul = fp8_matmul_forward  # the name callers used first (lab_utils.precision.numerics)


def triton_fp8_linear(a, b, fmt="fp8_e4m3", *, granularity="tensor", out_dtype=torch.float32, fast_accum=False, **_):
    p = prepare_scaled_mm_any(a, b, fmt, granularity=granularity)
    return fp8_matmul_forward(p[1], p[2], p[3], p[4], out_dtype=out_dtype, fast_accum=fast_accum)


def prepare_scaled_mm_any(a, b, fmt="fp8_e4m3", *, fmt_b=None, granularity="tensor"):
    """FP8 operands + dequant multipliers without the capability gate (for the Triton path)."""
    fmt_b = fmt_b or fmt
    qa = Q.quantize(a, fmt, axis=-1, granularity=granularity)
    qb = Q.quantize(b, fmt_b, axis=-1, granularity=granularity)
    return ("fp8", qa.data, qb.data, (1.0 / qa.scale).float().reshape(-1), (1.0 / qb.scale).float().reshape(-1))


def _triton_fp8_why_not(device=None, dtype=None, fmt="fp8_e4m3", granularity="tensor", **_):
    if fmt not in ("fp8_e4m3", "fp8_e5m2") or granularity not in ("tensor", "row"):
        return f"the Triton FP8 GEMM takes fp8 per-tensor/per-row scales, not {fmt}/{granularity}"
    cap = _cuda_cap(device) if device is not None and torch.device(device).type == "cuda" else None
    if cap is not None and cap < (8, 9):
        return f"FP8 tl.dot needs sm_89+; this GPU is sm_{cap[0]}{cap[1]}"
    return None


register("lowp_matmul", "reference", reference_matmul, kind="reference", description="float64 a @ b.T")
register(
    "lowp_matmul",
    "emulated",
    emulated_matmul,
    kind="eager",
    description="quantize -> dequantize -> fp32 matmul (any format, accumulation model)",
)
register(
    "lowp_matmul",
    "scaled_mm",
    scaled_mm,
    kind="library",
    check=scaled_mm_why_not,
    description="torch._scaled_mm, FP8 per-tensor / per-row (MX on sm_100)",
)
register(
    "lowp_matmul",
    "triton",
    triton_fp8_linear,
    kind="triton",
    check=_triton_fp8_why_not,
    description="Triton FP8 GEMM, fp32 accumulator, per-tensor / per-row scales",
)
