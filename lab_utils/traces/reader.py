"""Reading PyTorch profiler (Kineto) traces into column tables, with bounded memory.

What is read
------------
* a file: ``.json``, ``.json.gz``, ``.pt.trace.json``, ``.pt.trace.json.gz`` (gzip is detected by
  its magic bytes, not by the name);
* a folder: one job, one file per rank.  The rank is ``distributedInfo.rank`` when the trace
  records it, else the last number in the file name (``rank-3...``, ``sampled_rank-1``), else
  the file's position in sorted order.  Ranks are read in parallel by a process pool.

How
---
The JSON is parsed by ``msgspec`` into typed structs that declare only the fields used here
(unknown keys are skipped in C, never built as Python objects), and it is streamed: the file is
decompressed in blocks, the ``traceEvents`` array is cut between events, and each block of
events is turned into numpy columns before the next is read.  Memory therefore grows with the
number of events kept (about 60 bytes each plus the distinct names), not with the file's size.
A cut is only taken where the text reads ``}, {"`` between two events; a cut in the wrong place
cannot parse (it leaves a bracket open), and the block is then simply kept for the next cut.

Timestamps are kept exact: the integer microseconds are split from the fraction in the text and
stored relative to the trace's first integer microsecond, so a ns-resolution float timestamp
(``1711964650123456.789``) keeps its nanoseconds (a float64 of the absolute value would not).
``RankTrace.t0_us`` is that base; all ``ts`` columns are microseconds after it.

Tables of a :class:`RankTrace` (pandas, one row per complete event ``ph == "X"``):

* ``gpu``: kernels, memcpy and memset (``cat`` in :data:`GPU_CATS`) with name, cat, ts, dur,
  stream, device, correlation, external_id and, where recorded, ``bytes`` (``nbytes``), a copy's
  ``memory bandwidth (GB/s)`` (``memory_gbps``) and NCCL's arguments;
* ``host``: ``cpu_op``, ``user_annotation``, ``python_function``, runtime and driver calls with
  name, cat, ts, dur, pid, tid, correlation, external_id and, where recorded, input dims/types;
* ``sync``: ``cuda_sync`` events (kept apart: they are waits, not GPU work), with the stream and
  the ``cudaEventRecord`` call (``wait_stream``, ``wait_record``) an event wait waits on;
* ``gpu_ranges``: ``gpu_user_annotation`` ranges (the host ranges mirrored on the GPU timeline);
* ``memory``: the allocator's totals (``[memory]`` events of ``profile_memory=True``): ts,
  allocated bytes, device type (0 CPU, 1 CUDA).
"""

from __future__ import annotations

import gzip
import io
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from lab_utils.core.config import ConfigError

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "Runtime", "Operator")
SYNC_CATS = ("cuda_sync",)
GPU_RANGE_CATS = ("gpu_user_annotation",)
SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
BLOCK_BYTES = 2 << 20  # decompressed bytes per block: 2 MB keeps the peak near 30 MB (8 MB: 115 MB) on a 54 MB trace
_CUT = re.compile(rb'\}\s*,\s*\{\s*"')
_RANK_WORD = re.compile(r"rank\D?(\d+)", re.IGNORECASE)
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


class _Args(msgspec.Struct):
    correlation: int | None = None
    external_id: int | None = msgspec.field(default=None, name="External id")
    stream: int | str | None = None
    device: int | str | None = None
    nbytes: int | float | None = msgspec.field(default=None, name="bytes")
    collective: str | None = msgspec.field(default=None, name="Collective name")
    in_nelems: int | None = msgspec.field(default=None, name="In msg nelems")
    out_nelems: int | None = msgspec.field(default=None, name="Out msg nelems")
    dtype: str | None = None
    group_size: int | None = msgspec.field(default=None, name="Group size")
    pg_name: str | None = msgspec.field(default=None, name="Process Group Name")
    pg_ranks: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Process Group Ranks")
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input type")
    total_allocated: int | float | None = msgspec.field(default=None, name="Total Allocated")
    device_type: int | None = msgspec.field(default=None, name="Device Type")
    wait_stream: int | None = msgspec.field(default=None, name="wait_on_stream")  # cuda_sync "Stream Wait Event"
    wait_record: int | None = msgspec.field(default=None, name="wait_on_cuda_event_record_corr_id")
    memory_gbps: float | None = msgspec.field(default=None, name="memory bandwidth (GB/s)")  # memcpy, memset


class _Event(msgspec.Struct):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: msgspec.Raw = msgspec.Raw(b"")
    dur: float = 0.0
    args: _Args | None = None


class _Head(msgspec.Struct):
    traceEvents: list[_Event] = []
    distributedInfo: dict | None = None
    deviceProperties: list[dict] | None = None
    record_shapes: int | None = None


