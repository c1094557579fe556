"""A rectified-flow training step for the MMDiT, usable by every lab.

Design note
-----------
Objective (FLUX / SD3 rectified flow): for clean latent tokens x0 and noise ε,
sample t = sigmoid(n), n ~ N(logit_mean, logit_std) (logit-normal), form
x_t = (1 - t)·x0 + t·ε and regress the model's output on the velocity ε - x0 with an
MSE.  :func:`rf_loss` is that, on a :class:`Batch` (no encoders needed);
:func:`synthetic_batch` makes one from random tensors.

:class:`Trainer` is the full step the profiler lab measures: a real DataLoader with
aspect-ratio buckets, frozen T5/CLIP/VAE encoders (or cached latents and embeddings),
the loss under optional bf16 autocast, backward, gradient clipping, AdamW, optional
``torch.compile`` per block, and a checkpoint every N steps with ``torch.save`` or
``torch.distributed.checkpoint`` (synchronous or async).  Each phase runs inside
``torch.profiler.record_function(PHASE)`` so the profiler attributes time to it; on
CUDA the step synchronises at phase ends (``sync_phases``) so that CPU-side phase
ranges cover the GPU work they launched (this removes overlap between phases, which
is the honest price of a per-phase attribution).  :meth:`Trainer.as_step` is that step under the
step contract (``lab_utils.step.contract``), which every measurement of labs 01 and 08 takes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab_utils.attention.varlen import normalize_buckets
from lab_utils.core.config import LabConfig, built_from, check_bool, check_choice, check_float, check_int
from lab_utils.core.device import annotate, pick_device
from lab_utils.core.dtypes import DTYPES
from lab_utils.model.config import MMDiTConfig, resolve_config
from lab_utils.model.data import SyntheticImageCaptions, forever, make_loader
from lab_utils.model.encoders import Encoders, precompute, text_vocab
from lab_utils.model.layers import image_ids, patchify, text_ids
from lab_utils.model.mmdit import MMDiT, build_model
from lab_utils.model.saving import CKPT_FORMATS, Checkpointer
from lab_utils.step.contract import Periodic, StepFactory, run_step

PHASES = ("data_loading", "text_encoding", "image_encoding", "forward", "backward", "optimizer", "checkpoint")
#: parameter storage dtypes a training run offers
TRAIN_DTYPES = ("float32", "bfloat16")


# --------------------------------------------------------------------------------------
# The objective
# --------------------------------------------------------------------------------------


@dataclass
class Batch:
    """What the model consumes: clean packed latent tokens and conditioning."""

    img: torch.Tensor  # B L_img in_channels (x0)
    img_ids: torch.Tensor  # L_img 3
    txt: torch.Tensor  # B L_txt context_dim
    txt_ids: torch.Tensor  # L_txt 3
    y: torch.Tensor  # B pooled_dim
    guidance: torch.Tensor | None  # B
    txt_mask: torch.Tensor | None = None
    grid: tuple[int, int] = (0, 0)  # token grid (h, w)
    seed: int | None = None  # the seed of this batch's noise and timesteps (None: the caller's generator)

    @property
    def batch_size(self) -> int:
        return self.img.shape[0]

    def to(self, device, non_blocking: bool = False) -> Batch:
        mv = lambda t: t.to(device, non_blocking=non_blocking) if t is not None else None  # noqa: E731
        return Batch(
            mv(self.img),
            mv(self.img_ids),
            mv(self.txt),
            mv(self.txt_ids),
            mv(self.y),
            mv(self.guidance),
            mv(self.txt_mask),
            self.grid,
            self.seed,
        )


def sample_timesteps(
    n: int, generator: torch.Generator | None = None, device=None, *, logit_mean: float = 0.0, logit_std: float = 1.0
) -> torch.Tensor:
    """Logit-normal t in (0, 1): sigmoid(N(logit_mean, logit_std))."""
    return torch.sigmoid(logit_mean + logit_std * torch.randn(n, generator=generator, device=device))


@dataclass
class RFParts:
    loss: torch.Tensor
    t: torch.Tensor
    noise: torch.Tensor
    target: torch.Tensor
    pred: torch.Tensor


def rf_loss(
    model: MMDiT,
    batch: Batch,
    generator: torch.Generator | None = None,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    return_parts: bool = False,
):
    """Rectified-flow MSE: x_t = (1-t) x0 + t ε, target ε - x0, loss = mean((model(x_t, t) - target)²).

    ``generator`` (on the batch's device) draws ε and t, else one seeded with ``batch.seed`` when
    the batch carries one; the loss is computed in float32."""
    x0 = batch.img
    dev = x0.device
    if generator is None and batch.seed is not None:
        generator = torch.Generator(dev).manual_seed(batch.seed)
    t = sample_timesteps(x0.shape[0], generator, dev, logit_mean=logit_mean, logit_std=logit_std)
    noise = torch.randn(x0.shape, generator=generator, device=dev, dtype=torch.float32).to(x0.dtype)
    tt = t.to(x0.dtype)[:, None, None]
    x_t = (1 - tt) * x0 + tt * noise
    target = noise - x0
    pred = model(x_t, batch.img_ids, batch.txt, batch.txt_ids, t, batch.y, batch.guidance, txt_mask=batch.txt_mask)
    loss = torch.nn.functional.mse_loss(pred.float(), target.float())
    return RFParts(loss, t, noise, target, pred) if return_parts else loss


def synthetic_batch(
    cfg: MMDiTConfig | str,
    batch_size: int,
    *,
    height: int = 64,
    width: int = 64,
    txt_len: int = 16,
    generator: torch.Generator | None = None,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    guidance: float | None = 3.5,
) -> Batch:
    """A random :class:`Batch` for ``cfg`` (no encoders): image of height x width pixels
    (so (height/16)·(width/16) tokens for FLUX), ``txt_len`` text tokens."""
    cfg = resolve_config(cfg)
    check_int("batch_size", batch_size, min=1)
    check_int("txt_len", txt_len, min=1)
    h, w = cfg.check_resolution(height, width)
    dev = torch.device(device)
    g = generator

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev if g is None else g.device).to(dev, dtype)

    return Batch(
        img=rnd(batch_size, h * w, cfg.in_channels),
        img_ids=image_ids(h, w, dev),
        txt=rnd(batch_size, txt_len, cfg.context_dim),
        txt_ids=text_ids(txt_len, dev),
        y=rnd(batch_size, cfg.pooled_dim),
        guidance=(
            torch.full((batch_size,), float(guidance), device=dev)
            if cfg.guidance_embed and guidance is not None
            else None
        ),
        grid=(h, w),
    )


# --------------------------------------------------------------------------------------
# The step's configuration
# --------------------------------------------------------------------------------------


def _check_buckets(value, mcfg: MMDiTConfig) -> list[tuple[int, int]]:

    bk = normalize_buckets(value, "buckets")
    for h, w in bk:
        mcfg.check_resolution(h, w, param="buckets")
    return bk


#: The notebook parameters that are the model's: mapped into :attr:`TrainConfig.model` once.
MODEL_PARAMS = ("preset", "kernels", "attention_path", "recipe", "activation_checkpoint")


@dataclass(frozen=True)
class TrainParams(LabConfig):
    """The training step's parameters: names (== the notebook's parameters), defaults and what
    they mean.  :class:`TrainConfig` checks them; a lab config that holds its step's TrainConfig
    as a field (lab 08's) declares the same parameters by deriving from this."""

    preset: str = "tiny"
    device: str = "auto"
    batch_size: int = 2
    buckets: Any = ((64, 64), (64, 96))  # [height, width] pixel sizes of the aspect-ratio buckets
    min_caption_len: int = 8
    max_caption_len: int = 32
    pad_captions: str = "longest"  # "longest" in the batch | "max" (fixed, as FLUX's 512)
    encoders: str = "live"  # "live" T5/CLIP/VAE every step | "precomputed" cache
    num_samples: int = 32
    dtype: str = "float32"  # parameter storage
    autocast: str = "none"  # "none" | "bf16"
    compile: bool = False  # torch.compile each block
    activation_checkpoint: str = "none"
    kernels: str = "eager"
    attention_path: str = "sdpa"
    recipe: str = "bf16"  # precision recipe of lab_utils.precision.quantized ("bf16": no layer swapped)
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    guidance: float = 3.5
    ckpt_every: int = 0  # 0 = never
    ckpt_format: str = "torch"
    seed: int = 0


@dataclass(frozen=True)
class TrainConfig(TrainParams):
    """The training step's checked config.

    The model's parameters (:data:`MODEL_PARAMS`) are checked where they are defined, by
    :class:`MMDiTConfig`, which :class:`~lab_utils.core.config.LabConfig` builds from them once
    (``built_from``) and this config holds as :attr:`model`; this module never handles them."""

    #: the model's config, built once from the model's parameters (not a parameter itself)
    model: MMDiTConfig = built_from(MMDiTConfig.from_preset, MODEL_PARAMS)

    def __post_init__(self):
        super().__post_init__()  # builds .model: the model's parameters checked once, by MMDiTConfig
        model = self.model
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_int("batch_size", self.batch_size, min=1)
        check_int("min_caption_len", self.min_caption_len, min=1)
        check_int("max_caption_len", self.max_caption_len, min=self.min_caption_len)
        check_choice("pad_captions", self.pad_captions, ("longest", "max"))
        check_choice("encoders", self.encoders, ("live", "precomputed"))
        check_int("num_samples", self.num_samples, min=self.batch_size)
        check_choice("dtype", self.dtype, TRAIN_DTYPES)
        check_choice("autocast", self.autocast, ("none", "bf16"))
        check_bool("compile", self.compile)
        check_int("num_workers", self.num_workers, min=0)
        check_bool("pin_memory", self.pin_memory)
        check_int("prefetch_factor", self.prefetch_factor, min=1)
        check_float("lr", self.lr, min=0, min_exclusive=True)
        check_float("weight_decay", self.weight_decay, min=0)
        check_float("grad_clip", self.grad_clip, min=0)
        check_float("guidance", self.guidance, min=0)
        check_int("ckpt_every", self.ckpt_every, min=0)
        check_choice("ckpt_format", self.ckpt_format, CKPT_FORMATS)
        check_int("seed", self.seed, min=0)
        object.__setattr__(self, "buckets", [list(b) for b in _check_buckets(self.buckets, model)])

    def model_config(self) -> MMDiTConfig:
        """The model's config (built once, in ``__post_init__``)."""
        return self.model


# --------------------------------------------------------------------------------------
# Where a run's files go
# --------------------------------------------------------------------------------------


def artifacts_dir() -> Path:
    return Path(os.environ.get("PERFLAB_ARTIFACTS_DIR", ".perflab/artifacts"))


# --------------------------------------------------------------------------------------
# The full step
# --------------------------------------------------------------------------------------


def compile_blocks(model: MMDiT, **kwargs) -> MMDiT:
    """``torch.compile`` each double/single block in place (regional compilation: one
    graph per block kind is reused by all blocks, so compile time stays flat in depth)."""
    for blk in model.blocks():
        blk.compile(**kwargs)
    return model


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    grid: tuple[int, int]
    txt_len: int
    checkpoint: str | None = None


_RUNS = itertools.count()  # each trainer its own checkpoint folder: two may live at once (lab 08)


@dataclass
class Trainer:
    """Owns model, optimizer, encoders, loader and checkpointer for one :class:`TrainConfig`;
    :meth:`as_step` is its step under the step contract (:func:`lab_utils.step.contract.run_step`
    runs it), :meth:`step` runs the next one."""

    cfg: TrainConfig
    model: MMDiT = field(init=False)
    history: list[StepResult] = field(init=False, default_factory=list)

    def __post_init__(self):

        c = self.cfg
        self.device = pick_device(c.device)
        self.model_cfg = c.model
        self.model = build_model(self.model_cfg, self.device, DTYPES[c.dtype], seed=c.seed).train()
        if c.compile:
            compile_blocks(self.model)
            self.warm_compile()
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay, fused=self.device.type == "cuda"
        )
        self.encoders = Encoders(self.model_cfg, self.device, DTYPES[c.dtype], seed=c.seed + 1)
        data = SyntheticImageCaptions(
            c.num_samples,
            c.buckets,
            min_caption_len=c.min_caption_len,
            max_caption_len=c.max_caption_len,
            seed=c.seed,
            **text_vocab(self.model_cfg),
        )
        if c.encoders == "precomputed":
            with self._autocast():
                data = precompute(data, self.encoders, batch_size=c.batch_size, device=self.device)
            self.encoders = None  # a cached run does not hold the encoders
        self.dataset = data
        self.loader = make_loader(
            data,
            c.batch_size,
            num_workers=c.num_workers,
            pin_memory=c.pin_memory,
            prefetch_factor=c.prefetch_factor,
            pad_to=c.max_caption_len if c.pad_captions == "max" else None,
            seed=c.seed,
        )
        self._batches, self._next = None, 0  # the loader's batches from batch _next on
        self.checkpointer = (
            Checkpointer(
                artifacts_dir() / "checkpoints" / f"01_training_step-{os.getpid()}-{next(_RUNS)}", c.ckpt_format
            )
            if c.ckpt_every
            else None
        )
        self.step_index = 0
        self.last_checkpoint: str | None = None
        self._step: StepFactory | None = None

    def warm_compile(self) -> int:
        """Compile before measuring: forward + backward at two distinct shapes (first and
        last bucket, shortest and longest caption), so Dynamo has specialised once and then
        generalised to dynamic shapes, and the profiled steps do not recompile.  Returns
        the number of warm-up runs."""
        c = self.cfg
        g = torch.Generator(self.device).manual_seed(c.seed + 3)
        lo = c.max_caption_len if c.pad_captions == "max" else c.min_caption_len
        shapes = list(dict.fromkeys([(tuple(c.buckets[0]), lo), (tuple(c.buckets[-1]), c.max_caption_len)]))
        for (h, w), n in shapes:
            batch = synthetic_batch(
                self.model_cfg,
                c.batch_size,
                height=h,
                width=w,
                txt_len=n,
                generator=g,
                device=self.device,
                dtype=self.model.img_in.weight.dtype,
                guidance=c.guidance,
            )
            # real steps carry a caption mask; the same graph inputs avoid a recompile there
            batch.txt_mask = torch.ones(c.batch_size, n, dtype=torch.bool, device=self.device)
            with self._autocast():
                loss = rf_loss(self.model, batch, g)
            loss.backward()
        self.model.zero_grad(set_to_none=True)
        return len(shapes)

    # helpers ----------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.autocast == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def phase(self, name: str):
        """A named range, synchronized at its end on CUDA (the range holds the GPU work it launched)."""
        with annotate(name, self.device):
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _to_device(self, raw: dict) -> dict:
        nb = self.cfg.pin_memory and self.device.type == "cuda"
        return {k: v.to(self.device, non_blocking=nb) if isinstance(v, torch.Tensor) else v for k, v in raw.items()}

    def _seed(self, k: int, salt: int) -> int:
        return (self.cfg.seed + salt) * 1_000_003 + k

    # the step ---------------------------------------------------------------------------
    def make_batch(self, k: int) -> Batch:
        """Batch ``k``: the loader's ``k``-th batch (its order is seeded), encoded (the VAE's sample
        and the batch's noise seeded by ``k``), in the phases ``data_loading``, ``text_encoding``
        and ``image_encoding``.  The loader is read in order; another ``k`` restarts it there."""
        c, m = self.cfg, self.model
        with self.phase("data_loading"):
            if self._batches is None or k != self._next:
                self._batches = forever(self.loader)
                for _ in range(k):
                    next(self._batches)
            raw = self._to_device(next(self._batches))
            self._next = k + 1
        with self.phase("text_encoding"):
            if "t5_ids" in raw:
                with self._autocast():
                    emb = self.encoders.encode_text(raw["t5_ids"], raw["t5_mask"], raw["clip_ids"])
                txt, y = emb.txt, emb.y
            else:
                txt, y = raw["txt"], raw["y"]
            mask = raw["t5_mask"]
            txt = txt.to(m.img_in.weight.dtype)
            y = y.to(m.img_in.weight.dtype)
        with self.phase("image_encoding"):
            if "pixels" in raw:
                g = torch.Generator(self.device).manual_seed(self._seed(k, 2))
                with self._autocast():
                    lat = self.encoders.encode_image(raw["pixels"], generator=g)
            else:
                lat = raw["latents"]
            # packing latents into tokens and building position ids belong to the input side
            h, w = lat.shape[-2] // self.model_cfg.patch_size, lat.shape[-1] // self.model_cfg.patch_size
            tokens = patchify(lat.to(m.img_in.weight.dtype), self.model_cfg.patch_size)
            b = tokens.shape[0]
            return Batch(
                img=tokens,
                img_ids=image_ids(h, w, self.device),
                txt=txt,
                txt_ids=text_ids(txt.shape[1], self.device),
                y=y,
                guidance=(torch.full((b,), c.guidance, device=self.device) if self.model_cfg.guidance_embed else None),
                txt_mask=mask,
                grid=(h, w),
                seed=self._seed(k, 3),
            )

    def loss(self, model: MMDiT, batch: Batch) -> torch.Tensor:
        """The rectified-flow loss of ``batch`` (its own noise), under the config's autocast."""
        with self._autocast():
            return rf_loss(model, batch)

    def save(self, k: int) -> str:
        """The checkpoint after step ``k`` (named by the steps taken, ``k + 1``)."""
        self.last_checkpoint = str(self.checkpointer.save(self.model, self.opt, k + 1))
        return self.last_checkpoint

    def as_step(self) -> StepFactory:
        """This trainer's step under the step contract: its model, optimizer, batches and loss,
        its gradient clip and a checkpoint every ``ckpt_every`` steps (phase ``checkpoint``)."""
        if self._step is None:
            c = self.cfg
            every = (Periodic("checkpoint", c.ckpt_every, self.save),) if self.checkpointer is not None else ()
            self._step = StepFactory(
                self.model,
                self.opt,
                self.make_batch,
                self.loss,
                phases=("data_loading", "text_encoding", "image_encoding"),
                config=self.model_cfg,
                grad_clip=c.grad_clip,
                periodic=every,
            )
        return self._step

    def step(self) -> StepResult:
        """The next step (batch ``step_index``), recorded in ``history``."""
        i = self.step_index
        self.last_checkpoint = None
        run = run_step(self.as_step(), i)
        self.step_index += 1
        res = StepResult(
            step=i,
            loss=float(run.loss),
            grad_norm=run.grad_norm,
            grid=run.batch.grid,
            txt_len=int(run.batch.txt.shape[1]),
            checkpoint=self.last_checkpoint,
        )
        self.history.append(res)
        return res

    def run(self, steps: int) -> list[StepResult]:
        return [self.step() for _ in range(steps)]

    def close(self, keep_checkpoints: bool = False) -> None:
        """Finish pending async saves; delete this run's checkpoints unless asked to keep
        them (the lab measures saving; a FLUX-sized checkpoint is tens of GB)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()
            if not keep_checkpoints:
                shutil.rmtree(self.checkpointer.dir, ignore_errors=True)
        self._batches = None
        self.loader = None


def fit_fixed_batch(
    model: MMDiT, batch: Batch, steps: int, *, lr: float = 1e-3, seed: int = 0, grad_clip: float = 1.0
) -> list[float]:
    """AdamW on one fixed batch with fixed noise and timesteps (the generator is reseeded
    every step), so the objective is deterministic and its loss must go down."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    dev = batch.img.device
    for _ in range(steps):
        g = torch.Generator(dev).manual_seed(seed)
        loss = rf_loss(model, batch, g)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


__all__ = [
    "PHASES",
    "Batch",
    "RFParts",
    "rf_loss",
    "sample_timesteps",
    "synthetic_batch",
    "TrainConfig",
    "Trainer",
    "StepResult",
    "Checkpointer",
    "compile_blocks",
    "fit_fixed_batch",
    "artifacts_dir",
]
