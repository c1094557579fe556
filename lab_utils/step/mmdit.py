"""perflab's own MMDiT, registered as one step (the default of every lab's ``step``), as torchtitan
registers FLUX as one ``TrainSpec`` for its one ``Trainer``.

:func:`mmdit_step` builds the step the lab's parameters describe (``lab``: the lab's config):

* a lab whose config is (or holds, as ``train``) a :class:`~lab_utils.model.train.TrainConfig`
  (labs 01 and 08) gets the trainer's step: the bucketed ``DataLoader``, the T5 / CLIP / VAE
  encoders (or cached embeddings), autocast, gradient clipping and a checkpoint every N steps
  (:meth:`~lab_utils.model.train.Trainer.as_step`);
* any other lab (05, 07) gets the model at its preset and dtype on synthetic batches of its
  batch size, resolution and text length (batch ``k`` drawn from its own seed), with the
  rectified-flow loss; without a lab, the tiny preset at 64 x 64 px and 8 text tokens.

What only this model can do is declared as capabilities (``lab_utils.step.contract.CAPABILITIES``),
each the object a section reads: its config and step shape (presets, the analytic FLOP and memory
formulas, diffusers equivalence, FSDP), its own activation-checkpointing seam, its trainer's
configuration (lab 08's levers), its training runs (lab 07) and its token count.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab_utils.core.config import check_int
from lab_utils.core.device import pick_device
from lab_utils.core.dtypes import parse_dtype
from lab_utils.model import ACTIVATION_CHECKPOINTS, build_model, resolve_config
from lab_utils.model.accounting import training_step_flops
from lab_utils.model.config import MMDiTConfig
from lab_utils.model.layers import DoubleStreamBlock, SingleStreamBlock
from lab_utils.model.train import Batch, TrainConfig, Trainer, rf_loss, synthetic_batch
from lab_utils.step.contract import StepFactory

#: The step without a lab: the tiny preset, 64 x 64 px, 8 text tokens.
MMDIT_DEFAULTS = dict(preset="tiny", height=64, width=64, txt_len=8)
BLOCKS = (DoubleStreamBlock, SingleStreamBlock)


@dataclass(frozen=True)
class MMDiTShape:
    """The MMDiT a step trains and the shape of its step: what the formula sections read."""

    cfg: MMDiTConfig
    batch: int
    height: int
    width: int
    txt_len: int
    dtype: str = "float32"

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.check_resolution(self.height, self.width)


class SeamPolicies:
    """The MMDiT's own activation-checkpointing seam: every policy of the registry (its double /
    single and compile_budget ones too), applied once to the model as ``build_model`` does."""

    def __init__(self, model):
        self.model = model
        self.names = tuple(ACTIVATION_CHECKPOINTS)

    @contextlib.contextmanager
    def applied(self, name: str) -> Iterator[None]:
        before = self.model.activation_checkpoint
        ACTIVATION_CHECKPOINTS[name].apply(self.model)
        try:
            yield
        finally:
            before.apply(self.model)


def poison_latents(batch: Batch, scale: float) -> Batch:
    """The batch with its latent tokens scaled (lab 07's poisoned batch)."""
    return dataclasses.replace(batch, img=batch.img * scale)


def tokens_of(batch: Batch) -> int:
    """Image tokens of a step (the figure lab 08's tokens per second counts)."""
    return int(batch.batch_size * batch.grid[0] * batch.grid[1])


def _flops(cfg: MMDiTConfig):
    """FLOPs of a step of ``batch``'s shape, counted on a meta copy of the model (model FLOPs)."""

    def flops(batch: Batch) -> float:
        return float(training_step_flops(cfg, batch.batch_size, batch.grid, int(batch.txt.shape[1])))

    flops.method = "FlopCounterMode fwd+bwd on meta"  # how the figure is counted (the records say it)
    return flops


def capabilities(cfg: MMDiTConfig, model, shape: MMDiTShape, train: TrainConfig | None = None) -> dict:
    """What this step offers beyond the contract (see the module note)."""
    caps = dict(
        presets=shape,
        diffusers_equivalence=shape,
        flop_formula=shape,
        bad_input=shape,
        explorer=shape,
        memory_formula=shape,
        fsdp_check=shape,
        policies=SeamPolicies(model),
        stability_runs=shape,
        tokens=tokens_of,
    )
    if train is not None:
        caps["train_config"] = train
    return caps


def trainer_step(train: TrainConfig) -> StepFactory:
    """The trainer's step of ``train`` (labs 01 and 08)."""
    tr = Trainer(train)
    step = tr.as_step()
    h, w = train.buckets[0]
    shape = MMDiTShape(train.model, train.batch_size, h, w, train.max_caption_len, train.dtype)
    return dataclasses.replace(
        step,
        block_class=BLOCKS,
        flops=_flops(train.model),
        capabilities={**capabilities(train.model, tr.model, shape, train), "trainer": tr},
        close=tr.close,
    )


def synthetic_step(
    preset: str | MMDiTConfig = "tiny",
    *,
    batch_size: int = 2,
    height: int = 64,
    width: int = 64,
    txt_len: int = 8,
    device="cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> StepFactory:
    """The MMDiT of ``preset`` on synthetic batches (batch ``k``: drawn from ``seed`` and ``k``),
    AdamW (lr 1e-4), the rectified-flow loss with noise drawn from ``seed``."""
    cfg = resolve_config(preset)
    check_int("batch_size", batch_size, min=1)
    check_int("txt_len", txt_len, min=1)
    cfg.check_resolution(height, width)
    dt = parse_dtype("dtype", dtype) if isinstance(dtype, str) else dtype
    dev = torch.device(device)
    model = build_model(cfg, device=dev, dtype=dt, seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch(k: int) -> Batch:
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        return synthetic_batch(
            cfg, batch_size, height=height, width=width, txt_len=txt_len, generator=g, device=dev, dtype=dt
        )

    def loss_parts(m, batch: Batch):
        g = torch.Generator(device=dev).manual_seed(seed) if dev.type != "meta" else None  # meta: no draws
        return rf_loss(m, batch, g, return_parts=True)

    def loss(m, batch: Batch) -> torch.Tensor:
        return loss_parts(m, batch).loss

    name = str(dt).replace("torch.", "")
    shape = MMDiTShape(cfg, batch_size, height, width, txt_len, name)
    caps = dict(capabilities(cfg, model, shape), loss_parts=loss_parts, poison_batch=poison_latents)
    return StepFactory(
        model, opt, make_batch, loss, block_class=BLOCKS, flops=_flops(cfg), config=cfg, capabilities=caps
    )


def mmdit_step(lab=None, device="cpu", dtype=torch.float32, batch_size: int | None = None, seed: int = 0):
    """The default ``step``: perflab's MMDiT as the lab's parameters describe it (module note)."""
    train = lab if isinstance(lab, TrainConfig) else getattr(lab, "train", None)
    if isinstance(train, TrainConfig):
        return trainer_step(train)
    if lab is None:
        return synthetic_step(**MMDIT_DEFAULTS, batch_size=batch_size or 2, device=device, dtype=dtype, seed=seed)
    res = getattr(lab, "resolution", 64)
    return synthetic_step(
        getattr(lab, "preset", "tiny"),
        batch_size=batch_size or getattr(lab, "batch_size", 2),
        height=res,
        width=res,
        txt_len=getattr(lab, "txt_len", 8),
        device=pick_device(getattr(lab, "device", device)) if lab is not None else device,
        dtype=getattr(lab, "dtype", dtype),
        seed=getattr(lab, "seed", seed),
    )
