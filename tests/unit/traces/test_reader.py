"""lab_utils.traces.reader: exact numbers (numpy's fast path for plain decimals, Python's decimal for
the rest, checked against each other), the tables each event kind goes to, the allocator's totals,
the rank, device and job a file says it is, and streaming through events larger than the search
window, on files written here."""

from __future__ import annotations

import json
from decimal import ROUND_FLOOR, Decimal

import numpy as np
import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.traces import reader as R

from .kineto import H100, ann, kernel, launch, op, step, sync, write


def exact(text: str) -> tuple[int, float]:
    d = Decimal(text)
    w = int(d.to_integral_value(rounding=ROUND_FLOOR))
    return w, float(d - w)


@pytest.fixture
def no_slow_path(monkeypatch):
    def refuse(raws):
        raise AssertionError(f"the slow path read {len(raws)} plain decimals numpy reads")

    monkeypatch.setattr(R, "_numbers_slowly", refuse)


def test_plain_decimals_of_every_layout_are_read_by_numpy_exactly(gen, no_slow_path):
    """Epoch microseconds with 0 to 6 decimals, short ones, integers: numpy's path alone, digit for digit."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    texts = ["1711964650123456.789", "1711964650123457", "5.25", "0", "7", "123456789012345678.5",
             "1.123456789012345678"]  # fmt: skip
    for _ in range(300):
        whole = int(rng.integers(0, 10**16))
        digits = int(rng.integers(0, 7))
        texts.append(f"{whole}" if not digits else f"{whole}.{int(rng.integers(0, 10**digits)):0{digits}d}")
    w, f = R.numbers([t.encode() for t in texts])
    for t, a, b in zip(texts, w, f):
        want_w, want_f = exact(t)
        assert int(a) == want_w and b == pytest.approx(want_f, abs=1e-12), t
    one = R.numbers([b"1711964650123456.789"])  # one value, one width
    assert int(one[0][0]) == 1711964650123456 and one[1][0] == pytest.approx(0.789, abs=1e-12)


@pytest.mark.parametrize(
    "texts",
    [
        ["-1.5", "1711964650123456.789"],  # a sign in the narrowest width (read first)
        ["1.5e3", "12.25"],  # an exponent
        [".5", "10.5"],  # no digit before the point
        ["1234567890123456789.5"],  # 19 digits before the point
        ["1." + "1" * 19],  # 19 after it
        ["0." + "0" * 39 + "1"],  # wider than 40
    ],
)
def test_numbers_numpy_cannot_hold_go_the_exact_slow_way(texts):
    w, f = R.numbers([t.encode() for t in texts])
    for t, a, b in zip(texts, w, f):
        want_w, want_f = exact(t)
        assert int(a) == want_w and b == pytest.approx(want_f, abs=1e-12), t
        assert 0 <= b < 1


def test_no_number_is_two_empty_columns():
    w, f = R.numbers([])
    assert w.dtype == np.int64 and len(w) == len(f) == 0


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


def test_named_streams_and_threads_keep_what_is_a_number():
    assert R._ints([7, None, "stream 7 [copy]", 3.0]).tolist() == [7, -1, -1, 3]
    codes, values = R._codes([5, 5, 9], numeric=True)
    assert [values[c] for c in codes] == [5, 5, 9]
    codes, values = R._codes(["PyTorch Profiler", 5, "PyTorch Profiler"], numeric=True)
    assert [values[c] for c in codes] == ["PyTorch Profiler", 5, "PyTorch Profiler"]


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
