"""Precision recipes: which operands of which matmuls go to which format.

A :class:`Recipe` names, for every ``nn.Linear`` it converts, how each operand of the
three matmuls of a linear layer is quantized (a :class:`TensorQuant`, or ``None`` = kept
in the run's high precision); ``RECIPES`` holds the named ones the labs offer and
:func:`get_recipe` resolves a name (``ConfigError`` naming ``recipe`` otherwise).
``lab_utils.precision.quantized`` applies a recipe to a model (see its module note for the
operands and the contraction axes they are quantized along).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import pandas as pd
import torch

from lab_kernels import quant as Q
from lab_utils.core.config import ConfigError


@dataclass(frozen=True)
class TensorQuant:
    """How one operand is quantized (keywords of ``lab_kernels.quant.fake_quantize``)."""

    fmt: str
    granularity: str | None = None
    scale_rule: str = "floor"
    rounding: str = "nearest"
    hadamard: int | None = None  # random Hadamard rotation of this many points along the quantized axis

    def __post_init__(self):
        h = self.hadamard
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 2 or h & (h - 1)):
            raise ConfigError("hadamard", h, "None or a power of two >= 2 (the rotation size)")
        # a tiny quantization: the quantizer refuses a bad fmt / granularity / scale_rule / rounding by name
        Q.fake_quantize(
            torch.zeros(1, 32),
            self.fmt,
            granularity=self.granularity,
            scale_rule=self.scale_rule,
            rounding=self.rounding,
            generator=torch.Generator().manual_seed(0),
        )

    def why_not(self, length: int) -> str | None:
        """None when this operand can be quantized along an axis of ``length``, else why not
        (a Hadamard rotation needs whole blocks of its size)."""
        if self.hadamard is not None and length % self.hadamard:
            return (
                f"its {self.hadamard}-point Hadamard rotation needs an axis divisible by {self.hadamard}, not {length}"
            )
        return None

    def apply(self, t: torch.Tensor, axis: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Fake-quantize ``t`` along ``axis``.  An axis the rotation cannot cover is refused
        (ConfigError 'hadamard'): quantizing without it would not be the recipe."""
        why = self.why_not(t.shape[axis])
        if why:
            raise ConfigError(
                "hadamard",
                self.hadamard,
                f"a size dividing the quantized axis ({why}; shape {tuple(t.shape)})",
            )
        return Q.fake_quantize(
            t,
            self.fmt,
            axis=axis,
            granularity=self.granularity,
            scale_rule=self.scale_rule,
            rounding=self.rounding,
            hadamard=self.hadamard,
            generator=generator,
        )


DEFAULT_KEEP = (
    "img_in",
    "txt_in",
    "time_in.*",
    "vector_in.*",
    "guidance_in.*",
    "*mod.lin",
    "*modulation.lin",
    "final_layer.*",
)


@dataclass(frozen=True)
class Recipe:
    name: str
    kind: str = "emulated"  # "none" | "emulated" | "torchao_float8"
    fwd_x: TensorQuant | None = None
    fwd_w: TensorQuant | None = None
    dgrad_dy: TensorQuant | None = None
    dgrad_w: TensorQuant | None = None
    wgrad_dy: TensorQuant | None = None
    wgrad_x: TensorQuant | None = None
    keep_high_precision: tuple[str, ...] = DEFAULT_KEEP
    torchao_recipe: str | None = None  # "tensorwise" | "rowwise" for kind="torchao_float8"
    description: str = ""

    def __post_init__(self):
        if self.kind not in ("none", "emulated", "torchao_float8"):
            raise ConfigError("kind", self.kind, "'none', 'emulated' or 'torchao_float8'")

    def why_not(self, in_features: int, out_features: int) -> str | None:
        """None when every operand whose axis is fixed by the layer (K = ``in_features`` for
        the forward, N = ``out_features`` for the input gradient) can be quantized, else why
        not.  The weight-gradient operands run along the token axis, checked per call."""
        for op, axis_len in (
            ("fwd_x", in_features),
            ("fwd_w", in_features),
            ("dgrad_dy", out_features),
            ("dgrad_w", out_features),
        ):
            tq = getattr(self, op)
            why = tq.why_not(axis_len) if tq is not None else None
            if why:
                return f"operand {op}: {why}"
        return None

    def keeps(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in self.keep_high_precision)

    def table(self) -> pd.DataFrame:
        """Which operand of which matmul is in which format (a row per matmul)."""

        def s(t):
            if t is None:
                return "high precision"
            parts = (
                [t.fmt]
                + ([t.granularity] if t.granularity else [])
                + ([t.scale_rule] if Q.FORMATS[t.fmt].family == "mx" else [])
                + (["SR"] if t.rounding == "stochastic" else [])
                + ([f"RHT{t.hadamard}"] if t.hadamard else [])
            )
            return "/".join(parts)

        if self.kind == "torchao_float8":
            return pd.DataFrame(
                [dict(matmul="all three", operand_a=f"torchao float8 {self.torchao_recipe}", operand_b="")]
            )
        return pd.DataFrame(
            [
                dict(matmul="forward  x@W^T", operand_a=s(self.fwd_x), operand_b=s(self.fwd_w)),
                dict(matmul="dgrad    dy@W", operand_a=s(self.dgrad_dy), operand_b=s(self.dgrad_w)),
                dict(matmul="wgrad    dy^T@x", operand_a=s(self.wgrad_dy), operand_b=s(self.wgrad_x)),
            ]
        )


