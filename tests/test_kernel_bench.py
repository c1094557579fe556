"""kernel_bench: bytes formulas, the correctness checker catches wrong variants, sweep rows,
block-level agreement, config validation."""

import json

import pytest
import torch

import lab_kernels
from lab_kernels.registry import _REGISTRY, Variant, get_variant
from lab_utils import fused as kb
from lab_utils.config import ConfigError
from lab_utils.records import Recorder


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


def test_checker_catches_a_wrong_forward_and_a_wrong_gradient(monkeypatch):
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

    get_variant("gelu_tanh", "eager")  # load the op's registry entries
    for name, fn in (("wrong_fwd", wrong_fwd), ("wrong_grad", WrongGrad.apply)):
        monkeypatch.setitem(_REGISTRY["gelu_tanh"], name, Variant("gelu_tanh", name, fn, "eager"))
    p = kb.Problem(1, 5, 33)
    with pytest.raises(AssertionError, match=r"out .*1 of 165 elements mismatch.*\n.*at \(0, 0, 7\)"):
        kb.assert_variant_ok("gelu_tanh", "wrong_fwd", torch.float32, p)
    with pytest.raises(AssertionError, match=r"grad x .*elements mismatch"):
        kb.assert_variant_ok("gelu_tanh", "wrong_grad", torch.float32, p)


def test_checker_catches_an_unwritten_output(monkeypatch):
    def half_written(gate, up):
        out = torch.full_like(gate, float("nan"))  # a kernel that forgets the tail
        out[..., :-3] = torch.nn.functional.silu(gate[..., :-3]) * up[..., :-3]
        return out

    get_variant("swiglu", "eager")
    monkeypatch.setitem(_REGISTRY["swiglu"], "half", Variant("swiglu", "half", half_written, "eager"))
    with pytest.raises(AssertionError, match="NaN disagreements"):
        kb.assert_variant_ok("swiglu", "half", torch.float32, kb.Problem(1, 4, 20), grads=False)


def test_sweep_rows_and_triton_never_timed_on_cpu():
    rec = Recorder("test")
    p = kb.Problem(1, 16, 64)
    kb.sweep(
        rec, ["swiglu"], [p], ["float32"], ["fwd", "fwd+bwd"], variant_names=["eager", "triton"], reps=3, budget_s=10
    )
    df = rec.frame()
    timed = set(df[df.metric == "time"].variant)
    assert "eager" in timed
    if lab_kernels.TRITON_INTERPRETED:
        assert "triton" not in timed
    bw = df[(df.metric == "bandwidth") & (df.variant == "eager")]
    assert len(bw) == 2 and (bw.value > 0).all()
    assert json.loads(bw.extra.iloc[0])["bytes"] == kb.bytes_moved("swiglu", p, "float32", "fwd")
    assert set(df[df.metric == "speedup_vs_eager"].value) == {1.0}
    sw = kb.sweep_frame(df)
    assert set(sw.direction) == {"fwd", "fwd+bwd"}


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
    cases = kb.block_cases("tiny", kinds=("single",), providers=("eager", "triton"), img_tokens=6, txt_tokens=3)
    agree = kb.block_agreement(cases)
    assert {r["provider"] for r in agree} == {"eager", "triton"}
    assert all(r["max_abs_diff"] < 1e-4 for r in agree), agree
    rec = Recorder("test")
    kb.block_compare(rec, cases, reps=3)
    df = rec.frame()
    assert "eager" in set(df[(df.metric == "time") & (df.statistic == "median")].variant)


def test_config_refuses_bad_values_naming_the_parameter():
    with pytest.raises(ConfigError, match="'op'"):
        kb.FusedKernelsConfig(op="layernorm")
    with pytest.raises(ConfigError, match="'directions'"):
        kb.FusedKernelsConfig(directions=["forward"])
    with pytest.raises(ConfigError, match="'check_head_dim'"):
        kb.FusedKernelsConfig(check_head_dim=63)
    with pytest.raises(ConfigError, match="'sweep_variants'"):
        kb.FusedKernelsConfig(sweep_variants=["fast"])
    with pytest.raises(ConfigError, match="'block_providers'"):
        kb.FusedKernelsConfig(block_providers=["xla"])
    assert kb.FusedKernelsConfig().check_problem.hidden == 781


GPU_PATH_SCRIPT = r"""
import lab_kernels, torch
assert not lab_kernels.TRITON_INTERPRETED
import lab_kernels._common as C
from lab_kernels import rms_norm, layer_norm_modulate, gated_residual, gelu_tanh, swiglu, rope, qk_norm_rope
from torch._subclasses.fake_tensor import FakeTensorMode
C._sm_count = lambda idx: 132                 # no GPU to ask; the trace only needs a number
bf = torch.bfloat16
with FakeTensorMode():
    e = lambda *s, dt=bf: torch.empty(*s, dtype=dt, device="cuda")
    x, w = e(2, 37, 781), e(781)
    y, r = rms_norm.rms_norm_forward(x, w); dx, dw = rms_norm.rms_norm_backward(y, x, w, r)
    assert (y.shape, r.shape, dx.shape, dw.shape) == (x.shape, (74,), x.shape, w.shape) and y.dtype == bf
    sh, sc = e(2, 781), e(2, 781)
    y, m, r = layer_norm_modulate.layer_norm_modulate_forward(x, sh, sc)
    g = layer_norm_modulate.layer_norm_modulate_backward(y, x, sh, sc, m, r)
    assert [t.shape for t in g] == [x.shape, sh.shape, sc.shape]
    o = gated_residual.gated_residual_forward(x, sh, x); g = gated_residual.gated_residual_backward(o, x, sh, x)
    assert [t.shape for t in g] == [x.shape, x.shape, sh.shape]
    o = gelu_tanh.gelu_tanh_forward(x); assert gelu_tanh.gelu_tanh_backward(o, x).shape == x.shape
    o = swiglu.swiglu_forward(x, x); assert [t.shape for t in swiglu.swiglu_backward(o, x, x)] == [x.shape] * 2
    q, cos, sin = e(2, 3, 37, 62), e(37, 31, dt=torch.float32), e(37, 31, dt=torch.float32)
    o = rope.rope_forward(q, cos, sin); assert rope.rope_backward(o, cos, sin).shape == q.shape
    qw = e(62)
    o, r = qk_norm_rope.qk_norm_rope_forward(q, qw, cos, sin); g = qk_norm_rope.qk_norm_rope_backward(o, q, qw, cos, sin, r)
    assert [t.shape for t in g] == [q.shape, qw.shape] and r.shape == (2 * 3 * 37,)
print("GPU-path ops traced")
"""


def test_gpu_registration_traces_with_fake_cuda_tensors(tmp_path):
    """Without a GPU, import the kernels as a GPU machine would (TRITON_INTERPRET=0: the
    host functions become torch.library.triton_op with wrap_triton launches) and trace every
    forward and backward host op on fake CUDA tensors: registration, launch grids and output
    shapes/dtypes of the GPU path run here, only the kernels themselves do not."""
    import os
    import subprocess
    import sys

    script = tmp_path / "gpu_path.py"
    script.write_text(GPU_PATH_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert r.returncode == 0 and "GPU-path ops traced" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


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
