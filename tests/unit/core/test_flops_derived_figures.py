"""Derived figures pinned against an independent derivation, not against the constants that
produce them: FLOPs of matmul and attention against ``FlopCounterMode``, FLOPs of the fused
ops against a hand count of each op's formula, bytes of the fused ops against the sizes of
the real tensors each kernel reads and writes, and the speedup, GB/s and TFLOP/s rows of a
sweep against fake timings whose answer is known (a variant 2x slower than eager reads 0.5).

The FLOP convention (``lab_utils.core.flops``' docstring): FLOPs per element of the op's main
tensor(s), counted from the formula the kernel evaluates; a transcendental (tanh, exp,
rsqrt) is one FLOP, a per-row reduction is one add per element, per-row scalars (rstd,
mean, their sums divided by D) are not counted, constants are folded and a value formed once
is used again (x² on the way to x³).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lab_kernels import get_variant
from lab_utils.core import flops as F
from lab_utils.core.records import Recorder
from lab_utils.core.session import Session
from lab_utils.core.timing import Timing
from lab_utils.fused import blocks as fused_blocks
from lab_utils.fused import ops as kb

# ---------------------------------------------------------------------------------------------
# Matmul and attention: FlopCounterMode counts the matmuls torch runs


def counted(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def test_matmul_flops_equal_flopcountermode():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    assert F.matmul_flops(5, 3, 7) == counted(lambda: a @ b)
    a, b = torch.randn(4, 6, 9), torch.randn(4, 9, 2)
    assert F.matmul_flops(6, 2, 9, batch=4) == counted(lambda: torch.bmm(a, b))


def _math_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


@pytest.mark.parametrize("B,H,Lq,Lk,Dh", [(2, 3, 5, 7, 4), (1, 2, 9, 4, 8)])
def test_attention_flops_equal_flopcountermode_both_conventions(B, H, Lq, Lk, Dh):
    q = torch.randn(B, H, Lq, Dh, requires_grad=True)
    k = torch.randn(B, H, Lk, Dh, requires_grad=True)
    v = torch.randn(B, H, Lk, Dh, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        out = _math_attention(q, k, v)
    fwd = fc.get_total_flops()  # QKᵀ and PV
    with FlopCounterMode(display=False) as fc:
        out.backward(torch.randn_like(out))
    bwd_model = fc.get_total_flops()  # autograd: two matmuls per forward matmul
    recompute_s = counted(lambda: q @ k.transpose(-1, -2))  # what a flash backward runs again
    kw = dict(batch=B, heads=H, q_len=Lq, k_len=Lk, head_dim=Dh)
    assert F.attention_flops(**kw) == fwd
    assert F.attention_flops(**kw, direction="bwd", convention="model") == bwd_model
    assert F.attention_flops(**kw, direction="bwd", convention="kernel") == bwd_model + recompute_s
    assert F.attention_flops(**kw, direction="fwd+bwd", convention="model") == fwd + bwd_model


@pytest.mark.parametrize("Lq,Lk", [(6, 6), (4, 7), (7, 4)])
def test_causal_attention_flops_equal_the_matmuls_of_each_query(Lq, Lk):
    """Top-left causal: query i attends keys 0..i; counted as one small attention per query."""
    Dh = 8
    q, k, v = torch.randn(Lq, Dh), torch.randn(Lk, Dh), torch.randn(Lk, Dh)

    def per_query():
        for i in range(Lq):
            n = min(i + 1, Lk)
            _math_attention(q[i : i + 1], k[:n], v[:n])

    got = F.attention_flops(1, 1, Lq, Lk, Dh, pairs=F.causal_pairs(Lq, Lk))
    assert got == counted(per_query)


# ---------------------------------------------------------------------------------------------
# Fused ops: FLOPs per element by a hand count of each formula

#: (forward, backward) tallies: one entry per FLOP of the formula, per element of the main tensor.
TALLY: dict[str, tuple[list[str], list[str]]] = {
    # y = x·rsqrt(mean(x²) + eps)·w
    "rms_norm": (
        ["x·x", "Σ x²", "x·rstd", "·w"],
        # x̂ = x·rstd, g = dy·w, c = mean(g·x̂), dx = (g − x̂·c)·rstd, dw = Σ_rows dy·x̂
        ["x·rstd", "dy·w", "g·x̂", "Σ g·x̂", "x̂·c", "g − x̂c", "·rstd", "dy·x̂", "Σ_rows (dw)"],
    ),
    # y = (x − μ)·rstd·(1 + scale) + shift; the modulation 1 + scale is counted per element
    # (the forward kernel evaluates it on the whole tile), in both directions
    "layer_norm_modulate": (
        ["Σ x", "x − μ", "(x − μ)²", "Σ (x − μ)²", "·rstd", "1 + scale", "·(1 + scale)", "+ shift"],
        # x̂ recomputed, g = dy·(1 + s), dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), dshift, dscale
        [
            "x − μ",
            "·rstd",
            "1 + scale",
            "dy·(1 + s)",
            "Σ g",
            "g·x̂",
            "Σ g·x̂",
            "x̂·c2",
            "g − c1",
            "− x̂c2",
            "·rstd",
            "Σ_rows dy (dshift)",
            "dy·x̂",
            "Σ_rows dy·x̂ (dscale)",
        ],  # fmt: skip
    ),
    # out = x + gate·y; dx = dout (no work), dy = dout·gate, dgate = Σ_rows dout·y
    "gated_residual": (["gate·y", "x +"], ["dout·gate", "dout·y", "Σ_rows"]),
    # y = ½·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³)
    "gelu_tanh": (
        ["x² (for x³)", "x³", "·0.044715", "x +", "·√(2/π)", "tanh", "1 +", "x·", "·½"],
        # dx = dy·(½·(1 + t) + ½·x·(1 − t²)·u'), u' = √(2/π)·(1 + 3·0.044715·x²)
        [
            "x²",
            "x³",
            "·0.044715",
            "x +",
            "·√(2/π)",
            "tanh",  # t recomputed
            "3·0.044715·x²",
            "1 +",
            "·√(2/π)",  # u' (x² formed above)
            "1 + t",
            "½·",
            "t²",
            "1 − t²",
            "½·x",
            "·(1 − t²)",
            "·u'",
            "+",  # the product rule
            "dy·",
        ],  # fmt: skip
    ),
    # out = silu(gate)·up, silu(g) = g / (1 + exp(−g))
    "swiglu": (
        ["exp(−g)", "1 +", "g /", "·up"],
        # σ = 1/(1 + exp(−g)); dup = dout·g·σ; dgate = dout·up·σ·(1 + g·(1 − σ))
        ["exp(−g)", "1 +", "1 /", "g·σ", "dout·silu", "dout·up", "·σ", "1 − σ", "g·", "1 +", "·"],
    ),
    # a pair (x0, x1) -> (x0·c − x1·s, x0·s + x1·c): per pair 4 multiplies and 2 adds
    "rope": (
        ["x0·c", "x1·s", "−", "x0·s", "x1·c", "+"],
        ["dy0·c", "dy1·s", "+", "dy1·c", "dy0·s", "−"],  # the transposed rotation
    ),
}
PER_PAIR = {"rope"}  # tallied per pair of elements
# rms_norm then rope on each of q and k: the tallies add
TALLY["qk_norm_rope"] = (
    TALLY["rms_norm"][0] + [f"rope {t}" for t in TALLY["rope"][0][:3]],
    TALLY["rms_norm"][1] + [f"rope {t}" for t in TALLY["rope"][1][:3]],
)


def per_element(op: str, direction: int) -> float:
    n = len(TALLY[op][direction])
    return n / 2 if op in PER_PAIR else n


# B=2, L=5, D=48, Dh=16: 3 heads, irregular enough that no axis stands in for another
PROBLEM = kb.Problem(2, 5, 48, head_dim=16)


def main_elements(op: str, p: kb.Problem) -> int:
    """Elements of the op's main tensor(s), counted on the real inputs of the op."""
    args, inp, _ = kb.make_inputs(op, p, torch.float32, seed=0, requires_grad=False)
    named = dict(zip(inp.names, args))
    main = {"swiglu": ["gate"], "rope": ["q", "k"], "qk_norm_rope": ["q", "k"]}.get(op, ["x"])
    return sum(named[n].numel() for n in main)


