"""Fused-op problems and inputs: one size for every op of ``lab_kernels``, drawn from a seed.

One :class:`Problem` describes a size for every op (batch, tokens, hidden; heads x
head_dim for the rope ops).  :data:`OPS` maps each op to an :class:`OpSpec`: how to draw
its inputs (float64 from a seeded generator for checks, float32 on the device for
benchmarks), which of them are differentiable; the bytes it must move and its FLOPs are
counted in ``lab_utils.core.flops``.  :func:`problems_for` takes sizes from the model presets.
``lab_utils.fused.ops`` checks and times the variants on these inputs and re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lab_utils.core import flops as F
from lab_utils.core.dtypes import LAB_DTYPES, parse_dtype
from lab_utils.model import PRESETS

OP_NAMES = F.FUSED_OPS
DIRECTIONS = F.DIRECTIONS
DTYPES = {name: parse_dtype("dtype", name) for name in LAB_DTYPES}


def as_dtype(d) -> torch.dtype:
    """A lab dtype name (or a torch.dtype) as a torch.dtype; ConfigError naming 'dtype' otherwise."""
    return parse_dtype("dtype", d, LAB_DTYPES)


@dataclass(frozen=True)
class Problem:
    """One size for every op: x (batch, tokens, hidden); q, k (batch, heads, tokens, head_dim)."""

    batch: int
    tokens: int
    hidden: int
    head_dim: int = 128

    @property
    def heads(self) -> int:
        return max(1, self.hidden // self.head_dim)

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    def label(self) -> str:
        return f"B{self.batch}xL{self.tokens}xD{self.hidden}"


@dataclass
class OpInputs:
    args: list  # positional arguments of the op, float64 on CPU
    grads: tuple[str, ...]  # names of the differentiable arguments
    names: tuple[str, ...]  # names of all arguments
    tables: tuple[str, ...] = ()  # arguments that stay float32 whatever the dtype (rope cos/sin)
    shape: tuple = ()  # the main tensor's shape, for records and capability checks


@dataclass(frozen=True)
class OpSpec:
    op: str
    make: Callable[[Problem, Draw], OpInputs]
    n_outputs: int = 1
    problem_kw: Callable[[Problem], dict] = field(default=lambda p: {"shape": (p.batch, p.tokens, p.hidden)})

    def bytes(self, p: Problem, dtype, direction: str) -> float:
        """Bytes one call must move (``lab_utils.core.flops.fused_bytes``)."""
        s = torch.empty((), dtype=as_dtype(dtype)).element_size()
        return F.fused_bytes(
            self.op, direction, batch=p.batch, tokens=p.tokens, hidden=p.hidden, head_dim=p.head_dim, elem_size=s
        )


@dataclass(frozen=True)
class Draw:
    """Where inputs are drawn: float64 on the CPU for checks; benchmarks draw float32 on the
    device (drawing GB-sized float64 tensors on the host would dominate a GPU sweep)."""

    gen: torch.Generator
    dtype: torch.dtype = torch.float64

    @property
    def device(self) -> torch.device:
        return self.gen.device


def _randn(g: Draw, *shape, scale=1.0, offset=0.0):
    return torch.randn(*shape, generator=g.gen, dtype=g.dtype, device=g.device) * scale + offset


def _tables(p: Problem, g):
    # FLUX-like angles: position × frequency 10000^(-2i/Dh), positions shuffled per draw.
    half = p.head_dim // 2
    pos = torch.randperm(max(p.tokens, 1) * 4, generator=g.gen, device=g.device)[: p.tokens].to(g.dtype)
    freq = 10000.0 ** (-torch.arange(half, dtype=g.dtype, device=g.device) * 2 / p.head_dim)
    ang = pos[:, None] * freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def _make_rms(p, g):
    x = _randn(g, p.batch, p.tokens, p.hidden)
    return OpInputs(
        [x, _randn(g, p.hidden, scale=0.1, offset=1.0)], ("x", "weight"), ("x", "weight"), shape=tuple(x.shape)
    )


def _make_lnm(p, g):
    x = _randn(g, p.batch, p.tokens, p.hidden, scale=2.0, offset=0.5)
    return OpInputs(
        [x, _randn(g, p.batch, p.hidden, scale=0.5), _randn(g, p.batch, p.hidden, scale=0.5)],
        ("x", "shift", "scale"),
        ("x", "shift", "scale"),
        shape=tuple(x.shape),
    )


def _make_gr(p, g):
    x = _randn(g, p.batch, p.tokens, p.hidden)
    return OpInputs(
        [x, _randn(g, p.batch, p.hidden, scale=0.5), _randn(g, p.batch, p.tokens, p.hidden)],
        ("x", "gate", "y"),
        ("x", "gate", "y"),
        shape=tuple(x.shape),
    )


def _make_gelu(p, g):
    x = _randn(g, p.batch, p.tokens, p.hidden, scale=2.0)
    return OpInputs([x], ("x",), ("x",), shape=tuple(x.shape))


def _make_swiglu(p, g):
    gate = _randn(g, p.batch, p.tokens, p.hidden, scale=2.0)
    return OpInputs(
        [gate, _randn(g, p.batch, p.tokens, p.hidden)], ("gate", "up"), ("gate", "up"), shape=tuple(gate.shape)
    )


def _qk(p, g):
    shp = (p.batch, p.heads, p.tokens, p.head_dim)
    return _randn(g, *shp), _randn(g, *shp, scale=1.5)


def _make_rope(p, g):
    q, k = _qk(p, g)
    cos, sin = _tables(p, g)
    return OpInputs([q, k, cos, sin], ("q", "k"), ("q", "k", "cos", "sin"), tables=("cos", "sin"), shape=tuple(q.shape))


def _make_qknr(p, g):
    q, k = _qk(p, g)
    cos, sin = _tables(p, g)
    return OpInputs(
        [q, k, _randn(g, p.head_dim, scale=0.1, offset=1.0), _randn(g, p.head_dim, scale=0.1, offset=1.0), cos, sin],
        ("q", "k", "q_weight", "k_weight"),
        ("q", "k", "q_weight", "k_weight", "cos", "sin"),
        tables=("cos", "sin"),
        shape=tuple(q.shape),
    )


def _rope_kw(p):
    return {"shape": (p.batch, p.heads, p.tokens, p.head_dim), "head_dim": p.head_dim}


# How each op's inputs are drawn; its bytes and FLOPs are counted in lab_utils.core.flops.
OPS: dict[str, OpSpec] = {
    "rms_norm": OpSpec("rms_norm", _make_rms),
    "layer_norm_modulate": OpSpec("layer_norm_modulate", _make_lnm),
    "gated_residual": OpSpec("gated_residual", _make_gr),
    "gelu_tanh": OpSpec("gelu_tanh", _make_gelu),
    "swiglu": OpSpec("swiglu", _make_swiglu),
    "rope": OpSpec("rope", _make_rope, n_outputs=2, problem_kw=_rope_kw),
    "qk_norm_rope": OpSpec("qk_norm_rope", _make_qknr, n_outputs=2, problem_kw=_rope_kw),
}


def flops(op: str, problem: Problem, direction: str) -> float:
    """FLOPs of one call (``lab_utils.core.flops.fused_flops``: per-element counts documented there)."""
    return F.fused_flops(
        op, direction, batch=problem.batch, tokens=problem.tokens, hidden=problem.hidden, head_dim=problem.head_dim
    )


def spec(op: str) -> OpSpec:
    if op not in OPS:
        raise ValueError(f"parameter 'op' = {op!r} is not allowed: expected one of {', '.join(OPS)}")
    return OPS[op]


def bytes_moved(op: str, problem: Problem, dtype, direction: str) -> float:
    """Bytes the op must move for one call in ``direction`` (documented per op)."""
    return spec(op).bytes(problem, dtype, direction)


def _generator(seed: int | None) -> tuple[torch.Generator, int]:
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # fresh inputs, reported for reproduction
    g = torch.Generator().manual_seed(seed)
    return g, seed


def make_inputs(
    op: str,
    problem: Problem,
    dtype,
    device="cpu",
    *,
    seed: int | None = None,
    requires_grad: bool = True,
    fast: bool = False,
):
    """(args in dtype on device, OpInputs in float64, seed).  Tables stay float32.
    ``fast``: draw in float32 directly on ``device`` (benchmarks; values differ from the
    float64 draw of the same seed)."""
    g, seed = _generator(seed)
    draw = Draw(torch.Generator(device=device).manual_seed(seed), torch.float32) if fast else Draw(g)
    inp = spec(op).make(problem, draw)
    dt = as_dtype(dtype)
    args = []
    for name, a in zip(inp.names, inp.args):
        t = a.to(device=device, dtype=torch.float32 if name in inp.tables else dt)
        if requires_grad and name in inp.grads:
            t.requires_grad_(True)
        args.append(t)
    return args, inp, seed


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# ---------------------------------------------------------------------------------------------
# Sizes from the model presets


def preset_dims(preset: str) -> dict:
    """hidden size, heads, head dim and MLP hidden of a model preset (``lab_utils.model.PRESETS``)."""
    if preset not in PRESETS:
        raise ValueError(f"parameter 'preset' = {preset!r} is not allowed: expected one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    hidden, heads = int(p["hidden_size"]), int(p["num_heads"])
    return dict(hidden=hidden, heads=heads, head_dim=hidden // heads, mlp_hidden=int(hidden * p["mlp_ratio"]))


def problems_for(
    presets: Sequence[str], tokens: Sequence[int], *, batch: int = 1, include_mlp: bool = True
) -> list[Problem]:
    """Token counts × hidden sizes taken from presets (and their MLP widths)."""
    out = []
    for pr in presets:
        d = preset_dims(pr)
        widths = [d["hidden"]] + ([d["mlp_hidden"]] if include_mlp else [])
        for L in tokens:
            for w in widths:
                pb = Problem(batch, int(L), w, d["head_dim"])
                if pb not in out:
                    out.append(pb)
    return out


def ops_sizes_note() -> str:
    return (
        "rms_norm, layer_norm_modulate, gated_residual, gelu_tanh, swiglu: x (batch, tokens, hidden); "
        "rope, qk_norm_rope: q, k (batch, hidden/head_dim, tokens, head_dim)"
    )
