"""lab_utils.precision.quantized: recipes, the swapped linear (forward + both gradients), torchao, convergence."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats
from torch import nn
from torchao.float8.float8_linear import Float8Linear

import lab_kernels  # noqa: F401
from lab_utils.core.checks import assert_bitwise_equal, assert_close
from lab_utils.core.config import ConfigError
from lab_utils.model import build_model, resolve_config
from lab_utils.model.config import RECIPES as MODEL_RECIPES
from lab_utils.precision import quantized as P
from lab_utils.studies.low_precision import mmdit_task


@pytest.fixture(autouse=True)
def _seed_global_rng(gen):  # inputs and nn.Linear init draw from it: the seed gen reports replays them
    torch.manual_seed(gen.initial_seed())


def _manual(x, w, b, dy, r: P.Recipe):
    """The recipe's three matmuls written out: each operand quantized along its contraction axis."""

    def q(t, tq, axis):
        return tq.apply(t, axis) if tq is not None else t

    x2 = x.reshape(-1, x.shape[-1])
    g = dy.reshape(-1, dy.shape[-1])
    y = q(x2, r.fwd_x, -1) @ q(w, r.fwd_w, -1).T + b
    dx = q(g, r.dgrad_dy, -1) @ q(w, r.dgrad_w, 0)
    dw = q(g, r.wgrad_dy, 0).T @ q(x2, r.wgrad_x, 0)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, g.sum(0)


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_row", "fp8_block", "mxfp8", "mxfp4_fwd"])
def test_quant_linear_forward_and_gradients(name, gen):
    r = P.RECIPES[name]
    lin = nn.Linear(96, 40)
    ql = P.QuantLinear.from_linear(lin, r)
    x = torch.randn(3, 11, 96, generator=gen, requires_grad=True)
    dy = torch.randn(3, 11, 40, generator=gen)
    y = ql(x)
    y.backward(dy)
    ey, edx, edw, edb = _manual(x.detach(), lin.weight.detach(), lin.bias.detach(), dy, r)
    assert_bitwise_equal(y.detach(), ey, name="forward")
    assert_close(x.grad, edx, dtype=torch.float32, name="dgrad")
    assert_close(lin.weight.grad, edw, dtype=torch.float32, name="wgrad")
    assert_close(lin.bias.grad, edb, dtype=torch.float32, name="bias grad")


