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
The recipes themselves (:class:`Recipe`, ``RECIPES``, :func:`get_recipe`) are defined in
``lab_utils.precision.recipes`` and re-exported here.

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
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import torch
from torch import nn

from lab_utils.core.config import ConfigError
from lab_utils.precision.recipes import DEFAULT_KEEP, RECIPES, Recipe, TensorQuant, get_recipe

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
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415  (optional, heavy)

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
    from scipy import stats  # noqa: PLC0415  (absent on a bare GPU machine, where this module must import)

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


@dataclass(frozen=True)
class ConvergenceOptions:
    """How :func:`run_convergence` trains and judges: ``steps`` AdamW steps at ``lr`` per
    seed; ``baseline`` and every recipe under ``autocast_dtype``; the final gap over the last
    ``window`` steps (default: a quarter); per-timestep losses in ``n_buckets`` buckets; a run
    diverges when its loss exceeds ``diverge_factor`` x its first loss after step 5."""

    steps: int = 30
    seeds: tuple[int, ...] = (0, 1)
    lr: float = 1e-3
    baseline: str = "bf16"
    autocast_dtype: torch.dtype | None = torch.bfloat16
    window: int | None = None
    n_buckets: int = 4
    diverge_factor: float = 3.0

    def __post_init__(self):
        object.__setattr__(self, "seeds", tuple(self.seeds))
        object.__setattr__(self, "window", self.window or max(1, self.steps // 4))


def run_convergence(
    task: TrainTask,
    recipes: Iterable[str | Recipe],
    options: ConvergenceOptions | None = None,
    *,
    progress: Callable[[list], Iterable] | None = None,
    **kw,
) -> ConvergenceResult:
    """Train ``steps`` AdamW steps per (seed, recipe) from the same initialisation and data.

    ``options``: :class:`ConvergenceOptions`, or its fields as keywords ``kw``.  The baseline
    runs under ``autocast_dtype`` (bf16) like every recipe; a recipe's converted layers
    quantize their operands on top.  Divergence: a non-finite loss, or the loss above
    ``diverge_factor`` x the run's first loss after step 5; that run stops and is reported.
    Final gap: per seed, mean loss over the last ``window`` steps of recipe minus baseline
    (paired by seed), mean and 95% t-interval over seeds.  ``progress`` wraps the list of
    (recipe, seed) runs (e.g. ``tqdm``) to show progress."""
    o = replace(options, **kw) if options is not None else ConvergenceOptions(**kw)
    baseline = o.baseline
    names = [baseline] + [get_recipe(r).name for r in recipes if get_recipe(r).name != baseline]
    curve_rows, bucket_rows, div_rows = [], [], []
    secs = {}
    runs = [(name, seed) for name in names for seed in o.seeds]
    for name, seed in progress(runs) if progress is not None else runs:
        t0 = time.perf_counter()
        curve, last_per, last_t, div = _train_one(task, name, seed, o)
        curve_rows += curve
        div_rows += div
        if last_per:
            bucket_rows += _loss_buckets(torch.cat(last_per), torch.cat(last_t), name, seed, o.n_buckets)
        secs[name] = secs.get(name, 0.0) + time.perf_counter() - t0
    curves = pd.DataFrame(curve_rows)
    divs = pd.DataFrame(div_rows, columns=["recipe", "seed", "step", "reason"])
    gaps = _final_gaps(curves, divs, names, o)
    return ConvergenceResult(curves, pd.DataFrame(bucket_rows), gaps, divs, baseline, o.window, secs)


def _train_one(task: TrainTask, name: str, seed: int, o: ConvergenceOptions) -> tuple[list, list, list, list]:
    """One (recipe, seed) run: (loss curve rows, per-sample losses and timesteps of the last
    ``window`` steps, divergence rows)."""
    steps, window, diverge_factor, autocast_dtype = o.steps, o.window, o.diverge_factor, o.autocast_dtype
    model = task.make_model(seed)
    apply_recipe(model, name, seed=seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=0.0)
    curve_rows, div_rows = [], []
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
                dict(recipe=name, seed=seed, step=step, reason=f"loss {lv:.3g} > {diverge_factor} x first {first:.3g}")
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
    return curve_rows, last_per, last_t, div_rows


def _loss_buckets(per_all: torch.Tensor, t_all: torch.Tensor, name: str, seed: int, n_buckets: int) -> list[dict]:
    """Mean per-sample loss in each of ``n_buckets`` equal timestep buckets of [0, 1]."""
    edges = torch.linspace(0, 1, n_buckets + 1)
    b = torch.bucketize(t_all, edges[1:-1])
    rows = []
    for k in range(n_buckets):
        m = b == k
        if bool(m.any()):
            rows.append(
                dict(
                    recipe=name,
                    seed=seed,
                    bucket=f"t∈[{edges[k]:.2f},{edges[k + 1]:.2f})",
                    loss=float(per_all[m].mean()),
                    n=int(m.sum()),
                )
            )
    return rows


def _final_gaps(curves: pd.DataFrame, divs: pd.DataFrame, names: list[str], o: ConvergenceOptions) -> pd.DataFrame:
    """Per recipe: the final loss minus the baseline's, paired by seed: mean and 95% t-interval."""
    steps, window, baseline = o.steps, o.window, o.baseline
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
    return pd.DataFrame(gap_rows)


def matmul_share_from_analysis(analysis) -> float:
    """The matmul category's share of the profiled step time, from
    ``lab_utils.profiling.profiler`` (a ``ProfileReport`` or its ``TraceAnalysis``)."""
    a = getattr(analysis, "analysis", analysis)
    cat = a.categories.set_index("category")
    if "matmul" not in cat.index:
        return 0.0
    return float(cat.loc["matmul", "pct_of_step"]) / 100.0


# The recipes live in lab_utils.precision.recipes; precision re-exports them as part of its API.
__all__ = [
    "DEFAULT_KEEP",
    "RECIPES",
    "ConvergenceResult",
    "QuantLinear",
    "Recipe",
    "TensorQuant",
    "TrainTask",
    "amdahl_speedup",
    "apply_recipe",
    "get_recipe",
    "matmul_share_from_analysis",
    "mlp_task",
    "ConvergenceOptions",
    "run_convergence",
]
