"""Liger-Kernel's Triton kernels as the "liger" variant of the block's ops, beside perflab's own.

Liger-Kernel (``liger-kernel``, pinned in pyproject) ships hand-written Triton kernels for LLM
training.  Where one computes an op the MMDiT block uses, it is registered here as that op's
``"liger"`` variant (kind ``"triton"``: the registry's capability reasons apply, and on CPU it
is checked through Triton's interpreter, never timed), so lab 02's tables, explorer, ``perflab
compare`` and ``benchmarks/gpu_check.py`` hold it to the same float64 check and GB/s as
perflab's kernels.  Where Liger's layout or semantics differ from the block's, the adapter is
written out below; ops that cannot be adapted without changing what is measured are in
:data:`EXCLUDED` with the reason.

Per op (Liger 0.8.5):

* ``rms_norm``: ``LigerRMSNormFunction``, offset 0, casting mode ``"llama"`` (rstd in float32,
  x̂ cast back to x's dtype before the weight: FLUX's RMSNorm), ``in_place=False`` (Liger's
  default writes dx over the incoming gradient, which autograd may still hold).
* ``layer_norm_modulate``: Liger's LayerNorm has one affine weight and bias per feature, the
  block's adaLN one ``(1 + scale_b, shift_b)`` per sample: one Liger LayerNorm per sample
  with weight ``1 + scale_b`` and bias ``shift_b`` (float32, so ``1 + scale`` is not rounded to
  the input dtype), the samples stacked (one extra copy of y when batch > 1, in its time).
* ``swiglu``: ``LigerSiLUMulFunction`` as is.  Its backward writes da and db over the saved
  a and b (Liger's memory saving): the inputs hold the gradients after a backward.
* ``rope``: Liger rotates halves (``[x1, x2]`` with ``x1 = x[:D/2]``, the Llama layout) with
  ``cos`` / ``sin`` of width D (``cat(freqs, freqs)``); FLUX rotates pairs ``(x[2i], x[2i+1])``
  with tables of width D/2.  The adapter gathers each pair's two elements into the two halves
  (one copy of q and of k, laid out (B, L, H, D) as Liger's kernel reads them, which it then
  rotates in place), duplicates the tables, and interleaves the result back (one more copy):
  two copies of q and k the pair-layout kernels do not make, inside the variant's time.

On CPU, Triton's interpreter passes a Python float argument to a kernel as a Python float,
while compiled Triton types it fp32; Liger's kernels call ``eps.to(tl.float32)`` on such
arguments, which the interpreter then refuses.  :func:`interpreter_floats_why_not` probes that
once and, when the probe fails that way, wraps float arguments as fp32 scalars (what compiled
Triton does) for the process; perflab's kernels compute the same bits either way
(tests/unit/kernels/test_liger.py).  Public API: :data:`LIGER_VERSION`, :func:`liger_why_not`,
:data:`EXCLUDED`, the adapters ``liger_<op>``.
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch
import triton
import triton.language as tl

from . import _common as C
from . import layer_norm_modulate, rms_norm, rope, swiglu  # noqa: F401  (their own variants register first)
from .registry import register

try:  # optional: a bare GPU machine may not have it
    LIGER_VERSION: str | None = importlib.metadata.version("liger-kernel")
except importlib.metadata.PackageNotFoundError:
    LIGER_VERSION = None

_OPS: dict = {}


def _liger():
    """Liger's autograd functions, imported on first use: importing its ops probes for an NPU
    through transformers (seconds), which ``import lab_kernels`` should not pay."""
    if not _OPS:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction  # noqa: PLC0415
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: PLC0415
        from liger_kernel.ops.rope import LigerRopeFunction  # noqa: PLC0415
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction  # noqa: PLC0415

        _OPS.update(
            rms_norm=LigerRMSNormFunction,
            layer_norm=LigerLayerNormFunction,
            rope=LigerRopeFunction,
            swiglu=LigerSiLUMulFunction,
        )
    return _OPS


def liger_import_why_not() -> str | None:
    """None when Liger's ops import, else why not (cached by Python's import system)."""
    if LIGER_VERSION is None:
        return "liger-kernel not installed"
    try:
        _liger()
    except Exception as e:  # noqa: BLE001 - the reason is what the registry reports
        first = str(e).splitlines()[0] if str(e) else ""
        return f"liger-kernel {LIGER_VERSION} does not import: {type(e).__name__}: {first}"
    return None


LIBRARY = "liger-kernel"

#: Liger ops the block could use but that are not registered, with why (lab 02 prints this).
EXCLUDED: dict[str, str] = {
    "fused_add_rms_norm": (
        "the block has no residual add followed by an RMSNorm: its residual adds are gated "
        "(x + gate * y, the gated_residual op) and the norm after them is LayerNorm + modulation"
    ),
    "modulated_rms_norm": (
        "(1 + scale) * RMSNorm(x) + shift: the block's adaLN normalises with LayerNorm (mean "
        "subtracted), a different function (the float64 check would fail it, not its rounding)"
    ),
    "geglu": (
        "Liger's GELU is only gated, gelu_tanh(a) * b; the block's MLP is ungated gelu_tanh(fc1(x)): "
        "feeding b = ones would time an extra read of b and a db nobody needs (and on CPU its "
        "libdevice tanh has no interpreter implementation)"
    ),
    "qk_norm_rope": (
        "no fused QK-norm + RoPE in Liger; the block composes the liger rms_norm and rope variants "
        "when a model's kernels choose them (lab_utils.model.layers.KernelSet)"
    ),
    "gated_residual": "no Liger kernel for x + gate * y",
    "gelu_tanh": "no ungated GELU in Liger (see geglu)",
}


# ---------------------------------------------------------------------------------------------
# The interpreter's float arguments (CPU only)


def _wrap_float_args() -> bool:
    """Make the interpreter pass Python floats as fp32 scalars; False when there is no hook."""
    try:
        import numpy as np  # noqa: PLC0415
        import triton.language as tl  # noqa: PLC0415
        from triton.runtime import interpreter as ti  # noqa: PLC0415  (only where the interpreter runs)
    except ImportError:
        return False
    orig = getattr(ti, "_implicit_cvt", None)
    if orig is None or getattr(orig, "_perflab_floats", False):
        return False

    def cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(ti.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return orig(arg)

    cvt._perflab_floats = True
    ti._implicit_cvt = cvt
    return True


def _libdevice_from_tl_math() -> list[str]:
    """Point the libdevice functions Liger's modules imported (``rsqrt``) at ``tl.math``'s of the
    same name, which the interpreter implements (it has no libdevice: those return None)."""
    import triton.language as tl  # noqa: PLC0415
    from liger_kernel.ops import layer_norm as lln  # noqa: PLC0415
    from liger_kernel.ops import rms_norm as lrms  # noqa: PLC0415

    done = []
    for mod in (lrms, lln):
        for name, obj in list(vars(mod).items()):
            if "libdevice" in getattr(obj, "__module__", "") and hasattr(tl.math, name):
                # looked up at each call: the interpreter patches tl.math only while a kernel runs
                setattr(mod, name, lambda *a, _name=name: getattr(tl.math, _name)(*a))
                done.append(f"{mod.__name__.rsplit('.', 1)[-1]}.{name}")
    return done


def _probe() -> str | None:
    """Run Liger's RMSNorm (a float argument and a libdevice call) on a tiny input."""
    x = torch.randn(4, 8)
    try:
        y = _liger()["rms_norm"].apply(x, torch.ones(8), 1e-6, 0.0, "llama", False)
    except Exception as e:  # noqa: BLE001 - the failure is the verdict
        cause = e.__cause__ or e
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return None if torch.allclose(y, want, rtol=1e-5, atol=1e-6) else "wrong result"


