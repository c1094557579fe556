import json

import pytest

from lab_utils import ceilings as C


def test_measure_cache_and_force(tmp_cache, monkeypatch):
    c = C.get_ceilings("cpu", quick=True)
    assert c.copy_gbs > 0 and c.matmul_tflops["fp32"] > 0
    assert c.copy_bytes == 2 * (64 << 20)
    files = list((tmp_cache / "ceilings").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["copy_gbs"] == c.copy_gbs

    def no_measure(*a, **k):
        raise AssertionError("cached ceilings must not be re-measured")

    monkeypatch.setattr(C, "measure_ceilings", no_measure)
    assert C.get_ceilings("cpu", quick=True) == c
    with pytest.raises(AssertionError):
        C.get_ceilings("cpu", quick=True, force=True)


def test_corrupt_cache_is_remeasured(tmp_cache, monkeypatch):
    c = C.get_ceilings("cpu", quick=True)
    f = next((tmp_cache / "ceilings").glob("*.json"))
    f.write_text("{not json")
    fake = C.Ceilings(**{**c.as_dict(), "copy_gbs": 1.0})
    monkeypatch.setattr(C, "measure_ceilings", lambda *a, **k: fake)
    assert C.get_ceilings("cpu", quick=True).copy_gbs == 1.0


def test_lookup_and_summary():
    c = C.Ceilings(
        device={"name": "NVIDIA H200"},
        copy_gbs=4000.0,
        copy_bytes=1,
        matmul_tflops={"bf16": 700.0, "fp32": 50.0, "fp8": 1300.0},
        matmul_n={},
    )
    assert c.matmul("float16") == 700.0 and c.matmul("bfloat16") == 700.0
    import torch

    assert c.matmul(torch.float8_e4m3fn) == 1300.0 and c.matmul("fp4") is None
    rows = {r["quantity"]: r for r in c.summary_rows()}
    assert rows["copy bandwidth"]["datasheet"] == 4800.0
    assert rows["matmul bf16"]["measured/datasheet"] == pytest.approx(700 / 989.4)
