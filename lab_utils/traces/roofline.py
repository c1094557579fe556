"""A roofline per launching operator, where the trace recorded shapes (``record_shapes=True``).

Each ``cpu_op`` that launched GPU kernels (``op_index`` of the attribution) and carries
``Input Dims`` is costed from its shapes with :mod:`lab_utils.core.flops` conventions; its time
is the summed duration of the kernels it launched.  Operators are grouped by (name, shapes,
types, scalar arguments, math path): calls, GPU time, FLOPs and bytes per call, then TFLOP/s, GB/s,
arithmetic intensity and, against the datasheet row of the GPU the trace ran on
(:func:`lab_utils.core.datasheets.identify`: the exact part, from its name, memory and SMs), the
peak that applies (``peak``: which unit, ``peak_tflops``, ``peak_gbps``), % of it and the bound
(``compute`` when the intensity is above the ridge point peak FLOP/s / peak bytes/s, else
``memory``).  A GPU without a datasheet row keeps the rates and leaves the peaks empty.

Costed operators (FLOPs; bytes = every input read once + the outputs written once):

* ``aten::mm`` [m,k]x[k,n], ``aten::addmm`` (bias, [m,k], [k,n]), ``aten::bmm`` / ``aten::baddbmm``
  [b,m,k]x[b,k,n], ``aten::linear`` x[...,k], W[n,k], ``aten::_scaled_mm`` (fp8): 2mnk (x batch);
* attention, as torch records it (:data:`ATTENTION_OPS`, each checked against torch's schemas and
  meta kernels in tests/unit/traces/test_roofline_rules.py): the public ``scaled_dot_product_attention`` and
  the ``_scaled_dot_product_*`` ops take q [b, h, s, d], the kernels' own ops
  ``_flash_attention_forward`` / ``_efficient_attention_forward`` (what a CUDA trace charges the
  kernels to) take q [b, s, h, d]; k and v have t keys and h_kv <= h heads (grouped-query attention:
  the FLOPs count every query head, the bytes the tensors as recorded).  FLOPs
  ``2·b·h·pairs·(d + d_v)`` (4·b·h·s·t·d), pairs = s·t, or the causal count
  (:func:`~lab_utils.core.flops.causal_pairs`) when ``is_causal`` (or ``custom_mask_type`` 1, top
  left; 2, bottom right) is set in the recorded ``Concrete Inputs``; the ``*_backward`` ops are
  costed as backward, ``ATTENTION_BWD_FACTOR["kernel"]`` (2.5x) the forward, and write dq, dk, dv.
  ``mask`` says what was counted (``full``, ``causal``, ``causal (bottom right)``, ``full (mask not
  recorded)``); a variable-length (3-d, ``cum_seq``) call is not costed (its pairs are not in the shapes);
* normalisation and elementwise operators (``layer_norm``, ``rms_norm``, ``add``, ``mul``, ``gelu`` ...):
  FLOPs = elements x the per-element count of ``FUSED_FLOPS_PER_ELEMENT`` where it has the op, else 1;
  an ``out=`` tensor (one argument past the op's own, of the output's size) is written, not read.

The matmul peak (:meth:`DatasheetPeak.matmul_peak`) follows the inputs' type and the kernels that ran:
bfloat16 -> the BF16 tensor-core peak, half -> FP16, float8 -> FP8; ``float`` -> the TF32 tensor-core
peak only when a launched kernel's name says TF32 (``tf32``, ``xf32``, or CUTLASS's ``s1688`` tensor-op
GEMMs: on fp32 inputs the m16n8k8 tensor op is TF32's), else the part's fp32 rate (CUDA cores,
or CDNA's fp32 matrix cores); a part without a bf16/fp16 unit gets the fp32 rate it runs at.
Elementwise and normalisation rows are held to the fp32 vector rate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from lab_utils.core.datasheets import DatasheetPeak, identify
from lab_utils.core.flops import FUSED_FLOPS_PER_ELEMENT, attention_flops, causal_pairs, matmul_flops
from lab_utils.traces.reader import per_text, texts

ITEMSIZE = {"float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "half": 2, "bfloat16": 2, "long int": 8}
ITEMSIZE |= {"int": 4, "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2, "c10::float8_e4m3fn": 1}
ITEMSIZE |= {"c10::float8_e5m2": 1, "c10::float8_e4m3fnuz": 1, "c10::float8_e5m2fnuz": 1}
#: a GEMM kernel that ran in TF32 (see the module note)
TF32_KERNEL = re.compile(r"tf32|xf32|tensorop_s1688|s1688gemm", re.IGNORECASE)
_ELEMENTWISE = re.compile(
    r"^aten::(add|sub|mul|div|gelu|silu|relu|sigmoid|tanh|exp|pow|rsqrt|sqrt|neg|abs|clamp|where|"
    r"layer_norm|native_layer_norm|rms_norm|_fused_rms_norm|group_norm|native_group_norm)_?$"
)
#: arguments an elementwise op takes before an ``out=`` tensor (its functional schema's length)
_ARITY = {"add": 3, "sub": 3, "mul": 2, "div": 2, "pow": 2, "clamp": 3, "where": 3, "gelu": 2}
_ARITY |= dict.fromkeys(("silu", "relu", "sigmoid", "tanh", "exp", "rsqrt", "sqrt", "neg", "abs"), 1)


@dataclass(frozen=True)
class AttentionOp:
    """Where an attention op's inputs are in its recorded arguments (torch's schema order)."""

    query: int  # index of q (k and v follow); 1 for the backward ops, whose grad_out comes first
    layout: str  # "bhsd": q [b, h, s, d]; "bshd": q [b, s, h, d]
    causal: int | None = None  # index of ``is_causal`` (bool)
    mask_type: int | None = None  # index of ``custom_mask_type`` (0 none, 1 causal top left, 2 bottom right)
    backward: bool = False


#: torch's attention ops (``aten::`` names), their argument layout per torch's schemas and meta kernels
ATTENTION_OPS: dict[str, AttentionOp] = {
    "aten::scaled_dot_product_attention": AttentionOp(0, "bhsd", causal=5),
    "aten::_scaled_dot_product_attention_math": AttentionOp(0, "bhsd", causal=5),
    "aten::_scaled_dot_product_flash_attention": AttentionOp(0, "bhsd", causal=4),
    "aten::_scaled_dot_product_flash_attention_for_cpu": AttentionOp(0, "bhsd", causal=4),
    "aten::_scaled_dot_product_efficient_attention": AttentionOp(0, "bhsd", causal=6),
    "aten::_scaled_dot_product_cudnn_attention": AttentionOp(0, "bhsd", causal=6),
    "aten::_flash_attention_forward": AttentionOp(0, "bshd", causal=8),
    "aten::_efficient_attention_forward": AttentionOp(0, "bshd", mask_type=9),
    "aten::_scaled_dot_product_flash_attention_backward": AttentionOp(1, "bhsd", causal=11, backward=True),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": AttentionOp(1, "bhsd", causal=7, backward=True),
    "aten::_scaled_dot_product_efficient_attention_backward": AttentionOp(1, "bhsd", causal=11, backward=True),
    "aten::_scaled_dot_product_cudnn_attention_backward": AttentionOp(1, "bhsd", causal=14, backward=True),
    "aten::_flash_attention_backward": AttentionOp(1, "bshd", causal=11, backward=True),
    "aten::_efficient_attention_backward": AttentionOp(1, "bshd", mask_type=14, backward=True),
}


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float
    kind: str  # "matmul" | "attention" | "elementwise/norm"
    direction: str = ""  # "fwd" | "bwd" for attention
    mask: str = ""  # attention: what was counted


def _shapes(raw) -> list:
    if not isinstance(raw, (str, bytes)):
        return []
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return []


def _is_shape(d) -> bool:
    return isinstance(d, list) and bool(d) and all(isinstance(x, int) for x in d)


def _numel(shape) -> int:
    return int(np.prod(shape)) if _is_shape(shape) else 0


def _item(t) -> int:
    return ITEMSIZE.get(str(t).lower(), 4)


def _flag(concrete: list, i: int | None) -> str:
    return str(concrete[i]).strip() if i is not None and i < len(concrete) else ""


def attention_cost(op: str, dims: list, types: list, concrete: list) -> Cost | None:
    """One call of an attention op of :data:`ATTENTION_OPS` (see the module note), or None."""
    spec = ATTENTION_OPS[op]
    qi = spec.query
    if len(dims) < qi + 3 or not all(_is_shape(d) and len(d) == 4 for d in dims[qi : qi + 3]):
        return None  # variable-length (3-d, cum_seq) or unrecorded: the pairs are not in the shapes
    q, k, v = dims[qi : qi + 3]
    if spec.layout == "bhsd":
        (b, h, s, d), t, dv = q, k[2], v[3]
    else:
        (b, s, h, d), t, dv = q, k[1], v[3]
    causal, mask_type = _flag(concrete, spec.causal), _flag(concrete, spec.mask_type)
    if not concrete:
        mask, pairs = "full (mask not recorded)", s * t
    elif causal in ("True", "true", "1") or mask_type == "1":
        mask, pairs = "causal", causal_pairs(s, t)
    elif mask_type == "2":
        mask, pairs = "causal (bottom right)", causal_pairs(s, t, bottom_right=True)
    else:
        mask, pairs = "full", s * t
    direction = "bwd" if spec.backward else "fwd"
    flops = attention_flops(b, h, s, t, (d, dv), pairs=pairs, direction=direction, convention="kernel")
    read = sum(_numel(x) * _item(y) for x, y in zip(dims, types) if _is_shape(x))
    item = _item(types[qi]) if qi < len(types) else 4
    written = (_numel(q) + _numel(k) + _numel(v)) * item if spec.backward else b * h * s * dv * item
    return Cost(flops, float(read + written), "attention", direction, mask)


def cost(op: str, dims: list, types: list, concrete: list | None = None) -> Cost | None:
    """The cost of one call of ``op`` with input ``dims``/``types`` (and ``Concrete Inputs``), or None."""
    if op in ATTENTION_OPS:
        return attention_cost(op, dims, types, concrete or [])
    tensors = [(d, t) for d, t in zip(dims, types) if _is_shape(d)]
    if not tensors:
        return None
    item = _item(tensors[0][1])
    read = sum(_numel(d) * _item(t) for d, t in tensors)
    a = [d for d, _ in tensors]
    if op in ("aten::mm", "aten::addmm", "aten::_scaled_mm") and len(a) >= 2:
        x, w = (a[0], a[1]) if op != "aten::addmm" else (a[-2], a[-1])
        if len(x) < 2 or len(w) < 2:
            return None
        (m, k), n = x[-2:], w[-1]
        out = 2 if op == "aten::_scaled_mm" else item  # bf16 out by default
        return Cost(matmul_flops(m, n, k), float(read + m * n * out), "matmul")
    if op in ("aten::bmm", "aten::baddbmm") and len(a) >= 2:
        x, y = (a[0], a[1]) if op == "aten::bmm" else (a[-2], a[-1])
        if len(x) != 3 or len(y) != 3:
            return None
        b, m, k = x
        n = y[-1]
        return Cost(matmul_flops(m, n, k, batch=b), float(read + b * m * n * item), "matmul")
    if op == "aten::linear" and len(a) >= 2:
        x, w = a[0], a[1]
        m, k, n = int(np.prod(x[:-1])), x[-1], w[0]
        return Cost(matmul_flops(m, n, k), float(read + m * n * item), "matmul")
    if _ELEMENTWISE.match(op):
        base = op.split("::", 1)[1].rstrip("_")
        key = next((f for f in FUSED_FLOPS_PER_ELEMENT if f in op), None)
        per = FUSED_FLOPS_PER_ELEMENT[key][0] if key else 1
        n = max(_numel(d) for d in a)
        last = dims[-1] if dims else None
        if base in _ARITY and len(dims) > _ARITY[base] and _numel(last) == n:  # an ``out=`` tensor: written, not read
            read -= n * _item(types[len(dims) - 1])
        out = max(_item(t) for _, t in tensors)  # the promoted type (where's bool condition is not its output's)
        return Cost(float(per * n), float(read + n * out), "elementwise/norm")
    return None


def _precision(types: str) -> str:
    """fp8 / bf16 / fp16 / fp64 / fp32 of a row, from its first tensor's recorded type."""
    first = next((str(t).lower() for t in _shapes(types) if t and t != "Scalar"), "float")
    if "float8" in first:
        return "fp8"
    if "bfloat16" in first:
        return "bf16"
    if "half" in first:
        return "fp16"
    return "fp64" if first == "double" else "fp32"


