import json
import math
from pathlib import Path

import pandas as pd
import torch

from lab_utils.core.ceilings import Ceilings
from lab_utils.core.records import (
    CONTEXT_COLUMNS,
    ROW_COLUMNS,
    Recorder,
    fill_stability,
    load_records,
    run_context,
    stability_summary,
)
from lab_utils.core.timing import BenchFailure, Timing

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
    info = ctx["device_info"]
    assert info["name"] == ctx["device"] and info["kind"] == ctx["device_kind"] in ("cpu", "cuda")
    assert info["torch_version"] == ctx["torch_version"] == torch.__version__
    assert json.loads(json.dumps(ctx)) == ctx  # written to records as it is


def test_timing_rows_carry_the_stability_verdict():
    rec = Recorder("99_test", ceilings=CEIL)
    steady = Timing("k", "cpu", "test", (1.0, 1.01, 0.99, 1.0, 1.02), 1.0, meta={"threads": 1, "attempts": 1})
    stalled = Timing("k", "cpu", "test", (0.4,) * 7 + (31.9, 32.0, 31.8), 1.0, meta={"threads": 2, "attempts": 3})
    rec.add_timing("exp", "steady", steady, shape=(4, 8), bytes=1e6)
    rec.add_timing("exp", "stalled", stalled, shape=(4, 8), bytes=1e6)
    rec.add("exp", "steady", "max_abs_err", 0.0)
    df = rec.frame()
    timed = df[df.metric != "max_abs_err"]
    assert set(timed[timed.variant == "steady"].stable) == {True}
    bad = timed[timed.variant == "stalled"]
    assert set(bad.stable) == {False} and all("stalled" in s for s in bad.stability)
    assert set(bad.metric) == {"time", "bandwidth", "pct_of_ceiling"}
    assert json.loads(bad.iloc[0].extra)["threads"] == 2
    other = df[df.metric == "max_abs_err"].iloc[0]
    assert other.stable is None and other.stability == ""
    s = stability_summary(df)
    assert (s.timings, s.unstable, s.share) == (2, 1, 0.5) and "stalled" in s.examples[0]


def test_old_records_load_and_are_judged_from_samples(tmp_path):
    """A records file written before the verdict columns existed still loads; its timings are
    judged from the kept samples and the derived rows follow their time row."""
    old_cols = [c for c in ROW_COLUMNS if c not in ("stable", "stability")]
    row = dict(lab="l", experiment="e", variant="v", shape="4", dtype="float32", statistic="median", extra="")
    rows = [
        dict(row, metric="time", value=0.4, unit="ms", samples=[0.4] * 7 + [31.9, 32.0, 31.8]),
        dict(row, metric="bandwidth", value=9.0, unit="GB/s", samples=None),
    ]
    f = tmp_path / "records.json"
    f.write_text(json.dumps({"context": {}, "rows": [{k: r[k] for k in old_cols} for r in rows]}))
    df = load_records(f)
    assert df.stable.isna().all() and list(df.stability) == ["", ""]
    judged = fill_stability(df)
    assert list(judged.stable) == [False, False] and "judged from the kept samples" in judged.stability[0]
    pd.DataFrame([{k: r[k] for k in old_cols} for r in rows]).to_parquet(tmp_path / "old.parquet")
    assert "stable" in load_records(tmp_path / "old.parquet").columns


def test_context_records_the_timing_policy():
    ctx = run_context({})
    if ctx["device_kind"] == "cpu":
        assert ctx["timing"]["cpu_threads"]["threads"] >= 1 and ctx["timing"]["cpu_threads"]["reason"]


def test_unstable_timings_are_listed_with_their_reason():
    from lab_utils.core.records import stability_note, unstable_timings

    base = dict(lab="x", shape="8", dtype="float32", unit="ms", statistic="median", metric="time")
    df = pd.DataFrame(
        [
            dict(base, experiment="sweep", variant="eager", value=1.0, stable=True, stability="stable"),
            dict(base, experiment="sweep", variant="triton", value=9.0, stable=False, stability="stalls: 3 of 20"),
            dict(base, experiment="sweep", variant="triton", value=9.0, stable=None, stability="", metric="gbs"),
        ]
    )
    bad = unstable_timings(df)
    assert list(bad.variant) == ["triton"] and bad.stability[0] == "stalls: 3 of 20"
    assert stability_note(df).startswith("1 of 2 timings unstable")
    assert stability_note(df.iloc[:1]) == "all 1 timings stable"
    assert unstable_timings(df.iloc[:1]).empty