_SHIMS: dict = {}


def interpreter_why_not() -> str | None:
    """None when Triton's interpreter runs Liger's kernels (after the shims it needed), else why;
    probed once per process.  :func:`interpreter_note` says which shims were applied."""
    if "verdict" not in _SHIMS:
        notes, why = [], _probe()
        if why and "'float' object has no attribute" in why and _wrap_float_args():
            notes.append(f"float arguments passed as fp32 scalars (without: {why})")
            why = _probe()
        if why and "cannot convert None" in why:
            done = _libdevice_from_tl_math()
            if done:
                notes.append(f"libdevice {', '.join(done)} taken from tl.math (without: {why})")
                why = _probe()
        _SHIMS["note"] = "; ".join(notes) if why is None else ""
        _SHIMS["verdict"] = (
            None if why is None else f"Triton's interpreter cannot run Liger's kernels here (a probe raised {why})"
        )
    return _SHIMS["verdict"]


def interpreter_note() -> str:
    """The shims the interpreter needed to run Liger's kernels ('' when none or not probed)."""
    return _SHIMS.get("note", "")


@triton.jit
def _bf16_mul_kernel(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0)
    b = tl.load(b_ptr + offs, mask=mask, other=0)
    tl.store(c_ptr + offs, a * b, mask=mask)  # bfloat16 * bfloat16, no cast to float32


