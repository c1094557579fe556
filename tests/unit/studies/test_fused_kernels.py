"""Lab 02's study module: parameters validated by name, and every check the lab makes raises
(so a headless run is marked failed) when it fails, for every op the lab times."""

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.fused import blocks as fused_blocks
from lab_utils.studies import fused_kernels as study


def _lab(**params) -> study.Lab:
    cfg = study.FusedKernelsConfig(**params)
    return study.Lab(cfg, torch.device("cpu"), None, Recorder("test_02"))


def test_config_refuses_bad_values_naming_the_parameter():
    with pytest.raises(ConfigError, match="'op'"):
        study.FusedKernelsConfig(op="layernorm")
    with pytest.raises(ConfigError, match="'directions'"):
        study.FusedKernelsConfig(directions=["forward"])
    with pytest.raises(ConfigError, match="'check_head_dim'"):
        study.FusedKernelsConfig(check_head_dim=63)
    with pytest.raises(ConfigError, match="'sweep_variants'"):
        study.FusedKernelsConfig(sweep_variants=["fast"])
    with pytest.raises(ConfigError, match="'block_providers'"):
        study.FusedKernelsConfig(block_providers=["xla"])
    with pytest.raises(ConfigError, match="'dtype'"):
        study.FusedKernelsConfig(dtype="float64")
    assert study.FusedKernelsConfig().check_problem.hidden == 781


def test_correctness_raises_with_the_table_when_a_variant_fails(temporary_variant):
    temporary_variant(
        "rms_norm", "off_by_one_pct", lambda x, w, eps=1e-6: 1.01 * x * torch.rsqrt(x.pow(2).mean(-1, True) + eps) * w
    )
    lab = _lab(check_variants=["eager", "off_by_one_pct"], check_dtypes=["float32"], check_tokens=5, check_hidden=33)
    with pytest.raises(study.CheckFailed, match=r"(?s)off_by_one_pct\s+float32\s+FAIL"):
        study.correctness(lab)
    ok = _lab(check_variants=["eager"], check_dtypes=["float32"], check_tokens=5, check_hidden=33)
    text = study.correctness(ok)
    assert "PASS" in text and "FAIL" not in text
    assert set(ok.rec.frame().variant) == {"eager"}


def test_sweep_checks_every_op_it_times_not_only_op(temporary_variant):
    """On a GPU the sweep times every op; each (op, variant) it times is checked first, even
    when the correctness table is about another op."""
    temporary_variant("gelu_tanh", "fast_wrong", lambda x: torch.nn.functional.gelu(x))  # the erf form, not tanh
    lab = _lab(op="rms_norm", sweep_ops=["rms_norm", "gelu_tanh"], sweep_variants=["eager", "fast_wrong"],
               directions=["fwd"], tokens=[8], preset="tiny", check_tokens=7, check_hidden=40, reps=3)  # fmt: skip
    with pytest.raises(AssertionError, match="gelu_tanh/fast_wrong"):
        study.run_sweep(lab)
    good = _lab(sweep_ops=["gelu_tanh"], sweep_variants=["eager"], directions=["fwd"], tokens=[8], preset="tiny",
                check_tokens=7, check_hidden=40, reps=3)  # fmt: skip
    assert study.run_sweep(good).startswith("1 (op, variant) pairs checked against float64")


def test_block_agreement_raises_when_a_provider_disagrees():
    lab = _lab(block_kinds=["single"], block_providers=["eager"], block_img_tokens=6, block_txt_tokens=3)
    (case,) = study.block_cases(lab)
    assert "single eager" in study.block_agreement(lab, [case])

    def shifted():  # a provider whose outputs are 1e-2 off
        return tuple(o + 1e-2 for o in case.forward())

    bad = fused_blocks.BlockCase("triton", "single", case.fn, shifted, case.shape, "triton", False)
    with pytest.raises(study.CheckFailed, match="single/triton: max abs diff"):
        study.block_agreement(lab, [case, bad])
