"""Saved activations: the hooks that measure them (each storage once, attributed to the
region and op that made it) and the analytic model that equals them."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lab_utils.core.config import ConfigError, check_choice, check_int
from lab_utils.core.dtypes import parse_dtype
from lab_utils.model import CHECKPOINT_POLICIES, MMDiTConfig, build_model, resolve_config
from lab_utils.model.checkpointing import RECOMPUTE_POLICIES, SELECTIVE_POLICIES, block_policy, capture
from lab_utils.model.train import rf_loss, synthetic_batch

#: The dtypes the memory lab accounts for (parameters and activations in one dtype).
MEMORY_DTYPES = ("float32", "bfloat16")
#: Memory of one H200 (141 GB, decimal) when no device is given.
H200_BYTES = 141 * 10**9
#: Top-level modules of the MMDiT outside the blocks, each its own region.
EMBED_REGIONS = ("img_in", "txt_in", "time_in", "vector_in", "guidance_in", "pe_embedder", "final_layer")
#: Policies whose saved bytes the analytic model predicts exactly.
FORMULA_POLICIES = tuple(p for p in CHECKPOINT_POLICIES if p != "compile_budget")


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (the same for every view of it, also on ``meta``)."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


# --------------------------------------------------------------------------------------
# Regions: which part of the model is running
# --------------------------------------------------------------------------------------


def block_names(cfg: MMDiTConfig) -> list[str]:
    return [f"double_blocks.{i}" for i in range(cfg.depth_double)] + [
        f"single_blocks.{i}" for i in range(cfg.depth_single)
    ]


def check_block(cfg: MMDiTConfig, block: str, param: str = "block") -> str:
    """``block`` as "double_blocks.i" / "single_blocks.i"; an index out of range names ``param``."""
    names = block_names(cfg)
    if block not in names:
        raise ConfigError(
            param,
            block,
            f"one of double_blocks.0..{cfg.depth_double - 1}, "
            f"single_blocks.0..{cfg.depth_single - 1} (preset {cfg.preset!r})",
        )
    return block


class RegionTracker:
    """A stack of the model's regions, kept by forward pre/post hooks registered from outside
    (blocks by ``named_modules`` name, the embedders and final layer by name); outside the
    model the region is ``outside`` (the loss)."""

    def __init__(self, model: nn.Module, outside: str = "loss"):
        self.stack: list[str] = [outside]
        self.handles = []
        names = set(EMBED_REGIONS) | {n for n, _ in model.named_modules() if n.count(".") == 1 and "blocks." in n}
        for name, mod in model.named_modules():
            if name in names:
                self._track(mod, name)
        self._track(model, "model")

    def _track(self, mod: nn.Module, name: str) -> None:
        self.handles.append(mod.register_forward_pre_hook(self._enter(name)))
        self.handles.append(mod.register_forward_hook(self._leave(name), always_call=True))

    def _enter(self, name):
        def hook(mod, args):
            self.stack.append(name)

        return hook

    def _leave(self, name):
        def hook(mod, args, out):
            if self.stack[-1] == name:
                self.stack.pop()

        return hook

    @property
    def current(self) -> str:
        return self.stack[-1]

    def remove(self):
        for h in self.handles:
            h.remove()


class CreatorMode(TorchDispatchMode):
    """Remembers, for every storage an op creates, the region and aten op that made it.
    Outputs that share an input's storage (views, in-place ops) keep their creator."""

    def __init__(self, regions: RegionTracker):
        super().__init__()
        self.regions = regions
        self.made: dict[int, tuple[str, str]] = {}
        self.events: list[tuple[str, str, int, int]] = []  # (region, op, storage key, bytes) per new storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                k = storage_key(t)
                if k not in ins:
                    where = (self.regions.current, func.overloadpacket.__name__)
                    self.made[k] = where
                    self.events.append((*where, k, storage_bytes(t)))
        return out


# --------------------------------------------------------------------------------------
# Saved-tensor measurement
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedTensor:
    region: str  # "double_blocks.0", "single_blocks.3", "img_in", "model", "loss", "input"
    op: str  # the aten op that made the storage ("input" for tensors made outside the step)
    how: str  # "saved" (autograd), "kept_input" (checkpoint), "selective_cache"
    nbytes: int  # of the whole storage
    shape: tuple
    dtype: str


