"""lab_utils.traces.reader: the tables each event kind goes to, the allocator's totals,
the rank, device and job a file says it is, and streaming through events larger than the search
window, on files written here; each event's arguments on its own row across many blocks (against
``json.load``), and the step look-ahead: exact to the ns, refusing what the whole read refuses."""

from __future__ import annotations

import gzip
import json
import random
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.traces import reader as R
from lab_utils.traces.attribute import step_windows

from .kineto import H100, ann, kernel, launch, op, step, sync, write

ROOT = Path(__file__).resolve().parents[3]
TRACES = ROOT.parent / "shared" / "data" / "gpu-traces"


def test_each_kind_of_event_goes_to_its_table_and_incomplete_events_are_dropped(tmp_path):
    ev = [step(1, 10, 100), op("aten::mm", 20, 30, 5), launch(1, 25, ext=5),
          kernel("gemm", 1, 60, 10), kernel("Memcpy HtoD", 2, 80, 2, cat="gpu_memcpy", bytes=4096),
          kernel("Memset (Device)", 3, 85, 1, cat="gpu_memset"),
          sync("Stream Wait Event", 9, 90, 1, wait_on_stream=8, wait_on_cuda_event_record_corr_id=1),
          {"ph": "X", "cat": "gpu_user_annotation", "name": "## forward ##", "pid": 0, "tid": 7, "ts": 60, "dur": 30},
          {"ph": "i", "cat": "kernel", "name": "instant", "pid": 0, "tid": 7, "ts": 70},
          {"ph": "X", "cat": "python_function", "name": "nn.Module: Linear", "pid": 1, "tid": 1, "ts": 20, "dur": 5},
          {"ph": "X", "cat": "ac2g", "name": "flow", "pid": 1, "tid": 1, "ts": 20, "dur": 5}]  # fmt: skip
    r = R.read_rank(write(tmp_path / "t.json", ev))
    assert r.t0_us == 10
    assert r.gpu["name"].astype(str).tolist() == ["gemm", "Memcpy HtoD", "Memset (Device)"]
    assert r.gpu["ts"].tolist() == [50.0, 70.0, 75.0] and r.gpu["end"].tolist() == [60.0, 72.0, 76.0]
    assert r.gpu["nbytes"].tolist() == [None, 4096, None]
    assert r.host["cat"].astype(str).tolist() == ["user_annotation", "cpu_op", "cuda_runtime", "python_function"]
    assert r.host["external_id"].tolist() == [-1, 5, 5, -1] and r.host["correlation"].tolist() == [-1, -1, 1, -1]
    assert r.sync["name"].astype(str).tolist() == ["Stream Wait Event"]
    assert (r.sync["wait_stream"].iloc[0], r.sync["wait_record"].iloc[0]) == (8, 1)
    assert r.gpu_ranges["name"].astype(str).tolist() == ["## forward ##"]
    assert r.gpu["stream"].tolist() == [7, 7, 7] and r.gpu["device"].tolist() == [0, 0, 0]


def test_optional_arguments_are_columns_only_where_recorded(tmp_path):
    ev = [kernel("gemm", 1, 0, 10), kernel("Memcpy DtoD", 2, 20, 4, cat="gpu_memcpy", bytes=8_000_000,
                                          **{"memory bandwidth (GB/s)": 2000.0})]  # fmt: skip
    ev += [op("aten::mm", 0, 5, 3, **{"Input Dims": [[4, 8], [8, 2]], "Input type": ["float", "float"],
                                      "Concrete Inputs": ["", ""]})]  # fmt: skip
    r = R.read_rank(write(tmp_path / "t.json", ev))
    assert r.gpu["nbytes"].tolist() == [None, 8_000_000] and r.gpu["memory_gbps"].tolist() == [None, 2000.0]
    assert "input_dims" not in r.gpu and "nbytes" not in r.host
    assert json.loads(r.host["input_dims"].iloc[0]) == [[4, 8], [8, 2]]
    assert json.loads(r.host["input_type"].iloc[0]) == ["float", "float"]
    assert json.loads(r.host["concrete"].iloc[0]) == ["", ""]
    plain = R.read_rank(write(tmp_path / "p.json", [kernel("gemm", 1, 0, 10)]))
    assert not {"nbytes", "memory_gbps", "collective", "in_nelems"} & set(plain.gpu.columns)


