"""lab_kernels.liger: what is specific to the Liger-Kernel variants (their float64 checks are in
tests/unit/fused/test_ops.py with every other variant's): the RoPE layout adapter, which inputs
Liger's kernels overwrite, the capability reasons, and that the interpreter shims leave
perflab's own kernels' bits unchanged."""

import os
import subprocess
import sys

import pytest
import torch

from lab_kernels import get_variant, liger, rope
from lab_utils.fused import ops as fused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _seed(gen):
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def test_pair_half_layout_round_trip_and_rotation(gen):
    """The adapter's layout change is exact both ways, and rotating halves with duplicated tables
    is the pair rotation (written out here, float64, no kernel)."""
    x = torch.randn(2, 3, 5, 12, generator=gen, dtype=torch.float64)
    h = liger.pairs_to_halves(x)
    assert h.shape == x.shape and h.transpose(1, 2).is_contiguous()
    assert torch.equal(liger.halves_to_pairs(h), x)
    assert torch.equal(h[..., :6], x[..., 0::2]) and torch.equal(h[..., 6:], x[..., 1::2])
    ang = torch.rand(5, 6, generator=gen, dtype=torch.float64) * 10
    cos, sin = liger.half_tables(torch.cos(ang), torch.sin(ang))
    assert cos.shape == (1, 5, 12)
    x1, x2 = h[..., :6], h[..., 6:]
    rotated = h * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]  # Llama's rotate_half form
    want = rope.reference_rope_one(x, torch.cos(ang), torch.sin(ang))
    assert torch.allclose(liger.halves_to_pairs(rotated), want, rtol=0, atol=1e-12)


def _fwd_bwd(op, args, gen):
    out = fused.as_tuple(get_variant(op, "liger")(*args))
    douts = [torch.randn(o.shape, generator=gen) for o in out]
    kept = [d.clone() for d in douts]
    torch.autograd.grad(out, [a for a in args if a.requires_grad], douts)
    return douts, kept


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm_modulate", "rope"])
def test_adapters_leave_inputs_and_incoming_gradient_alone(op, gen):
    """rms_norm runs with in_place=False, the others never hand Liger a caller's buffer to write."""
    args, inp, seed = fused.make_inputs(op, fused.Problem(1, 9, 64, head_dim=16), torch.float32, seed=_seed(gen))
    before = [a.detach().clone() for a in args]
    douts, kept = _fwd_bwd(op, args, gen)
    for n, a, b in zip(inp.names, args, before):
        assert torch.equal(a.detach(), b), f"{op}/liger overwrote input {n} (seed {seed})"
    for d, k in zip(douts, kept):
        assert torch.equal(d, k), f"{op}/liger overwrote the incoming gradient (seed {seed})"


def test_swiglu_backward_overwrites_its_inputs_with_the_gradients(gen):
    """Liger's SwiGLU backward stores da, db over the saved a, b (its memory saving, documented in
    lab_kernels.liger): after a backward the caller's gate and up hold the gradients."""
    args, _, seed = fused.make_inputs("swiglu", fused.Problem(1, 9, 64), torch.float32, seed=_seed(gen))
    gate0, up0 = (a.detach().clone() for a in args)
    out = get_variant("swiglu", "liger")(*args)
    dc = torch.randn(out.shape, generator=gen)
    dgate, dup = torch.autograd.grad(out, args, dc)
    assert not torch.equal(args[0].detach(), gate0), f"seed {seed}"
    assert torch.equal(args[0].detach(), dgate) and torch.equal(args[1].detach(), dup), f"seed {seed}"
    sig = torch.sigmoid(gate0)
    assert torch.allclose(dup, dc * gate0 * sig, rtol=1e-5, atol=1e-6)
    assert torch.allclose(dgate, dc * up0 * sig * (1 + gate0 * (1 - sig)), rtol=1e-5, atol=1e-6)


def test_swiglu_backward_is_not_timed_on_reused_inputs(monkeypatch):
    """Timing repeats calls on the same inputs, which Liger's SwiGLU backward overwrites: its fwd+bwd
    and bwd are refused with the reason (its forward is timed where Triton is)."""
    from lab_kernels import registry

    v = get_variant("swiglu", "liger")
    assert "overflow" in v.extra["backward_overwrites_inputs"]
    monkeypatch.setattr(registry.Variant, "timeable", lambda self, device: True)  # as on a GPU
    monkeypatch.setattr(registry.Variant, "why_not", lambda self, *a, **k: None)
    for direction in ("fwd+bwd", "bwd"):
        t, mem = fused.bench_variant("swiglu", "liger", fused.Problem(1, 8, 64), torch.float32, direction)
        assert not t.ok and "writes the gradients over its inputs" in t.reason and mem is None