@dataclass
class SavedReport:
    """The storages kept for the backward after one forward, each counted once."""

    tensors: list[SavedTensor] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.tensors:
            out[t.region] += t.nbytes
        return dict(out)

    def by_op(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = defaultdict(int)
        for t in self.tensors:
            out[(t.region, t.op)] += t.nbytes
        return dict(out)

    def rows(self) -> list[dict]:
        return [
            dict(region=t.region, op=t.op, how=t.how, bytes=t.nbytes, shape=t.shape, dtype=t.dtype)
            for t in self.tensors
        ]


@contextmanager
def saved_tensor_probe(model: nn.Module, *, creators: bool = True) -> Iterator[SavedReport]:
    """Inside: every storage autograd saves (parameters and buffers skipped), every input a
    checkpointed block keeps and every output a selective policy caches, counted once,
    attributed to the region and op that made it.  The report is complete on exit.

    ``creators=False`` attributes a storage to the region running when it was saved (op
    "saved"): torch.compile runs eager under a dispatch mode, so the compiled policy is
    measured that way."""
    report = SavedReport()
    state = {storage_key(p) for p in model.parameters()} | {storage_key(b) for b in model.buffers()}
    regions = RegionTracker(model)
    mode = CreatorMode(regions) if creators else contextlib.nullcontext()
    seen: dict[int, tuple[torch.Tensor, str]] = {}
    saved_in: dict[int, tuple[str, str]] = {}

    def note(t: torch.Tensor, how: str) -> None:
        k = storage_key(t)
        if k not in state and k not in seen:
            seen[k] = (t, how)
            saved_in[k] = (regions.current, "saved")

    def pack(t):
        note(t, "saved")
        return t

    try:
        with capture() as cap, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            yield report
        for _, _, ts in cap.kept_inputs:
            for t in ts:
                note(t, "kept_input")
        for _, _, storage in cap.selective_caches:
            for t in tree_leaves(storage):
                t = getattr(t, "val", t)
                if isinstance(t, torch.Tensor):
                    note(t, "selective_cache")
    finally:
        regions.remove()
    for k, (t, how) in seen.items():
        region, op = mode.made.get(k, ("input", "input")) if creators else saved_in[k]
        report.tensors.append(
            SavedTensor(region, op, how, storage_bytes(t), tuple(t.shape), str(t.dtype).replace("torch.", ""))
        )


# --------------------------------------------------------------------------------------
# The analytic model of saved activations
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepShape:
    """One step's token shape: batch, image tokens, text tokens."""

    batch: int
    img_tokens: int
    txt_tokens: int

    @property
    def tokens(self) -> int:
        return self.img_tokens + self.txt_tokens


def step_shape(cfg: MMDiTConfig, batch: int, height: int, width: int, txt_len: int) -> StepShape:
    check_int("batch_size", batch, min=1)
    check_int("txt_len", txt_len, min=1)
    h, w = cfg.check_resolution(height, width)
    return StepShape(batch, h * w, txt_len)


def _qk_extra(n_tokens: int, d: int, s: int) -> int:
    """QK-norm's saved float32 work for q and k of ``n_tokens`` rows: in float32 the
    normalised q/k (x·rrms); in a 16-bit dtype the float32 upcasts and the rounded
    normalised q/k."""
    return 2 * n_tokens * d * 4 + (0 if s == 4 else 2 * n_tokens * d * s)


def double_block_bytes(cfg: MMDiTConfig, sh: StepShape, s: int, stat: int | None = None) -> dict[str, int]:
    """Bytes a double-stream block saves with no checkpointing, by part: ``own`` (made and
    freed inside the block) and ``output`` (img and txt out, kept by whoever reads them)."""
    b, d, m, h, dh = sh.batch, cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads, cfg.head_dim
    own = 0
    views = 0  # streams whose slice of the joint attention output the projection saves as a view
    for n in (sh.img_tokens, sh.txt_tokens):
        rows = b * n
        # The projection flattens its (B, n, D) slice of the joint output o (B, Li+Lt, D):
        # a view when B == 1 or n == 1, else a copy of the slice.  A view keeps all of o.
        if b == 1 or n == 1:
            views += 1
        else:
            own += rows * d * s  # the copied slice
        own += 7 * rows * d * s  # 2 LN outs, 2 modulated inputs, proj out, residual, fc2 out
        own += 2 * rows * m * s  # fc1 out (GELU input), GELU out (fc2 input)
        own += 9 * b * d * s  # SiLU(vec), adaLN out (6D), two (1 + scale)
        own += 4 * rows * (stat or s)  # LayerNorm mean and rstd, twice
        own += 2 * b * h * n * 4  # RMSNorm rrms of q and k (float32)
        own += 2 * n * dh * 8  # RoPE 2x2 rotation tables of q and k (float32)
        own += _qk_extra(rows, d, s) + (3 * rows * d * s if s == 4 else 0)  # float32: q/k are views of qkv
    rows = b * sh.tokens
    own += 4 * rows * d * s + b * h * sh.tokens * 4  # cat q, k, v; attention out + logsumexp
    own += rows * d * s if views else 0  # o itself, kept whole by a viewed slice
    return {"own": own, "output": rows * d * s}


def single_block_bytes(cfg: MMDiTConfig, sh: StepShape, s: int, stat: int | None = None) -> dict[str, int]:
    """Bytes a single-stream block saves with no checkpointing (see :func:`double_block_bytes`)."""
    b, d, m, h, dh = sh.batch, cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads, cfg.head_dim
    n = sh.tokens
    rows = b * n
    own = 6 * rows * d * s  # LN out, modulated input, q and k after RoPE, attention out, linear2 out
    own += rows * (3 * d + m) * s  # linear1 out (q k v | mlp; GELU reads it)
    own += rows * (d + m) * s  # cat(attn, GELU(mlp)), linear2's input
    own += b * h * n * 4  # attention logsumexp
    own += 5 * b * d * s  # SiLU(vec), adaLN out (3D), (1 + scale)
    own += 2 * rows * (stat or s) + 2 * b * h * n * 4 + 2 * n * dh * 8  # LN stats, rrms, RoPE tables
    own += _qk_extra(rows, d, s)
    return {"own": own, "output": rows * d * s}


def selective_cache_bytes(cfg: MMDiTConfig, sh: StepShape, s: int, kind: str, policy: str) -> int:
    """What a selective ``policy`` caches in one block: matmul and/or attention outputs."""
    b, d, m, h = sh.batch, cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads
    fams = SELECTIVE_POLICIES[policy]
    out = 0
    if "matmul" in fams:
        if kind == "double":
            for n in (sh.img_tokens, sh.txt_tokens):
                out += 6 * b * d * s + b * n * (3 * d + d + m + d) * s  # adaLN, qkv, proj, fc1, fc2
        else:
            out += 3 * b * d * s + b * sh.tokens * ((3 * d + m) + d) * s  # adaLN, linear1, linear2
    if "attention" in fams:
        out += b * sh.tokens * d * s + b * h * sh.tokens * 4
    return out


def saved_bytes_formula(
    cfg: MMDiTConfig, sh: StepShape, dtype: str | torch.dtype, policy: str | None = None, device_type: str = "cpu"
) -> dict[str, int]:
    """Bytes kept for the backward after the forward of one rectified-flow step, per region,
    from the config alone (device bytes: under ``offload`` what sits in host memory is left
    out).  Equals :func:`measure_saved` exactly on CPU for every policy in
    :data:`FORMULA_POLICIES` (tests).  ``device_type="cuda"`` keeps LayerNorm statistics in
    float32 as CUDA's kernels do (CPU keeps them in the input dtype); flash attention's few
    RNG-state bytes are left out."""
    policy = policy or cfg.activation_checkpoint
    check_choice("activation_checkpoint", policy, FORMULA_POLICIES)
    s = parse_dtype("dtype", dtype).itemsize
    stat = s if device_type == "cpu" else 4
    b, d, c = sh.batch, cfg.hidden_size, cfg.in_channels
    li, lt, n = sh.img_tokens, sh.txt_tokens, sh.tokens
    nd, ns = cfg.depth_double, cfg.depth_single
    offload = policy == "offload"
    out: dict[str, int] = {}
    kinds = [("double", i) for i in range(nd)] + [("single", i) for i in range(ns)]
    for kind, i in kinds:
        parts = (double_block_bytes if kind == "double" else single_block_bytes)(cfg, sh, s, stat)
        treated = block_policy(policy, kind, i)
        if not treated:
            own = parts["own"]
        elif policy in SELECTIVE_POLICIES:
            own = selective_cache_bytes(cfg, sh, s, kind, policy)
        else:
            own = 0
        # The output is kept by the next block (saved, or kept as a checkpoint input) or
        # by the final layer; the last double block's outputs are only concatenated.
        last_double = kind == "double" and i == nd - 1
        last_single = kind == "single" and i == ns - 1
        if last_double:
            kept = 0
        elif offload:
            kept = parts["output"] if last_single else 0
        else:
            kept = parts["output"]
        out[f"{kind}_blocks.{i}"] = own + kept
    # img_in / txt_in outputs are kept by the first double block; with no double block they
    # are only concatenated (cat saves nothing) and the joint sequence is counted in "model".
    first_keeps = nd > 0 and not offload
    out["img_in"] = b * li * d * s if first_keeps else 0
    out["txt_in"] = b * lt * d * s if first_keeps else 0
    for name in ("time_in", "vector_in") + (("guidance_in",) if cfg.guidance_embed else ()):
        out[name] = 2 * b * d * s
    cat_kept = not (offload and ns > 0)
    out["model"] = b * d * s + (2 if cfg.guidance_embed else 1) * b * 256 * s + (b * n * d * s if cat_kept else 0)
    ckpt_inputs = policy in RECOMPUTE_POLICIES and any(block_policy(policy, k, i) for k, i in kinds)
    out["pe_embedder"] = 4 * n * cfg.head_dim if ckpt_inputs else 0
    out["final_layer"] = 2 * b * d * s + 2 * b * li * stat + 2 * b * li * d * s + (b * li * c * 4 if s == 4 else 0)
    out["loss"] = b * li * c * s + (1 if s == 4 else 2) * b * li * c * 4
    out["input"] = b * lt * cfg.context_dim * s + b * cfg.pooled_dim * s
    return {k: v for k, v in out.items() if v}


def bytes_per_token_per_block(
    cfg: MMDiTConfig,
    dtype: str | torch.dtype,
    kind: str = "single",
    img_tokens: int = 4096,
    txt_tokens: int = 512,
    device_type: str = "cuda",
) -> float:
    """Saved bytes of one block with no checkpointing (batch 1) per token of its sequence of
    ``img_tokens + txt_tokens`` tokens; LayerNorm statistics in float32 on ``cuda``, in the
    activation dtype on ``cpu`` (see :func:`saved_bytes_formula`)."""
    check_choice("kind", kind, ("double", "single"))
    check_int("img_tokens", img_tokens, min=1)
    check_int("txt_tokens", txt_tokens, min=1)
    check_choice("device_type", device_type, ("cpu", "cuda"))
    sh = StepShape(1, img_tokens, txt_tokens)
    s = parse_dtype("dtype", dtype).itemsize
    stat = s if device_type == "cpu" else 4
    parts = (double_block_bytes if kind == "double" else single_block_bytes)(cfg, sh, s, stat)
    return (parts["own"] + parts["output"]) / sh.tokens


def measure_saved(
    cfg: MMDiTConfig | str,
    sh: StepShape,
    dtype: str | torch.dtype = "float32",
    policy: str | None = None,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    model: nn.Module | None = None,
) -> SavedReport:
    """Run the forward of one rectified-flow step (batch built outside the probe) and return
    what it keeps for the backward.  ``device="meta"`` works for every preset.

    A ``model`` passed in runs the policy applied to it (``model.activation_checkpoint``, taken
    when ``policy`` is None): a ``policy`` or ``cfg`` that differs from the model's is refused
    rather than silently measuring something else."""
    cfg = resolve_config(cfg)
    if policy is not None:
        cfg = cfg.replace(activation_checkpoint=policy)
    elif model is not None and getattr(model, "cfg", None) is not None:
        cfg = cfg.replace(activation_checkpoint=model.activation_checkpoint.name)  # none asked for: the model's
    dt = parse_dtype("dtype", dtype)
    dev = torch.device(device)
    if model is None:
        model = build_model(cfg, device=dev, dtype=dt, seed=seed)
    else:
        own = getattr(model, "cfg", None)
        if own is None:
            raise ConfigError("model", type(model).__name__, "an MMDiT (built by build_model, with its .cfg)")
        applied = model.activation_checkpoint.name
        if applied != cfg.activation_checkpoint:
            raise ConfigError(
                "policy",
                cfg.activation_checkpoint,
                f"the model's own policy {applied!r} (the model runs the policy applied to it; "
                "pass policy=None or a model built with this activation_checkpoint)",
            )
        if own != cfg:
            diff = {f.name: getattr(own, f.name) for f in fields(own) if getattr(own, f.name) != getattr(cfg, f.name)}
            raise ConfigError("cfg", cfg.preset, f"the model's own config (it differs in {diff})")
    model.train()
    gen = torch.Generator(device="cpu").manual_seed(seed) if dev.type != "meta" else None
    batch = batch_for(cfg, sh, dt, dev, gen)
    with saved_tensor_probe(model, creators=cfg.activation_checkpoint != "compile_budget") as report:
        loss = rf_loss(model, batch, gen)
    del loss
    return report


def batch_for(cfg: MMDiTConfig, sh: StepShape, dt: torch.dtype, dev: torch.device, gen=None):
    """A synthetic batch of ``sh`` (square-ish grid: img_tokens = 1 x img_tokens when not square)."""
    ppt = cfg.pixels_per_token
    h = int(math.isqrt(sh.img_tokens))
    while sh.img_tokens % h:
        h -= 1
    w = sh.img_tokens // h
    return synthetic_batch(
        cfg, sh.batch, height=h * ppt, width=w * ppt, txt_len=sh.txt_tokens, generator=gen, device=dev, dtype=dt
    )