def test_tallies_cover_every_fused_op():
    assert set(TALLY) == set(F.FUSED_OPS)


@pytest.mark.parametrize("op", F.FUSED_OPS)
def test_fused_flops_equal_a_hand_count_of_the_formula(op):
    n = main_elements(op, PROBLEM)
    kw = dict(batch=PROBLEM.batch, tokens=PROBLEM.tokens, hidden=PROBLEM.hidden, head_dim=PROBLEM.head_dim)
    fwd, bwd = per_element(op, 0) * n, per_element(op, 1) * n
    assert F.fused_flops(op, "fwd", **kw) == fwd, TALLY[op][0]
    assert F.fused_flops(op, "bwd", **kw) == bwd, TALLY[op][1]
    assert F.fused_flops(op, "fwd+bwd", **kw) == fwd + bwd
    assert kb.flops(op, PROBLEM, "fwd") == fwd  # the sweep's figure is the same count


def test_hand_counts_on_a_concrete_shape():
    """The tallies above, spelled out as numbers on PROBLEM (x: 2·5·48 = 480 elements; q and k:
    2·3·5·16 = 480 each)."""
    kw = dict(batch=2, tokens=5, hidden=48, head_dim=16)
    assert F.fused_flops("rms_norm", "fwd", **kw) == 4 * 480
    assert F.fused_flops("gelu_tanh", "bwd", **kw) == 18 * 480
    assert F.fused_flops("rope", "fwd", **kw) == 3 * 960
    assert F.fused_flops("qk_norm_rope", "bwd", **kw) == 12 * 960


