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
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1200, cwd=ROOT)
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


class _Const:
    """A kernel that returns ``value`` everywhere, whatever its input."""

    def __init__(self, value):
        self.value = value

    def apply(self, x, w, eps, offset, mode, in_place):
        return torch.full_like(x, self.value)


@pytest.mark.parametrize(
    "value,want", [(2**-0.5, None), (1.0, "wrong result"), (0.5**0.5 * (1 + 1e-4), "wrong result")]
)
def test_the_interpreter_probe_holds_the_kernel_to_its_eps(monkeypatch, value, want):
    """On rows whose mean square equals eps the probe's reference is known by hand: every element
    a = 1e-3 with eps = 1e-6 gives a / sqrt(a^2 + eps) = 1 / sqrt(2).  A kernel that gives that
    passes; one that drops eps (1.0) or is off by 1e-4 relative is wrong."""
    randn = torch.randn
    monkeypatch.setattr(
        torch, "randn", lambda *shape, **kw: torch.full(shape, 1e-3) if shape == (4, 8) else randn(*shape, **kw)
    )
    monkeypatch.setattr(liger, "_liger", lambda: {"rms_norm": _Const(value)})
    assert liger._probe() == want


@pytest.mark.parametrize("value,want", [(0.0, None), (5e-7, None), (2e-6, "wrong result")])
def test_the_interpreter_probe_allows_a_millionth_off_where_the_answer_is_zero(monkeypatch, value, want):
    """All-zero rows normalize to zeros (0 x 1 / sqrt(eps)); there the probe allows 1e-6 absolute
    (no relative tolerance helps at zero): half of it passes, twice it is wrong."""
    randn = torch.randn
    monkeypatch.setattr(
        torch, "randn", lambda *shape, **kw: torch.zeros(shape) if shape == (4, 8) else randn(*shape, **kw)
    )
    monkeypatch.setattr(liger, "_liger", lambda: {"rms_norm": _Const(value)})
    assert liger._probe() == want


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


def test_per_sample_tables_are_doubled_per_sample(gen):
    """FLUX's per-sample tables (B, L, D/2) become Liger's (B, L, D): each half holds the same angles."""
    c, s = torch.rand(3, 5, 4, generator=gen), torch.rand(3, 5, 4, generator=gen)
    cc, ss = liger.half_tables(c, s)
    assert cc.shape == ss.shape == (3, 5, 8)
    for t, h in ((c, cc), (s, ss)):
        assert torch.equal(h[..., :4], t) and torch.equal(h[..., 4:], t)
    one, _ = liger.half_tables(c[0], s[0])  # shared tables (L, D/2): one batch row
    assert one.shape == (1, 5, 8) and torch.equal(one[0], cc[0])


def test_pairs_to_halves_by_hand():
    """One head of width 6 holding 0..5: pairs (0,1), (2,3), (4,5) go to halves [0, 2, 4 | 1, 3, 5]."""
    x = torch.arange(12.0).reshape(1, 2, 1, 6)  # (B, H, L, D), two heads
    h = liger.pairs_to_halves(x)
    assert h.tolist() == [[[[0.0, 2.0, 4.0, 1.0, 3.0, 5.0]], [[6.0, 8.0, 10.0, 7.0, 9.0, 11.0]]]]
    assert liger.halves_to_pairs(h).tolist() == x.tolist() and liger.halves_to_pairs(h).is_contiguous()


def _rms(x, w, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def test_rms_norm_default_eps_is_1e_6_where_eps_matters(gen):
    """Rows whose mean square is 1e-6 (eps's own size): 1e-6 halves it in the root, 1e-5 or 1e-7
    would move every element by far more than float32's rounding."""
    seed = _seed(gen)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 32, generator=g)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * 1e-3  # mean square exactly 1e-6 per row
    w = torch.rand(32, generator=g) + 0.5
    y = liger.liger_rms_norm(x, w)
    assert torch.allclose(y.double(), _rms(x, w, 1e-6), rtol=1e-5, atol=0), f"seed {seed}"
    assert not torch.allclose(y.double(), _rms(x, w, 1e-5), rtol=1e-2, atol=0)
    assert torch.allclose(liger.liger_rms_norm(x, w, 1e-5).double(), _rms(x, w, 1e-5), rtol=1e-5, atol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_layer_norm_modulate_per_sample_against_float64(batch, gen):
    """(1 + scale_b) * LayerNorm(x_b) + shift_b, each sample its own modulation, shift (B, D) or (B, 1, D)."""
    seed = _seed(gen)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 7, 48, generator=g) * 3 + 1
    shift, scale = torch.randn(batch, 1, 48, generator=g), torch.randn(batch, 48, generator=g)
    y = liger.liger_layer_norm_modulate(x, shift, scale)
    x64 = x.double()
    mu, var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
    want = (x64 - mu) / torch.sqrt(var + 1e-6) * (1 + scale.double()[:, None]) + shift.double()
    assert y.shape == x.shape and torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5), f"seed {seed}"


def test_rope_with_per_sample_tables_against_the_pair_rotation(gen):
    """Liger's RoPE through the adapter, tables (B, L, D/2), against FLUX's pair rotation in float64."""
    seed = _seed(gen)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    ang = torch.rand(2, 5, 4, generator=g, dtype=torch.float64) * 6
    oq, ok = liger.liger_rope(q, k, torch.cos(ang).float(), torch.sin(ang).float())
    for x, o in ((q, oq), (k, ok)):
        for b in range(2):  # the reference takes one sample's tables
            want = rope.reference_rope_one(x[b : b + 1].double(), torch.cos(ang[b]), torch.sin(ang[b]))
            assert torch.allclose(o[b : b + 1].double(), want, rtol=1e-5, atol=1e-6), f"seed {seed}"
    assert oq.shape == q.shape and oq.is_contiguous()


