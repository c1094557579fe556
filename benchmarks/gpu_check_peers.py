"""gpu_check's peers: Liger-Kernel's fused ops and torchao's float8 training beside perflab's own.

Imported by ``benchmarks/gpu_check.py`` (which runs from a bare checkout: no notebook packages;
torchao may be absent there, and is then refused with the reason, never failed):

* :func:`liger_check`: the ``liger`` variant of each fused op Liger-Kernel implements
  (``lab_kernels.liger``), forward and every gradient against float64 at the ``fused`` section's
  check size, beside perflab's Triton check.  Its timings come from the ``fused`` section's sweep
  (``"liger"`` is one of the plan's ``fused_variants``): the same GB/s and % of the measured copy
  ceiling as perflab's rows.  On CPU a bfloat16 check Liger cannot run through Triton's
  interpreter (its kernel computes in bfloat16) is run in float32 instead, and says so.
* :func:`section_torchao`: torchao's ``convert_to_float8_training`` (tensorwise, rowwise) on a
  FLUX-width MLP (Linear, tanh-GELU, Linear): the output and the gradients of the input and of
  the first weight against float64 (SQNR in dB, held to :data:`MIN_SQNR_DB`), then on CUDA the
  forward + backward timed beside the same MLP in bfloat16, each compiled as torchao recommends
  (compilation outside the statistics).  On CPU torchao emulates float8: checked, never timed.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from lab_kernels import get_variant, liger
from lab_utils.core.timing import try_bench
from lab_utils.fused import ops as F

LIGER_OPS = ("rms_norm", "layer_norm_modulate", "swiglu", "rope")
RECIPES = ("tensorwise", "rowwise")
#: Float8 (e4m3 operands, e5m2 gradients in the tensorwise recipe) keeps about 31 dB of SQNR per
#: operand on Gaussian data (lab 04's synthetic table: 31.6 e4m3, 25.5 e5m2); a product of two
#: quantized operands loses 3 dB more, so 20 dB leaves margin and still fails a wrong scale.
MIN_SQNR_DB = 20.0
#: MLP sizes: (tokens, hidden, mlp hidden); dims multiples of 16 (torchao's float8 matmuls)
MLP_SIZES = {"cuda": (4096 + 512, 3072, 12288), "cpu": (48, 64, 256)}
NOT_TIMED_CPU = "not timed: torchao emulates float8 on CPU (emulate=True): checked only"


# ------------------------------------------------------------------------------------- Liger
def liger_check(s, op: str, dt: torch.dtype, pc) -> None:
    """The op's ``liger`` variant forward and backward against float64 (beside the Triton check)."""
    if op not in LIGER_OPS:
        return
    kw = F.spec(op).problem_kw(pc)
    v = get_variant(op, "liger")
    why = v.why_not(s.dev, dt, **kw)
    if why and "bfloat16" in why and s.dev.type == "cpu" and v.why_not(s.dev, torch.float32, **kw) is None:
        s.log(f"{op} liger: {why}; checked in float32 here")
        dt = torch.float32
        why = None
    if why:
        s.rec.add("fused_check", "liger", "max_abs_err", math.nan, "", dtype=dt, statistic="not_run", op=op, reason=why)
        if "not installed" in why or "does not import" in why or "interpreter cannot" in why:
            s.refuse(f"{op} liger check", why)  # this machine's software, not a failed check
        else:
            s.check(False, f"{op} liger cannot run the check problem", why)
        return
    rows = F.check_variant(op, "liger", dt, pc, device=s.dev, seed=s.run.seed)
    for r in rows:
        s.rec.add(
            "fused_check", "liger", "max_abs_err", r.max_abs, "", shape=r.shape, dtype=dt, statistic="max",
            op=op, tensor=r.tensor, ok=r.ok, n_bad=r.n_bad, seed=r.seed, library=f"liger-kernel {liger.LIGER_VERSION}",
        )  # fmt: skip
    bad = [r for r in rows if not r.ok]
    if s.check(not bad, f"{op} liger fwd+bwd vs float64 at {rows[0].shape}", "\n".join(r.message for r in bad)):
        s.log(f"{op} liger fwd+bwd ok at {rows[0].shape} {str(dt).replace('torch.', '')} ({len(rows)} tensors)")


# ------------------------------------------------------------------------------------ torchao
def torchao_why_not(dev: torch.device) -> str | None:
    """None when torchao's float8 training can run on ``dev``, else why not."""
    try:
        import torchao.float8  # noqa: F401, PLC0415  (absent on a bare GPU machine)
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"torchao is not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        return "float8 matmuls need sm_89 or newer"
    return None


def mlp(hidden: int, mlp_hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(hidden, mlp_hidden), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden, hidden))


