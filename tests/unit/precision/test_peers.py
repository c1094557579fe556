"""lab_utils.precision.peers: torchao's float8 training recipes beside perflab's own in lab 04."""

import math
import sys

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


# float8 tensor-core matmuls (torch._scaled_mm) exist from Ada (sm_89) on: Hopper sm_90, Blackwell sm_100/120
@pytest.mark.parametrize(
    "cap,ok",
    [((7, 0), False), ((7, 5), False), ((8, 0), False), ((8, 6), False), ((8, 7), False), ((8, 8), False),
     ((8, 9), True), ((9, 0), True), ((10, 0), True), ((12, 0), True)],
)  # fmt: skip
def test_float8_training_needs_sm89_or_newer(monkeypatch, cap, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: cap)
    for r in TORCHAO:
        why = peers.recipe_why_not(r, "cuda:0")
        if ok:
            assert why is None
        else:
            assert why == (
                f"torchao float8 training needs float8 matmuls (sm_89 or newer); this GPU is sm_{cap[0]}{cap[1]}"
            )
    here = peers.recipe_sources(TORCHAO, torch.device("cuda")).here
    assert list(here) == (["float8 matmuls"] * 2 if ok else [f"not run: {why}"] * 2)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_tensor", "mxfp8"])
def test_perflab_recipes_train_on_any_device(monkeypatch, recipe):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (6, 0))
    assert peers.recipe_why_not(recipe, "cuda") is None and peers.recipe_why_not(recipe, "cpu") is None
    row = peers.recipe_sources([recipe], "cuda").loc[recipe]
    assert row.source == "perflab (lab_kernels.quant, exact emulation)" and row.here == "emulated"
    assert row.per_layer_sqnr == ""


def test_torchao_not_importable_is_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # the import raises ModuleNotFoundError
    for r in TORCHAO:
        why = peers.recipe_why_not(r, "cpu")
        assert why is not None and why.startswith("torchao is not importable: ModuleNotFoundError: ")
    t = peers.recipe_sources([*TORCHAO, "fp8_tensor"], "cpu")
    assert all(t.loc[r, "here"] == "not run: " + peers.recipe_why_not(r, "cpu") for r in TORCHAO)
    assert t.loc["fp8_tensor", "here"] == "emulated"


def test_each_source_names_torchaos_version_and_scaling():
    import torchao  # noqa: PLC0415  (optional, heavy: imported where the test needs it)

    t = peers.recipe_sources(list(reversed(TORCHAO)), "cpu")
    assert list(t.index) == list(reversed(TORCHAO))  # one row per recipe, in the order asked
    for r, scaling in zip(TORCHAO, ("tensorwise", "rowwise")):
        assert t.loc[r, "source"] == f"torchao {torchao.__version__} convert_to_float8_training ({scaling})"
        assert t.loc[r, "here"] == "emulated by torchao (emulate=True)"
        assert t.loc[r, "per_layer_sqnr"] == peers.PEER_SQNR_VARIANTS[r]
    assert "e5m2" in t.loc["torchao_float8_tensorwise", "per_layer_sqnr"]  # tensorwise: e5m2 gradients
    assert "e5m2" not in t.loc["torchao_float8_rowwise", "per_layer_sqnr"]  # rowwise: e4m3 throughout
