"""Whole MMDiT blocks with the fused ops from one provider: the same double- or single-stream
block (same weights, same inputs) with its fused ops taken from eager torch, the Triton
kernels or Liger's, optionally compiled whole, or diffusers' own block (its QKV projections
unfused or fused: ``lab_utils.fused.peer_blocks``); their outputs compared with the eager
block's and their forward + backward timed (Triton on CPU: compared, never timed)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lab_kernels import get_variant
from lab_utils.core.records import Recorder
from lab_utils.core.timing import try_bench
from lab_utils.fused import peer_blocks as peers
from lab_utils.fused.ops import as_dtype, as_tuple, peak_memory_bytes
from lab_utils.model import DoubleStreamBlock, KernelSet, MMDiTConfig, Seams, SingleStreamBlock
from lab_utils.model.config import kernel_map

BLOCK_PROVIDERS = {
    # name: (kernels variant for every fused op, or {op: variant}; torch.compile the whole block)
    "eager": ("eager", False),
    "compile": ("eager", True),
    "triton": ("triton", False),
    "triton+compile": ("triton", True),
    "liger": (peers.LIGER_KERNELS, False),
    # diffusers' own block (kernels: none of perflab's), QKV projections unfused / fused
    "diffusers": ("diffusers", False),
    "diffusers+fused_qkv": ("diffusers", False),
}


def interpreted_kernels(kernels) -> bool:
    """Whether a provider's kernels include a Triton variant (on CPU: the interpreter, never timed)."""
    if kernels == "diffusers":
        return False
    return any(get_variant(op, name).kind == "triton" for op, name in kernel_map(kernels).items())


@dataclass
class BlockCase:
    provider: str
    kind: str  # "double" | "single"
    fn: Callable  # one forward + backward
    forward: Callable  # forward only -> outputs
    shape: str
    kernels: str  # a variant name, "liger" (lab_utils.fused.peer_blocks.LIGER_KERNELS) or "diffusers"
    compiled: bool
    interpreted: bool = False  # Triton kernels on CPU: compared, never timed