def _uniform(name, q_x, q_w, q_g, **kw) -> Recipe:
    return Recipe(name, "emulated", q_x, q_w, q_g, q_w, q_g, q_x, **kw)


_E4 = TensorQuant("fp8_e4m3")
_E5 = TensorQuant("fp8_e5m2")
RECIPES: dict[str, Recipe] = {
    "bf16": Recipe("bf16", "none", description="baseline: every matmul in the run's high precision (bf16 autocast)"),
    "fp8_tensor": _uniform(
        "fp8_tensor",
        _E4,
        _E4,
        _E5,
        description="FP8 per-tensor current scaling: e4m3 weights/activations, e5m2 gradients",
    ),
    "fp8_row": _uniform(
        "fp8_row",
        TensorQuant("fp8_e4m3", "row"),
        TensorQuant("fp8_e4m3", "row"),
        TensorQuant("fp8_e5m2", "row"),
        description="FP8 per-row (along K) scales; e5m2 gradients",
    ),
    "fp8_block": Recipe(
        "fp8_block",
        "emulated",
        TensorQuant("fp8_e4m3", "block"),
        TensorQuant("fp8_e4m3", "block2d"),
        TensorQuant("fp8_e4m3", "block"),
        TensorQuant("fp8_e4m3", "block2d"),
        TensorQuant("fp8_e4m3", "block"),
        TensorQuant("fp8_e4m3", "block"),
        description="DeepSeek-V3 style: e4m3 everywhere, 1x128 activation/gradient blocks, 128x128 weight tiles",
    ),
    "mxfp8": _uniform(
        "mxfp8",
        TensorQuant("mxfp8_e4m3"),
        TensorQuant("mxfp8_e4m3"),
        TensorQuant("mxfp8_e4m3"),
        description="MXFP8 e4m3 everywhere, OCP floor scales",
    ),
    "mxfp8_rceil": _uniform(
        "mxfp8_rceil",
        TensorQuant("mxfp8_e4m3", scale_rule="rceil"),
        TensorQuant("mxfp8_e4m3", scale_rule="rceil"),
        TensorQuant("mxfp8_e4m3", scale_rule="rceil"),
        description="MXFP8 e4m3 everywhere, round-up (rceil) scales",
    ),
    "mxfp4_fwd": Recipe(
        "mxfp4_fwd",
        "emulated",
        TensorQuant("mxfp4"),
        TensorQuant("mxfp4"),
        description="MXFP4 forward only; both backward matmuls in high precision",
    ),
    "nvfp4": Recipe(
        "nvfp4",
        "emulated",
        TensorQuant("nvfp4"),
        TensorQuant("nvfp4"),
        TensorQuant("nvfp4", rounding="stochastic"),
        TensorQuant("nvfp4"),
        TensorQuant("nvfp4", rounding="stochastic", hadamard=16),
        TensorQuant("nvfp4", hadamard=16),
        description="NVFP4 (after NVIDIA's NVFP4 pretraining recipe): stochastic rounding on gradients, "
        "16-point random Hadamard on the weight-gradient operands",
    ),
    "torchao_float8_tensorwise": Recipe(
        "torchao_float8_tensorwise",
        "torchao_float8",
        torchao_recipe="tensorwise",
        description="torchao convert_to_float8_training, tensorwise (emulated on CPU)",
    ),
    "torchao_float8_rowwise": Recipe(
        "torchao_float8_rowwise",
        "torchao_float8",
        torchao_recipe="rowwise",
        description="torchao convert_to_float8_training, rowwise (emulated on CPU)",
    ),
}


def get_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ConfigError("recipe", recipe, "one of " + ", ".join(map(repr, RECIPES)))
    return RECIPES[recipe]
