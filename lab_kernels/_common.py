"""Shared plumbing of the fused-op modules (private).

Design note: every op's Triton host functions are custom ops in the ``lab_kernels``
namespace so that ``torch.compile`` treats them as graph nodes instead of tracing
into a kernel launch.  On a GPU they are ``torch.library.triton_op`` with every
launch wrapped in ``wrap_triton`` (Inductor sees the kernel and may schedule it with
the rest of the graph).  Under Triton's interpreter (CPU-only machines) a
``triton_op`` cannot be traced: the interpreter replaces ``JITFunction`` and fake
tensors have no data pointer, so compiling fails with "Cannot access data pointer".
There we register the same Python body as an opaque ``torch.library.custom_op``
with a fake (meta) implementation; compile then composes with it as an opaque call.
Numerically the two registrations run the same kernels.

This module also holds the package's one interpreter predicate, :func:`interpreted`
(``lab_kernels/__init__`` sets ``TRITON_INTERPRET`` before Triton is first imported).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

#: Whether this process's kernels run in Triton's interpreter (fixed when the package is imported).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
NAMESPACE = "lab_kernels"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Widest row a single-pass row kernel holds in registers (elements, power of two).
MAX_ROW = 65536


def interpreted() -> bool:
    """True when the package's Triton kernels run through the interpreter (CPU, correctness only)."""
    return INTERPRETED


# ---------------------------------------------------------------------------------------------
# Whether this interpreter works at all.  Found on the GPU machine's stack (triton 3.6 with
# numpy >= 2.4): the interpreter converts a scalar argument to an index with ``int()`` of a
# 1-element array, which numpy 2.5 refuses ("only 0-dimensional arrays can be converted to
# Python scalars"), so every kernel with a loop bound taken from an argument raises.  The
# capability is probed with a tiny call, never assumed from version numbers; triton's own
# later fix (``int(data.squeeze())``) is applied once when the probe fails that way, and the
# probe run again.  The verdict (None, or the reason in words) is cached for the process.


@triton.jit
def _interpreter_probe_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """y[0:BLOCK] = sum over k of x[k*BLOCK : (k+1)*BLOCK] (masked tail): a loop bound from an argument."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + tl.arange(0, BLOCK), acc)


def _run_interpreter_probe() -> str | None:
    n, block = 20, 8
    x = torch.arange(n, dtype=torch.float32)
    y = torch.full((block,), float("nan"))
    try:
        _interpreter_probe_kernel[(1,)](x, y, n, BLOCK=block)
    except Exception as e:  # noqa: BLE001 - the failure is the verdict
        cause = e.__cause__ or e
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    want = torch.nn.functional.pad(x, (0, 24 - n)).reshape(3, block).sum(0)
    if not torch.equal(y, want):
        return f"wrong result: {y.tolist()} instead of {want.tolist()}"
    return None


def _shim_scalar_index() -> bool:
    """Index a scalar through ``squeeze()``, as later triton releases (3.9) do; False without such a hook."""
    try:
        from triton.runtime import interpreter as ti  # noqa: PLC0415  (only where the interpreter runs)
    except ImportError:
        return False
    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_perflab_shim", False):
        return False

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._perflab_shim = True
    ti._patch_lang_tensor = patched
    return True


#: What the probe found: None before it ran, else (verdict, note).
_PROBE: dict = {}


def interpreter_why_not() -> str | None:
    """None when Triton's interpreter runs this package's kernels here, else why not (probed once).

    Only meaningful where :func:`interpreted` is True; a GPU process never calls it."""
    if "verdict" not in _PROBE:
        why = _run_interpreter_probe()
        note = ""
        if why and "0-dimensional" in why and _shim_scalar_index():
            first = why
            why = _run_interpreter_probe()
            note = f"scalar indices shimmed (without: {first})" if why is None else ""
        if why:
            import numpy as np  # noqa: PLC0415  (only to name the version in the reason)

            why = (
                f"Triton {triton.__version__}'s interpreter cannot run kernels with numpy {np.__version__} "
                f"here (a tiny probe kernel raised {why})"
            )
        _PROBE.update(verdict=why, note=note)
    return _PROBE["verdict"]


def interpreter_note() -> str:
    """What the probe had to do for the interpreter to work ('' when nothing)."""
    interpreter_why_not()
    return _PROBE.get("note", "")


def launch(kernel):
    """The launchable form of a kernel inside a registered op: ``wrap_triton`` on a GPU."""
    if INTERPRETED:
        return kernel
    return wrap_triton(kernel)


def kernel_op(name: str, fake: Callable):
    """Register ``fn`` as the custom op ``lab_kernels::<name>`` (see the module note)."""

    def deco(fn):
        if INTERPRETED:
            op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
            op.register_fake(fake)
        else:
            op = triton_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        return op

    return deco


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def num_warps_for(block: int) -> int:
    """Warps for a row of ``block`` elements: ~8 elements per thread, 1..16 warps."""
    return int(min(16, max(1, block // 256)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(n_items: int, device: torch.device, per_sm: int = 4) -> int:
    """Programs for a grid-stride loop: a few per SM on a GPU, a handful in the interpreter."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        cap = _sm_count(idx) * per_sm
    else:
        cap = 4
    return max(1, min(int(n_items), cap))