def _block_inputs(cfg, kind: str, batch: int, img_tokens: int, txt_tokens: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    D, half = cfg.hidden_size, cfg.head_dim // 2
    L = img_tokens + txt_tokens
    ang = torch.rand(L, half, generator=g) * 50
    pe = (torch.cos(ang).to(device), torch.sin(ang).to(device))

    def t(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_()

    vec = t(batch, D)
    if kind == "double":
        return (t(batch, img_tokens, D), t(batch, txt_tokens, D), vec, pe)
    return (t(batch, L, D), vec, pe)


def block_cases(
    preset: str = "tiny",
    *,
    kinds: Sequence[str] = ("double", "single"),
    providers: Sequence[str] = ("eager", "compile", "triton"),
    batch: int = 1,
    img_tokens: int = 64,
    txt_tokens: int = 16,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
) -> list[BlockCase]:
    """One MMDiT block per kind (weights shared by every provider), wrapped per provider."""
    dt = as_dtype(dtype)
    for p in providers:
        if p not in BLOCK_PROVIDERS:
            raise ValueError(f"parameter 'block_providers' has {p!r}; allowed: {', '.join(BLOCK_PROVIDERS)}")
    cfg = MMDiTConfig.from_preset(preset)
    out = []
    for kind in kinds:
        if kind not in ("double", "single"):
            raise ValueError(f"parameter 'block_kinds' has {kind!r}; allowed: 'double', 'single'")
        cls = DoubleStreamBlock if kind == "double" else SingleStreamBlock
        torch.manual_seed(seed)
        base = cls(cfg, Seams(KernelSet("eager"), cfg.attention_path))
        ref = None
        if any(p in peers.DIFFUSERS_PROVIDERS for p in providers):  # every provider on diffusers' weights
            ref = peers.diffusers_block(kind, cfg, seed=seed)
            peers.load_into(base, kind, ref)
        base = base.to(device=device, dtype=dt)
        inputs = _block_inputs(cfg, kind, batch, img_tokens, txt_tokens, dt, device, seed)
        diff = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        shape = (
            f"B{batch}xLimg{img_tokens}xLtxt{txt_tokens}xD{cfg.hidden_size}"
            if kind == "double"
            else f"B{batch}xL{img_tokens + txt_tokens}xD{cfg.hidden_size}"
        )
        for p in providers:
            kernels, comp = BLOCK_PROVIDERS[p]
            if p in peers.DIFFUSERS_PROVIDERS:
                blk = copy.deepcopy(ref).to(device=device, dtype=dt)
                if peers.DIFFUSERS_PROVIDERS[p]:
                    peers.fuse_qkv(blk)
                fwd = peers.diffusers_forward(blk, kind, txt_tokens)
            else:
                blk = copy.deepcopy(base)
                seams = Seams(KernelSet(kernels, device=device, dtype=dt), cfg.attention_path)
                for m in blk.modules():
                    if hasattr(m, "_seams"):
                        m._seams = seams
                fwd = torch.compile(blk) if comp else blk
            params = [q for q in blk.parameters() if q.requires_grad]

            def one(fwd=fwd, params=params, inputs=inputs, diff=diff):
                outs = as_tuple(fwd(*inputs))
                return torch.autograd.grad(outs, diff + params, [torch.ones_like(o) for o in outs])

            label = p if p in ("liger", *peers.DIFFUSERS_PROVIDERS) else kernels
            interp = torch.device(device).type == "cpu" and interpreted_kernels(kernels)
            forward = lambda fwd=fwd, inputs=inputs: as_tuple(fwd(*inputs))  # noqa: E731
            out.append(BlockCase(p, kind, one, forward, shape, label, comp, interp))
    return out


def block_agreement(cases: Sequence[BlockCase], baseline: str = "eager") -> list[dict]:
    """Max abs difference of each provider's block outputs from the baseline provider's
    (same weights, same inputs): shows a fused variant is a drop-in replacement."""
    rows = []
    for kind in dict.fromkeys(c.kind for c in cases):
        ks = [c for c in cases if c.kind == kind]
        base = next((c for c in ks if c.provider == baseline), None)
        if base is None:
            continue
        with torch.no_grad():
            ref = [o.float() for o in base.forward()]
            for c in ks:
                outs = [o.float() for o in c.forward()]
                err = max(float((a - b).abs().max()) for a, b in zip(outs, ref))
                scale = max(float(b.abs().max()) for b in ref)
                rows.append(dict(kind=kind, provider=c.provider, max_abs_diff=err, max_abs_ref=scale))
    return rows


def block_compare(
    rec: Recorder,
    cases: Sequence[BlockCase],
    *,
    device="cpu",
    dtype=torch.float32,
    reps: int = 10,
    budget_s: float = 30.0,
    experiment: str = "block",
) -> None:
    """Time each case's forward + backward (median/p20/p80), speedup over the eager
    provider and peak memory (CUDA).  Providers running Triton on CPU are not timed."""
    dev = torch.device(device)
    eager_ms: dict[str, float] = {}
    for c in sorted(cases, key=lambda c: c.provider != "eager"):
        extra = dict(kind=c.kind, kernels=c.kernels, compiled=c.compiled, direction="fwd+bwd")
        if c.interpreted:
            continue  # Triton's interpreter: correctness only (block_agreement)
        t = try_bench(c.fn, name=f"{c.kind}/{c.provider}", device=dev, reps=reps, budget_s=budget_s)
        rec.add_timing(experiment, c.provider, t, shape=c.shape, dtype=dtype, **extra)
        if not getattr(t, "ok", False):
            continue
        if c.provider == "eager":
            eager_ms[c.kind] = t.median_ms
        if c.kind in eager_ms:
            rec.add(
                experiment,
                c.provider,
                "speedup_vs_eager",
                eager_ms[c.kind] / t.median_ms,
                "x",
                shape=c.shape,
                dtype=dtype,
                statistic="median",
                formula="eager median / provider median",
                **extra,
            )
        mem = peak_memory_bytes(c.fn, dev)
        if mem is not None:
            rec.add(
                experiment,
                c.provider,
                "peak_memory",
                mem / 2**20,
                "MiB",
                shape=c.shape,
                dtype=dtype,
                statistic="value",
                formula="max_memory_allocated - allocated before the call",
                **extra,
            )


__all__ = ["BLOCK_PROVIDERS", "BlockCase", "block_agreement", "block_cases", "block_compare"]