# ---------------------------------------------------------------------------------------------
# Fused ops: bytes from the sizes of the tensors each kernel touches

#: What the backward kernel reads and writes; "d<name>" is the gradient
#: of an input (same size), "dout<i>" the upstream gradient of output i, "stat <name>" a
#: float32 per-row statistic saved by the forward (one per row of x, or of q and of k).
BWD_TOUCHES: dict[str, tuple[list[str], list[str]]] = {
    "rms_norm": (["x", "dout0", "weight", "stat rstd"], ["dx", "dweight"]),
    # the shift is not read: its gradient is Σ dy
    "layer_norm_modulate": (["x", "dout0", "scale", "stat mean", "stat rstd"], ["dx", "dshift", "dscale"]),
    # dx = dout is passed through: no kernel, no traffic
    "gated_residual": (["dout0", "y", "gate"], ["dy", "dgate"]),
    "gelu_tanh": (["x", "dout0"], ["dx"]),
    "swiglu": (["gate", "up", "dout0"], ["dgate", "dup"]),
    "rope": (["dout0", "dout1", "cos", "sin"], ["dq", "dk"]),
    "qk_norm_rope": (
        ["q", "k", "dout0", "dout1", "q_weight", "k_weight", "cos", "sin", "stat rstd q", "stat rstd k"],
        ["dq", "dk", "dq_weight", "dk_weight"],
    ),
}


def tensor_bytes(op: str, p: kb.Problem, dtype) -> tuple[int, int]:
    """(forward, backward) bytes: every input read once and every output written once; the
    backward's reads and writes as listed in BWD_TOUCHES, sized on the real tensors."""
    args, inp, _ = kb.make_inputs(op, p, dtype, seed=0, requires_grad=False)
    outs = kb.as_tuple(get_variant(op, "reference")(*args))
    size = {n: a.numel() * a.element_size() for n, a in zip(inp.names, args)}
    size.update({f"d{n}": size[n] for n in inp.grads})
    size.update({f"dout{i}": o.numel() * o.element_size() for i, o in enumerate(outs)})
    rows = args[0].numel() // args[0].shape[-1]  # rows of x, or of q (= of k)
    fwd = sum(size.values()) - sum(size[f"d{n}"] for n in inp.grads)  # inputs + outputs
    reads, writes = BWD_TOUCHES[op]
    bwd = sum(4 * rows if t.startswith("stat ") else size[t] for t in reads + writes)
    return fwd, bwd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", F.FUSED_OPS)
def test_fused_bytes_equal_the_tensors_the_kernel_touches(op, dtype):
    fwd, bwd = tensor_bytes(op, PROBLEM, dtype)
    assert kb.bytes_moved(op, PROBLEM, dtype, "fwd") == fwd
    assert kb.bytes_moved(op, PROBLEM, dtype, "bwd") == bwd
    assert kb.bytes_moved(op, PROBLEM, dtype, "fwd+bwd") == fwd + bwd


def test_bytes_on_a_concrete_shape():
    """Two of the above as numbers: rms_norm bfloat16 on x (2, 5, 48): forward reads x (960 B)
    and w (96 B) and writes y (960 B); the backward reads x, dy, w and rstd (10 rows · 4 B) and
    writes dx and dw."""
    assert kb.bytes_moved("rms_norm", PROBLEM, torch.bfloat16, "fwd") == 960 + 96 + 960
    assert kb.bytes_moved("rms_norm", PROBLEM, torch.bfloat16, "bwd") == 3 * 960 + 2 * 96 + 40


# ---------------------------------------------------------------------------------------------
# Speedup, GB/s and TFLOP/s of a sweep: fake timings whose answer is known


def fake_timing(ms: float, name: str = "") -> Timing:
    """Five samples whose median is ``ms`` (and whose p20 and p80 are not)."""
    return Timing(name, "cpu", "fake", tuple(ms * f for f in (1.03, 0.97, 1.0, 1.01, 0.99)), 0.0)


MS = {"eager": 2.0, "slow2x": 4.0, "fast2x": 1.0}


@pytest.fixture
def fake_bench(monkeypatch):
    """The timing primitive of lab_utils.fused.ops answers from MS by variant name."""

    def try_bench(fn, *, name, **kw):
        return fake_timing(MS[name.split("/")[1]], name)

    monkeypatch.setattr(kb, "try_bench", try_bench)


