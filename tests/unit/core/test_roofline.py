import pytest

from lab_utils.core.ceilings import Ceilings
from lab_utils.core.roofline import roofline, roofline_curve
from lab_utils.core.timing import Timing

CEIL = Ceilings(
    device={"name": "test"}, copy_gbs=1000.0, copy_bytes=1, matmul_tflops={"bf16": 500.0, "fp32": 50.0}, matmul_n={}
)


def test_memory_bound_point():
    # 1 GB moved, 1 GFLOP: intensity 1 FLOP/B, ridge 500 FLOP/B -> memory-bound; floor 1 ms.
    p = roofline(2.0, bytes=1e9, flops=1e9, ceilings=CEIL, dtype="bf16")
    assert p.bound == "memory" and p.ridge == pytest.approx(500)
    assert p.floor_ms == pytest.approx(1.0)
    assert p.gbs == pytest.approx(500) and p.pct_of_ceiling == pytest.approx(50)


def test_compute_bound_point_and_timing_input():
    t = Timing("x", "cpu", "test", (4.0, 5.0, 6.0), 1.0)
    p = roofline(t, bytes=1e6, flops=2e12, ceilings=CEIL, dtype="bfloat16")  # intensity 2e6
    assert p.bound == "compute" and p.time_ms == 5.0
    assert p.floor_ms == pytest.approx(4.0)
    assert p.tflops == pytest.approx(400) and p.pct_of_ceiling == pytest.approx(80)


def test_dtype_picks_its_ceiling_and_bad_input():
    assert roofline(1.0, bytes=1, flops=1e12, ceilings=CEIL, dtype="fp32").ceiling_tflops == 50
    with pytest.raises(ValueError, match="time"):
        roofline(0.0, bytes=1, flops=1, ceilings=CEIL)
    x, y = roofline_curve(CEIL, "bf16")
    assert y.max() == pytest.approx(500) and (y[1:] >= y[:-1]).all()
