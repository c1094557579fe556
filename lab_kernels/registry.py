"""Registry of op variants with capability checks.

Every op module (``lab_kernels/<op>.py``) registers its variants at import time:
the float64-valid reference, eager torch, ``torch.compile``, hand-written Triton,
and library implementations when installed.  A notebook asks
``variants("rms_norm", device="cpu", dtype=torch.bfloat16)`` for every variant that
can run there; ``why_not`` says in words why one cannot.

Op names equal module names.  ``lab_kernels/__init__`` imports every op module, so by the
time anyone can ask, every op of the package has registered its variants.

Public API: :func:`register`, :func:`get_variant`, :func:`variants`,
:func:`register_fused_op`, :func:`variant_names`, :func:`list_ops`, :func:`unregister` and
:class:`Variant`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._common import FLOAT_DTYPES, compiled, interpreted, interpreter_why_not

KINDS = ("reference", "eager", "compile", "triton", "library")

_REGISTRY: dict[str, dict[str, Variant]] = {}


@dataclass(frozen=True)
class Variant:
    """One implementation of an op.

    ``check(device=..., dtype=..., **problem)`` may return a reason string when the
    variant cannot handle a particular problem (shape limits, head dims, masks).
    """

    op: str
    name: str
    fn: Callable[..., Any]
    kind: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] | None = None
    check: Callable[..., str | None] | None = None
    description: str = ""
    extra: dict = field(default_factory=dict)

    def why_not(
        self, device: str | torch.device | None = None, dtype: torch.dtype | None = None, **problem: Any
    ) -> str | None:
        """None when the variant can run this problem, else the reason in words."""
        dev = torch.device(device).type if device is not None else None
        if dev is not None and dev not in self.devices:
            return f"{self.op}/{self.name} runs on {', '.join(self.devices)}, not {dev}"
        if self.kind == "triton" and dev == "cpu" and not interpreted():
            return (
                f"{self.op}/{self.name} is a Triton kernel; on CPU it needs "
                "TRITON_INTERPRET=1 set before lab_kernels is imported"
            )
        if self.kind == "triton" and dev == "cpu" and interpreter_why_not():
            return f"{self.op}/{self.name}: {interpreter_why_not()}"
        if self.kind == "triton" and dev == "cuda" and interpreted():
            return f"{self.op}/{self.name}: TRITON_INTERPRET=1 is set, kernels would not run on the GPU"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            return f"{self.op}/{self.name} takes dtypes {allowed}, not {str(dtype).replace('torch.', '')}"
        if self.check is not None:
            return self.check(device=dev, dtype=dtype, **problem)
        return None

    def can_run(self, device=None, dtype=None, **problem) -> bool:
        return self.why_not(device, dtype, **problem) is None

    def timeable(self, device: str | torch.device) -> bool:
        """False where timings would be meaningless (Triton's CPU interpreter)."""
        return not (self.kind == "triton" and torch.device(device).type == "cpu")

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def register(
    op: str,
    name: str,
    fn: Callable | None = None,
    *,
    kind: str,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    dtypes=None,
    check=None,
    description: str = "",
    **extra,
):
    """Register a variant; usable as ``register(op, name, fn, kind=...)`` or as a decorator."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")

    def _do(f):
        _REGISTRY.setdefault(op, {})[name] = Variant(
            op=op,
            name=name,
            fn=f,
            kind=kind,
            devices=tuple(devices),
            dtypes=tuple(dtypes) if dtypes is not None else None,
            check=check,
            description=description,
            extra=extra,
        )
        return f

    return _do(fn) if fn is not None else _do


def register_fused_op(
    op: str,
    *,
    reference: Callable,
    eager: Callable,
    triton: Callable,
    eager_description: str,
    triton_description: str,
    reference_description: str = "plain torch, float64-valid",
    check: Callable[..., str | None] | None = None,
    eager_tol_scale: float | None = None,
) -> None:
    """The four variants every fused op registers: its float64-valid reference, eager torch,
    ``torch.compile`` of the eager function, and the Triton kernels (float dtypes, ``check``).
    ``eager_tol_scale``: an unfused path that rounds an intermediate to the dtype is held to
    that multiple of the dtype's tolerance."""
    tol = {} if eager_tol_scale is None else {"tol_scale": eager_tol_scale}
    register(op, "reference", reference, kind="reference", description=reference_description)
    register(op, "eager", eager, kind="eager", description=eager_description, **tol)
    register(op, "compile", compiled(eager), kind="compile", description="torch.compile(eager)", **tol)
    register(op, "triton", triton, kind="triton", dtypes=FLOAT_DTYPES, check=check, description=triton_description)


def unregister(op: str, name: str) -> Variant:
    """Remove a variant (tests that register a deliberately wrong one clean up with this)."""
    ops = _ops_of(op)
    if name not in ops:
        raise KeyError(f"variant={name!r} is not a variant of {op}; known: {', '.join(ops)}")
    return ops.pop(name)


def _ops_of(op: str) -> dict[str, Variant]:
    try:
        return _REGISTRY[op]
    except KeyError:
        raise KeyError(f"op={op!r} is not registered; known ops: {', '.join(list_ops()) or 'none'}") from None


def list_ops() -> list[str]:
    """Every registered op (the package's op modules and any op registered since)."""
    return sorted(_REGISTRY)


def variant_names(op: str) -> tuple[str, ...]:
    """Names of every variant registered for ``op``, in registration order (whatever can run here)."""
    return tuple(_ops_of(op))


def get_variant(op: str, name: str) -> Variant:
    ops = _ops_of(op)
    try:
        return ops[name]
    except KeyError:
        raise KeyError(f"variant={name!r} is not a variant of {op}; known: {', '.join(ops)}") from None


def variants(
    op: str,
    device=None,
    dtype=None,
    *,
    include_unavailable: bool = False,
    kinds: tuple[str, ...] | None = None,
    **problem,
) -> list[Variant]:
    """All variants of ``op`` that can run on ``device``/``dtype`` for this problem."""
    out = []
    for v in _ops_of(op).values():
        if kinds is not None and v.kind not in kinds:
            continue
        if include_unavailable or v.why_not(device, dtype, **problem) is None:
            out.append(v)
    return out
