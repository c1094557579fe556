"""Attention: the Triton kernel (through the interpreter on CPU), every path of
lab_utils.attention.attend against the float64 reference (output and dq/dk/dv), packed varlen
equal to each sequence alone, the registry, and bad input named by parameter.

Shapes are small and irregular (the interpreter is slow); tolerances come from
lab_utils.core.checks (gradients: GRAD_SCALE x the dtype's tolerance)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import lab_kernels
from lab_kernels import attention as ka
from lab_utils.attention import attend as A
from lab_utils.attention import masks as M
from lab_utils.core.checks import assert_close, poison_, rel_error, tolerance
from lab_utils.core.config import ConfigError
from lab_utils.model import build_model
from lab_utils.model.train import synthetic_batch


@pytest.fixture(autouse=True)
def _seed_global_rng(gen):  # inputs and nn.Linear init draw from it: the seed gen reports replays them
    torch.manual_seed(gen.initial_seed())


CUDA = torch.cuda.is_available()


def _ref_grads(q, k, v, do, **kw):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = ka.reference_attention(q64, k64, v64, **kw)
    return (out, *torch.autograd.grad(out, (q64, k64, v64), do.double()))


def _rand(shape, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype)


#: Norm-wise bounds ||a - e|| / ||e|| in units of the dtype's unit roundoff u.  The per-element
#: tolerance (4x the dtype's for gradients: 6.4% in bfloat16) lets a systematic percent-level
#: error through; norm-wise a rounded result is off by about u (measured on CPU: at most 1.1 u
#: for the output and 1.65 u for dq/dk/dv, the Triton interpreter truncating to bfloat16), so a
#: 1% error in bfloat16 (2.6 u) or 0.13% in float16 (2.7 u) fails these.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
NORM_BOUND_U = {"out": 2.0, "dq": 2.5, "dk": 2.5, "dv": 2.5}


def _check_all(got, want, dtype):
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        scale = 1.0 if name == "out" else A.GRAD_SCALE[dtype]
        atol, rtol = tolerance(dtype, scale)
        assert_close(a, e, atol=atol, rtol=rtol, name=name)
        if dtype in UNIT_ROUNDOFF:
            err = rel_error(a, e) / UNIT_ROUNDOFF[dtype]
            assert err <= NORM_BOUND_U[name], f"{name}: ||a - e|| / ||e|| = {err:.2f} u > {NORM_BOUND_U[name]} u"


# --------------------------------------------------------------------------- Triton kernel (interpreter on CPU)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_dense_matches_float64_reference(head_dim, causal):
    dev = "cuda" if CUDA else "cpu"
    B, H, L = 2, 2, 97 if head_dim == 64 else 71
    q, k, v, do = (_rand((B, H, L, head_dim), device=dev) for _ in range(4))
    # poisoned output / gradient buffers: an unwritten element would stay NaN
    out = poison_(torch.empty_like(q))
    o, lse = ka.attention_forward(q, k, v, causal=causal, out=out)
    assert o.data_ptr() == out.data_ptr()
    grads = tuple(poison_(torch.empty_like(q)) for _ in range(3))
    dq, dk, dv = ka.attention_backward(do, q, k, v, o, lse, causal=causal, grads=grads)
    _check_all((o, dq, dk, dv), _ref_grads(q, k, v, do, causal=causal), torch.float32)


def test_triton_autograd_strided_input_bf16():
    """(B, L, H, D).transpose(1, 2) views go in without a copy; bf16 through autograd."""
    dev = "cuda" if CUDA else "cpu"
    B, L, H, D = 1, 83, 2, 64
    x = [_rand((B, L, H, D), torch.bfloat16, dev).requires_grad_() for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in x)
    do = _rand((B, H, L, D), torch.bfloat16, dev)
    o = ka.attention(q, k, v, causal=True)
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    _check_all(got, _ref_grads(q, k, v, do, causal=True), torch.bfloat16)


@pytest.mark.parametrize("causal,head_dim", [(True, 64), (False, 128)])
def test_triton_varlen_equals_each_sequence_alone(causal, head_dim):
    dev = "cuda" if CUDA else "cpu"
    lengths = [37, 97, 58]
    T, H = sum(lengths), 2
    cu = torch.tensor([0, 37, 134, 192], dtype=torch.int32, device=dev)
    q, k, v, do = (_rand((T, H, head_dim), device=dev) for _ in range(4))
    out = poison_(torch.empty_like(q))
    o, lse = ka.attention_forward(q, k, v, causal=causal, cu_seqlens=cu, out=out)
    grads = tuple(poison_(torch.empty_like(q)) for _ in range(3))
    dq, dk, dv = ka.attention_backward(do, q, k, v, o, lse, causal=causal, cu_seqlens=cu, grads=grads)
    _check_all((o, dq, dk, dv), _ref_grads(q, k, v, do, causal=causal, cu_seqlens=cu), torch.float32)
    # each sequence alone through the dense kernel gives the same rows
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = [t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v, do)]
        oa, la = ka.attention_forward(*one[:3], causal=causal)
        ga = ka.attention_backward(one[3], *one[:3], oa, la, causal=causal)
        for name, packed, alone in zip(("out", "dq", "dk", "dv"), (o, dq, dk, dv), (oa, *ga)):
            assert_close(packed[s:e], alone[0].transpose(0, 1), dtype=torch.float32, name=f"{name}[{s}:{e}]")


def test_kernel_registry_variants():
    names = {v.name for v in lab_kernels.variants("attention", include_unavailable=True)}
    assert {"reference", "eager", "triton"} <= names
    tri = lab_kernels.get_variant("attention", "triton")
    assert "head dims" in tri.why_not("cpu", torch.float32, head_dim=96)
    assert "masks" in tri.why_not("cpu", torch.float32, mask="sliding_window")
    assert tri.why_not("cpu", torch.float64) is not None
    assert tri.timeable("cpu") is False
    assert tri.why_not("cpu", torch.bfloat16, head_dim=128, mask="causal") is None


def test_kernel_bad_input_names_parameter():
    q = _rand((5, 2, 64))
    with pytest.raises(ValueError, match="'cu_seqlens'.*increasing"):
        ka.attention(q, q, q, cu_seqlens=torch.tensor([0, 3, 3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="'cu_seqlens'.*end at the packed length 5"):
        ka.attention(q, q, q, cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32))
    x = _rand((1, 2, 8, 64))
    with pytest.raises(ValueError, match="'k'"):
        ka.attention(x, _rand((1, 2, 9, 64)), x)
    with pytest.raises(ValueError, match="'v'.*dtype"):
        ka.attention(x, x, x.half())
    with pytest.raises(ValueError, match="'q'.*head dim 96"):
        y = _rand((1, 2, 8, 96))
        ka.attention(y, y, y)


# --------------------------------------------------------------------------- every path vs the float64 reference
CPU_PATHS = ["sdpa", "math", "flash", "flex_eager", "triton"]
MASKS = ["full", "causal", "sliding_window", "document", "prefix_lm", "mmdit", "neighborhood"]


@pytest.mark.parametrize("mask_name", MASKS)
def test_every_path_matches_reference(mask_name, gen):
    """Output and dq/dk/dv of each path that honours the mask; paths that cannot (or have
    no backward here) are reported as skipped with a reason, never compared silently."""
    L = 97
    mask = M.make_mask(mask_name, L)
    paths = [p for p in CPU_PATHS if p != "triton" or mask.kind != "custom"]
    inputs = A.random_qkv(1, 2, L, 64, seed=gen.initial_seed())  # fresh random inputs, seed reported on failure
    ran = 0
    for path in paths + ["efficient", "cudnn", "flash_attn"]:
        for r in A.check_path(path, inputs, mask=mask):
            if r.ok is None:
                assert r.note, f"{path}:{r.tensor} skipped without a reason"
                continue
            assert r.ok, r.note
            ran += 1
    assert ran >= 4 * 3 + 1  # sdpa, math, flash fwd+bwd at least, flex_eager fwd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_paths(dtype, gen):
    inputs = A.random_qkv(2, 2, 67, 64, dtype=dtype, seed=gen.initial_seed())
    for path in ("sdpa", "math", "flash", "triton"):
        res = A.check_path(path, inputs, mask="causal")
        assert all(r.ok for r in res), [r.note for r in res if not r.ok]


@pytest.mark.parametrize("mask_name", ["causal", "sliding_window"])
def test_packed_paths_equal_each_sequence_alone(mask_name, gen):
    lengths = [41, 97, 64]
    mask = M.causal() if mask_name == "causal" else M.sliding_window(7)
    inp = A.random_qkv(0, 2, 0, 64, lengths=lengths, requires_grad=False, seed=gen.initial_seed())
    cu = inp["cu_seqlens"]
    paths = ["reference", "sdpa", "math", "flash", "flex_eager"] + (["triton"] if mask.kind != "custom" else [])
    for path in paths:
        packed = A.attend(inp["q"], inp["k"], inp["v"], path=path, mask=mask, cu_seqlens=cu)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            one = [inp[n][s:e].transpose(0, 1).unsqueeze(0) for n in ("q", "k", "v")]
            alone = A.attend(*one, path="reference", mask=mask)[0].transpose(0, 1)
            assert_close(packed[s:e], alone, dtype=torch.float32, name=f"{path} packed[{s}:{e}]")
        # and the reference itself vs float64 with full gradients through check_path
    res = A.check_path("sdpa", A.random_qkv(0, 2, 0, 64, lengths=lengths, seed=gen.initial_seed() + 1), mask=mask)
    assert all(r.ok for r in res)


def test_model_seam_boolean_key_mask():
    """lab_utils.model.mmdit passes a (B, 1, 1, L) key-padding mask, SDPA's convention."""
    B, H, L, D = 2, 2, 45, 64
    q, k, v = (_rand((B, H, L, D)) for _ in range(3))
    keys = torch.ones(B, L, dtype=torch.bool)
    keys[0, 5:12] = False
    m = keys[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
    for path in ("sdpa", "math", "flash", "reference", "flex_eager"):
        assert_close(A.attend(q, k, v, path=path, mask=m), want, dtype=torch.float32, name=path)
    assert set(A.PATHS) == set(A.REGISTRY)


def test_path_table_lists_reasons():
    t = A.path_table("cpu", torch.float32, 64)
    assert set(t.path) == set(A.PATHS)
    assert (t[~t.supported].why_not.str.len() > 0).all()
    row = t[(t.path == "triton") & (t.mask == "custom")]
    assert not row.supported.any()
    assert t[(t.path == "reference")].supported.all()
    assert "math" in A.available_paths("cpu", torch.float32, mask="custom", backward=True)


# --------------------------------------------------------------------------- bad input
def _qkv(shape=(1, 2, 16, 64), dtype=torch.float32):
    return [_rand(shape, dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "case,param",
    [
        ("k_shape", "k"),
        ("v_len", "v"),
        ("v_dtype", "v"),
        ("q_rank", "q"),
        ("unknown_path", "path"),
        ("mask_float", "mask"),
        ("mask_shape", "mask"),
        ("mask_len", "mask"),
        ("causal_cross", "mask"),
        ("triton_custom", "mask"),
        ("triton_dtype", "q"),
        ("triton_headdim", "q"),
        ("flex_backward_cpu", "path"),
        ("cu_not_increasing", "cu_seqlens"),
        ("cu_bad_sum", "cu_seqlens"),
        ("cu_not_zero", "cu_seqlens"),
        ("packed_tensor_mask", "mask"),
        ("packed_shape", "k"),
        ("scale", "scale"),
    ],
)
def test_bad_input_raises_naming_parameter(case, param):
    q, k, v = _qkv()
    kw: dict = {}
    path = "sdpa"
    if case == "k_shape":
        k = _rand((1, 3, 16, 64))
    elif case == "v_len":
        v = _rand((1, 2, 17, 64))
    elif case == "v_dtype":
        v = v.double()
    elif case == "q_rank":
        q = q[0]
    elif case == "unknown_path":
        path = "fast"
    elif case == "mask_float":
        kw["mask"] = torch.zeros(16, 16)
    elif case == "mask_shape":
        kw["mask"] = torch.ones(15, 16, dtype=torch.bool)
    elif case == "mask_len":
        kw["mask"] = M.document([5, 6])
    elif case == "causal_cross":
        k, v = _rand((1, 2, 20, 64)), _rand((1, 2, 20, 64))
        kw["mask"] = "causal"
    elif case == "triton_custom":
        path, kw["mask"] = "triton", M.sliding_window(3)
    elif case == "triton_dtype":
        path = "triton"
        q, k, v = (t.double() for t in (q, k, v))
    elif case == "triton_headdim":
        path = "triton"
        q, k, v = _qkv((1, 2, 16, 96))
    elif case == "flex_backward_cpu":
        if CUDA:
            pytest.skip("flex has a backward on CUDA")
        path = "flex_eager"
        q.requires_grad_()
    elif case.startswith("cu_") or case.startswith("packed"):
        q, k, v = _qkv((10, 2, 64))
        kw["cu_seqlens"] = {"cu_not_increasing": [0, 6, 4, 10], "cu_bad_sum": [0, 4, 9], "cu_not_zero": [1, 4, 10]}.get(
            case, [0, 4, 10]
        )
        kw["cu_seqlens"] = torch.tensor(kw["cu_seqlens"], dtype=torch.int32)
        if case == "packed_tensor_mask":
            kw["mask"] = torch.ones(10, 10, dtype=torch.bool)
        if case == "packed_shape":
            k = _rand((11, 2, 64))
    elif case == "scale":
        kw["scale"] = -1.0
    with pytest.raises(ConfigError) as ei:
        A.attend(q, k, v, path=path, **kw)
    assert ei.value.param == param, str(ei.value)
    assert repr(param) in str(ei.value)


# --------------------------------------------------------------------------- compiled flex
def test_compiled_flex_matches_reference(gen):
    """torch.compile(flex_attention) with the MMDiT mask against float64: forward and the three
    gradients on CUDA, the forward on CPU (flex's compiled backward is CUDA-only). Its first compile
    took 14 s cold on the idle 2-core machine (fresh inductor cache), so it runs in ``make test``."""
    dev = "cuda" if CUDA else "cpu"
    inputs = A.random_qkv(1, 2, 128 if CUDA else 97, 64, device=dev, seed=gen.initial_seed())
    res = A.check_path("flex", inputs, mask=M.make_mask("mmdit", inputs["q"].shape[2]))
    assert [r.tensor for r in res] == ["out", "dq", "dk", "dv"], res
    assert res[0].ok is True, res[0].note
    if CUDA:
        _assert_ran_and_matched(res, "compiled flex, mmdit mask")
    else:  # the gradients are skipped with the reason, never passed off as checked
        assert [(r.ok, r.note) for r in res[1:]] == [(None, "path 'flex' has no backward on cpu")] * 3


#: paths that must run (forward and backward) on a Hopper GPU with the pinned torch
GPU_DENSE_PATHS = ("sdpa", "flash", "efficient", "cudnn", "triton")
GPU_PACKED_PATHS = ("triton", "flex")


def _assert_ran_and_matched(results, what: str) -> None:
    """Every tensor (out, dq, dk, dv) was computed and matched: a skipped one is a failure."""
    assert len(results) == 4, f"{what}: {[(r.tensor, r.ok) for r in results]}"
    bad = [
        (r.tensor, "skipped" if r.ok is None else "mismatch", r.note.splitlines()[0] if r.note else "")
        for r in results
        if r.ok is not True
    ]
    assert not bad, f"{what}: {bad}"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: GPU paths at real tile sizes")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_paths_at_tile_sizes(dtype, gen):
    """Each named path must run here (a path that skips fails the test); flash-attn is
    named only when the package is installed."""
    lengths = [1000, 3001, 517]
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    seed = gen.initial_seed()
    for mask in ("full", "causal"):
        inputs = A.random_qkv(2, 4, 1531, 128, dtype=dtype, device="cuda", seed=seed)
        for path in GPU_DENSE_PATHS + (("flash_attn",) if has_flash_attn else ()):
            _assert_ran_and_matched(A.check_path(path, inputs, mask=mask), f"{path} dense {mask} {dtype}")
        packed = A.random_qkv(0, 4, 0, 64, dtype=dtype, device="cuda", lengths=lengths, seed=seed + 1)
        for path in GPU_PACKED_PATHS + (("flash_attn",) if has_flash_attn else ()):
            _assert_ran_and_matched(A.check_path(path, packed, mask=mask), f"{path} packed {mask} {dtype}")
    if not has_flash_attn:
        r = A.check_path("flash_attn", inputs, mask="causal")
        assert all(x.ok is None and "not installed" in x.note for x in r), r


def test_ran_and_matched_refuses_a_skipped_path():
    """The GPU test's own check: a skipped tensor or a missing gradient is a failure."""
    inputs = A.random_qkv(1, 2, 40, 64, seed=0)
    _assert_ran_and_matched(A.check_path("sdpa", inputs, mask="causal"), "sdpa")
    with pytest.raises(AssertionError, match="skipped"):
        _assert_ran_and_matched(A.check_path("flex_eager", inputs, mask="causal"), "flex_eager")  # no CPU backward
    with pytest.raises(AssertionError, match="skipped"):
        _assert_ran_and_matched(A.check_path("efficient", inputs, mask="causal"), "efficient")  # CUDA only


def test_model_calls_attend_through_its_config():
    """The model helper's seam: MMDiT(attention_path=...) routes every block through attend()."""
    b = synthetic_batch("tiny", 2, height=64, width=48, txt_len=7, generator=torch.Generator().manual_seed(0))
    txt_mask = torch.ones(2, 7, dtype=torch.bool)
    txt_mask[1, 4:] = False
    outs = {}
    for path in ("sdpa", "math", "reference"):
        model = build_model("tiny", seed=0, attention_path=path)
        t = torch.full((2,), 0.5)
        outs[path] = model(b.img, b.img_ids, b.txt, b.txt_ids, t, b.y, b.guidance, txt_mask=txt_mask)
    assert_close(outs["math"], outs["sdpa"], dtype=torch.float32, name="math vs sdpa")
    assert_close(outs["reference"], outs["sdpa"], atol=1e-4, rtol=1e-3, name="reference vs sdpa")
    with pytest.raises(ConfigError, match="'mask'"):
        model = build_model("tiny", seed=0, attention_path="triton")  # Dh 16 + key mask: refused
        model(b.img, b.img_ids, b.txt, b.txt_ids, torch.full((2,), 0.5), b.y, b.guidance, txt_mask=txt_mask)


_AOT = r"""
import os, re, sys
os.environ["TRITON_INTERPRET"] = "0"          # compile for real, not the interpreter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import torch
import lab_kernels.attention as ka
dt, D, causal, varlen = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
for kern, kind in ((ka._attention_fwd_kernel, "fwd"), (ka._attention_bwd_dkdv_kernel, "bwd_dkdv"),
                   (ka._attention_bwd_dq_kernel, "bwd_dq")):
    cfg = ka.launch_config(kind, D, tdt)
    const = dict(HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, IS_VARLEN=varlen,
                 **ka.dot_args(tdt))
    ptrs = {"LSE": "*fp32", "DELTA": "*fp32", "CU_SEQLENS": "*i32"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*" + dt) if n.isupper() else
           "fp32" if n in ("qk_scale_log2", "sm_scale") else "i32" for n in kern.arg_names}
    # what the JIT specializes at run time: 16-byte aligned pointers, row strides that are multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
             if n not in const and (n.isupper() or n.startswith(("stride_q", "stride_g", "stride_o")))}
    k = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    assert k.metadata.shared <= 227 * 1024, (kern.__name__, k.metadata.shared)
    ptx = k.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    # operand tiles (2-D, 16-bit) loaded ahead by the software pipeline
    ahead = len(re.findall(r"async_copy_global_to_local[^\n]*-> <\d+x\d+x(?:bf16|f16)", k.asm["ttgir"]))
    print(kern.__name__, "ok", k.metadata.shared, mma, cfg["num_stages"], ahead)
"""


@pytest.mark.parametrize("dt,D,causal,varlen", [("bf16", 128, "1", "1"), ("fp16", 64, "0", "0")])
def test_triton_kernels_compile_for_hopper(dt, D, causal, varlen):
    """No GPU is needed to compile: the kernels at their GPU tile sizes must lower to sm_90
    code and fit Hopper's shared memory (the interpreter never exercises that path)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run(
        [sys.executable, "-c", _AOT, dt, str(D), causal, varlen], capture_output=True, text=True, env=env, timeout=1200
    )
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("this triton install has no ptxas to compile with")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(" ok ") == 3, r.stdout
    if dt in ("bf16", "fp16"):
        # Hopper tiles: every kernel's dots lower to wgmma (a 32-row dQ tile lowered to mma.sync) and
        # the backward kernels are software-pipelined (they ran single-stage at head dim 128)
        for line in r.stdout.strip().splitlines():
            name, _, _, mma, stages, ahead = line.split()
            assert mma == "wgmma", line
            assert name == "_attention_fwd_kernel" or (int(stages) >= 2 and int(ahead) >= 2), line