def test_a_reports_gathered_records_json_keeps_every_value(tmp_path, monkeypatch):
    """The report's records.json (and so a stored baseline) was written by pandas' to_json: 10
    decimals, and +-inf lost. A value read back must be the value measured, non-finite ones too."""
    from types import SimpleNamespace

    from lab_utils.run.report import gather_records

    monkeypatch.setenv("PERFLAB_RECORDS_DIR", str(tmp_path / "records" / "99_test"))
    vals = [1 / 3 * 1e-7, 0.1 + 0.2, 2.0**-40 / 3, 123456.78901234567, math.inf, -math.inf, math.nan]
    rec = Recorder("99_test")
    for i, v in enumerate(vals):
        rec.add("e", f"v{i}", "grad_norm", v, samples=[v, 1 / 7])
    rec.save()
    st = SimpleNamespace(notebook="99_test", status="ok", rows=0, timings=0, unstable=0)
    gather_records(tmp_path, [st], "run1")
    back = load_records(tmp_path / "records.json")
    for a, b in zip(vals, back["value"], strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == b, (a, b)
    assert [s[0] for s in back["samples"][:4]] == vals[:4]
    pq = load_records(tmp_path / "records.parquet")
    assert pq["value"].iloc[:6].tolist() == back["value"].iloc[:6].tolist()


# ------------------------------------------------------------------------- records as Parquet
def same_cell(a, b) -> bool:
    """One cell read from two files holds the same value: floats bit for bit (NaN is NaN), samples
    element by element (a list from JSON, an array from Parquet), nulls as nulls."""
    if isinstance(a, (list, tuple)) or hasattr(a, "__array__"):
        if not (isinstance(b, (list, tuple)) or hasattr(b, "__array__")) or len(a) != len(b):
            return False
        return all(same_cell(float(x), float(y)) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return type(a) is type(b) and a == b


def assert_same_rows(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert len(a) == len(b) and list(a.columns) == list(b.columns), (a.shape, b.shape)
    for c in a.columns:
        bad = [i for i, (x, y) in enumerate(zip(a[c], b[c], strict=True)) if not same_cell(x, y)]
        if bad:
            i = bad[0]
            raise AssertionError(f"column {c!r}: {len(bad)} rows differ, row {i}: {a[c].iloc[i]!r} != {b[c].iloc[i]!r}")


def test_records_read_back_the_same_from_parquet_as_from_json(tmp_path):
    """A stored baseline is Parquet now (its JSON was 3.8 MB): every value, sample, verdict and
    null reads back as the exact JSON gives it."""
    from lab_utils.core.records import write_records_json, write_records_parquet

    vals = [1 / 3 * 1e-7, 0.1 + 0.2, 5e-324, 123456.78901234567, math.inf, -math.inf, math.nan]
    rows = [
        dict(zip(ROW_COLUMNS, [""] * len(ROW_COLUMNS)), lab="99_test", metric="m", value=v, unit="ms")
        | dict(samples=[v, 1 / 7] if i % 3 else None, stable=[True, False, None][i % 3], extra='{"k": "é"}')
        for i, v in enumerate(vals)
    ]
    df = pd.DataFrame(rows, columns=ROW_COLUMNS)
    from_json = load_records(write_records_json(df, tmp_path / "records.json"))
    from_parquet = load_records(write_records_parquet(df, tmp_path / "records.parquet"))
    assert_same_rows(from_json, from_parquet)
    assert from_parquet["stable"].tolist() == [True, False, None, True, False, None, True]
    assert from_parquet["samples"].iloc[0] is None and list(from_parquet["samples"].iloc[4]) == [math.inf, 1 / 7]
    assert not same_cell(1.0, 1.0 + 2**-52) and not same_cell([1.0], [1.0, 2.0])  # the check can fail


STORED = Path(__file__).resolve().parents[3] / "parameterized" / "baselines"
MAX_STORED_BYTES = 1_500_000


def test_stored_baselines_are_parquet_and_small():
    """Each file of a stored baseline stays under 1.5 MB: the records are Parquet (the CPU
    baseline's records.json was 3.8 MB, its records.parquet is ~72 kB), so a refresh does not
    add megabytes to the repository's history each time."""
    kinds = [p for p in STORED.iterdir() if p.is_dir()]
    assert kinds
    for kind in kinds:
        assert (kind / "records.parquet").exists() and not (kind / "records.json").exists(), kind.name
        meta = json.loads((kind / "baseline.json").read_text())
        assert len(load_records(kind)) == meta["rows"], kind.name
        for f in kind.rglob("*"):
            assert f.stat().st_size < MAX_STORED_BYTES, (
                f"{f.relative_to(STORED)} is {f.stat().st_size / 1e6:.1f} MB: a stored baseline's file stays under "
                f"{MAX_STORED_BYTES / 1e6} MB (every refresh adds it to git's history; records go to Parquet, "
                f"`perflab baseline refresh` writes them so)"
            )