def test_the_allocators_totals_sit_on_the_traces_clock(tmp_path):
    mem = [{"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": "TSM",
            "args": {"Total Allocated": 1_048_576, "Device Type": 1, "Bytes": 512}},
           {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 1000000000000130,
            "args": {"Total Allocated": 2048, "Device Type": 0}},
           {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 1000000000000140,
            "args": {"Bytes": 3}}]  # fmt: skip
    ev = [kernel("k", 1, "TSK", 1.0)] + mem
    r = R.read_rank(write(tmp_path / "m.json", ev, literal={"TSM": "1000000000000120.25", "TSK": "1000000000000100.5"}))
    assert r.t0_us == 1000000000000100
    assert r.memory["ts"].tolist() == pytest.approx([20.25, 30.0], abs=1e-9)
    assert r.memory["allocated"].tolist() == [1_048_576.0, 2048.0]
    assert r.memory["device_type"].tolist() == [1, 0]
    assert r.gpu["ts"].tolist() == pytest.approx([0.5], abs=1e-9)


def test_an_event_longer_than_the_search_window_is_read_whole(tmp_path, monkeypatch):
    """A 70 kB kernel name (longer than the 64 kB window a cut is looked for in) read in 4 kB blocks:
    the window widens, and a block holding no complete event waits for the next one."""
    long = "k" * 70_000
    ev = [kernel(long, 1, 0, 1.0), kernel("short", 2, 5, 1.0), kernel(long + "2", 3, 10, 1.0)]
    path = write(tmp_path / "big.json", ev)
    monkeypatch.setattr(R, "BLOCK_BYTES", 4096)
    r = R.read_rank(path)
    assert [len(n) for n in r.gpu["name"].astype(str)] == [70_000, 5, 70_001]
    assert R._last_cut(b'{"a": 1}' + b"x" * 100_000) is None
    buf = b'{"a": 1}, {"b": 2}' + b"x" * 100_000
    assert R._last_cut(buf) == buf.index(b"}")


def test_rank_device_and_job_of_a_file(tmp_path):
    props = [{"id": 1, "name": "NVIDIA A100-SXM4-80GB", "numSms": 108, "extra": 1}, H100]
    ev = [kernel("k", 1, 0, 1.0, device=0), kernel("k", 2, 5, 1.0, device=0), kernel("k", 3, 9, 1.0, device=1)]
    info = {"rank": 3, "world_size": 16, "backend": "nccl", "pg_count": 2}
    r = R.read_rank(write(tmp_path / "rank7.json", ev, deviceProperties=props, distributedInfo=info))
    assert r.rank == 3 and r.world_size == 16  # distributedInfo before the name
    assert r.device_name == H100["name"]  # the device most of its kernels ran on (id 0)
    assert r.distributed == {"rank": 3, "world_size": 16, "backend": "nccl"}
    assert (
        r.device_properties[0] == {k: props[0].get(k) for k in R.PROPERTIES} and "extra" not in r.device_properties[0]
    )
    other = R.read_rank(write(tmp_path / "x.json", [kernel("k", 1, 0, 1.0, device=5)], deviceProperties=props))
    assert other.device_name == props[0]["name"]  # no entry for device 5: the first
    assert other.world_size is None and other.rank == 0
    assert R.read_rank(write(tmp_path / "trace_rank-4.json", ev)).rank == 4
    assert R.read_rank(write(tmp_path / "host_12.json", ev)).rank == 0  # a lone file: a bare number is no rank
    assert R.read_rank(write(tmp_path / "host_12.json", ev), 6, alone=False).rank == 12
    assert R.read_rank(write(tmp_path / "host.json", ev), 6, alone=False).rank == 6
    assert other.vendor == "cuda"
    amd = R.read_rank(write(tmp_path / "amd.json", ev, deviceProperties=[{"id": 0, "name": "AMD Instinct MI250X"}]))
    assert amd.vendor == "rocm"


