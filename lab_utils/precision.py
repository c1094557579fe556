"""Precision recipes for training: which tensors of which matmuls go to which format.

A :class:`Recipe` names, for every ``nn.Linear`` it converts, how each operand of the
three matmuls of a linear layer is quantized (``None`` = kept in the run's high
precision):

* forward         ``y  = x @ W^T``      operands ``fwd_x`` (x, along K), ``fwd_w`` (W, along K)
* input gradient  ``dx = dy @ W``       operands ``dgrad_dy`` (dy, along N), ``dgrad_w`` (W, along N)
* weight gradient ``dW = dy^T @ x``     operands ``wgrad_dy`` (dy, along tokens), ``wgrad_x`` (x, along tokens)

Each operand is quantized along the matmul's contraction axis, as a real low-precision
GEMM needs (MX/NVFP4 blocks and per-row scales run along K; that is why the weight
gradient re-quantizes x and dy along the token axis).  Products are then formed in
fp32 from the dequantized operands (the emulation of an FP8/FP4 GEMM with an fp32
accumulator) and the output is returned in the autocast dtype when autocast is on.

``keep_high_precision`` lists ``fnmatch`` patterns of module names that are never
converted (embeddings, modulation, final layer by default: small, sensitive).

``apply_recipe(model, recipe)`` swaps the matching layers in place.  ``"bf16"`` is
the no-op baseline.  Two families of recipes:

* ``kind="emulated"``: the lab's own :class:`QuantLinear` (all formats of
  ``lab_kernels.quant``; stochastic rounding and Hadamard per operand).
* ``kind="torchao_float8"``: torchao's ``convert_to_float8_training`` (tensorwise or
  rowwise), with ``emulate=True`` off CUDA so it runs on this CPU.

:func:`run_convergence` trains N steps x several seeds for the baseline and each
recipe on identical data and initialisation, and returns the loss curves, the final
gap in nats with a t-interval over seeds, loss by timestep bucket, and divergences.
:func:`amdahl_speedup` bounds the end-to-end gain of a faster matmul.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import torch
from torch import nn

from lab_kernels import quant as Q

from .config import ConfigError


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


# --------------------------------------------------------------------------- the swapped layer


class _QLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, recipe: Recipe, gen):
        out_dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            out_dtype = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).float()
            wf = w.float()
            xq = recipe.fwd_x.apply(x2, -1, gen) if recipe.fwd_x else x2
            wq = recipe.fwd_w.apply(wf, -1, gen) if recipe.fwd_w else wf
            y = xq @ wq.T
            if b is not None:
                y = y + b.float()
        ctx.save_for_backward(x2, wf)
        ctx.recipe, ctx.gen, ctx.has_b, ctx.xshape, ctx.xdtype = recipe, gen, b is not None, x.shape, x.dtype
        ctx.wdtype = w.dtype
        return y.reshape(*x.shape[:-1], w.shape[0]).to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, wf = ctx.saved_tensors
        r, gen = ctx.recipe, ctx.gen
        with torch.autocast(dy.device.type, enabled=False):
            g = dy.reshape(-1, dy.shape[-1]).float()  # (T, N)
            dx = dw = db = None
            if ctx.needs_input_grad[0]:
                gq = r.dgrad_dy.apply(g, -1, gen) if r.dgrad_dy else g  # along N
                wq = r.dgrad_w.apply(wf, 0, gen) if r.dgrad_w else wf  # along N
                dx = (gq @ wq).reshape(ctx.xshape).to(ctx.xdtype)
            if ctx.needs_input_grad[1]:
                gq = r.wgrad_dy.apply(g, 0, gen) if r.wgrad_dy else g  # along tokens
                xq = r.wgrad_x.apply(x2, 0, gen) if r.wgrad_x else x2  # along tokens
                dw = (gq.T @ xq).to(ctx.wdtype)
            if ctx.has_b and ctx.needs_input_grad[2]:
                db = g.sum(0)
        return dx, dw, db, None, None


class QuantLinear(nn.Linear):
    """``nn.Linear`` whose three matmuls follow an emulated :class:`Recipe`."""

    def __init__(self, in_features, out_features, bias=True, *, recipe: Recipe, seed: int = 0, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe
        self._gen = torch.Generator().manual_seed(seed)  # stochastic-rounding draws (CPU generator)

    @classmethod
    def from_linear(cls, lin: nn.Linear, recipe: Recipe, seed: int = 0) -> QuantLinear:
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.in_features, q.out_features = lin.in_features, lin.out_features
        q.weight = lin.weight
        q.bias = lin.bias
        q.recipe = recipe
        q._gen = torch.Generator().manual_seed(seed)
        return q

    def forward(self, x):
        return _QLinearFn.apply(x, self.weight, self.bias, self.recipe, self._gen)

    def extra_repr(self):
        return super().extra_repr() + f", recipe={self.recipe.name}"


def apply_recipe(model: nn.Module, recipe: str | Recipe, *, seed: int = 0) -> nn.Module:
    """Swap ``model``'s ``nn.Linear`` layers in place per ``recipe``; returns the model.

    Layers matching ``recipe.keep_high_precision`` stay.  ``"bf16"`` changes nothing.
    ``model.precision_report`` (a DataFrame) lists every linear and what it became."""
    r = get_recipe(recipe)
    rows = []
    if r.kind == "none":
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                rows.append(dict(module=name, converted=False, reason="baseline recipe"))
        _set_report(model, rows)
        return model
    if r.kind == "torchao_float8":
        return _apply_torchao(model, r)
    i = 0
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            full = f"{name}.{cname}" if name else cname
            if type(child) is nn.Linear:
                if r.keeps(full):
                    rows.append(dict(module=full, converted=False, reason="keep_high_precision"))
                    continue
                why = r.why_not(child.in_features, child.out_features)
                if why:
                    raise ConfigError("recipe", r.name, f"a recipe that can convert {full!r}: {why}")
                setattr(mod, cname, QuantLinear.from_linear(child, r, seed=seed * 1000 + i))
                rows.append(dict(module=full, converted=True, reason=r.name))
                i += 1
    _set_report(model, rows)
    return model


def _set_report(model, rows):
    try:
        object.__setattr__(model, "precision_report", pd.DataFrame(rows))
    except Exception:  # pragma: no cover
        pass


def _apply_torchao(model: nn.Module, r: Recipe) -> nn.Module:
    # torchao is an optional, heavy dependency (absent from the GPU check machine)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    cfg = Float8LinearConfig.from_recipe_name(r.torchao_recipe)
    on_cuda = any(p.is_cuda for p in model.parameters())
    if not on_cuda:
        cfg = replace(cfg, emulate=True)
    rows = []

    def filt(mod, fqn):
        if not isinstance(mod, nn.Linear):
            return False
        if r.keeps(fqn):
            rows.append(dict(module=fqn, converted=False, reason="keep_high_precision"))
            return False
        if mod.in_features % 16 or mod.out_features % 16:
            rows.append(dict(module=fqn, converted=False, reason="dims not multiples of 16 (torchao float8)"))
            return False
        rows.append(dict(module=fqn, converted=True, reason=r.name))
        return True

    convert_to_float8_training(model, config=cfg, module_filter_fn=filt)
    _set_report(model, rows)
    return model


# --------------------------------------------------------------------------- Amdahl


def amdahl_speedup(matmul_share: float, matmul_speedup: float) -> float:
    """End-to-end speed-up bound when only the matmuls (``matmul_share`` of step time,
    as the training-step profiler measures it) get ``matmul_speedup`` times faster."""
    if not 0.0 <= matmul_share <= 1.0:
        raise ConfigError("matmul_share", matmul_share, "a fraction in [0, 1]")
    if matmul_speedup <= 0:
        raise ConfigError("matmul_speedup", matmul_speedup, "a positive number")
    return 1.0 / ((1.0 - matmul_share) + matmul_share / matmul_speedup)


# --------------------------------------------------------------------------- convergence


@dataclass
class TrainTask:
    """What the convergence runner trains.  ``make_model(seed)`` builds a fresh model;
    ``loss(model, step, seed)`` returns (per-sample loss (B,), per-sample timestep (B,))
    on the batch for ``step`` (identical across recipes for one seed)."""

    name: str
    make_model: Callable[[int], nn.Module]
    loss: Callable[[nn.Module, int, int], tuple[torch.Tensor, torch.Tensor]]


def mlp_task(*, dim: int = 64, hidden: int = 256, batch_size: int = 32) -> TrainTask:
    """Stand-in task (no MMDiT needed): an MLP denoiser learning a rectified-flow
    velocity on a fixed 2-D-manifold dataset embedded in ``dim`` dimensions."""
    g = torch.Generator().manual_seed(1234)
    basis = torch.randn(4, dim, generator=g)
    z = torch.randn(512, 4, generator=g)
    data = torch.tanh(z) @ basis

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(dim + 1, hidden)
            self.h1 = nn.Linear(hidden, hidden)
            self.h2 = nn.Linear(hidden, hidden)
            self.out = nn.Linear(hidden, dim)

        def forward(self, x, t):
            h = torch.nn.functional.gelu(self.inp(torch.cat([x, t[:, None]], -1)))
            h = h + torch.nn.functional.gelu(self.h1(h))
            h = h + torch.nn.functional.gelu(self.h2(h))
            return self.out(h)

    def make_model(seed):
        torch.manual_seed(seed)
        return Net()

    def loss(model, step, seed):
        bg = torch.Generator().manual_seed(seed * 100_003 + step)
        x0 = data[torch.randint(0, data.shape[0], (batch_size,), generator=bg)]
        x1 = torch.randn(x0.shape, generator=bg)
        t = torch.rand(batch_size, generator=bg)
        xt = (1 - t[:, None]) * x0 + t[:, None] * x1
        per = ((model(xt, t).float() - (x1 - x0)) ** 2).mean(-1)
        return per, t

    return TrainTask("mlp", make_model, loss)


def _t975(dof: int) -> float:
    """The 97.5% quantile of Student's t with ``dof`` degrees of freedom (95% two-sided)."""
    # scipy is not on a bare GPU machine, where the model (and so this module) must import
    from scipy import stats  # noqa: PLC0415

    return float(stats.t.ppf(0.975, dof))


