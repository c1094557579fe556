"""FLOP and byte conventions of the lab, in one place.

Every TFLOP/s, GB/s, roofline point and MFU figure of perflab divides by a count made here,
never by one inferred from a time.  The conventions:

* **Matmul**: ``2·M·N·K`` FLOPs (one multiply and one add per product).
* **Attention** (per head, ``pairs`` = the (query, key) pairs the mask allows):
  forward ``4·pairs·Dh`` (``QKᵀ`` and ``PV``, 2 FLOPs per multiply-add; softmax not counted).
  The backward has two names, and a figure must say which it uses:

  - ``convention="kernel"``: 2.5x forward, the five matmuls a flash backward executes
    (``dV = PᵀdO``, ``dP = dO·Vᵀ``, ``dQ = dS·K``, ``dK = dSᵀ·Q`` and the recomputed
    ``S = QKᵀ``, against the forward's two).  Use it for a kernel's achieved TFLOP/s.
  - ``convention="model"``: 2x forward, the usual training-FLOPs convention (backward = two
    matmuls per forward matmul, no recomputation).  Use it for MFU, so that a recomputing
    kernel is not credited with work the model does not need.

* **Fused memory-bound ops** (``lab_kernels``): FLOPs per element of the main tensor(s), in
  :data:`FUSED_FLOPS_PER_ELEMENT`, counted from the formula each kernel evaluates; a
  transcendental (tanh, exp, rsqrt) counts as one FLOP, per-row reductions count one add
  per element, per-row scalars (rstd, mean) are not counted.  These only place the ops on
  the roofline: every one sits far left of the ridge point.
* **Fused-op bytes** (:func:`fused_bytes`): the fewest bytes the op must move, each input
  read once and each output written once, in the passes the kernel actually makes over
  the large tensors; the formulas are repeated in each ``lab_kernels`` module's docstring.
"""

from __future__ import annotations

import math

DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
ATTENTION_CONVENTIONS = ("kernel", "model")
#: Backward FLOPs of attention as a multiple of the forward, per convention (see the module note).
ATTENTION_BWD_FACTOR: dict[str, float] = {"kernel": 2.5, "model": 2.0}

#: tanh-GELU, ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``, forward FLOPs per element:
#: x³ (2), ·0.044715 (1), + x (1), ·√(2/π) (1), tanh (1), 1 + (1), · x (1), · 0.5 (1) = 9.
GELU_TANH_FLOPS = 9

# (forward, backward) FLOPs per element of the op's main tensor(s).  Tallies:
# rms_norm      fwd x·x, Σ, ·rstd, ·w = 4; bwd g = dy·w, x̂ = x·rstd, g·x̂, Σ, x̂·c, g −, ·rstd,
#               dw: dy·x̂, Σ rows = 9
# layer_norm_modulate  fwd Σx, x − μ, (x − μ)², Σ, ·rstd, ·(1 + scale), + shift, 1 + scale = 8;
#               bwd g = dy·(1 + s), Σg, g·x̂, Σ, x̂·c2, g − c1 −, ·rstd, x̂ recomputed (2), dshift Σ,
#               dscale dy·x̂ and Σ, 1 + s = 14
# gated_residual fwd gate·y, + x = 2; bwd dout·gate, dout·y, Σ = 3
# gelu_tanh     fwd 9 (above); bwd the tanh argument (5), tanh (1), 1 − t² (2), the derivative of
#               the argument u' = √(2/π)·(1 + 3·0.044715·x²) with x² reused (3), the product rule
#               ½·(1 + t) + ½·x·(1 − t²)·u' (6), · dy (1) = 18
# swiglu        fwd silu(g) = g / (1 + exp(−g)) (3), · up = 4; bwd σ recomputed (3), silu (1),
#               dup = dout·silu (1), dgate = dout·up·σ·(1 + g·(1 − σ)) (6) = 11
# rope          a pair (x0, x1) -> (x0·c − x1·s, x0·s + x1·c): 4 multiplies + 2 adds per pair = 3
#               per element; the backward is the transposed rotation: 3
# qk_norm_rope  rms_norm + rope: fwd 4 + 3 = 7; bwd 9 + 3 = 12
FUSED_FLOPS_PER_ELEMENT: dict[str, tuple[int, int]] = {
    "rms_norm": (4, 9),
    "layer_norm_modulate": (8, 14),
    "gated_residual": (2, 3),
    "gelu_tanh": (GELU_TANH_FLOPS, 18),
    "swiglu": (4, 11),
    "rope": (3, 3),
    "qk_norm_rope": (7, 12),
}
FUSED_OPS = tuple(FUSED_FLOPS_PER_ELEMENT)
#: Ops whose main tensors are q and k, (batch, heads, tokens, head_dim) each.
QK_OPS = ("rope", "qk_norm_rope")


def _check(param: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"parameter {param!r} = {value!r} is not allowed: expected one of {', '.join(allowed)}")


def _split(direction: str, fwd: float, bwd: float) -> float:
    _check("direction", direction, DIRECTIONS)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[direction]


def matmul_flops(m: int, n: int, k: int, *, batch: int = 1) -> float:
    """``2·M·N·K`` per matmul (times ``batch``)."""
    return 2.0 * batch * m * n * k