def test_a_folder_is_its_trace_files_sorted_and_two_files_of_one_rank_are_refused(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    for name in ("b_rank1.pt.trace.json", "a_rank0.json", "notes.txt", "c_rank2.json.gz"):
        (job / name).write_text("x")
    assert [p.name for p in R.trace_files(job)] == ["a_rank0.json", "b_rank1.pt.trace.json", "c_rank2.json.gz"]
    assert R.trace_files(job / "a_rank0.json") == [job / "a_rank0.json"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="folder holding trace files"):
        R.trace_files(tmp_path / "empty")
    with pytest.raises(ConfigError, match="a trace file or a folder"):
        R.trace_files(tmp_path / "missing")
    two = tmp_path / "two"
    two.mkdir()
    write(two / "a.json", [step(1, 0, 10)], distributedInfo={"rank": 1})
    write(two / "b.json", [step(1, 0, 10)], distributedInfo={"rank": 0})
    assert list(R.read_job(two, workers=1)) == [0, 1]  # sorted by rank, whatever the file order
    write(two / "c.json", [step(1, 0, 10)], distributedInfo={"rank": 1})
    with pytest.raises(ConfigError, match="one file per rank"):
        R.read_job(two, workers=1)


def test_events_are_the_kept_events_as_chrome_trace_dicts(tmp_path):
    ev = [ann("## fwd ##", 100, 50), op("aten::mm", 110, 20, 5, **{"Input Dims": [[2, 3], [3, 4]],
                                                                   "Input type": ["float", "float"]}),
          launch(1, 115, ext=5), kernel("gemm", 1, 140, 10)]  # fmt: skip
    out = R.events(write(tmp_path / "t.json", ev))
    names = [e["name"] for e in out]
    assert names == ["gemm", "## fwd ##", "aten::mm", "cudaLaunchKernel"]  # the GPU table, then the host's
    mm = out[2]
    assert mm["ts"] == 110 and mm["dur"] == 20 and mm["pid"] == 1 and mm["tid"] == 1
    assert mm["args"] == {"External id": 5, "Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}
    assert out[1]["args"] == {}  # no id recorded: none written
    assert out[0]["args"] == {"External id": 1, "correlation": 1, "stream": 7} and out[0]["ts"] == 140


def test_the_step_annotations_read_ahead_are_the_tables_step_windows(tmp_path):
    """``read_steps`` keeps only the ``ProfilerStep`` user annotations: the same windows (step, order,
    duration) as the whole file read into tables, a repeated step kept once, other events left out."""
    ev = [step(3, 100.5, 50), step(1, 0.25, 40), step(2, 40.25, 60), step(2, 41.0, 5), ann("## forward ##", 1, 9),
          op("aten::mm", 2, 3, ext=1), kernel("gemm", 1, 5, 4),
          {"ph": "i", "cat": "user_annotation", "name": "ProfilerStep#9", "ts": 7, "pid": 1, "tid": 1}]  # fmt: skip
    path = write(tmp_path / "t.json.gz", ev, gz=True)
    ahead = R.read_steps(path)
    got = step_windows(ahead.assign(end=ahead["ts"] + ahead["dur"], tid=""))
    want = step_windows(R.read_rank(path).host)
    assert got["step"].tolist() == want["step"].tolist() == [1, 2, 3]
    assert got["dur"].tolist() == want["dur"].tolist() == [40.0, 60.0, 50.0]
    assert np.allclose(np.diff(got["ts"]), np.diff(want["ts"]))
    bad = tmp_path / "cut.json.gz"
    bad.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ConfigError, match="cut.json.gz"):
        R.read_steps(bad)


def test_the_step_annotations_of_the_real_traces_are_their_step_windows():
    files = sorted(f for f in TRACES.glob("*/*") if f.name.endswith(R.SUFFIXES)) if TRACES.is_dir() else []
    if not files:
        pytest.skip(f"no real traces under {TRACES}")
    for f in files:
        ahead = R.read_steps(f)
        got = step_windows(ahead.assign(end=ahead["ts"] + ahead["dur"], tid=""))
        want = step_windows(R.read_rank(f).host)
        assert got["step"].tolist() == want["step"].tolist() and got["dur"].tolist() == want["dur"].tolist(), f


NOT_TRACES = [
    ('{"model": "flux", "steps": 10}', "no traceEvents array (its keys: model, steps)"),
    ('{"traceEvents": []}', "its traceEvents array is empty"),
    ('{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "py"}}]}',
     "none of its 1 events is a complete"),
    ('{"traceEvents": [{"ph": "X", "cat": "gpu_op", "name": "ProfilerStep#1", "ts": 1, "dur": 2}]}',
     "none of its 1 events is a complete"),
]  # fmt: skip


@pytest.mark.parametrize("text, why", NOT_TRACES)
@pytest.mark.parametrize("gz", [False, True])
def test_the_step_look_ahead_refuses_what_the_whole_read_refuses(tmp_path, text, why, gz):
    """JSON that is not a profiler trace: one line naming the file, the same from ``read_steps`` as
    from ``read_rank`` (a look-ahead that answered "no steps" would pass a config file for a trace)."""
    path = tmp_path / ("config.json.gz" if gz else "config.json")
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    errors = []
    for read in (R.read_steps, R.read_rank):
        with pytest.raises(ConfigError) as e:
            read(path)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and why in errors[0] and str(path) in errors[0] and "\n" not in errors[0]
    with pytest.raises(ConfigError, match="an existing trace file"):
        R.read_steps(tmp_path / "missing.json")


def test_a_trace_without_steps_looks_ahead_to_no_steps(tmp_path):
    ahead = R.read_steps(write(tmp_path / "t.json", [op("aten::mm", 0, 5, 1), kernel("gemm", 1, 5, 4)]))
    assert ahead.empty and list(ahead.columns) == ["name", "ts", "dur", "cat"]


def test_the_step_look_ahead_keeps_nanoseconds_after_the_earliest_step(tmp_path):
    """Epoch timestamps with ns (``1711964650123456.789``), the earliest step not first in the file:
    each step's ts is its distance from the earliest step's integer microsecond, exact to the ns
    (Python's decimal); the whole read counts from the trace's first integer microsecond."""
    texts = {
        "S3": "1711964650125000.125",
        "S1": "1711964650123456.789",
        "S2": "1711964650124000",
        "K": "1711964650123400.5",
    }
    ev = [step(3, "S3", 10), step(1, "S1", 40.5), kernel("k", 1, "K", 3), step(2, "S2", 60)]
    path = write(tmp_path / "ns.json", ev, literal={k: v for k, v in texts.items()})
    ahead = R.read_steps(path)
    base = Decimal(1711964650123456)
    want = [float(Decimal(texts[k]) - base) for k in ("S3", "S1", "S2")]
    assert ahead["name"].tolist() == ["ProfilerStep#3", "ProfilerStep#1", "ProfilerStep#2"]
    assert ahead["ts"].to_numpy() == pytest.approx(want, abs=1e-6) and want[0] == pytest.approx(1544.125)
    assert ahead["dur"].tolist() == [10, 40.5, 60]
    host = R.read_rank(path).host  # the whole read: after the kernel's integer microsecond
    assert host["ts"].to_numpy() == pytest.approx(
        [float(Decimal(texts[k]) - 1711964650123400) for k in ("S3", "S1", "S2")], abs=1e-6
    )


@pytest.mark.parametrize("gz", [False, True])
def test_each_events_arguments_land_on_its_own_row_across_blocks(tmp_path, monkeypatch, gz):
    """400 activities read in 4 kB blocks (many blocks, so row numbers restart per block), a random
    few carrying bytes, NCCL's arguments, a recorded bandwidth or shapes: every table row holds
    exactly its own event's arguments, compared with the file read by ``json.load``."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    ev = []
    for i in range(400):
        extra = {}
        if rng.random() < 0.15:
            extra["bytes"] = rng.randrange(1, 10**9)
        if rng.random() < 0.1:
            extra |= {"Collective name": rng.choice(["allreduce", "allgather"]),
                      "In msg nelems": rng.randrange(1, 10**6), "Group size": rng.choice([2, 8]),
                      "Process Group Name": str(rng.randrange(3))}  # fmt: skip
        if rng.random() < 0.1:
            extra["memory bandwidth (GB/s)"] = round(rng.uniform(1, 3000), 3)
        if rng.random() < 0.2:
            ev.append(op("aten::mm", i, 0.5, 10_000 + i, **{"Input Dims": [[i, 2], [2, rng.randrange(1, 9)]]}))
        ev.append(kernel(f"k{i % 7}", i, i + 0.25, 0.5, **extra))
    path = write(tmp_path / "t.json", ev, gz=gz)
    monkeypatch.setattr(R, "BLOCK_BYTES", 4096)
    r = R.read_rank(path)
    with gzip.open(path, "rt") if gz else open(path) as fh:
        events = json.load(fh)["traceEvents"]
    gpu = [e for e in events if e["cat"] == "kernel"]
    host = [e for e in events if e["cat"] == "cpu_op"]
    assert len(r.gpu) == 400 and r.gpu["correlation"].tolist() == [e["args"]["correlation"] for e in gpu]
    for col, key in (("nbytes", "bytes"), ("collective", "Collective name"), ("in_nelems", "In msg nelems"),
                     ("group_size", "Group size"), ("pg_name", "Process Group Name"),
                     ("memory_gbps", "memory bandwidth (GB/s)")):  # fmt: skip
        want = [e["args"].get(key) for e in gpu]
        got = r.gpu[col].tolist() if col in r.gpu else [None] * len(gpu)
        assert [None if pd.isna(v) else v for v in got] == want, (seed, col)
    assert [json.loads(d) for d in r.host["input_dims"].astype(str)] == [e["args"]["Input Dims"] for e in host], seed


@pytest.mark.parametrize("rows", [[2, 0, -1, 2], [1, 1, 0, -1, 1, 0, 1, 3, 2, 1]], ids=["subset", "all"])
def test_per_text_reads_each_row_as_astype_str_and_calls_once_per_distinct_value(rows):
    """A categorical column (the reader's text columns) gives each row ``fn`` of its text, a missing
    one ``fn("nan")``; ``fn`` runs once per distinct value, whether the
    rows are fewer than the categories (a subset of a table) or more."""
    col = pd.Series(
        pd.Categorical.from_codes(rows, categories=pd.Index(["a", "bb", "ccc", "d", "e", "f"], dtype=object))
    )
    calls = []

    def length(text):
        calls.append(text)
        return len(text)

    names = ["a", "bb", "ccc", "d", "e", "f"]
    want = [names[r] if r >= 0 else "nan" for r in rows]
    assert R.per_text(col, length, np.int64).tolist() == [len(t) for t in want]
    assert len(calls) == len(set(calls)) and set(calls) >= set(want)
    assert R.texts(col).tolist() == want and R.texts(col).dtype == object
    assert R.texts(col.iloc[:0]).tolist() == []


def test_texts_of_a_plain_column_are_its_values_as_text_a_missing_one_nan():
    col = pd.Series(["x", None, 7, "y", float("nan")], dtype=object)
    assert R.texts(col).tolist() == ["x", "nan", "7", "y", "nan"]
    assert R.per_text(col, lambda t: t.startswith("x"), bool).tolist() == [True, False, False, False, False]