def interpreter_bf16_why_not() -> str | None:
    """None when the interpreter multiplies two bfloat16 operands right, else what it got (probed
    once).  Triton 3.9's does not: Liger kernels that compute in bfloat16 (SwiGLU's forward,
    RMSNorm's llama-mode weight gradient) cannot be checked in bfloat16 through it."""
    if "bf16" not in _SHIMS:
        a = torch.tensor([1.5, -2.0, 0.25, 3.0], dtype=torch.bfloat16)
        b = torch.tensor([2.0, 0.5, -4.0, 1.0], dtype=torch.bfloat16)
        c = torch.full_like(a, float("nan"))
        try:
            _bf16_mul_kernel[(1,)](a, b, c, 4, BLOCK=4)
            got = None if torch.equal(c, a * b) else f"{c.float().tolist()} for {(a * b).float().tolist()}"
        except Exception as e:  # noqa: BLE001 - the failure is the verdict
            got = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        _SHIMS["bf16"] = None if got is None else f"a bfloat16 x bfloat16 probe gave {got}"
    return _SHIMS["bf16"]


def liger_why_not(device=None, dtype=None, shape=None, *, bf16_arith: bool = False, **_) -> str | None:
    """Capability check shared by the liger variants (the registry adds the Triton reasons).
    ``bf16_arith``: the kernel computes in bfloat16 (not only loads and stores it)."""
    why = liger_import_why_not()
    if why:
        return why
    if device == "cpu" and C.interpreted() and not C.interpreter_why_not():
        why = interpreter_why_not()
        if why:
            return why
        if bf16_arith and dtype == torch.bfloat16 and interpreter_bf16_why_not():
            return "computes in bfloat16, which Triton's interpreter gets wrong (probed): bfloat16 on a GPU only"
    if shape is not None:
        return C.row_width_reason("liger", shape)
    return None


def _bf16_arith_check(device=None, dtype=None, **problem):
    return liger_why_not(device, dtype, bf16_arith=True, **problem)


# ---------------------------------------------------------------------------------------------
# The adapters


def _shimmed(fn):
    """Apply the interpreter's shims (probed once) before the first call on CPU."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if C.interpreted() and "verdict" not in _SHIMS:
            interpreter_why_not()
        return fn(*args, **kwargs)

    return call


@_shimmed
def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Liger RMSNorm, FLUX's casting (llama mode), dx never written over the incoming gradient."""
    return _liger()["rms_norm"].apply(x, weight, eps, 0.0, "llama", False)