@pytest.mark.parametrize("head_dim,odd", [(None, False), (2, False), (16, False), (1, True), (15, True)])
def test_rope_check_refuses_only_odd_head_dims(head_dim, odd):
    why = get_variant("rope", "liger").why_not("cpu", torch.float32, head_dim=head_dim)
    if odd:
        assert why == f"rope/liger: head_dim={head_dim} is odd; RoPE rotates halves of an even head dim"
    else:
        assert why is None


def test_an_import_failure_is_the_reason_with_its_first_line(monkeypatch):
    def broken():
        raise ImportError("no module named npu\nTraceback ...")

    monkeypatch.setattr(liger, "_liger", broken)
    monkeypatch.setattr(liger, "LIGER_VERSION", "9.9.9")
    assert liger.liger_import_why_not() == "liger-kernel 9.9.9 does not import: ImportError: no module named npu"
    assert liger.liger_why_not("cuda", torch.float32) == liger.liger_import_why_not()


def test_on_a_gpu_only_the_row_width_rule_applies(monkeypatch):
    """The interpreter's probes are for CPU: a GPU device never runs them."""
    monkeypatch.setattr(liger, "interpreter_why_not", lambda: pytest.fail("probed on a GPU"))
    monkeypatch.setattr(liger, "interpreter_bf16_why_not", lambda: pytest.fail("probed on a GPU"))
    assert liger.liger_why_not("cuda", torch.bfloat16, (4, 64), bf16_arith=True) is None
    wide = liger.C.MAX_ROW + 1
    assert liger.liger_why_not("cuda", torch.float32, (4, wide)) == (
        f"liger/triton: rows of {wide} elements exceed the single-pass limit of {liger.C.MAX_ROW}"
    )
    assert liger.liger_why_not("cuda", torch.float32, (4, liger.C.MAX_ROW)) is None  # the limit itself fits


def test_the_interpreter_verdict_applies_each_shim_only_for_its_failure(monkeypatch):
    """A float-argument failure gets the fp32-scalar shim, a libdevice one the tl.math shim; the note
    names each with the failure it fixed; a failure no shim fixes is the verdict, with no note."""
    probes = iter(["AttributeError: 'float' object has no attribute 'to'", "TypeError: cannot convert None", None])
    monkeypatch.setattr(liger, "_SHIMS", {})
    monkeypatch.setattr(liger, "_probe", lambda: next(probes))
    monkeypatch.setattr(liger, "_wrap_float_args", lambda: True)
    monkeypatch.setattr(liger, "_libdevice_from_tl_math", lambda: ["rms_norm.rsqrt"])
    assert liger.interpreter_why_not() is None
    assert liger.interpreter_note() == (
        "float arguments passed as fp32 scalars (without: AttributeError: 'float' object has no attribute 'to'); "
        "libdevice rms_norm.rsqrt taken from tl.math (without: TypeError: cannot convert None)"
    )
    monkeypatch.setattr(liger, "_probe", lambda: pytest.fail("probed twice"))
    assert liger.interpreter_why_not() is None  # cached for the process

    monkeypatch.setattr(liger, "_SHIMS", {})
    monkeypatch.setattr(liger, "_probe", lambda: "RuntimeError: boom")
    assert (
        liger.interpreter_why_not()
        == "Triton's interpreter cannot run Liger's kernels here (a probe raised RuntimeError: boom)"
    )
    assert liger.interpreter_note() == ""
    monkeypatch.setattr(liger, "_SHIMS", {})  # a shim applied, then another failure: no note, that failure
    probes = iter(["AttributeError: 'float' object has no attribute 'to'", "RuntimeError: still"])
    monkeypatch.setattr(liger, "_probe", lambda: next(probes))
    assert liger.interpreter_why_not().endswith("(a probe raised RuntimeError: still)")
    assert liger.interpreter_note() == ""
    monkeypatch.setattr(liger, "_SHIMS", {})
    monkeypatch.setattr(liger, "_wrap_float_args", lambda: False)  # no hook: the first failure stands
    monkeypatch.setattr(liger, "_probe", lambda: "AttributeError: 'float' object has no attribute 'to'")
    assert "'float' object has no attribute" in liger.interpreter_why_not() and liger.interpreter_note() == ""


def test_the_bfloat16_probe_reports_what_it_got(monkeypatch):
    """Its verdict is None when the product is exact, else the values got beside the right ones."""
    monkeypatch.setattr(liger, "_SHIMS", {})
    got = liger.interpreter_bf16_why_not()
    want = [3.0, -1.0, -1.0, 3.0]  # 1.5*2, -2*0.5, 0.25*-4, 3*1: exact in bfloat16
    assert got is None or (got.startswith("a bfloat16 x bfloat16 probe gave ") and f"for {want}" in got)
    assert liger.interpreter_bf16_why_not() == got  # cached


def test_the_bfloat16_probe_kernel_multiplies_and_masks():
    """The probe's kernel in float32 (which the interpreter multiplies right): c = a * b on the first
    n elements, the masked rest never written."""
    a = torch.tensor([1.5, -2.0, 0.25, 3.0])
    b = torch.tensor([2.0, 0.5, -4.0, 7.0])
    c = torch.full_like(a, float("nan"))
    liger._bf16_mul_kernel[(1,)](a, b, c, 3, BLOCK=4)
    assert c[:3].tolist() == [3.0, -1.0, -1.0] and torch.isnan(c[3])
