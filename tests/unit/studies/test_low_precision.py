"""Lab 04's study module: its config, the Amdahl table from a measured matmul share (the
constant shares only as labelled what-ifs), and the emulation proof that raises."""

from __future__ import annotations

import json

import pytest
import torch

from lab_kernels import quant as Q
from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.precision import numerics as N
from lab_utils.precision import quantized as P
from lab_utils.studies import low_precision as S


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(profile_steps=0), "profile_steps"),
        (dict(matmul_shares=[0.5, 1.5]), "matmul_shares"),
        (dict(recipes=["bf16"]), "recipes"),
        (dict(preset="flux-dev"), "preset"),
        (dict(format_variants=["fp8_e4m3/tensor", "fp6"]), "format_variants"),
    ],
)
def test_config_refuses_bad_values_by_name(kw, param):
    with pytest.raises(ConfigError) as ei:
        S.LowPrecisionLabConfig(**kw)
    assert ei.value.param == param


def test_amdahl_table_starts_from_the_measured_share():
    measured = S.MatmulShare(0.2284, "measured: 2-step profile of tiny on cpu")
    amd = S.amdahl_table(measured, [0.3, 0.8], speedups=(2.0, 4.0))
    assert len(amd) == 6
    first = amd.iloc[:2]
    assert (first.share_source == measured.source).all() and (first.matmul_share == 0.228).all()
    assert first.step_speedup_bound.tolist() == pytest.approx(
        [P.amdahl_speedup(0.2284, 2.0), P.amdahl_speedup(0.2284, 4.0)]
    )
    assert (amd.iloc[2:].share_source == "what-if").all()
    rec = Recorder(lab="04_low_precision")
    S.record_amdahl(rec, amd)
    # the measured share is a result: in extra, never in the key (a what-if share is a parameter)
    assert [r["variant"] for r in rec.rows[:2]] == ["measured share"] * 2
    assert [json.loads(r["extra"])["matmul_share"] for r in rec.rows[:2]] == [0.228] * 2
    assert [r["variant"] for r in rec.rows[2:]] == ["what-if share=0.3"] * 2 + ["what-if share=0.8"] * 2
    assert all(r["variant"].startswith("what-if") for r in rec.rows[2:])
    view = S.amdahl_view(amd)
    assert view.index[0] == (measured.source, 0.228)


def test_measured_matmul_share_profiles_the_lab_preset(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_ARTIFACTS_DIR", str(tmp_path))
    cfg = S.LowPrecisionLabConfig(profile_steps=1, batch_size=2, autocast=False)
    rec = Recorder(lab="04_low_precision")
    share = S.measured_matmul_share(cfg, "cpu", rec)
    assert 0.0 < share.share < 1.0 and share.source.startswith("measured: 1-step profile of tiny")
    assert [(r["metric"], r["value"]) for r in rec.rows] == [("matmul_share", share.share)]
    assert list(tmp_path.rglob("*.trace.json")), "the profile's trace is kept beside the run's artifacts"


def test_emulation_proof_raises_when_an_implementation_differs(monkeypatch, capsys):
    real = Q.torchao_fake_quantize

    def off_by_one_ulp(x, fmt, **kw):
        y = real(x, fmt, **kw)
        return y if fmt != "mxfp4" else torch.nextafter(y, torch.full_like(y, float("inf")))

    monkeypatch.setattr(Q, "torchao_fake_quantize", off_by_one_ulp)
    with pytest.raises(AssertionError, match="mxfp4/floor"):
        S.emulation_proof()
    assert "mxfp4       floor   reference == triton: True   == torchao: False" in capsys.readouterr().out


def test_mmdit_task_is_deterministic_per_seed_and_step():
    task = S.mmdit_task("tiny", batch_size=2)
    m = task.make_model(0)
    a, ta = task.loss(m, 3, 1)
    b, tb = task.loss(m, 3, 1)
    assert torch.equal(a, b) and torch.equal(ta, tb)
    c, _ = task.loss(m, 4, 1)
    assert not torch.equal(a, c)


def _small_sqnr_cfg():
    return S.LowPrecisionLabConfig(tensor_shape=[32, 128], format_variants=["fp8_e4m3/tensor", "mxfp4/floor"])


def test_sqnr_table_passes_its_independent_derivation():
    sq = S.sqnr_synthetic(_small_sqnr_cfg(), Recorder(lab="04_low_precision"))
    assert len(sq) == 2 * len(S.LowPrecisionLabConfig().distributions)
    lo, hi = S.sqnr_band_db(3)  # e4m3: half-ulp bound 6.02 * 4 dB, mean-square bound + 1.5 dB
    assert lo == pytest.approx(24.08, abs=0.01) and hi == pytest.approx(36.37, abs=0.01)


def test_sqnr_table_raises_when_the_sqnr_derivation_is_wrong(monkeypatch):
    real = N.sqnr_db
    monkeypatch.setattr(N, "sqnr_db", lambda q, x: 2 * real(q, x))  # 20*log10 of a power ratio
    with pytest.raises(AssertionError, match="SQNR table off its independent derivation: fp8_e4m3/tensor"):
        S.sqnr_synthetic(_small_sqnr_cfg(), Recorder(lab="04_low_precision"))


def test_sqnr_table_raises_outside_the_format_band(monkeypatch):
    monkeypatch.setattr(S, "sqnr_band_db", lambda m: (40.0, 50.0))  # a band fp8/fp4 cannot reach
    with pytest.raises(AssertionError, match=r"band 40\.0\.\.50\.0"):
        S.sqnr_synthetic(_small_sqnr_cfg(), Recorder(lab="04_low_precision"))