# ---------------------------------------------------------------------------------------------
# Input checks shared by the Triton host functions.  Every message names the op, the
# parameter and the rule, so a notebook user sees why a variant refused.


def check_tensor(op: str, name: str, t, *, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: parameter {name!r} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{op}/triton: parameter {name!r} has dtype {str(t.dtype).replace('torch.', '')}; "
            f"the kernel takes {allowed}"
        )


def check_device(op: str, *named: tuple[str, torch.Tensor]) -> torch.device:
    dev = named[0][1].device
    for name, t in named:
        if t.device != dev:
            raise ValueError(f"{op}: parameter {name!r} is on {t.device} but {named[0][0]!r} is on {dev}")
    if dev.type == "cuda" and INTERPRETED:
        raise RuntimeError(f"{op}/triton: TRITON_INTERPRET=1 is set, the kernel cannot run on {dev}")
    if dev.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            f"{op}/triton: input is on CPU; Triton runs on CPU only through its interpreter "
            "(TRITON_INTERPRET=1 before lab_kernels is imported)"
        )
    if dev.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{op}/triton: device {dev} is not supported (cuda, or cpu via the interpreter)")
    return dev


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple, what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(
            f"{op}: parameter {name!r} has shape {tuple(t.shape)}, expected {tuple(expected)}"
            + (f" ({what})" if what else "")
        )


def check_row_width(op: str, name: str, n: int, limit: int = MAX_ROW) -> None:
    if n > limit:
        raise ValueError(
            f"{op}/triton: parameter {name!r} has a last dimension of {n}, wider than the "
            f"kernel's single-pass row limit of {limit} elements"
        )


def row_width_reason(op: str, shape, limit: int = MAX_ROW) -> str | None:
    """Capability check for registries: None when the rows fit, else why not."""
    if shape is None:
        return None
    n = int(tuple(shape)[-1])
    if n > limit:
        return f"{op}/triton: rows of {n} elements exceed the single-pass limit of {limit}"
    return None


def row_width_check(op: str, limit: int = MAX_ROW) -> Callable[..., str | None]:
    """A registry capability check refusing rows wider than the single-pass limit."""

    def check(device=None, dtype=None, shape=None, **_):
        return row_width_reason(op, shape, limit)

    return check


def even_head_dim_check(op: str) -> Callable[..., str | None]:
    """A registry capability check refusing an odd head dim (rope rotates pairs)."""

    def check(device=None, dtype=None, shape=None, head_dim=None, **_):
        dh = head_dim if head_dim is not None else (tuple(shape)[-1] if shape is not None else None)
        if dh is not None and dh % 2:
            return f"{op}/triton: head dim {dh} is odd; pairs need an even head dim"
        return None

    return check


def needs_no_grad(op: str, **named: torch.Tensor) -> None:
    for name, t in named.items():
        if t.requires_grad:
            raise ValueError(
                f"{op}/triton: parameter {name!r} requires grad, but the kernel treats it as a "
                "constant table and computes no gradient for it; detach it or use the eager variant"
            )


def promote(*ts: torch.Tensor) -> torch.dtype:
    dt = ts[0].dtype
    for t in ts[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt


# ---------------------------------------------------------------------------------------------
# Column reduction of per-program partial sums (weight / gate gradients): the second
# stage of a two-stage reduction, so every program of the first stage writes without atomics.


@triton.jit
def _col_sum_kernel(part_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[g, n] = sum_p part[g, p, n]; part (G, P, N) float32, out (G, N) any float dtype.

    Bytes: 4·G·P·N read + G·N·s written."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    base = part_ptr + g * P * N
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        m = (rows[:, None] < P) & cmask[None, :]
        tile = tl.load(base + rows[:, None] * N + cols[None, :], mask=m, other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + g * N + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def col_sum(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reduce float32 partials (G, P, N) into ``out`` (G, N) with the Triton column-sum kernel."""
    G, P, N = partials.shape
    BLOCK_N = min(next_pow2(N), 256)
    BLOCK_P = min(next_pow2(P), 32)
    launch(_col_sum_kernel)[(G, triton.cdiv(N, BLOCK_N))](partials, out, P, N, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N)
    return out


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` built on first call (compiling at import would cost seconds)."""
    holder: dict = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "f" not in holder:
            holder["f"] = torch.compile(fn)
        return holder["f"](*args, **kwargs)

    wrapper.__wrapped_eager__ = fn
    return wrapper
