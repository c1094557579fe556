"""The attention paths and their registry: what each path is, runs and honours.

Every path has the signature ``fn(q, k, v, mask, scale, cu_seqlens=None, max_seqlen=None)``
(inputs already validated by :func:`lab_utils.attention.attend.check_inputs`) and an
:class:`AttentionPath` entry in :data:`REGISTRY` saying which masks, layouts, dtypes, head
dims, devices and directions it takes; ``why_not`` answers in words when it cannot run a
problem.  SDPA backends are probed once per (device, dtype, head dim) on a tiny real call.

Mask preprocessing (the dense boolean mask for SDPA, the BlockMask for flex) is cached per
Mask object and shape, so timings after the first call measure attention only.
:mod:`lab_utils.attention.attend` is the entry point (``attend``); use the paths through it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

import lab_kernels  # (sets TRITON_INTERPRET before kernels are defined)
from lab_kernels import attention as kernel
from lab_utils.attention.masks import Mask, causal, dense_mask, flex_block_mask, packed_mask
from lab_utils.core.config import ConfigError
from lab_utils.core.dtypes import dtype_name

MASK_KINDS = ("full", "causal", "custom")
LAYOUTS = ("bhld", "packed")


class AttentionError(ConfigError):
    """A problem a path cannot run, or malformed input; names the parameter."""


# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class AttentionPath:
    name: str
    kind: str  # reference | eager | compile | triton | library
    masks: tuple[str, ...]  # subset of MASK_KINDS
    layouts: tuple[str, ...]
    devices: tuple[str, ...]
    description: str
    fn: Callable[..., torch.Tensor] = field(repr=False, default=None)
    dtypes: tuple[torch.dtype, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    backward_devices: tuple[str, ...] = ("cpu", "cuda")
    probe: Callable[..., str | None] | None = field(repr=False, default=None)  # device-specific check
    available: Callable[[], str | None] | None = field(repr=False, default=None)

    def why_not(
        self,
        *,
        device="cpu",
        dtype=None,
        mask="full",
        layout="bhld",
        head_dim=None,
        lq=None,
        lk=None,
        backward=False,
        **_,
    ) -> str | None:
        device = torch.device(device).type
        if self.available is not None:
            r = self.available()
            if r:
                return r
        if device not in self.devices:
            return f"path {self.name!r} runs on {', '.join(self.devices)}, not {device}"
        if self.kind == "triton":
            r = lab_kernels.get_variant("attention", "triton").why_not(device, dtype)
            if r:
                return r
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            names = ", ".join(dtype_name(d) for d in self.dtypes)
            return f"path {self.name!r} takes dtypes {names}, not {dtype_name(dtype)}"
        if layout not in self.layouts:
            return f"path {self.name!r} supports layouts {', '.join(self.layouts)}, not {layout!r}"
        if mask not in self.masks:
            return f"path {self.name!r} honours masks {', '.join(self.masks)}, not a {mask!r} mask"
        if head_dim is not None and self.head_dims is not None and head_dim not in self.head_dims:
            return f"path {self.name!r} supports head dims {self.head_dims}, not {head_dim}"
        if self.kind == "triton" and lq is not None and lk is not None and lq != lk:
            return f"path {self.name!r} does self-attention only (Lq == Lk)"
        if backward and device not in self.backward_devices:
            return f"path {self.name!r} has no backward on {device}"
        if self.probe is not None:
            return self.probe(
                device=device, dtype=dtype, mask=mask, head_dim=head_dim, backward=backward, layout=layout
            )
        return None


REGISTRY: dict[str, AttentionPath] = {}


def _register(p: AttentionPath) -> None:
    REGISTRY[p.name] = p


def get_path(name: str) -> AttentionPath:
    if name not in REGISTRY:
        raise AttentionError("path", name, "one of " + ", ".join(REGISTRY))
    return REGISTRY[name]


# --------------------------------------------------------------------------- caches
_CACHE: dict[tuple, tuple[Any, Any]] = {}
_CACHE_MAX = 64


def _cached(key: tuple, keep: Any, build: Callable[[], Any]):
    """Small cache; ``keep`` (the Mask) is held so its id() cannot be reused."""
    hit = _CACHE.get(key)
    if hit is not None:
        return hit[1]
    val = build()
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (keep, val)
    return val


def clear_caches() -> None:
    _CACHE.clear()


def _dense_for(mask: Mask, B, Lq, Lk, device) -> torch.Tensor:
    return _cached(
        ("dense", id(mask), B, Lq, Lk, str(device)), mask, lambda: dense_mask(mask, B, 1, Lq, Lk, device=device)
    )


# --------------------------------------------------------------------------- path implementations
def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _packed_loop(fn, q, k, v, mask, scale, cu_seqlens):
    """Run ``fn`` per sequence of a packed batch (sequence i gets Mask b-index i)."""
    bounds = cu_seqlens.tolist()
    outs = []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        qi, ki, vi = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # 1 H l Dh
        m = mask
        if isinstance(mask, Mask) and mask.kind == "custom" and i:
            m = _cached(("shift", id(mask), i), mask, lambda mask=mask, i=i: _shift_batch(mask, i))
        outs.append(fn(qi, ki, vi, m, scale)[0].transpose(0, 1))
    return torch.cat(outs, 0)


def _shift_batch(mask: Mask, i: int) -> Mask:
    mod = mask.mask_mod
    return Mask(mask.name, lambda b, h, q, k: mod(b + i, h, q, k), mask.kind, mask.params)


def _reference(q, k, v, mask, scale):
    dt = q.dtype
    q64, k64, v64 = q.double(), k.double(), v.double()
    B, _, Lq, _ = q.shape
    Lk = k.shape[2]
    dm = None
    if isinstance(mask, torch.Tensor):
        dm = mask
    elif isinstance(mask, Mask) and mask.kind != "full":
        dm = dense_mask(mask, B, 1, Lq, Lk, device=q.device)
    return kernel.reference_attention(q64, k64, v64, scale=_scale(q, scale), mask=dm).to(dt)


_SDPA_BACKENDS = {
    "math": "MATH",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}


def _sdpa_call(q, k, v, mask, scale, backend: str | None):
    kw: dict[str, Any] = dict(scale=scale)
    if isinstance(mask, torch.Tensor):
        kw["attn_mask"] = mask
    elif isinstance(mask, Mask):
        if mask.kind == "causal":
            kw["is_causal"] = True
        elif mask.kind == "custom":
            kw["attn_mask"] = _dense_for(mask, q.shape[0], q.shape[2], k.shape[2], q.device)
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[backend])):
        return F.scaled_dot_product_attention(q, k, v, **kw)


@functools.cache
def _probe_sdpa(
    backend: str, device: str, dtype: torch.dtype, head_dim: int, custom_mask: bool, is_causal: bool, backward: bool
) -> str | None:
    """Does this SDPA backend run this kind of problem on this device?  A tiny real call."""
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(1, 2, 64, head_dim, device=device, dtype=dtype, generator=g).requires_grad_(backward)
            for _ in range(3)
        )
        m = torch.ones(64, 64, dtype=torch.bool, device=device).tril() if custom_mask else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o = _sdpa_call(q, k, v, m if custom_mask else (causal() if is_causal else None), None, backend)
            if backward:
                o.sum().backward()
        return None
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            f"SDPA backend {backend!r} cannot run this on {device} ({dtype_name(dtype)}, Dh {head_dim}"
            f"{', mask' if custom_mask else ''}{', causal' if is_causal else ''}{', backward' if backward else ''}): "
            f"{msg[:160]}"
        )


def _sdpa_probe(backend):
    def probe(*, device, dtype, mask, head_dim, backward, layout):
        return _probe_sdpa(
            backend, device, dtype or torch.float32, head_dim or 64, mask == "custom", mask == "causal", bool(backward)
        )

    return probe


def _make_sdpa(backend: str | None):
    def run(q, k, v, mask, scale, cu_seqlens=None, max_seqlen=None):
        if cu_seqlens is not None:
            return _packed_loop(
                lambda a, b_, c, m, s: _sdpa_call(a, b_, c, m, s, backend), q, k, v, mask, scale, cu_seqlens
            )
        return _sdpa_call(q, k, v, mask, scale, backend)

    return run


def _run_reference(q, k, v, mask, scale, cu_seqlens=None, max_seqlen=None):
    if cu_seqlens is not None:
        return _packed_loop(_reference, q, k, v, mask, scale, cu_seqlens)
    return _reference(q, k, v, mask, scale)


# flex ---------------------------------------------------------------------------------
_FLEX_COMPILED = None


def _flex_fn(compiled: bool):
    global _FLEX_COMPILED
    if not compiled:
        return flex_attention
    if _FLEX_COMPILED is None:
        # Every (shape, mask_mod) is a recompilation; past dynamo's recompile limit (8) it
        # would silently fall back to the *unfused* eager flex and the sweep would time the
        # wrong thing.  Raise the limits (names differ across torch versions).  torch loads
        # torch._dynamo lazily on first use (seconds), so it is reached here, not imported above.
        dynamo_config = torch._dynamo.config
        for name, value in (
            ("recompile_limit", 1024),
            ("cache_size_limit", 1024),
            ("accumulated_recompile_limit", 4096),
            ("accumulated_cache_size_limit", 4096),
        ):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), value))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def _flex_block_mask(mask: Mask, B, Lq, Lk, device, compiled: bool, key_extra=()):
    return _cached(
        ("block", id(mask), B, Lq, Lk, str(device), *key_extra),
        mask,
        lambda: flex_block_mask(
            mask, B, None, Lq, Lk, device=device, compile=compiled and torch.device(device).type == "cuda"
        ),
    )


def _make_flex(compiled: bool):
    def run(q, k, v, mask, scale, cu_seqlens=None, max_seqlen=None):
        fn = _flex_fn(compiled)
        if cu_seqlens is not None:
            lengths = tuple(int(x) for x in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
            pm = _cached(("packedmask", id(mask), lengths), mask, lambda: packed_mask(mask, lengths))
            T = q.shape[0]
            bm = _flex_block_mask(pm, 1, T, T, q.device, compiled)
            qq, kk, vv = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # 1 H T Dh
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = fn(qq, kk, vv, block_mask=bm, scale=scale)
            return out[0].transpose(0, 1)
        B, _, Lq, _ = q.shape
        Lk = k.shape[2]
        if isinstance(mask, torch.Tensor):
            # a tensor mask is keyed by its storage: the same tensor object -> the same block mask
            t = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(B, q.shape[1], Lq, Lk)
            mm = Mask("tensor", lambda b, h, qi, ki: t[b, h, qi, ki], "custom")
            bm = _cached(
                ("tblock", mask.data_ptr(), tuple(mask.shape), B, Lq, Lk, str(q.device)),
                mask,
                lambda: _flex_block_mask(mm, B, Lq, Lk, q.device, compiled),
            )
        elif mask is None or mask.kind == "full":
            bm = None
        else:
            bm = _flex_block_mask(mask, B, Lq, Lk, q.device, compiled)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the uncompiled path warns on every call, by design
            return fn(q, k, v, block_mask=bm, scale=scale)

    return run


# triton -------------------------------------------------------------------------------
def _run_triton(q, k, v, mask, scale, cu_seqlens=None, max_seqlen=None):
    is_causal = isinstance(mask, Mask) and mask.kind == "causal"
    return kernel.attention(q, k, v, causal=is_causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


# flash-attn ---------------------------------------------------------------------------
def _flash_attn_available() -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    return None


def _run_flash_attn(q, k, v, mask, scale, cu_seqlens=None, max_seqlen=None):
    import flash_attn  # noqa: PLC0415  (optional CUDA-only package, absent on most machines)

    is_causal = isinstance(mask, Mask) and mask.kind == "causal"
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        ml = max_seqlen or int((cu[1:] - cu[:-1]).max())
        return flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, ml, ml, softmax_scale=scale, causal=is_causal)
    o = flash_attn.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=is_causal
    )  # B L H Dh
    return o.transpose(1, 2)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_register(
    AttentionPath(
        "reference",
        "reference",
        MASK_KINDS,
        LAYOUTS,
        ("cpu", "cuda"),
        "dense scores in float64 (cast back to the input dtype): the ground truth",
        _run_reference,
        dtypes=(*_FLOATS, torch.float64),
    )
)
_register(
    AttentionPath(
        "sdpa",
        "eager",
        MASK_KINDS,
        LAYOUTS,
        ("cpu", "cuda"),
        "F.scaled_dot_product_attention, torch picks the backend; packed: one call per sequence",
        _make_sdpa(None),
        dtypes=(*_FLOATS, torch.float64),
    )
)
for _b, _desc in (
    ("math", "SDPA math backend (materialises the scores; any mask)"),
    ("flash", "SDPA FlashAttention backend (CUDA: no custom masks; CPU: its own flash kernel)"),
    ("efficient", "SDPA memory-efficient backend (xFormers kernel; CUDA)"),
    ("cudnn", "SDPA cuDNN backend (CUDA, Hopper+)"),
):
    _register(
        AttentionPath(
            _b,
            "eager",
            MASK_KINDS,
            LAYOUTS,
            ("cpu", "cuda") if _b in ("math", "flash") else ("cuda",),
            _desc + "; packed: one call per sequence",
            _make_sdpa(_b),
            dtypes=(*_FLOATS, torch.float64),
            probe=_sdpa_probe(_b),
        )
    )
_register(
    AttentionPath(
        "flex",
        "compile",
        MASK_KINDS,
        LAYOUTS,
        ("cpu", "cuda"),
        "torch.compile(flex_attention) with a BlockMask (packed: document mask over the packed "
        "sequence); CPU: forward only, first call compiles (~10-30 s)",
        _make_flex(True),
        dtypes=_FLOATS,
        backward_devices=("cuda",),
    )
)
_register(
    AttentionPath(
        "flex_eager",
        "eager",
        MASK_KINDS,
        LAYOUTS,
        ("cpu", "cuda"),
        "flex_attention uncompiled: the debug path, materialises the scores; CPU: forward only",
        _make_flex(False),
        dtypes=(*_FLOATS, torch.float64),
        backward_devices=("cuda",),
    )
)
_register(
    AttentionPath(
        "triton",
        "triton",
        ("full", "causal"),
        LAYOUTS,
        ("cpu", "cuda"),
        "lab_kernels.attention: hand-written FlashAttention-2 fwd+bwd (CPU: interpreter, correctness only)",
        _run_triton,
        dtypes=kernel.TRITON_DTYPES,
        head_dims=kernel.HEAD_DIMS,
    )
)
_register(
    AttentionPath(
        "flash_attn",
        "library",
        ("full", "causal"),
        LAYOUTS,
        ("cuda",),
        "flash-attn library (flash_attn_func / flash_attn_varlen_func)",
        _run_flash_attn,
        dtypes=(torch.float16, torch.bfloat16),
        available=_flash_attn_available,
    )
)
#: The attention paths' names, read from the one registry (registration order).
PATHS: tuple[str, ...] = tuple(REGISTRY)
