import json

import pytest

from lab_utils.core import ceilings as C


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
    first = C.Ceilings(device={"name": "t"}, copy_gbs=2.0, copy_bytes=1, matmul_tflops={"fp32": 1.0}, matmul_n={})
    monkeypatch.setattr(C, "measure_ceilings", lambda *a, **k: first)  # (measuring is the test above)
    assert C.get_ceilings("cpu", quick=True).copy_gbs == 2.0
    f = next((tmp_cache / "ceilings").glob("*.json"))
    f.write_text("{not json")
    fake = C.Ceilings(**{**first.as_dict(), "copy_gbs": 1.0})
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


def test_cache_is_written_atomically(tmp_path):
    """Many writers at once (runs sharing the cache): every read sees a whole JSON file, and no
    temporary file is left behind."""
    import threading

    path = tmp_path / "ceilings" / "k.json"
    errors = []

    def writer(i):
        for j in range(20):
            C.write_json_atomic(path, {"writer": i, "j": j, "pad": "x" * 20000})

    def reader():
        for _ in range(200):
            if path.exists():
                try:
                    json.loads(path.read_text())
                except json.JSONDecodeError as e:
                    errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and json.loads(path.read_text())["j"] == 19
    assert [p.name for p in path.parent.iterdir()] == ["k.json"]


def test_unstable_ceiling_timings_are_noted():
    c = C.Ceilings(
        device={"name": "t"},
        copy_gbs=10.0,
        copy_bytes=1,
        matmul_tflops={"fp32": 1.0},
        matmul_n={},
        unstable={"copy": "dispersion p80/p20 = 1.5 > 1.2"},
    )
    rows = {r["quantity"]: r for r in c.summary_rows()}
    assert "UNSTABLE timing: dispersion" in rows["copy bandwidth"]["note"] and rows["matmul fp32"]["note"] == ""
