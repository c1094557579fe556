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