def test_sweep_speedup_reads_eager_over_variant(fake_bench, temporary_variant):
    gelu = lambda x: torch.nn.functional.gelu(x, approximate="tanh")  # noqa: E731
    temporary_variant("gelu_tanh", "slow2x", gelu)
    temporary_variant("gelu_tanh", "fast2x", gelu)
    rec = Recorder("test")
    p = kb.Problem(1, 4, 32)
    kb.sweep(kb.OpGrid(["gelu_tanh"], [p], ["float32"], ["fwd"], ["slow2x", "fast2x"]), Session("cpu", rec), reps=3)
    df = rec.frame()
    speed = dict(df[df.metric == "speedup_vs_eager"][["variant", "value"]].values)
    assert speed == {"eager": 1.0, "slow2x": 0.5, "fast2x": 2.0}
    # GB/s and TFLOP/s: the hand-counted bytes and FLOPs over the fake median
    nbytes, nflops = 2 * 128 * 4, 9 * 128  # read x, write y (128 float32 elements); 9 FLOPs each
    for v, ms in MS.items():
        bw = df[(df.metric == "bandwidth") & (df.variant == v)]
        assert bw.value.item() == pytest.approx(nbytes / (ms * 1e-3) / 1e9, rel=1e-12)
        assert json.loads(bw.extra.item())["bytes"] == nbytes
        tf = df[(df.metric == "throughput") & (df.variant == v)]
        assert tf.value.item() == pytest.approx(nflops / (ms * 1e-3) / 1e12, rel=1e-12)


def test_block_speedup_reads_eager_over_provider(monkeypatch):
    def try_bench(fn, *, name, **kw):
        return fake_timing({"eager": 3.0, "slow": 6.0, "fast": 1.5}[name.split("/")[1]], name)

    monkeypatch.setattr(fused_blocks, "try_bench", try_bench)
    cases = [
        fused_blocks.BlockCase(p, "single", lambda: None, lambda: None, "1x8x16", "torch", False)
        for p in ("slow", "eager", "fast")  # eager not first: the baseline is found, not assumed
    ]
    rec = Recorder("test")
    fused_blocks.block_compare(rec, cases, reps=3)
    df = rec.frame()
    speed = dict(df[df.metric == "speedup_vs_eager"][["variant", "value"]].values)
    assert speed == {"eager": 1.0, "slow": 0.5, "fast": 2.0}
    assert math.isclose(df[(df.metric == "time") & (df.statistic == "median") & (df.variant == "slow")].value.item(), 6)


def test_a_cuda_time_without_a_graph_is_per_call(monkeypatch):
    """Where a CUDA graph cannot be captured, each sample runs several calls back to back: the
    recorded time is each sample over the calls it made (counted here), not the sample."""
    counted = [0]

    def op():
        counted[0] += 1

    def try_bench(fn, **kw):
        fn()  # what one sample runs
        return Timing("fake", "cuda", "events", (8.0, 16.0, 24.0), 0.0)

    monkeypatch.setattr(kb, "try_bench", try_bench)
    t = kb.time_op(op, name="fake", device="cuda", reps=3, budget_s=1.0, graph=False)
    calls = counted[0]
    assert calls > 1
    assert t.samples_ms == pytest.approx((8.0 / calls, 16.0 / calls, 24.0 / calls), rel=1e-12)
    assert t.meta["calls_per_sample"] == calls and t.meta["cuda_graph"] is False


def test_peak_memory_rows_are_in_mib(fake_bench, monkeypatch):
    """3 MiB = 3 x 1,048,576 B = 3,145,728 B: the sweep's and the block table's peak-memory rows
    read 3.0 (not 3.1457..., the same bytes in MB)."""
    real = kb.bench_variant

    def bench_variant(*a, **kw):
        t, _ = real(*a, **kw)
        return t, 3_145_728.0

    monkeypatch.setattr(kb, "bench_variant", bench_variant)
    rec = Recorder("test")
    kb.sweep(kb.OpGrid(["gelu_tanh"], [kb.Problem(1, 4, 32)], ["float32"], ["fwd"], []), Session("cpu", rec), reps=3)
    df = rec.frame()
    mem = df[df.metric == "peak_memory"]
    assert len(mem) >= 1 and set(mem.unit) == {"MiB"} and mem.value.tolist() == [3.0] * len(mem)

    monkeypatch.setattr(fused_blocks, "try_bench", lambda fn, *, name, **kw: fake_timing(2.0, name))
    monkeypatch.setattr(fused_blocks, "peak_memory_bytes", lambda fn, dev: 3_145_728.0)
    rec = Recorder("test")
    case = fused_blocks.BlockCase("eager", "single", lambda: None, lambda: None, "1x8x16", "torch", False)
    fused_blocks.block_compare(rec, [case], reps=3)
    df = rec.frame()
    assert df[df.metric == "peak_memory"].value.tolist() == [3.0]