def test_all_high_precision_recipe_equals_linear(gen):
    r = P.Recipe("none_quantized", "emulated")
    lin = nn.Linear(32, 16)
    ql = P.QuantLinear.from_linear(lin, r)
    x = torch.randn(5, 32, generator=gen, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    ql(x).sum().backward()
    w_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    ref = lin(x2)
    ref.sum().backward()
    assert_close(x.grad, x2.grad, dtype=torch.float32)
    assert_close(w_grad, lin.weight.grad, dtype=torch.float32)


def test_stochastic_rounding_recipe_runs_and_differs_between_calls(gen):
    ql = P.QuantLinear.from_linear(nn.Linear(64, 32), P.RECIPES["nvfp4"])
    x = torch.randn(16, 64, generator=gen, requires_grad=True)
    dy = torch.randn(16, 32, generator=gen)
    ql(x).backward(dy)
    g1 = x.grad.clone()
    x.grad = None
    ql(x).backward(dy)
    assert not torch.equal(g1, x.grad), "stochastic rounding should draw fresh bits each step"
    assert bool(torch.isfinite(g1).all())


def test_autocast_output_dtype(gen):
    ql = P.QuantLinear.from_linear(nn.Linear(32, 16), P.RECIPES["fp8_tensor"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ql(torch.randn(4, 32, generator=gen))
    assert y.dtype == torch.bfloat16


def test_apply_recipe_to_mmdit_respects_keep_list():
    task = mmdit_task("tiny", batch_size=2)
    m = P.apply_recipe(task.make_model(0), "mxfp8")
    rep = m.precision_report.set_index("module")
    assert not rep.loc["img_in", "converted"] and not rep.loc["final_layer.linear", "converted"]
    assert not rep.loc["double_blocks.0.img_mod.lin", "converted"]
    assert rep.loc["double_blocks.0.img_attn.qkv", "converted"]
    assert isinstance(m.single_blocks[0].linear1, P.QuantLinear)
    per, t = task.loss(m, 0, 0)
    per.mean().backward()
    assert bool(torch.isfinite(per).all())
    base = P.apply_recipe(task.make_model(0), "bf16")
    assert not base.precision_report["converted"].any()


def test_model_config_recipe_seam():
    assert "fp8_tensor" in MODEL_RECIPES
    model = build_model(resolve_config("tiny", recipe="fp8_tensor"))
    assert isinstance(model.double_blocks[0].img_mlp.fc1, P.QuantLinear)
    with pytest.raises(ConfigError, match="'recipe'"):
        resolve_config("tiny", recipe="fp3")


def test_torchao_float8_recipe_runs_emulated_on_cpu():
    task = mmdit_task("tiny", batch_size=2)
    m = P.apply_recipe(task.make_model(0), "torchao_float8_tensorwise")
    assert m.precision_report["converted"].sum() > 0
    assert isinstance(m.double_blocks[0].img_attn.qkv, Float8Linear)
    per, _ = task.loss(m, 0, 0)
    per.mean().backward()
    assert bool(torch.isfinite(per).all())


def test_recipe_tables_and_errors():
    assert list(P.RECIPES["nvfp4"].table()["operand_a"])[2] == "nvfp4/SR/RHT16"
    assert P.RECIPES["mxfp4_fwd"].table()["operand_a"].tolist()[1] == "high precision"
    with pytest.raises(ConfigError, match="'recipe'"):
        P.apply_recipe(nn.Linear(4, 4), "fp3")
    with pytest.raises(ValueError, match="'fmt'"):
        P.TensorQuant("fp9")
    with pytest.raises(ValueError, match="'scale_rule'"):
        P.TensorQuant("mxfp4", scale_rule="round")
    with pytest.raises(ConfigError, match="'kind'"):
        P.Recipe("x", kind="magic")


def test_amdahl():
    assert P.amdahl_speedup(0.0, 2.0) == 1.0
    assert P.amdahl_speedup(1.0, 2.0) == 2.0
    assert P.amdahl_speedup(0.6, 2.0) == pytest.approx(1 / (0.4 + 0.3))
    with pytest.raises(ConfigError, match="'matmul_share'"):
        P.amdahl_speedup(1.5, 2.0)
    with pytest.raises(ConfigError, match="'matmul_speedup'"):
        P.amdahl_speedup(0.5, 0)


def test_convergence_runner_on_mlp():
    task = P.mlp_task(dim=16, hidden=32, batch_size=16)
    res = P.run_convergence(task, ["fp8_tensor", "mxfp4_fwd"], steps=8, seeds=(0, 1), lr=3e-3, window=4)
    assert set(res.curves.recipe) == {"bf16", "fp8_tensor", "mxfp4_fwd"}
    assert len(res.curves) == 3 * 2 * 8
    g = res.gaps.set_index("recipe")
    assert g.loc["fp8_tensor", "n_seeds"] == 2 and not g.loc["fp8_tensor", "diverged"]
    # the gap and its interval, recomputed from the curves: per seed, mean of the last
    # `window` losses of the recipe minus the baseline's; a 95% t-interval over seeds
    c = res.curves[res.curves.step >= 8 - 4].groupby(["recipe", "seed"])["loss"].mean()
    d = np.array([c["fp8_tensor", s] - c["bf16", s] for s in (0, 1)])
    half = stats.t.ppf(0.975, 1) * d.std(ddof=1) / math.sqrt(2)
    assert g.loc["fp8_tensor", "gap"] == pytest.approx(d.mean(), rel=1e-12, abs=1e-15)
    assert g.loc["fp8_tensor", "ci_low"] == pytest.approx(d.mean() - half, rel=1e-12, abs=1e-15)
    assert g.loc["fp8_tensor", "ci_high"] == pytest.approx(d.mean() + half, rel=1e-12, abs=1e-15)
    band = res.band().set_index(["recipe", "step"])
    one = res.curves[(res.curves.recipe == "mxfp4_fwd") & (res.curves.step == 3)].loss.to_numpy()
    half = stats.t.ppf(0.975, 1) * one.std(ddof=1) / math.sqrt(2)
    assert band.loc[("mxfp4_fwd", 3), "mean"] == pytest.approx(one.mean(), rel=1e-12)
    assert band.loc[("mxfp4_fwd", 3), "high"] - band.loc[("mxfp4_fwd", 3), "low"] == pytest.approx(2 * half, rel=1e-9)
    assert res.buckets["n"].sum() == 3 * 2 * 4 * 16
    # same seed + recipe -> identical curve (determinism of data and init)
    seen = []
    again = P.run_convergence(task, [], steps=3, seeds=(0,), lr=3e-3, progress=lambda runs: seen.extend(runs) or runs)
    assert seen == [("bf16", 0)]
    first = res.curves[(res.curves.recipe == "bf16") & (res.curves.seed == 0)].loss.tolist()[:3]
    assert again.curves.loss.tolist() == first


def scripted_task(losses: dict[str, list[float]]) -> P.TrainTask:
    """The MLP task whose loss at each step is scripted per recipe (keyed by the recipe of its
    first converted layer, "bf16" when none is), so when a run diverges is known in advance."""
    real = P.mlp_task(dim=8, hidden=16, batch_size=4)

    def loss(model, step, seed):
        q = next((m.recipe.name for m in model.modules() if isinstance(m, P.QuantLinear)), "bf16")
        zero = sum(p.sum() for p in model.parameters()) * 0.0  # a graph to run backward through
        return zero + torch.full((4,), losses[q][step]), torch.full((4,), 0.5)

    return P.TrainTask("scripted", real.make_model, loss)


def test_divergence_detected():
    """A run diverges on a non-finite loss, or from step 5 on a loss above diverge_factor x its
    first; it is stopped there and its recipe has no gap.  The baseline beside it does not."""
    steady = [1.0] * 10
    task = scripted_task(
        {
            "bf16": steady,
            # 5x the first loss at step 4 is before the rule applies; exactly 2x at step 5 is not above
            "fp8_tensor": [1.0, 1.0, 1.0, 1.0, 5.0, 2.0, 2.0 * (1 + 1e-6), 1.0, 1.0, 1.0],
            "mxfp4_fwd": [1.0, 1.0, float("nan")] + [1.0] * 7,
        }
    )
    res = P.run_convergence(task, ["fp8_tensor", "mxfp4_fwd"], steps=10, seeds=(0,), diverge_factor=2.0)
    d = res.divergences.set_index("recipe")
    assert set(d.index) == {"fp8_tensor", "mxfp4_fwd"}  # never the steady baseline
    assert d.loc["fp8_tensor", "step"] == 6 and "> 2.0 x first 1" in d.loc["fp8_tensor", "reason"]
    assert d.loc["mxfp4_fwd", "step"] == 2 and d.loc["mxfp4_fwd", "reason"] == "non-finite loss"
    g = res.gaps.set_index("recipe")
    assert g.loc["fp8_tensor", "diverged"] and math.isnan(g.loc["fp8_tensor", "gap"])
    assert g.loc["mxfp4_fwd", "diverged"] and g.loc["mxfp4_fwd", "n_seeds"] == 0
    assert res.curves[res.curves.recipe == "fp8_tensor"].step.max() == 6  # stopped at the divergence
    assert res.curves[res.curves.recipe == "bf16"].step.max() == 9
    # stopped before step 6: no divergence; the gap is the last window's loss (step 5: 2.0) minus the baseline's
    calm = P.run_convergence(task, ["fp8_tensor"], steps=6, seeds=(0,), diverge_factor=2.0)
    assert calm.divergences.empty and calm.gaps.set_index("recipe").loc["fp8_tensor", "gap"] == 1.0


def test_hadamard_that_cannot_apply_is_refused(gen):
    """A rotation over an axis its size does not divide is refused: quantizing without it
    would silently not be the recipe its table shows."""
    tq = P.TensorQuant("nvfp4", hadamard=16)
    x = torch.randn(24, 40, generator=gen)
    assert tq.why_not(40) and tq.why_not(32) is None
    with pytest.raises(ConfigError, match="'hadamard'") as ei:
        tq.apply(x, axis=-1)  # 40 % 16 != 0
    assert "40" in str(ei.value)
    with pytest.raises(ConfigError, match="'hadamard'"):
        tq.apply(x, axis=0)  # 24 % 16 != 0
    y = tq.apply(torch.randn(32, 40, generator=gen), axis=0)  # 32 tokens: rotated and quantized
    assert y.shape == (32, 40) and bool(torch.isfinite(y).all())
    with pytest.raises(ConfigError, match="'hadamard'"):
        P.TensorQuant("nvfp4", hadamard=12)


def test_recipe_with_a_rotation_its_layer_cannot_take_is_refused():
    rotated = P.TensorQuant("mxfp4", hadamard=32)
    r = P.Recipe("rht_fwd", "emulated", fwd_x=rotated, fwd_w=rotated)
    assert r.why_not(64, 40) is None and "fwd_x" in r.why_not(48, 64)
    with pytest.raises(ConfigError, match="'recipe'") as ei:
        P.apply_recipe(nn.Sequential(nn.Linear(48, 64)), r)
    assert "'0'" in str(ei.value) and "48" in str(ei.value)
    ok = P.apply_recipe(nn.Sequential(nn.Linear(64, 40)), r)
    assert isinstance(ok[0], P.QuantLinear)


def test_nvfp4_weight_gradient_refuses_a_token_count_its_rotation_cannot_cover(gen):
    ql = P.QuantLinear.from_linear(nn.Linear(64, 32), P.RECIPES["nvfp4"])
    x = torch.randn(20, 64, generator=gen, requires_grad=True)  # 20 tokens: 20 % 16 != 0
    with pytest.raises(ConfigError, match="'hadamard'"):
        ql(x).sum().backward()


def test_matmul_share_from_analysis():
    class Analysis:
        categories = pd.DataFrame(
            dict(category=["matmul", "attention", "other"], ms=[3.0, 5.0, 2.0], pct_of_step=[30.0, 50.0, 20.0])
        )

    class Report:
        analysis = Analysis()

    assert P.matmul_share_from_analysis(Report()) == pytest.approx(0.3)
    assert P.matmul_share_from_analysis(Analysis()) == pytest.approx(0.3)


# (forward x, forward W, dgrad dy, dgrad W, wgrad dy, wgrad x): FP8 recipes keep e4m3 for
# weights and activations and give gradients e5m2's range, except DeepSeek-style blocks
# (e4m3 everywhere); MXFP8 is e4m3 everywhere.
_E4, _E5 = "fp8_e4m3", "fp8_e5m2"
RECIPE_FORMATS = {
    "fp8_tensor": (_E4, _E4, _E5, _E4, _E5, _E4),
    "fp8_row": (_E4, _E4, _E5, _E4, _E5, _E4),
    "fp8_block": (_E4,) * 6,
    "mxfp8": ("mxfp8_e4m3",) * 6,
}


@pytest.mark.parametrize("name", sorted(RECIPE_FORMATS))
def test_each_fp8_recipe_gives_each_operand_its_format(name):
    r = P.RECIPES[name]
    ops = ("fwd_x", "fwd_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")
    assert tuple(getattr(r, op).fmt for op in ops) == RECIPE_FORMATS[name]