def float8(model: nn.Module, recipe: str, dev: torch.device) -> nn.Module:
    """A copy of ``model`` converted by torchao (emulated on CPU)."""
    from dataclasses import replace  # noqa: PLC0415

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    cfg = Float8LinearConfig.from_recipe_name(recipe)
    if dev.type != "cuda":
        cfg = replace(cfg, emulate=True)
    m = convert_to_float8_training(copy.deepcopy(model), config=cfg)
    assert all(type(x).__name__ == "Float8Linear" for x in (m[0], m[2])), "torchao converted no linear"
    return m


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """10 log10(||e||^2 / ||a - e||^2), in float64 (inf when equal, -inf for a non-finite result)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not bool(torch.isfinite(a).all()):
        return -math.inf
    err = float((a - e).pow(2).sum())
    return math.inf if err == 0 else 10 * math.log10(float(e.pow(2).sum()) / err)


def _fwd_bwd(model, x, dy):
    x = x.detach().requires_grad_()
    y = model(x)
    dx, dw = torch.autograd.grad(y, [x, model[0].weight], dy)
    return y, dx, dw


def _check_recipe(s, recipe, base, x, dy, ref, shape) -> nn.Module:
    m = float8(base, recipe, s.dev)
    got = _fwd_bwd(m, x, dy)
    worst = math.inf
    for name, a, e in zip(("out", "grad x", "grad w1"), got, ref):
        db = sqnr_db(a, e)
        worst = min(worst, db)
        s.rec.add(
            "torchao_check", f"float8_{recipe}", "sqnr", db, "dB", shape=shape, dtype="bfloat16", statistic="value",
            tensor=name, floor_db=MIN_SQNR_DB, ok=db >= MIN_SQNR_DB,
        )  # fmt: skip
    if s.check(worst >= MIN_SQNR_DB, f"torchao float8 {recipe} MLP vs float64", f"worst SQNR {worst:.1f} dB"):
        s.log(f"torchao float8 {recipe}: fwd+bwd vs float64 ok (worst SQNR {worst:.1f} dB >= {MIN_SQNR_DB:g})")
    return m


def section_torchao(s) -> None:
    """torchao float8 training (tensorwise, rowwise) on a FLUX-width MLP: checked against float64,
    timed beside bf16 on CUDA."""
    dev = s.dev
    why = torchao_why_not(dev)
    if why:
        s.refuse("torchao float8 training", why)
        for r in ("bf16", *(f"float8_{x}" for x in RECIPES)):
            s.not_timed("torchao_time", r, why)
        return
    tokens, hidden, mlp_hidden = MLP_SIZES[dev.type]
    shape = f"{tokens}x{hidden}x{mlp_hidden}"
    g = torch.Generator().manual_seed(s.run.seed)
    x64 = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    dy64 = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    base = mlp(hidden, mlp_hidden, s.run.seed)
    x, dy = x64.to(dev, torch.bfloat16), dy64.to(dev, torch.bfloat16)
    bf16 = base.to(dev, torch.bfloat16)
    ref = _fwd_bwd(copy.deepcopy(bf16).to(torch.float64), x.double(), dy.double())  # same rounded weights
    models = {"bf16": bf16}
    for recipe in RECIPES:
        models[f"float8_{recipe}"] = _check_recipe(s, recipe, bf16, x, dy, ref, shape)
    if dev.type != "cuda":
        for name in models:
            s.not_timed("torchao_time", name, NOT_TIMED_CPU if name != "bf16" else "not timed: float8 rows are not")
        return
    _time_models(s, models, x, dy, shape, tokens * hidden * mlp_hidden)


def _time_models(s, models: dict, x, dy, shape: str, mnk: int) -> None:
    base_ms = None
    for name, m in models.items():
        if s.over_budget(f"torchao {name} timing"):
            continue
        cm = torch.compile(m)

        def step(cm=cm, m=m):
            return _fwd_bwd_compiled(cm, m, x, dy)

        t = try_bench(step, name=f"torchao/{name}", device=s.dev, reps=s.plan.reps, budget_s=s.plan.item_budget_s)
        flops = 3 * 2 * 2 * mnk  # two matmuls, forward + two backward matmuls each
        s.rec.add_timing(
            "torchao_time", name, t, shape=shape, dtype="bfloat16", flops=flops, direction="fwd+bwd", compiled=True
        )
        if not getattr(t, "ok", False):
            s.log(f"torchao {name}: not timed ({getattr(t, 'reason', '')[:120]})")
            continue
        base_ms = t.median_ms if name == "bf16" else base_ms
        if base_ms:
            s.rec.add(
                "torchao_time", name, "speedup_vs_bf16", base_ms / t.median_ms, "x", shape=shape, dtype="bfloat16",
                statistic="median", formula="bf16 median / recipe median", direction="fwd+bwd", compiled=True,
            )  # fmt: skip
        s.log(f"torchao {name} fwd+bwd {shape}: {t.median_ms:.3f} ms, {flops / t.median_ms / 1e9:.0f} TFLOP/s")


def _fwd_bwd_compiled(cm, m, x, dy):
    xx = x.detach().requires_grad_()
    return torch.autograd.grad(cm(xx), [xx, m[0].weight], dy)


__all__ = ["LIGER_OPS", "MIN_SQNR_DB", "liger_check", "section_torchao", "sqnr_db", "torchao_why_not"]
