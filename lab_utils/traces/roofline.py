"""A roofline per launching operator, where the trace recorded shapes (``record_shapes=True``).

Each ``cpu_op`` that launched GPU kernels (``op_index`` of the attribution) and carries
``Input Dims`` is costed from its shapes with :mod:`lab_utils.core.flops` conventions; its time
is the summed duration of the kernels it launched.  Operators are grouped by (name, shapes,
types): calls, GPU time, FLOPs and bytes per call, then TFLOP/s, GB/s, arithmetic intensity
and, against the datasheet peaks of the GPU named in ``deviceProperties``
(:func:`lab_utils.core.device.datasheet_for`), % of peak and the bound (``compute`` when the
intensity is above the ridge point peak FLOP/s / peak bytes/s, else ``memory``).  A GPU
without a datasheet row keeps the rates and leaves the peaks empty.

Costed operators (FLOPs; bytes = every input read once + the output written once):

* ``aten::mm`` [m,k]x[k,n], ``aten::addmm`` (bias, [m,k], [k,n]), ``aten::bmm`` [b,m,k]x[b,k,n],
  ``aten::linear`` x[...,k], W[n,k]: ``matmul_flops`` = 2mnk (x batch);
* ``aten::_scaled_dot_product_{flash,efficient,cudnn}_attention`` and ``scaled_dot_product_attention``
  q[b,h,s,d], k[b,h,t,d]: ``attention_flops`` forward (4·s·t·d per head);
* normalisation and elementwise operators (``layer_norm``, ``rms_norm``, ``add``, ``mul``, ``gelu`` ...):
  FLOPs = elements x the per-element count of ``FUSED_FLOPS_PER_ELEMENT`` where it has the op, else 1;
  a trailing tensor of the output's size (``out=``) is written, not read.

The matmul peak is :meth:`DatasheetPeak.matmul_tflops` of the inputs' type: for ``float`` the TF32
tensor-core peak where the part has TF32 (what cuBLAS uses when it is allowed; an upper bound
otherwise), else its fp32 matrix or CUDA-core rate (V100, P100, MI250); for half the fp16 peak,
for bfloat16 the bf16 peak (on a part without a bf16 unit, the fp32 rate it runs at).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd

from lab_utils.core.device import DatasheetPeak, datasheet_for
from lab_utils.core.flops import FUSED_FLOPS_PER_ELEMENT, attention_flops, matmul_flops

ITEMSIZE = {"float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "half": 2, "bfloat16": 2, "long int": 8}
ITEMSIZE |= {"int": 4, "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2, "c10::float8_e4m3fn": 1}
_ATTN = re.compile(r"scaled_dot_product|_flash_attention|_efficient_attention|_cudnn_attention")
_ELEMENTWISE = re.compile(
    r"^aten::(add|sub|mul|div|gelu|silu|relu|sigmoid|tanh|exp|pow|rsqrt|sqrt|neg|abs|clamp|where|"
    r"layer_norm|native_layer_norm|rms_norm|_fused_rms_norm|group_norm|native_group_norm)_?$"
)


def _shapes(raw) -> list:
    if raw is None or (isinstance(raw, float) and np.isnan(raw)):
        return []
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return []


def _numel(shape) -> int:
    return int(np.prod(shape)) if isinstance(shape, list) and all(isinstance(x, int) for x in shape) else 0


def cost(op: str, dims: list, types: list) -> tuple[float, float, str] | None:
    """(FLOPs, bytes, kind) of one call of ``op`` with input ``dims``/``types``, or None if not costed."""
    tensors = [(d, t) for d, t in zip(dims, types) if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    if not tensors:
        return None
    item = ITEMSIZE.get(str(tensors[0][1]).lower(), 4)
    read = sum(_numel(d) * ITEMSIZE.get(str(t).lower(), 4) for d, t in tensors)
    a = [d for d, _ in tensors]
    if op in ("aten::mm", "aten::addmm") and len(a) >= 2:
        (m, k), (_, n) = a[-2][-2:], a[-1][-2:]
        return matmul_flops(m, n, k), read + m * n * item, "matmul"
    if op == "aten::bmm" and len(a) >= 2 and len(a[0]) == 3:
        b, m, k = a[0]
        n = a[1][-1]
        return matmul_flops(m, n, k, batch=b), read + b * m * n * item, "matmul"
    if op == "aten::linear" and len(a) >= 2:
        x, w = a[0], a[1]
        m, k, n = int(np.prod(x[:-1])), x[-1], w[0]
        return matmul_flops(m, n, k), read + m * n * item, "matmul"
    if _ATTN.search(op) and len(a) >= 3 and len(a[0]) == 4:
        b, h, s, d = a[0]
        t = a[1][2]
        return attention_flops(b, h, s, t, d), read + b * h * s * d * item, "attention"
    if _ELEMENTWISE.match(op):
        key = next((f for f in FUSED_FLOPS_PER_ELEMENT if f in op), None)
        per = FUSED_FLOPS_PER_ELEMENT[key][0] if key else 1
        n = max(_numel(d) for d in a)
        if len(a) >= 3 and _numel(a[-1]) == n:  # an ``out=`` tensor: written, not read
            read -= n * ITEMSIZE.get(str(tensors[-1][1]).lower(), 4)
        return float(per * n), read + n * item, "elementwise/norm"
    return None


def op_roofline(
    kernels: pd.DataFrame,
    host: pd.DataFrame,
    device_name: str | None,
    peak: DatasheetPeak | None = None,
    properties: dict | None = None,
) -> pd.DataFrame:
    """One row per (op, shapes, types) that launched kernels (see the module note); ``peak``
    replaces the datasheet row of ``device_name`` (a CPU's measured ceilings); ``properties``:
    the device's ``deviceProperties`` entry (:func:`datasheet_for` reads it)."""
    cols = ["op", "shapes", "types", "kind", "calls", "gpu_us", "flops", "bytes", "tflops", "gbps", "intensity"]
    cols += ["peak_tflops", "peak_gbps", "pct_of_peak", "bound", "device"]
    if "input_dims" not in host:
        return pd.DataFrame(columns=cols)
    t = kernels[kernels["op_index"] >= 0].groupby("op_index")["dur"].sum()
    ops = host.loc[t.index]
    ops = ops[ops["input_dims"].notna()]
    rows = []
    for (name, dims, types), grp in ops.groupby([ops["name"].astype(str), "input_dims", "input_type"], dropna=False):
        c = cost(name, _shapes(dims), _shapes(types))
        if c is None:
            continue
        rows.append(
            {
                "op": name,
                "shapes": dims.decode() if isinstance(dims, bytes) else str(dims),
                "types": types.decode() if isinstance(types, bytes) else str(types),
                "kind": c[2],
                "calls": len(grp),
                "gpu_us": float(t.reindex(grp.index).sum()),
                "flops": c[0] * len(grp),
                "bytes": c[1] * len(grp),
            }
        )
    df = pd.DataFrame(rows, columns=cols[:8])
    if not len(df):
        return pd.DataFrame(columns=cols)
    df["tflops"] = df["flops"] / (df["gpu_us"] * 1e6)
    df["gbps"] = df["bytes"] / (df["gpu_us"] * 1e3)
    df["intensity"] = df["flops"] / df["bytes"]
    peak = peak or datasheet_for(device_name, properties)
    half = df["types"].str.contains("Half|BFloat16", case=False)
    if peak is not None:
        fp16 = df["types"].str.contains("Half", case=False) & ~df["types"].str.contains("BFloat16", case=False)
        mm = {d: peak.matmul_tflops(d) or np.nan for d in ("fp32", "fp16", "bf16")}
        df["peak_tflops"] = np.where(half, np.where(fp16, mm["fp16"], mm["bf16"]), mm["fp32"])
        df["peak_tflops"] = np.where(df["kind"] == "elementwise/norm", peak.fp32_tflops or np.nan, df["peak_tflops"])
        df["peak_gbps"] = peak.hbm_gbs
        ridge = df["peak_tflops"] * 1e12 / (df["peak_gbps"] * 1e9)
        df["bound"] = np.where(df["intensity"] >= ridge, "compute", "memory")
        df["pct_of_peak"] = np.where(
            df["bound"] == "compute", 100 * df["tflops"] / df["peak_tflops"], 100 * df["gbps"] / df["peak_gbps"]
        )
    else:
        df["peak_tflops"] = df["peak_gbps"] = df["pct_of_peak"] = np.nan
        df["bound"] = "no datasheet for " + str(device_name)
    df["device"] = device_name if peak is None or device_name else peak.name
    return df.sort_values("gpu_us", ascending=False).reset_index(drop=True)[cols]