_DEC_EVENTS = msgspec.json.Decoder(list[_Event])
_DEC_HEAD = msgspec.json.Decoder(_Head)


@dataclass
class RankTrace:
    """One rank's trace as tables (see the module note); ``ts`` in us after ``t0_us``."""

    rank: int
    path: str
    t0_us: int
    gpu: pd.DataFrame
    host: pd.DataFrame
    sync: pd.DataFrame
    gpu_ranges: pd.DataFrame
    memory: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["ts", "allocated", "device_type"]))
    device_name: str | None = None
    world_size: int | None = None
    distributed: dict = field(default_factory=dict)
    device_properties: list[dict] = field(default_factory=list)

    @property
    def vendor(self) -> str:
        """``rocm`` when the device or kernel names say AMD, else ``cuda``."""
        name = (self.device_name or "").lower()
        if "amd" in name or "radeon" in name or "instinct" in name or name.startswith("mi"):
            return "rocm"
        return "cuda"


def _open_bytes(path: Path) -> io.BufferedIOBase:
    fh = open(path, "rb")  # noqa: SIM115 - handed to the caller, closed there
    magic = fh.read(2)
    fh.seek(0)
    return gzip.GzipFile(fileobj=fh) if magic == b"\x1f\x8b" else fh


class _Columns:
    """Grows numpy columns block by block.  Strings (name, cat, pid, tid) are interned into
    integer codes once per trace; the rare argument columns (NCCL's, shapes) are kept sparse,
    as (row, value) pairs: a kept event costs about 60 bytes whatever the file's size."""

    STR = ("name", "cat", "pid", "tid")
    INT = ("corr", "ext", "stream", "device")
    EXTRA = ("nbytes", "collective", "in_nelems", "out_nelems", "dtype", "group_size", "pg_name", "wait_stream",
             "wait_record", "memory_gbps")  # fmt: skip
    SHAPES = ("input_dims", "input_type")

    def __init__(self) -> None:
        self.cols: dict[str, list] = {k: [] for k in ("kind", "ts_i", "ts_f", "dur") + self.STR + self.INT}
        self.codes: dict[str, dict] = {k: {} for k in self.STR}
        self.sparse: dict[str, list[tuple[int, object]]] = {k: [] for k in self.EXTRA + self.SHAPES + ("pg_ranks",)}
        self.n = 0
        self.memory: list[tuple[float, float, int | None]] = []
        self.kinds = {c: 0 for c in GPU_CATS} | {c: 1 for c in HOST_CATS}
        self.kinds |= {c: 2 for c in SYNC_CATS} | {c: 3 for c in GPU_RANGE_CATS}

    def add(self, events: list[_Event]) -> None:
        kinds = self.kinds
        for e in events:  # allocator totals (``[memory]`` instant events, profile_memory=True)
            if e.name == "[memory]" and e.args is not None and e.args.total_allocated is not None and len(e.ts):
                self.memory.append((float(bytes(e.ts)), float(e.args.total_allocated), e.args.device_type))
        keep = [e for e in events if e.ph == "X" and e.cat in kinds and len(e.ts)]
        if not keep:
            return
        c = self.cols
        raw = np.array([bytes(e.ts) for e in keep])
        whole, _, frac = np.char.partition(raw, b".").T
        c["ts_i"].append(whole.astype(np.int64))
        c["ts_f"].append(np.char.add(b"0.", frac).astype(np.float64))
        c["kind"].append(np.array([kinds[e.cat] for e in keep], dtype=np.int8))
        c["dur"].append(np.array([e.dur for e in keep], dtype=np.float64))
        for key in self.STR:
            table = self.codes[key]
            c[key].append(np.array([table.setdefault(getattr(e, key), len(table)) for e in keep], dtype=np.int32))
        none = _Args()
        args = [e.args if e.args is not None else none for e in keep]
        for key, attr in zip(self.INT, ("correlation", "external_id", "stream", "device")):
            c[key].append(_int_col([getattr(a, attr) for a in args]))
        n = self.n
        for key in self.EXTRA:
            self.sparse[key] += [(n + i, v) for i, a in enumerate(args) if (v := getattr(a, key)) is not None]
        for key in self.SHAPES + ("pg_ranks",):  # msgspec.Raw: empty when absent
            self.sparse[key] += [(n + i, bytes(v)) for i, a in enumerate(args) if len(v := getattr(a, key))]
        self.n += len(keep)


def _int_col(values: list, fill: int = -1) -> np.ndarray:
    """Integers; None, and ids that are not numbers (a named stream "stream 7 [copy]"), become ``fill``."""
    return np.array([v if type(v) is int else _to_int(v, fill) for v in values], dtype=np.int64)