def test_reasons_when_liger_is_missing_or_a_head_dim_is_odd(monkeypatch):
    assert get_variant("rope", "liger").why_not("cpu", torch.float32, head_dim=62) is None
    why = get_variant("rope", "liger").why_not("cpu", torch.float32, head_dim=7)
    assert "head_dim=7 is odd" in why
    monkeypatch.setattr(liger, "LIGER_VERSION", None)
    for op in ("rms_norm", "layer_norm_modulate", "swiglu", "rope"):
        assert "liger-kernel not installed" in get_variant(op, "liger").why_not("cpu", torch.float32)
    assert get_variant("rms_norm", "liger").why_not("cpu", torch.float64).startswith("rms_norm/liger takes dtypes")


def test_liger_variants_are_never_timed_on_cpu():
    for op in ("rms_norm", "layer_norm_modulate", "swiglu", "rope"):
        v = get_variant(op, "liger")
        assert v.kind == "triton" and v.extra["library"] == "liger-kernel" and not v.timeable("cpu")
        t, mem = fused.bench_variant(op, "liger", fused.Problem(1, 8, 64, head_dim=16), torch.float32, "fwd")
        assert not t.ok and "interpreter" in t.reason and mem is None


def test_every_excluded_op_says_why():
    assert {"fused_add_rms_norm", "modulated_rms_norm", "geglu"} <= set(liger.EXCLUDED)
    assert all(len(why) > 20 for why in liger.EXCLUDED.values())


SHIM_SCRIPT = r"""
import torch, lab_kernels
from lab_kernels import liger, rms_norm, layer_norm_modulate as lnm
assert lab_kernels.TRITON_INTERPRETED
g = torch.Generator().manual_seed(0)
x, w = torch.randn(3, 5, 40, generator=g), torch.randn(40, generator=g)
sh, sc = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
def run():
    y, r = rms_norm.rms_norm_forward(x, w, 1e-6)
    z, m, s = lnm.layer_norm_modulate_forward(x, sh, sc, 1e-6)
    return [y, r, z, m, s]
before = run()
assert liger.interpreter_why_not() is None and liger.interpreter_note(), liger.interpreter_note()
after = run()
assert all(torch.equal(a, b) for a, b in zip(before, after))
print("same bits;", liger.interpreter_note())
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shims exist for the CPU interpreter only")
def test_interpreter_shims_leave_perflabs_kernels_bit_identical(tmp_path):
    """The float-argument and libdevice shims Liger needs in the interpreter are applied for the
    process; perflab's own kernels (which take eps as a float) give the same bits after them."""
    script = tmp_path / "shim.py"
    script.write_text(SHIM_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and "same bits" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "fp32 scalars" in r.stdout and "tl.math" in r.stdout


class _Fake:
    """Liger's rms_norm as the probe calls it, returning ``scale`` times the true RMSNorm (or raising)."""

    def __init__(self, scale=1.0, error=None):
        self.scale, self.error = scale, error

    def apply(self, x, w, eps, offset, mode, in_place):
        if self.error is not None:
            raise self.error
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w * self.scale


@pytest.mark.parametrize("scale,want", [(1.0, None), (1 + 1e-4, "wrong result"), (1 - 1e-4, "wrong result")])
def test_the_interpreter_probe_refuses_a_kernel_a_little_off(monkeypatch, scale, want):
    """A kernel off by 1e-4 relative is wrong (the probe holds it to 1e-5 of the float32 reference); the
    exact one passes; one that raises gives its error's type and first line."""
    monkeypatch.setattr(liger, "_liger", lambda: {"rms_norm": _Fake(scale)})
    assert liger._probe() == want
    monkeypatch.setattr(liger, "_liger", lambda: {"rms_norm": _Fake(error=TypeError("bad arg\nmore"))})
    assert liger._probe() == "TypeError: bad arg"


def test_the_capability_check_returns_each_reason_it_finds(monkeypatch):
    """Liger missing: that reason first; on the interpreter, its probe's reason; a bfloat16-arithmetic
    kernel in bfloat16 when the interpreter multiplies bfloat16 wrong: that; else the row-width rule."""
    monkeypatch.setattr(liger, "liger_import_why_not", lambda: "liger-kernel is not installed")
    assert liger.liger_why_not("cpu", torch.float32, (4, 8)) == "liger-kernel is not installed"
    monkeypatch.setattr(liger, "liger_import_why_not", lambda: None)
    monkeypatch.setattr(liger.C, "interpreted", lambda: True)
    monkeypatch.setattr(liger.C, "interpreter_why_not", lambda: None)
    monkeypatch.setattr(liger, "interpreter_why_not", lambda: "the probe raised X")
    assert liger.liger_why_not("cpu", torch.float32, (4, 8)) == "the probe raised X"
    monkeypatch.setattr(liger, "interpreter_why_not", lambda: None)
    monkeypatch.setattr(liger, "interpreter_bf16_why_not", lambda: "a bfloat16 probe gave [1.0]")
    why = liger.liger_why_not("cpu", torch.bfloat16, (4, 8), bf16_arith=True)
    assert why is not None and "bfloat16" in why and "GPU" in why
    assert liger.liger_why_not("cpu", torch.bfloat16, None, bf16_arith=False) is None
    assert liger.liger_why_not("cpu", torch.float32, (4, 8)) == liger.C.row_width_reason("liger", (4, 8))