def _bcast_rows(t: torch.Tensor) -> torch.Tensor:
    """shift / scale (B, D) or (B, 1, D) -> (B, D)."""
    return t.reshape(t.shape[0], t.shape[-1])


@_shimmed
def liger_layer_norm_modulate(x, shift, scale, eps: float = 1e-6):
    """One Liger LayerNorm per sample, weight ``1 + scale_b`` and bias ``shift_b`` in float32."""
    w = 1.0 + _bcast_rows(scale).float()
    b = _bcast_rows(shift).float()
    ys = [_liger()["layer_norm"].apply(x[i], w[i], b[i], eps) for i in range(x.shape[0])]
    return ys[0].unsqueeze(0) if len(ys) == 1 else torch.stack(ys)


@_shimmed
def liger_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Liger SwiGLU as is: silu(gate) * up (its backward overwrites the saved gate and up)."""
    return _liger()["swiglu"].apply(gate, up)


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) pair layout -> the same rotation's half layout, stored (B, L, H, D)."""
    B, H, L, D = x.shape
    halves = x.permute(0, 2, 1, 3).unflatten(-1, (D // 2, 2)).transpose(-1, -2).reshape(B, L, H, D)
    return halves.transpose(1, 2)  # a (B, H, L, D) view whose transpose(1, 2) is contiguous


def halves_to_pairs(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pairs_to_halves`: a contiguous (B, H, L, D) tensor in pair layout."""
    D = x.shape[-1]
    return x.unflatten(-1, (2, D // 2)).transpose(-1, -2).flatten(-2).contiguous()


def half_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX tables (L, D/2) or (B, L, D/2) -> Liger's (1 or B, L, D): each angle for both halves."""
    c, s = (t if t.dim() == 3 else t.unsqueeze(0) for t in (cos, sin))
    return torch.cat((c, c), -1), torch.cat((s, s), -1)


@_shimmed
def liger_rope(q, k, cos, sin):
    """Liger RoPE on the block's pair layout (see the module note: two copies of q and k)."""
    c, s = half_tables(cos, sin)
    oq, ok = _liger()["rope"].apply(pairs_to_halves(q), pairs_to_halves(k), c, s)
    return halves_to_pairs(oq), halves_to_pairs(ok)


def _rope_check(device=None, dtype=None, shape=None, head_dim=None, **_):
    why = liger_why_not(device, dtype)
    if why is None and head_dim is not None and head_dim % 2:
        why = f"rope/liger: head_dim={head_dim} is odd; RoPE rotates halves of an even head dim"
    return why


_ADAPTERS = {
    "rms_norm": (liger_rms_norm, _bf16_arith_check, "Liger RMSNorm (llama casting, in_place=False)"),
    "layer_norm_modulate": (
        liger_layer_norm_modulate,
        liger_why_not,
        "Liger LayerNorm once per sample, weight 1 + scale_b, bias shift_b (adapter)",
    ),
    "swiglu": (liger_swiglu, _bf16_arith_check, "Liger SiLU-mul (backward overwrites its inputs)"),
    "rope": (liger_rope, _rope_check, "Liger RoPE (half layout) between two pair<->half copies (adapter)"),
}

#: why Liger's SwiGLU backward is never timed on reused inputs (lab_utils.fused.ops.bench_variant)
SWIGLU_OVERWRITES = (
    "Liger's SwiGLU backward writes the gradients over its inputs: timed calls repeated on the same "
    "inputs would run on the last call's gradients, which overflow to inf within tens of calls"
)

for _op, (_fn, _check, _desc) in _ADAPTERS.items():
    register(
        _op,
        "liger",
        _fn,
        kind="triton",
        dtypes=C.FLOAT_DTYPES,
        check=_check,
        description=_desc,
        library=LIBRARY,
        library_version=LIGER_VERSION,
        **({"backward_overwrites_inputs": SWIGLU_OVERWRITES} if _op == "swiglu" else {}),
    )