@dataclass
class ConvergenceResult:
    curves: pd.DataFrame  # recipe, seed, step, loss
    buckets: pd.DataFrame  # recipe, seed, bucket, loss (last window)
    gaps: pd.DataFrame  # recipe, gap (mean), ci_low, ci_high, n_seeds, diverged
    divergences: pd.DataFrame  # recipe, seed, step, reason
    baseline: str
    window: int
    seconds: dict = field(default_factory=dict)

    def band(self, smooth: int = 1) -> pd.DataFrame:
        """Mean loss per (recipe, step) with a 95% t-band over seeds (optionally smoothed)."""
        c = self.curves.sort_values(["recipe", "seed", "step"]).copy()
        if smooth > 1:
            c["loss"] = c.groupby(["recipe", "seed"])["loss"].transform(
                lambda s: s.rolling(smooth, min_periods=1).mean()
            )
        g = c.groupby(["recipe", "step"])["loss"]
        out = g.agg(["mean", "std", "count"]).reset_index()
        tq = out["count"].map(lambda n: _t975(n - 1) if n > 1 else float("nan"))
        half = tq * out["std"] / np.sqrt(out["count"])
        out["low"], out["high"] = out["mean"] - half.fillna(0), out["mean"] + half.fillna(0)
        return out


def run_convergence(
    task: TrainTask,
    recipes: Iterable[str | Recipe],
    *,
    steps: int = 30,
    seeds: Iterable[int] = (0, 1),
    lr: float = 1e-3,
    baseline: str = "bf16",
    autocast_dtype: torch.dtype | None = torch.bfloat16,
    window: int | None = None,
    n_buckets: int = 4,
    diverge_factor: float = 3.0,
    progress: Callable[[list], Iterable] | None = None,
) -> ConvergenceResult:
    """Train ``steps`` AdamW steps per (seed, recipe) from the same initialisation and data.

    The baseline runs under ``autocast_dtype`` (bf16) like every recipe; a recipe's
    converted layers quantize their operands on top.  Divergence: a non-finite loss, or
    the loss above ``diverge_factor`` x the run's first loss after step 5; that run stops
    and is reported.  Final gap: per seed, mean loss over the last ``window`` steps of
    recipe minus baseline (paired by seed), mean and 95% t-interval over seeds.
    ``progress`` wraps the list of (recipe, seed) runs (e.g. ``tqdm``) to show progress."""
    seeds = list(seeds)
    names = [baseline] + [get_recipe(r).name for r in recipes if get_recipe(r).name != baseline]
    window = window or max(1, steps // 4)
    curve_rows, bucket_rows, div_rows = [], [], []
    secs = {}
    edges = torch.linspace(0, 1, n_buckets + 1)
    runs = [(name, seed) for name in names for seed in seeds]
    for name, seed in progress(runs) if progress is not None else runs:
        t0 = time.perf_counter()
        model = task.make_model(seed)
        apply_recipe(model, name, seed=seed)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        first = None
        last_per, last_t = [], []
        for step in range(steps):
            dev_type = next(model.parameters()).device.type
            ctx = torch.autocast(dev_type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
            with ctx:
                per, t = task.loss(model, step, seed)
            loss = per.mean()
            lv = float(loss.detach())
            if not math.isfinite(lv):
                div_rows.append(dict(recipe=name, seed=seed, step=step, reason="non-finite loss"))
                break
            first = lv if first is None else first
            if step >= 5 and lv > diverge_factor * first:
                div_rows.append(
                    dict(
                        recipe=name,
                        seed=seed,
                        step=step,
                        reason=f"loss {lv:.3g} > {diverge_factor} x first {first:.3g}",
                    )
                )
                curve_rows.append(dict(recipe=name, seed=seed, step=step, loss=lv))
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            curve_rows.append(dict(recipe=name, seed=seed, step=step, loss=lv))
            if step >= steps - window:
                last_per.append(per.detach().float())
                last_t.append(t.detach().float())
        if last_per:
            per_all, t_all = torch.cat(last_per), torch.cat(last_t)
            b = torch.bucketize(t_all, edges[1:-1])
            for k in range(n_buckets):
                m = b == k
                if bool(m.any()):
                    bucket_rows.append(
                        dict(
                            recipe=name,
                            seed=seed,
                            bucket=f"t∈[{edges[k]:.2f},{edges[k + 1]:.2f})",
                            loss=float(per_all[m].mean()),
                            n=int(m.sum()),
                        )
                    )
        secs[name] = secs.get(name, 0.0) + time.perf_counter() - t0
    curves = pd.DataFrame(curve_rows)
    divs = pd.DataFrame(div_rows, columns=["recipe", "seed", "step", "reason"])
    final = (
        curves[curves.step >= steps - window].groupby(["recipe", "seed"])["loss"].mean().unstack("seed")
        if len(curves)
        else pd.DataFrame()
    )
    gap_rows = []
    for name in names:
        if name == baseline:
            continue
        diverged = bool((divs.recipe == name).any())
        if diverged or name not in final.index:
            gap_rows.append(
                dict(recipe=name, gap=float("nan"), ci_low=float("nan"), ci_high=float("nan"), n_seeds=0, diverged=True)
            )
            continue
        d = (final.loc[name] - final.loc[baseline]).dropna().to_numpy()
        n = len(d)
        mean = float(d.mean()) if n else float("nan")
        if n > 1:
            half = float(_t975(n - 1) * d.std(ddof=1) / math.sqrt(n))
        else:
            half = float("nan")
        gap_rows.append(dict(recipe=name, gap=mean, ci_low=mean - half, ci_high=mean + half, n_seeds=n, diverged=False))
    return ConvergenceResult(curves, pd.DataFrame(bucket_rows), pd.DataFrame(gap_rows), divs, baseline, window, secs)


def matmul_share_from_analysis(analysis) -> float:
    """The matmul category's share of the profiled step time, from
    ``lab_utils.profiler`` (a ``ProfileReport`` or its ``TraceAnalysis``)."""
    a = getattr(analysis, "analysis", analysis)
    cat = a.categories.set_index("category")
    if "matmul" not in cat.index:
        return 0.0
    return float(cat.loc["matmul", "pct_of_step"]) / 100.0
