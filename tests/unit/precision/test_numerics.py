"""lab_utils.precision.numerics: error metrics, distributions, captured tensors, grid histogram."""

import math

import pytest
import torch
from torch import nn

import lab_kernels  # noqa: F401
from lab_kernels import quant as Q
from lab_utils.precision import numerics as N
from lab_utils.studies.low_precision import mmdit_task


@pytest.fixture(autouse=True)
def _seed_global_rng(gen):  # inputs and nn.Linear init draw from it: the seed gen reports replays them
    torch.manual_seed(gen.initial_seed())


def test_representable_input_has_no_error():
    v = Q.representable_values("e4m3")
    x = v.float().reshape(1, -1)
    s = N.error_stats(x, "fp8_e4m3", granularity="none")
    assert s.sqnr_db == math.inf and s.rel_fro == 0 and s.max_abs == 0
    assert s.flushed_frac == 0 and s.saturated_frac == 0


def test_flushed_and_saturated_fractions():
    # MXFP4 block: amax 7.9 -> floor scale 2^(2-2) = 1, so 7.9 > 6 saturates; 0.2 < 0.25 flushes
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 7.9, 0.2, 1.0, -7.0
    s = N.error_stats(x, "mxfp4")
    assert s.saturated_frac == pytest.approx(2 / 32)
    assert s.flushed_frac == pytest.approx(1 / 32)
    r = N.error_stats(x, "mxfp4", scale_rule="rceil")  # rceil never saturates
    assert r.saturated_frac == 0


def test_error_metrics_definitions(gen):
    x = torch.randn(64, 64, generator=gen)
    q = Q.fake_quantize(x, "mxfp8_e4m3")
    m = N.error_metrics(q, x)
    d = q.double() - x.double()
    assert m["rel_fro"] == pytest.approx(float(d.norm() / x.double().norm()))
    assert m["sqnr_db"] == pytest.approx(-20 * math.log10(m["rel_fro"]))
    assert m["max_abs"] == pytest.approx(float(d.abs().max()))


def test_distributions_deterministic_and_heavy_tailed():
    for d in N.DISTRIBUTIONS:
        a, b = N.make_tensor(d, (64, 128), seed=3), N.make_tensor(d, (64, 128), seed=3)
        assert torch.equal(a, b) and a.shape == (64, 128) and a.dtype == torch.float32
    g = N.make_tensor("gaussian", (256, 256))
    t = N.make_tensor("student_t", (256, 256))
    kurt = lambda x: float(((x - x.mean()) ** 4).mean() / x.var() ** 2)  # noqa: E731
    assert kurt(t) > kurt(g) + 1
    o = N.make_tensor("outlier_channels", (64, 128))
    assert float(o.abs().amax(0).max() / o.abs().amax(0).median()) > 10
    with pytest.raises(ValueError, match="'dist'"):
        N.make_tensor("cauchy")


def test_nonfinite_refused():
    with pytest.raises(ValueError, match="'x'"):
        N.error_stats(torch.tensor([[1.0, math.nan]]), "mxfp4")


def test_sqnr_table_rows_and_ordering():
    T = {"g": N.make_tensor("gaussian", (32, 128))}
    df = N.sqnr_table(T, ["fp8_e4m3/tensor", "mxfp8_e4m3/floor", "mxfp4/floor", "nvfp4"])
    assert len(df) == 4 and {"sqnr_db", "rel_fro", "flushed_frac", "saturated_frac", "bits"} <= set(df.columns)
    s = df.set_index("variant")["sqnr_db"]
    assert s["fp8_e4m3/tensor"] > s["nvfp4"] > s["mxfp4/floor"]


def test_format_grid_histogram_counts(gen):
    x = torch.randn(7, 50, generator=gen)  # 50 is padded to 64 for MX: padding not counted
    for fmt in ("mxfp4", "fp8_e4m3", "nvfp4"):
        h = N.format_grid_histogram(x, fmt)
        assert h["count"].sum() == x.numel()
        assert abs(h["frac"].sum() - 1) < 1e-12
        assert h["value"].is_monotonic_increasing
    h = N.format_grid_histogram(x, "mxfp4")
    assert len(h) == 8 and h["value"].max() == 6.0


def test_capture_linear_tensors_small_model(gen):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 3, 8, generator=gen)
    cap = N.capture_linear_tensors(model, lambda: model(x).pow(2).sum())
    assert set(cap.by_kind("weight")) == {"0", "2"}
    assert cap.by_kind("activation")["2"].shape == (15, 16)
    assert cap.by_kind("gradient")["0"].shape == (15, 16)
    assert all(p.grad is None for p in model.parameters())
    assert len(cap.summary()) == 6


def test_capture_from_mmdit_tiny():
    task = mmdit_task("tiny", batch_size=2)
    model = task.make_model(0)
    cap = N.capture_linear_tensors(
        model,
        lambda: task.loss(model, 0, 0)[0].mean(),
        names=["double_blocks.0.img_attn.qkv", "single_blocks.0.linear2"],
    )
    assert set(k.split(":")[0] for k in cap.tensors) == {"weight", "activation", "gradient"}
    assert cap.by_kind("activation")["single_blocks.0.linear2"].shape[-1] == 320
    assert all(bool(torch.isfinite(v).all()) for v in cap.tensors.values())


def test_saturation_and_histogram_on_padded_axes_and_tiles():
    """Codes are read in the tensor's own layout: a block that padding completes (40 = 32 + 8)
    along axis 0, and 128x128 tiles over a 130 x 7 matrix."""
    x = torch.zeros(40, 3)
    x[33, 1], x[34, 1], x[35, 1] = 7.9, 1.0, 0.2  # last (padded) block of column 1: scale 1
    s = N.error_stats(x, "mxfp4", axis=0)
    assert s.saturated_frac == pytest.approx(1 / 120) and s.flushed_frac == pytest.approx(1 / 120)
    h = N.format_grid_histogram(x, "mxfp4", axis=0)
    assert h["count"].sum() == 120 and h.set_index("value").loc[6.0, "count"] == 1
    y = torch.ones(130, 7)
    y[129, 6] = 1e6  # the amax of its 128x128 tile (rows 128..129): at the top code, not saturated
    t = N.error_stats(y, "fp8_e4m3", granularity="block2d")
    assert t.saturated_frac == 0
    assert t.flushed_frac == pytest.approx(13 / 910)  # the tile's 13 ones fall below 1e6 / 448 * 2^-9