def _to_int(v, fill: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return fill


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _strings(codes: np.ndarray, table: dict) -> pd.Categorical:
    names = [str(k) for k in table]  # insertion order = code order
    return (
        pd.Categorical.from_codes(codes, categories=pd.Index(names).unique())
        if _unique(names)
        else (pd.Categorical(np.asarray(names, dtype=object)[codes]))
    )


def _unique(names: list[str]) -> bool:
    return len(set(names)) == len(names)


def _frame(cols: _Columns, t0: int) -> pd.DataFrame:
    c = cols.cols
    ts = (_cat(c["ts_i"], np.int64) - t0).astype(np.float64) + _cat(c["ts_f"], np.float64)
    data = {"kind": _cat(c["kind"], np.int8)}
    for key in ("name", "cat"):
        data[key] = _strings(_cat(c[key], np.int32), cols.codes[key])
    data |= {"ts": ts, "dur": _cat(c["dur"], np.float64)}
    for key in ("pid", "tid"):
        data[key] = _strings(_cat(c[key], np.int32), cols.codes[key])
    for key, col in zip(_Columns.INT, ("correlation", "external_id", "stream", "device")):
        data[col] = _cat(c[key], np.int64)
    df = pd.DataFrame(data)
    df["end"] = df["ts"] + df["dur"]
    for k, pairs in cols.sparse.items():
        if pairs:
            col = np.full(len(df), None, dtype=object)
            rows, vals = zip(*pairs)
            col[list(rows)] = list(vals)
            df[k] = pd.array(col, dtype=object)
    return df


def _stream_events(fh: io.BufferedIOBase, cols: _Columns) -> _Head:
    """Stream ``fh``'s ``traceEvents`` into ``cols``; return the other top-level keys."""
    buf = b""
    head_bytes = b""
    while True:  # the head: everything before the events array
        block = fh.read(BLOCK_BYTES)
        buf += block
        m = re.search(rb'"traceEvents"\s*:\s*\[', buf)
        if m:
            head_bytes, buf = buf[: m.end()], buf[m.end() :]
            break
        if not block:  # no traceEvents key: parse the whole text as one document
            return _whole(buf, cols)
    head = _DEC_HEAD.decode(head_bytes + b"]}")
    while True:
        block = fh.read(BLOCK_BYTES)
        if not block:
            break
        buf += block
        cut = _last_cut(buf)
        if cut is None:
            continue
        try:
            events = _DEC_EVENTS.decode(b"[" + buf[: cut + 1] + b"]")
        except msgspec.DecodeError:
            continue  # a cut inside nested args: keep the block, cut later
        cols.add(events)
        buf = buf[cut + 1 :].lstrip().lstrip(b",")
    tail = _DEC_HEAD.decode(b'{"traceEvents": [' + buf)  # the last events and the keys after the array
    cols.add(tail.traceEvents)
    for k in ("distributedInfo", "deviceProperties", "record_shapes"):
        if getattr(head, k) is None:
            setattr(head, k, getattr(tail, k))
    return head


def _last_cut(buf: bytes) -> int | None:
    """Index of the ``}`` closing the last complete event in ``buf`` (a cut candidate)."""
    start = max(0, len(buf) - (64 << 10))
    while True:
        last = None
        for m in _CUT.finditer(buf, start):
            last = m
        if last is not None:
            return last.start()
        if start == 0:
            return None
        start = max(0, start - (4 << 20))


def _whole(text: bytes, cols: _Columns) -> _Head:
    if text.lstrip().startswith(b"["):  # a bare array of events
        cols.add(_DEC_EVENTS.decode(text))
        return _Head()
    head = _DEC_HEAD.decode(text)
    cols.add(head.traceEvents)
    head.traceEvents = []
    return head


def _rank_from(head: _Head, path: Path, fallback: int, alone: bool) -> int:
    """``distributedInfo.rank``; else ``rank<N>`` in the name; else (a folder's file) the name's
    last number; else ``fallback`` (the file's position; 0 for a lone file)."""
    info = head.distributedInfo or {}
    if isinstance(info.get("rank"), int):
        return int(info["rank"])
    stem = path.name.split(".")[0]
    m = _RANK_WORD.search(stem) or (None if alone else _LAST_NUMBER.search(stem))
    return int(m.group(1)) if m else fallback


def read_rank(path: str | Path, fallback_rank: int = 0, *, alone: bool = True) -> RankTrace:
    """Read one trace file (see the module note)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("path", str(path), f"an existing trace file ending in one of {SUFFIXES}")
    cols = _Columns()
    with _open_bytes(path) as fh:
        try:
            head = _stream_events(fh, cols)
        except (msgspec.DecodeError, OSError, UnicodeDecodeError) as exc:
            allowed = f"a profiler trace in Chrome trace JSON (reading failed: {exc})"
            raise ConfigError("path", str(path), allowed) from exc
    c = cols.cols
    t0 = int(min(a.min() for a in c["ts_i"] if len(a))) if c["ts_i"] else 0
    df = _frame(cols, t0)
    parts = {k: df[df["kind"] == i].drop(columns="kind").reset_index(drop=True) for i, k in enumerate(_KINDS)}
    for k in _KINDS:  # the optional argument columns only where some event recorded them
        df_k = parts[k]
        parts[k] = df_k.drop(
            columns=[c for c in _Columns.EXTRA + _Columns.SHAPES + ("pg_ranks",) if c in df_k and df_k[c].isna().all()]
        )
    props = head.deviceProperties or []
    info = head.distributedInfo or {}
    gpu_dev = parts["gpu"]["device"]
    dev_id = int(gpu_dev.mode().iloc[0]) if len(gpu_dev) and (gpu_dev >= 0).any() else 0
    name = next((p.get("name") for p in props if p.get("id") == dev_id), None)
    mem = pd.DataFrame(cols.memory, columns=["ts", "allocated", "device_type"])
    mem["ts"] = mem["ts"] - t0
    return RankTrace(
        memory=mem,
        rank=_rank_from(head, path, fallback_rank, alone),
        path=str(path),
        t0_us=int(t0),
        device_name=name or (props[0].get("name") if props else None),
        world_size=info.get("world_size") if isinstance(info.get("world_size"), int) else None,
        distributed={k: v for k, v in info.items() if k in ("backend", "rank", "world_size", "nccl_version")},
        device_properties=[{k: p.get(k) for k in ("id", "name", "numSms", "totalGlobalMem")} for p in props],
        **parts,
    )


_KINDS = ("gpu", "host", "sync", "gpu_ranges")


def trace_files(path: str | Path) -> list[Path]:
    """The trace files of ``path``: itself, or a folder's files with a trace suffix, sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError("path", str(path), "a trace file or a folder of per-rank trace files")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise ConfigError("path", str(path), f"a folder holding trace files ending in one of {SUFFIXES}")
    return files


def _read_indexed(args: tuple[str, int, bool]) -> RankTrace:
    return read_rank(args[0], args[1], alone=args[2])


def read_job(path: str | Path, *, workers: int | None = None) -> dict[int, RankTrace]:
    """Read a file or a folder (one job, one file per rank) into ``{rank: RankTrace}``.

    Several files are read in parallel by ``workers`` processes (default: one per file, at
    most the CPU count).  Two files claiming the same rank raise ``ConfigError``.
    """
    files = trace_files(path)
    jobs = [(str(f), i, len(files) == 1) for i, f in enumerate(files)]
    n = min(len(files), workers or os.cpu_count() or 1)
    if n > 1:
        with ProcessPoolExecutor(max_workers=n) as pool:
            ranks = list(pool.map(_read_indexed, jobs))
    else:
        ranks = [_read_indexed(j) for j in jobs]
    out: dict[int, RankTrace] = {}
    for r in ranks:
        if r.rank in out:
            raise ConfigError("path", str(path), f"one file per rank (rank {r.rank}: {out[r.rank].path} and {r.path})")
        out[r.rank] = r
    return dict(sorted(out.items()))


def events(path: str | Path) -> list[dict]:
    """The complete events of one file kept here, as Chrome-trace dicts (``ph``, ``name``, ``cat``,
    absolute ``ts``, ``dur``, ``pid``, ``tid`` and the args read: ``External id``, ``correlation``,
    ``stream``, ``Input Dims``, ``Input type``), host events first, each table in file order.
    For code written against ``json.load(...)["traceEvents"]``; it reads ``.json.gz`` too."""
    r = read_rank(path)
    out = []
    for kind in _KINDS:
        df = getattr(r, kind)
        dims = df["input_dims"].to_numpy() if "input_dims" in df else [None] * len(df)
        types = df["input_type"].to_numpy() if "input_type" in df else [None] * len(df)
        for row, d, t in zip(df.itertuples(index=False), dims, types):
            args = {"External id": row.external_id, "correlation": row.correlation, "stream": row.stream}
            args = {k: int(v) for k, v in args.items() if v >= 0}
            if d is not None:
                args["Input Dims"] = msgspec.json.decode(d)
            if t is not None:
                args["Input type"] = msgspec.json.decode(t)
            out.append(
                {"ph": "X", "name": str(row.name), "cat": str(row.cat), "ts": r.t0_us + row.ts, "dur": row.dur,
                 "pid": _num(row.pid), "tid": _num(row.tid), "args": args}
            )  # fmt: skip
    return out


def _num(x: str) -> int | str:
    try:
        return int(x)
    except ValueError:
        return x
