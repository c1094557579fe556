"""lab_utils.precision.peers: torchao's float8 training recipes beside perflab's own in lab 04."""

import math

import pytest
import torch

from lab_utils.precision import peers
from lab_utils.precision import quantized as P
from lab_utils.studies import low_precision as S

TORCHAO = ["torchao_float8_tensorwise", "torchao_float8_rowwise"]


def test_torchao_recipes_train_here_and_the_gap_has_an_interval():
    """The convergence comparison runs torchao's recipes (emulated on CPU) against bf16 with two
    seeds: every run converts its linears, no run diverges, each gap has a 95% interval around it."""
    assert all(peers.recipe_why_not(r, "cpu") is None for r in TORCHAO)
    res = P.run_convergence(P.mlp_task(), TORCHAO, steps=6, seeds=[0, 1], autocast_dtype=None)
    assert res.divergences.empty
    gaps = res.gaps.set_index("recipe")
    for r in TORCHAO:
        g = gaps.loc[r]
        assert g.n_seeds == 2 and math.isfinite(g.gap) and g.ci_low <= g.gap <= g.ci_high
    m = P.apply_recipe(P.mlp_task().make_model(0), "torchao_float8_rowwise")
    assert m.precision_report.converted.any()


def test_a_gpu_without_float8_matmuls_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    why = peers.recipe_why_not("torchao_float8_rowwise", "cuda")
    assert "sm_89 or newer" in why and "sm_80" in why
    assert peers.recipe_why_not("fp8_tensor", "cuda") is None
    t = peers.recipe_sources(["fp8_tensor", "torchao_float8_rowwise"], "cuda")
    assert t.loc["torchao_float8_rowwise", "here"].startswith("not run: ") and t.loc["fp8_tensor", "here"] == "emulated"


def test_recipe_sources_on_cpu_name_the_peer_and_its_per_layer_figures():
    t = peers.recipe_sources(["fp8_tensor", *TORCHAO], "cpu")
    assert t.loc["fp8_tensor", "source"].startswith("perflab")
    for r in TORCHAO:
        assert t.loc[r, "source"].startswith("torchao 0.18") and "emulated" in t.loc[r, "here"]
        assert t.loc[r, "per_layer_sqnr"].startswith("fp8_e4m3/")


def test_lab_runs_only_the_recipes_that_can_train_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(peers, "recipe_why_not", lambda r, dev: "no float8 here" if r.startswith("torchao") else None)
    seen = {}

    def fake_run(task, recipes, **kw):
        seen["recipes"] = list(recipes)
        raise StopIteration

    monkeypatch.setattr(P, "run_convergence", fake_run)
    cfg = S.LowPrecisionLabConfig()
    assert set(TORCHAO) <= set(cfg.recipes)
    with pytest.raises(StopIteration):
        S.run_convergence(cfg, torch.device("cpu"), None)
    assert seen["recipes"] == ["fp8_tensor", "mxfp8"]
    out = capsys.readouterr().out
    assert all(f"{r}: not run here: no float8 here" in out for r in TORCHAO)