def _peak(kind: str, types: str, tf32: bool, p: DatasheetPeak) -> tuple[float, str]:
    """(peak TFLOP/s, which unit) of one row (see the module note)."""
    if kind == "elementwise/norm":
        return (p.fp32_tflops or np.nan), "FP32 vector"
    prec = _precision(types)
    if prec == "fp8":
        return (p.fp8_tflops or np.nan), "FP8 tensor cores" if p.fp8_tflops else "no FP8 unit"
    if prec == "fp64":
        return np.nan, "FP64 (no FP64 peak in the table)"
    value, unit = p.matmul_peak(prec, tf32=tf32)
    return (value or np.nan), unit


COLUMNS = ["op", "shapes", "types", "kind", "direction", "mask", "tf32", "calls", "gpu_us", "flops", "bytes",
           "tflops", "gbps", "intensity", "peak", "peak_tflops", "peak_gbps", "pct_of_peak", "bound", "device",
           "part"]  # fmt: skip


def op_roofline(
    kernels: pd.DataFrame,
    host: pd.DataFrame,
    device_name: str | None,
    peak: DatasheetPeak | None = None,
    properties: dict | None = None,
) -> pd.DataFrame:
    """One row per (op, shapes, types, scalar arguments, math path) that launched kernels (see the
    module note); ``peak`` replaces the datasheet row of ``device_name`` (a CPU's measured
    ceilings); ``properties``: the device's ``deviceProperties`` entry (the part is told by it)."""
    if "input_dims" not in host or not len(kernels):
        return pd.DataFrame(columns=COLUMNS)
    launched = kernels[kernels["op_index"] >= 0]
    t = launched.groupby("op_index")["dur"].sum()
    tf32_name = per_text(launched["name"], lambda n: TF32_KERNEL.search(n) is not None, bool)
    tf32 = pd.Series(tf32_name, index=launched.index).groupby(launched["op_index"]).any()
    ops = host.loc[t.index]
    ops = ops[ops["input_dims"].notna()]
    none = np.full(len(ops), "", dtype=object)
    text = {"op": texts(ops["name"]), "dims": texts(ops["input_dims"]),
            "types": texts(ops["input_type"]) if "input_type" in ops else none,
            "concrete": np.where(ops["concrete"].isna().to_numpy(), "", texts(ops["concrete"]))
            if "concrete" in ops else none}  # fmt: skip
    is_tf32 = tf32.reindex(ops.index).to_numpy(dtype=bool)
    # one row per distinct (op, dims, types, concrete, tf32), grouped by codes, in first-seen order
    key = pd.DataFrame({c: pd.factorize(v)[0] for c, v in text.items()} | {"tf32": is_tf32}, index=ops.index)
    rows = []
    for _, grp in key.groupby(list(key.columns), sort=False):
        i = ops.index.get_loc(grp.index[0])
        name, dims, types, concrete = (text[c][i] for c in ("op", "dims", "types", "concrete"))
        c = cost(name, _shapes(dims), _shapes(types), _shapes(concrete))
        if c is None:
            continue
        rows.append({"op": name, "shapes": dims, "types": types, "kind": c.kind, "direction": c.direction,
                     "mask": c.mask, "tf32": bool(is_tf32[i]), "calls": len(grp),
                     "gpu_us": float(t.reindex(grp.index).sum()), "flops": c.flops * len(grp),
                     "bytes": c.bytes * len(grp)})  # fmt: skip
    df = pd.DataFrame(rows, columns=COLUMNS[:11])
    if not len(df):
        return pd.DataFrame(columns=COLUMNS)
    df["tflops"] = df["flops"] / (df["gpu_us"] * 1e6)
    df["gbps"] = df["bytes"] / (df["gpu_us"] * 1e3)
    df["intensity"] = df["flops"] / df["bytes"]
    found = identify(device_name, properties) if peak is None else None
    peak = peak or (found.peak if found else None)
    if peak is not None:
        pk = [_peak(k, ty, tf, peak) for k, ty, tf in zip(df["kind"], df["types"], df["tf32"])]
        df["peak_tflops"] = [p for p, _ in pk]
        df["peak_gbps"] = peak.hbm_gbs
        ridge = df["peak_tflops"] * 1e12 / (df["peak_gbps"] * 1e9)
        df["bound"] = np.where(df["intensity"] >= ridge, "compute", "memory")
        df["peak"] = [u if b == "compute" else f"HBM ({u} below the ridge)" for (_, u), b in zip(pk, df["bound"])]
        df["pct_of_peak"] = np.where(
            df["bound"] == "compute", 100 * df["tflops"] / df["peak_tflops"], 100 * df["gbps"] / df["peak_gbps"]
        )
    else:
        df["peak_tflops"] = df["peak_gbps"] = df["pct_of_peak"] = np.nan
        df["peak"] = ""
        df["bound"] = "no datasheet for " + str(device_name)
    df["device"] = device_name if peak is None or device_name else peak.name
    df["part"] = peak.name if peak is not None else ""
    return df.sort_values("gpu_us", ascending=False).reset_index(drop=True)[COLUMNS]
