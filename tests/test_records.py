import json
import math

import pandas as pd
import torch

from lab_utils.ceilings import Ceilings
from lab_utils.records import CONTEXT_COLUMNS, ROW_COLUMNS, Recorder, load_records, run_context
from lab_utils.timing import BenchFailure, Timing

CEIL = Ceilings(device={"name": "t"}, copy_gbs=100.0, copy_bytes=1, matmul_tflops={"fp32": 1.0}, matmul_n={})


def test_rows_are_tidy_and_timings_expand():
    rec = Recorder("99_test", params={"n": 3}, ceilings=CEIL)
    rec.add("exp", "eager", "max_abs_err", 1e-6, "", shape=(1823, 781), dtype=torch.bfloat16, note="x")
    t = Timing("k", "cpu", "test", (1.0, 2.0, 3.0, 4.0, 5.0), 10.0)
    rec.add_timing("exp", "triton", t, shape=(4, 8), dtype=torch.float32, bytes=2e8, flops=1e9)
    rec.add_timing("exp", "broken", BenchFailure("k", "raised", "boom"), shape=(4, 8), dtype=torch.float32)
    df = rec.frame()
    assert list(df.columns) == ROW_COLUMNS
    assert df.iloc[0]["shape"] == "1823x781" and df.iloc[0]["dtype"] == "bfloat16"
    assert json.loads(df.iloc[0].extra) == {"note": "x"}
    tri = df[df.variant == "triton"].set_index(["metric", "statistic"])
    assert tri.loc[("time", "median"), "value"] == 3.0
    assert tri.loc[("time", "median"), "samples"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert tri.loc[("time", "p20"), "value"] < 3.0 < tri.loc[("time", "p80"), "value"]
    assert tri.loc[("bandwidth", "median"), "value"] == 2e8 / 3e-3 / 1e9
    assert tri.loc[("throughput", "median"), "unit"] == "TFLOP/s"
    assert ("pct_of_ceiling", "median") in tri.index
    bad = df[df.variant == "broken"].iloc[0]
    assert bad.statistic == "failed" and math.isnan(bad.value) and "boom" in bad.extra


def test_save_to_runner_dir_and_load(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_RECORDS_DIR", str(tmp_path))
    rec = Recorder("99_test", params={"dtype": torch.float16})
    rec.add("e", "v", "m", 1.5, "ms")
    rec.add("e", "v", "skipped", float("nan"), "ms", statistic="failed")
    rec.add("e", "v", "overflow", float("inf"), "")
    path = rec.save()
    assert path == tmp_path / "records.json"
    df = load_records(path)
    assert set(CONTEXT_COLUMNS) <= set(df.columns)
    assert df.iloc[0].value == 1.5 and df.iloc[0].device_kind in ("cpu", "cuda")
    assert math.isnan(df.iloc[1].value) and df.iloc[2].value == math.inf and df.value.dtype == float
    df.to_parquet(tmp_path / "r.parquet")  # what the report writes must accept NaN rows
    ctx = json.loads(path.read_text())["context"]
    assert ctx["params"] == {"dtype": "torch.float16"} and ctx["commit"]


def test_context_has_versions():
    ctx = run_context({"a": 1})
    for k in ("device", "torch_version", "triton_version", "cuda_version", "commit", "timestamp", "params"):
        assert k in ctx
    assert isinstance(pd.DataFrame([ctx["device_info"]]), pd.DataFrame)