def causal_pairs(q_len: int, k_len: int | None = None, *, bottom_right: bool = False) -> int:
    """(query, key) pairs a causal mask allows: top-left aligned (torch's ``is_causal``), query i sees
    keys j <= i; ``bottom_right`` (flash-attn's, xformers' ``custom_mask_type=2``), keys j <= i + k_len - q_len."""
    k_len = q_len if k_len is None else k_len
    if bottom_right:
        if q_len <= k_len:
            return q_len * (k_len - q_len) + q_len * (q_len + 1) // 2
        return k_len * (k_len + 1) // 2
    if q_len <= k_len:
        return q_len * (q_len + 1) // 2
    return k_len * (k_len + 1) // 2 + (q_len - k_len) * k_len


def attention_flops(
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    head_dim: int | tuple[int, int],
    *,
    pairs: int | None = None,
    direction: str = "fwd",
    convention: str = "kernel",
) -> float:
    """Attention FLOPs: ``4·pairs·Dh`` per head forward; the backward by ``convention``
    ("kernel": 2.5x, the matmuls a flash backward runs; "model": 2x, for MFU).

    ``pairs``: allowed (query, key) pairs per (batch, head); default all ``q_len·k_len``
    (use :func:`causal_pairs` or a mask's count otherwise).  ``heads``: the query heads (with
    grouped-query attention the key/value heads are fewer; every query head still does the work).
    ``head_dim``: Dh, or (Dh of q and k, Dv of v) where they differ: ``2·pairs·(Dh + Dv)``."""
    _check("convention", convention, ATTENTION_CONVENTIONS)
    pairs = q_len * k_len if pairs is None else pairs
    dk, dv = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
    fwd = 2.0 * batch * heads * pairs * (dk + dv)
    return _split(direction, fwd, ATTENTION_BWD_FACTOR[convention] * fwd)


def fused_elements(op: str, *, batch: int, tokens: int, hidden: int, head_dim: int) -> int:
    """Elements of the op's main tensor(s): x (batch, tokens, hidden), or q and k together."""
    _check("op", op, FUSED_OPS)
    if op in QK_OPS:
        heads = max(1, hidden // head_dim)
        return 2 * batch * heads * tokens * head_dim
    return batch * tokens * hidden


def fused_flops(op: str, direction: str, *, batch: int, tokens: int, hidden: int, head_dim: int = 128) -> float:
    """FLOPs of one call of a fused op (:data:`FUSED_FLOPS_PER_ELEMENT` × elements)."""
    n = fused_elements(op, batch=batch, tokens=tokens, hidden=hidden, head_dim=head_dim)
    f, b = FUSED_FLOPS_PER_ELEMENT[op]
    return float(_split(direction, n * f, n * b))


def fused_bytes(
    op: str, direction: str, *, batch: int, tokens: int, hidden: int, head_dim: int = 128, elem_size: int
) -> float:
    """Bytes one call of a fused op must move (``elem_size`` = bytes per element of the dtype;
    statistics saved by the forward, rope tables and partial sums are float32).

    Per op (M = batch·tokens rows of D = hidden; n = elements of q and of k; R = their rows;
    t = elements of one rope table; B = batch; s = elem_size):

    ======================  ==================================  =======================================
    op                      forward                             backward
    ======================  ==================================  =======================================
    rms_norm                2·M·D·s + D·s                       3·M·D·s + 2·D·s + 4·M
    layer_norm_modulate     2·M·D·s + 2·B·D·s                   3·M·D·s + 3·B·D·s + 8·M
    gated_residual          3·M·D·s + B·D·s                     3·M·D·s + 2·B·D·s
    gelu_tanh               2·M·D·s                             3·M·D·s
    swiglu                  3·M·D·s                             5·M·D·s
    rope                    4·n·s + 8·t                         4·n·s + 8·t
    qk_norm_rope            4·n·s + 2·Dh·s + 8·t                6·n·s + 4·Dh·s + 8·t + 8·R
    ======================  ==================================  =======================================

    layer_norm_modulate's backward makes 3 passes over (M, D) (reads x and dy, writes dx) and
    touches scale (read), dshift and dscale (written) once per batch row: the shift is not
    read by the backward."""
    _check("op", op, FUSED_OPS)
    s = elem_size
    M, D, B = batch * tokens, hidden, batch
    heads = max(1, hidden // head_dim)
    n = batch * heads * tokens * head_dim
    R = batch * heads * tokens
    t = tokens * (head_dim // 2)
    md = M * D * s
    table = {
        "rms_norm": (2 * md + D * s, 3 * md + 2 * D * s + 4 * M),
        "layer_norm_modulate": (2 * md + 2 * B * D * s, 3 * md + 3 * B * D * s + 8 * M),
        "gated_residual": (3 * md + B * D * s, 3 * md + 2 * B * D * s),
        "gelu_tanh": (2 * md, 3 * md),
        "swiglu": (3 * md, 5 * md),
        "rope": (4 * n * s + 8 * t, 4 * n * s + 8 * t),
        "qk_norm_rope": (4 * n * s + 2 * head_dim * s + 8 * t, 6 * n * s + 4 * head_dim * s + 8 * t + 8 * R),
    }
    fwd, bwd = table[op]
    return float(_split(direction, fwd, bwd))


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte (inf for a zero-byte op, 0 for a zero-FLOP one)."""
    return math.inf if nbytes == 0 else flops / nbytes


__all__ = [
    "ATTENTION_BWD_FACTOR",
    "ATTENTION_CONVENTIONS",
    "DIRECTIONS",
    "FUSED_FLOPS_PER_ELEMENT",
    "FUSED_OPS",
    "GELU_TANH_FLOPS",
    "QK_OPS",
    "arithmetic_intensity",
    "attention_flops",
    "causal_pairs",
    "fused_bytes",
    "fused_elements",
    "fused_flops",
    "matmul_flops",
]
