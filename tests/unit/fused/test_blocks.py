"""lab_utils.fused.ops: bytes formulas, the correctness checker catches wrong variants, sweep rows
(and the sweep's check before timing), block-level agreement."""

import json

import pytest
import torch

import lab_kernels
from lab_utils.core.records import Recorder
from lab_utils.core.session import Session
from lab_utils.fused import blocks as fused_blocks
from lab_utils.fused import ops as kb


def test_bytes_formulas_by_hand():
    p = kb.Problem(2, 10, 96, head_dim=32)  # n = 1920 elements, 3 heads
    n = 2 * 10 * 96
    assert kb.bytes_moved("rms_norm", p, "bfloat16", "fwd") == 2 * n * 2 + 96 * 2
    assert kb.bytes_moved("rms_norm", p, "float32", "bwd") == 3 * n * 4 + 2 * 96 * 4 + 4 * 20
    assert kb.bytes_moved("gated_residual", p, "float32", "fwd") == 3 * n * 4 + 2 * 96 * 4
    assert kb.bytes_moved("swiglu", p, "float16", "fwd+bwd") == (3 + 5) * n * 2
    assert kb.bytes_moved("gelu_tanh", p, "float32", "bwd") == 3 * n * 4
    # rope: q and k (2, 3, 10, 32) read and written, cos and sin (10, 16) float32 read once
    assert kb.bytes_moved("rope", p, "bfloat16", "fwd") == 4 * n * 2 + 2 * 4 * 10 * 16


def test_checker_catches_a_wrong_forward_and_a_wrong_gradient(temporary_variant):
    def wrong_fwd(x):
        y = torch.nn.functional.gelu(x, approximate="tanh").clone()
        y.view(-1)[7] += 0.5
        return y

    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.nn.functional.gelu(x, approximate="tanh")

        @staticmethod
        def backward(ctx, g):
            return g  # d gelu / dx is not 1

    temporary_variant("gelu_tanh", "wrong_fwd", wrong_fwd)
    temporary_variant("gelu_tanh", "wrong_grad", WrongGrad.apply)
    p = kb.Problem(1, 5, 33)
    with pytest.raises(AssertionError, match=r"out .*1 of 165 elements mismatch.*\n.*at \(0, 0, 7\)"):
        kb.assert_variant_ok("gelu_tanh", "wrong_fwd", torch.float32, p)
    with pytest.raises(AssertionError, match=r"grad x .*elements mismatch"):
        kb.assert_variant_ok("gelu_tanh", "wrong_grad", torch.float32, p)


def test_checker_catches_an_unwritten_output(temporary_variant):
    def half_written(gate, up):
        out = torch.full_like(gate, float("nan"))  # a kernel that forgets the tail
        out[..., :-3] = torch.nn.functional.silu(gate[..., :-3]) * up[..., :-3]
        return out

    temporary_variant("swiglu", "half", half_written)
    with pytest.raises(AssertionError, match="NaN disagreements"):
        kb.assert_variant_ok("swiglu", "half", torch.float32, kb.Problem(1, 4, 20), grads=False)


def test_sweep_rows_and_triton_never_timed_on_cpu():
    rec = Recorder("test")
    p = kb.Problem(1, 16, 64)
    grid = kb.OpGrid(["swiglu"], [p], ["float32"], ["fwd", "fwd+bwd"], ["eager", "triton"])
    kb.sweep(grid, Session("cpu", rec), reps=3, budget_s=10)
    df = rec.frame()
    timed = set(df[df.metric == "time"].variant)
    assert "eager" in timed
    if lab_kernels.TRITON_INTERPRETED:
        assert "triton" not in timed
    bw = df[(df.metric == "bandwidth") & (df.variant == "eager")]
    assert len(bw) == 2 and (bw.value > 0).all()
    assert json.loads(bw.extra.iloc[0])["bytes"] == kb.bytes_moved("swiglu", p, "float32", "fwd")
    assert set(df[df.metric == "speedup_vs_eager"].value) == {1.0}
    assert set(json.loads(e)["direction"] for e in bw.extra) == {"fwd", "fwd+bwd"}


def test_sweep_checks_every_variant_before_timing_it(temporary_variant):
    """A variant that computes the wrong thing is refused before it is timed, so no lab
    reports a speed for a wrong answer."""
    temporary_variant("gelu_tanh", "fast_but_wrong", lambda x: 1.01 * torch.nn.functional.gelu(x, approximate="tanh"))
    rec = Recorder("test")
    p = kb.Problem(1, 8, 64)
    grid = kb.OpGrid(["gelu_tanh"], [p], ["float32"], ["fwd"], ["eager"])
    checked = kb.sweep(grid, Session("cpu", rec), reps=3, check=p)
    assert ("gelu_tanh", "eager", "float32") in checked
    with pytest.raises(AssertionError, match="fast_but_wrong"):
        grid = kb.OpGrid(["gelu_tanh"], [p], ["float32"], ["fwd"], ["fast_but_wrong"])
        kb.sweep(grid, Session("cpu", rec), reps=3, check=p)
    assert "fast_but_wrong" not in set(rec.frame().variant)


def test_bench_variant_refuses_the_interpreter():
    if not lab_kernels.TRITON_INTERPRETED:
        pytest.skip("Triton is compiled here; the refusal is for the CPU interpreter")
    t, mem = kb.bench_variant("rms_norm", "triton", kb.Problem(1, 4, 32), "float32", "fwd")
    assert not t.ok and "interpreter" in t.reason and mem is None


def test_correctness_table_lists_unavailable_variants_with_the_reason():
    t = kb.correctness_table("gated_residual", ["float32"], kb.Problem(1, 7, 40), variant_names=["eager", "triton"])
    assert set(t.variant) == {"eager", "triton"} and set(t.verdict) == {"PASS"}


def test_problems_from_presets():
    ps = kb.problems_for(["flux-dev"], [4096])
    assert [(p.tokens, p.hidden, p.head_dim, p.heads) for p in ps] == [(4096, 3072, 128, 24), (4096, 12288, 128, 96)]
    with pytest.raises(ValueError, match="'preset'"):
        kb.preset_dims("nope")


def test_block_providers_agree_and_eager_is_timed():
    cases = fused_blocks.block_cases(
        "tiny", kinds=("single",), providers=("eager", "triton"), img_tokens=6, txt_tokens=3
    )
    agree = fused_blocks.block_agreement(cases)
    assert {r["provider"] for r in agree} == {"eager", "triton"}
    assert all(r["max_abs_diff"] < 1e-4 for r in agree), agree
    rec = Recorder("test")
    fused_blocks.block_compare(rec, cases, reps=3)
    df = rec.frame()
    assert "eager" in set(df[(df.metric == "time") & (df.statistic == "median")].variant)


def test_benchmark_script_writes_rows(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", "benchmarks/bench_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "k.csv"
    rc = mod.main(
        [
            "--preset",
            "cpu",
            "--ops",
            "gelu_tanh",
            "--tokens",
            "16",
            "--directions",
            "fwd",
            "--reps",
            "3",
            "--no-block",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    import pandas as pd

    df = pd.read_csv(out)
    assert {"eager"} <= set(df.variant) and "bandwidth" in set(df.metric) and (df.device != "").all()
