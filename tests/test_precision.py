"""lab_utils.precision: recipes, the swapped linear (forward + both gradients), torchao, convergence."""

import math

import pytest
import torch
from torch import nn

import lab_kernels  # noqa: F401
from lab_utils import precision as P
from lab_utils.checks import assert_bitwise_equal, assert_close
from lab_utils.config import ConfigError


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
    task = P.mmdit_task("tiny", batch_size=2)
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
    from lab_utils.model import mmdit as M

    assert "fp8_tensor" in (M.recipe_names() or ())
    model = M.build_model(M.resolve_config("tiny", recipe="fp8_tensor"))
    assert isinstance(model.double_blocks[0].img_mlp.fc1, P.QuantLinear)
    with pytest.raises(ConfigError, match="'recipe'"):
        M.resolve_config("tiny", recipe="fp3")


def test_torchao_float8_recipe_runs_emulated_on_cpu():
    task = P.mmdit_task("tiny", batch_size=2)
    m = P.apply_recipe(task.make_model(0), "torchao_float8_tensorwise")
    assert m.precision_report["converted"].sum() > 0
    from torchao.float8.float8_linear import Float8Linear

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
    assert g.loc["fp8_tensor", "ci_low"] <= g.loc["fp8_tensor", "gap"] <= g.loc["fp8_tensor", "ci_high"]
    band = res.band()
    assert bool((band["low"] <= band["mean"]).all()) and bool((band["mean"] <= band["high"]).all())
    assert res.buckets["n"].sum() == 3 * 2 * 4 * 16
    # same seed + recipe -> identical curve (determinism of data and init)
    again = P.run_convergence(task, [], steps=3, seeds=(0,), lr=3e-3)
    first = res.curves[(res.curves.recipe == "bf16") & (res.curves.seed == 0)].loss.tolist()[:3]
    assert again.curves.loss.tolist() == first


def test_divergence_detected():
    task = P.mlp_task(dim=16, hidden=32, batch_size=16)
    res = P.run_convergence(task, ["fp8_tensor"], steps=12, seeds=(0,), lr=50.0, diverge_factor=2.0)
    assert len(res.divergences) >= 1
    g = res.gaps.set_index("recipe")
    assert g.loc["fp8_tensor", "diverged"] or "bf16" in set(res.divergences.recipe)
    assert math.isnan(g.loc["fp8_tensor", "gap"]) or "bf16" in set(res.divergences.recipe)
