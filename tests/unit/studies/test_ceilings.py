import pytest
import torch

from lab_utils.core.ceilings import Ceilings
from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.studies import ceilings as study


def test_costs():
    assert study.op_cost("copy", 10, torch.float32) == (80, 0)
    assert study.op_cost("add", 10, torch.bfloat16) == (60, 10)
    assert study.op_cost("matmul", 4, torch.float32) == (3 * 16 * 4, 128)
    # gelu, tanh form 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x^3))): x^3 (2), *0.044715, +x,
    # *sqrt(2/pi), tanh, +1, *x, *0.5 = 9 FLOPs per element; read x, write y
    assert study.op_cost("gelu", 10, torch.float32) == (2 * 10 * 4, 9 * 10)
    with pytest.raises(ValueError, match="op="):
        study.op_cost("conv", 1, torch.float32)


@pytest.mark.parametrize("op", study.OPS)
def test_ops_compute_what_they_claim(op, gen):
    n = 33 if op == "matmul" else 1001
    fn = study.make_op(op, n, torch.float32, torch.device("cpu"), gen)
    out = fn()
    assert out.shape == ((n, n) if op == "matmul" else (n,))
    assert torch.isfinite(out).all() and out.abs().sum() > 0


def test_config_validation():
    with pytest.raises(ConfigError, match="'ops'"):
        study.CeilingsLabConfig(ops=["copy", "fft"])
    with pytest.raises(ConfigError, match="'matmul_sizes'"):
        study.CeilingsLabConfig(matmul_sizes=[0])
    with pytest.raises(ConfigError, match="'dtypes'"):
        study.CeilingsLabConfig(dtypes="float32")


def test_tiny_sweep_records_every_point():
    cfg = study.CeilingsLabConfig(
        device="cpu",
        ops=["copy", "matmul"],
        dtypes=["float32"],
        elementwise_sizes=[4096],
        matmul_sizes=[32, 48],
        reps=3,
    )
    ceil = Ceilings(device={"name": "t"}, copy_gbs=10.0, copy_bytes=1, matmul_tflops={"fp32": 0.1}, matmul_n={})
    rec = Recorder("00_ceilings", ceilings=ceil)
    pts = study.run_sweep(cfg, rec, ceil, progress=False)
    assert len(pts) == 3 and pts.ok.all()
    assert set(pts[pts.op == "matmul"].bound) <= {"memory", "compute"}
    df = rec.frame()
    assert set(df.metric) == {"time", "bandwidth", "throughput", "pct_of_ceiling"}
    assert df[df.metric == "time"].groupby("variant").size().to_dict() == {"copy": 3, "matmul": 6}
    hm = study.roofline_map(pts, ceil)
    assert list(hm.keys()) == ["float32"]
