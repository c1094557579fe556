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
number of events kept (their tables hold about 90 bytes each plus the distinct names and shapes;
the read peaks at about twice that), not with the size of the JSON text.
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
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from lab_utils.core.config import ConfigError
from lab_utils.traces.numbers import codes as value_codes
from lab_utils.traces.numbers import ints, numbers

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "Runtime", "Operator")
SYNC_CATS = ("cuda_sync",)
GPU_RANGE_CATS = ("gpu_user_annotation",)
SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
BLOCK_BYTES = 2 << 20  # decompressed bytes per block: 2 MB keeps the peak near 30 MB (8 MB: 115 MB) on a 54 MB trace
_CUT = re.compile(rb'\}\s*,\s*\{\s*"')
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
#: what is kept of each ``deviceProperties`` entry (the part's identity: lab_utils.core.datasheets)
PROPERTIES = ("id", "name", "numSms", "totalGlobalMem", "computeMajor", "computeMinor", "clockRate")
_RANK_WORD = re.compile(r"rank\D?(\d+)", re.IGNORECASE)
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


class _Args(msgspec.Struct, gc=False):
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
    concrete: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Concrete Inputs")
    total_allocated: int | float | None = msgspec.field(default=None, name="Total Allocated")
    device_type: int | None = msgspec.field(default=None, name="Device Type")
    wait_stream: int | None = msgspec.field(default=None, name="wait_on_stream")  # cuda_sync "Stream Wait Event"
    wait_record: int | None = msgspec.field(default=None, name="wait_on_cuda_event_record_corr_id")
    memory_gbps: float | None = msgspec.field(default=None, name="memory bandwidth (GB/s)")  # memcpy, memset


class _Event(msgspec.Struct, gc=False):  # gc=False: millions of them, none holds a cycle
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


class _Slim(msgspec.Struct, gc=False):  # what the step windows need of an event
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: msgspec.Raw = msgspec.Raw(b"")
    dur: float = 0.0


class _SlimHead(msgspec.Struct):
    traceEvents: list[_Slim] = []
    distributedInfo: dict | None = None
    deviceProperties: list[dict] | None = None
    record_shapes: int | None = None


_SLIM = (msgspec.json.Decoder(list[_Slim]), msgspec.json.Decoder(_SlimHead))
_FULL = (_DEC_EVENTS, _DEC_HEAD)
_NO_ARGS = _Args()


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


def per_text(col: pd.Series, fn, dtype=object) -> np.ndarray:
    """``fn`` of each row's text (``str``; a missing value, None or NaN, reads ``"nan"``), called once
    per distinct value where the column is categorical (the reader's text columns are), so a
    million rows of a few thousand names cost a few thousand calls."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats, codes = col.cat.categories, col.cat.codes.to_numpy()
        if len(codes) < len(cats):  # a few rows of many distinct values (a subset): the values used only
            used, codes = np.unique(codes, return_inverse=True)
            values = [fn(str(cats[c])) if c >= 0 else fn("nan") for c in used.tolist()]
        else:
            values = [fn(str(c)) for c in cats] + [fn("nan")]  # code -1 (missing) takes the last entry
        table = np.empty(len(values), dtype=dtype)
        table[:] = values
        return table[codes.ravel()]
    out = np.empty(len(col), dtype=dtype)
    out[:] = [fn("nan" if v is None or v != v else str(v)) for v in col.tolist()]  # v != v: NaN
    return out


def texts(col: pd.Series) -> np.ndarray:
    """A text column as an object array of ``str`` (see :func:`per_text`)."""
    return per_text(col, str)


def _open_bytes(path: Path) -> io.BufferedIOBase:
    fh = open(path, "rb")  # noqa: SIM115 - handed to the caller, closed there
    magic = fh.read(2)
    fh.seek(0)
    return gzip.GzipFile(fileobj=fh) if magic == b"\x1f\x8b" else fh


class _Columns:
    """Grows the tables block by block.  Each block's strings (name, cat, pid, tid) become integer
    codes into the block's own table of distinct values, joined into one table per trace at the
    end; the argument columns most events lack (NCCL's, sizes, shapes) are kept sparse, as
    (row, value) pairs, their texts interned.  A kept event costs about 90 bytes whatever the
    file's size."""

    STR = ("name", "cat", "pid", "tid")
    INT = ("correlation", "external_id", "stream", "device")
    EXTRA = ("nbytes", "collective", "in_nelems", "out_nelems", "dtype", "group_size", "pg_name", "wait_stream",
             "wait_record", "memory_gbps")  # fmt: skip
    SHAPES = ("input_dims", "input_type", "concrete")  # raw JSON, kept as interned text
    KINDS = {c: 0 for c in GPU_CATS} | {c: 1 for c in HOST_CATS} | {c: 2 for c in SYNC_CATS}
    KINDS |= {c: 3 for c in GPU_RANGE_CATS}

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self.sparse: dict[str, list[tuple[int, object]]] = {k: [] for k in self.EXTRA + ("pg_ranks",)}
        self.shape_keys: dict[bytes, int] = {}  # dims, types and concrete inputs of one call -> code
        self.shaped: list[tuple[np.ndarray, np.ndarray]] = []  # per block: (rows, codes)
        self.n = 0
        self.seen = 0  # events read, kept or not
        self.memory: list[tuple[bytes, float, int | None]] = []

    def add(self, events: list[_Event]) -> None:
        kinds = self.KINDS
        self.seen += len(events)
        for e in [e for e in events if e.name == "[memory]" and e.args is not None]:  # profile_memory=True
            if e.args.total_allocated is not None and len(e.ts):
                self.memory.append((bytes(e.ts), float(e.args.total_allocated), e.args.device_type))
        keep = [e for e in events if e.ph == "X" and e.cat in kinds and len(e.ts)]
        if not keep:
            return
        args = [e.args or _NO_ARGS for e in keep]
        block: dict = {}
        for key, values in (("name", [e.name for e in keep]), ("cat", [e.cat for e in keep]),
                            ("pid", [e.pid for e in keep]), ("tid", [e.tid for e in keep])):  # fmt: skip
            block[key] = value_codes(values, key in ("pid", "tid"))
        block["kind"] = np.array([kinds[c] for c in block["cat"][1]], dtype=np.int8)[block["cat"][0]]
        block["ts"] = numbers([e.ts for e in keep])
        block["dur"] = np.array([e.dur for e in keep], dtype=np.float64)
        corr, ext = [a.correlation for a in args], [a.external_id for a in args]
        stream, device = [a.stream for a in args], [a.device for a in args]
        for key, values in (("correlation", corr), ("external_id", ext), ("stream", stream), ("device", device)):
            block[key] = ints(values)
        self.blocks.append(block)
        n = self.n
        rare = [i for i, a in enumerate(args) if a.nbytes is not None or a.collective is not None
                or a.in_nelems is not None or a.dtype is not None or a.group_size is not None
                or a.pg_name is not None or len(a.pg_ranks) or a.wait_record is not None
                or a.memory_gbps is not None]  # fmt: skip
        for key in self.EXTRA:
            self.sparse[key] += [(n + i, v) for i in rare if (v := getattr(args[i], key)) is not None]
        for i in [i for i in rare if len(args[i].pg_ranks)]:
            self.sparse["pg_ranks"].append((n + i, bytes(args[i].pg_ranks).decode()))
        # recorded shapes (record_shapes=True): dims, types and concrete inputs joined into one key,
        # interned per trace (the same shapes recur every step)
        keys = self.shape_keys
        shaped = [i for i, a in enumerate(args) if len(a.input_dims)]
        if shaped:
            codes = [
                keys.setdefault(k, len(keys))
                for k in [b"\x00".join((args[i].input_dims, args[i].input_type, args[i].concrete)) for i in shaped]
            ]
            self.shaped.append((np.array(shaped, dtype=np.int64) + n, np.array(codes, dtype=np.int32)))
        self.n += len(keep)

    def strings(self, key: str) -> pd.Categorical:
        """One column's codes over every block, into one table of distinct values (as text)."""
        index: dict = {}
        parts = []
        for b in self.blocks:
            codes, values = b[key]
            remap = np.array([index.setdefault(str(v), len(index)) for v in values], dtype=np.int32)
            parts.append(remap[codes])
        codes = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return pd.Categorical.from_codes(codes, categories=pd.Index(list(index), dtype=object))

    def column(self, key: str, dtype) -> np.ndarray:
        parts = [b[key] for b in self.blocks]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _frame(cols: _Columns) -> tuple[dict[str, pd.DataFrame], int]:
    """The kept events as the four tables (``_KINDS``), built from the columns kind by kind (no table of
    every event first: one copy of the data at a time), and the trace's t0.  An optional argument
    column is given to a table only where one of its events recorded it."""
    whole = np.concatenate([b["ts"][0] for b in cols.blocks]) if cols.blocks else np.zeros(0, dtype=np.int64)
    frac = np.concatenate([b["ts"][1] for b in cols.blocks]) if cols.blocks else np.zeros(0)
    t0 = int(whole.min()) if len(whole) else 0
    kind = cols.column("kind", np.int8)
    data: dict = {key: cols.strings(key) for key in ("name", "cat")}
    data["ts"] = (whole - t0).astype(np.float64) + frac
    del whole, frac
    data["dur"] = cols.column("dur", np.float64)
    for key in ("pid", "tid"):
        data[key] = cols.strings(key)
    for key in _Columns.INT:
        data[key] = cols.column(key, np.int64)
    cols.blocks.clear()  # every block's arrays are in ``data`` now
    sparse = {k: tuple(np.asarray(x) for x in zip(*pairs)) for k, pairs in cols.sparse.items() if pairs}
    shapes: dict[str, pd.Categorical] = {}
    if cols.shaped:  # each shape field as codes into its distinct texts
        rows = np.concatenate([r for r, _ in cols.shaped])
        codes = np.concatenate([c for _, c in cols.shaped])
        fields = [k.split(b"\x00") for k in cols.shape_keys]
        for j, key in enumerate(_Columns.SHAPES):
            table: dict = {}
            per_key = np.array([table.setdefault(f[j], len(table)) if f[j] else -1 for f in fields], dtype=np.int32)
            col = np.full(len(kind), -1, dtype=np.int32)
            col[rows] = per_key[codes]
            shapes[key] = pd.Categorical.from_codes(col, categories=pd.Index([t.decode() for t in table], dtype=object))
    parts = {}
    for i, name in enumerate(_KINDS):
        idx = np.flatnonzero(kind == i)
        df = pd.DataFrame({k: v[idx] for k, v in data.items()})
        df["end"] = df["ts"] + df["dur"]
        pos = np.full(len(kind), -1, dtype=np.int64)
        pos[idx] = np.arange(len(idx))
        for k, (rows, vals) in sparse.items():
            mine = pos[rows.astype(np.int64)]
            if (mine >= 0).any():
                col = np.full(len(df), None, dtype=object)
                col[mine[mine >= 0]] = vals[mine >= 0]
                df[k] = pd.array(col, dtype=object)
        for k, cat in shapes.items():
            sub = cat[idx]
            if len(sub) and (sub.codes >= 0).any():
                df[k] = sub
        parts[name] = df
    return parts, t0


def _stream_events(fh: io.BufferedIOBase, cols, decoders: tuple = _FULL) -> tuple[_Head, bool]:
    """Stream ``fh``'s ``traceEvents`` into ``cols`` (its ``add``); return the other top-level keys,
    and whether the text has a ``traceEvents`` array at all.  ``decoders``: (events, head)."""
    dec_events, dec_head = decoders
    buf = b""
    head_bytes = b""
    while True:  # the head: everything before the events array
        block = fh.read(BLOCK_BYTES)
        buf += block
        m = _EVENTS_KEY.search(buf)
        if m:
            head_bytes, buf = buf[: m.end()], buf[m.end() :]
            break
        if not block:  # no traceEvents key: parse the whole text as one document
            return _whole(buf, cols, decoders)
    head = dec_head.decode(head_bytes + b"]}")
    while True:
        block = fh.read(BLOCK_BYTES)
        if not block:
            break
        buf += block
        cut = _last_cut(buf)
        if cut is None:
            continue
        try:
            events = dec_events.decode(b"[" + buf[: cut + 1] + b"]")
        except msgspec.DecodeError:
            continue  # a cut inside nested args: keep the block, cut later
        cols.add(events)
        buf = buf[cut + 1 :].lstrip().lstrip(b",")
    tail = dec_head.decode(b'{"traceEvents": [' + buf)  # the last events and the keys after the array
    cols.add(tail.traceEvents)
    for k in ("distributedInfo", "deviceProperties", "record_shapes"):
        if getattr(head, k) is None:
            setattr(head, k, getattr(tail, k))
    return head, True


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


def _whole(text: bytes, cols, decoders: tuple = _FULL) -> tuple[_Head, bool]:
    if text.lstrip().startswith(b"["):  # a bare array of events
        cols.add(decoders[0].decode(text))
        return _Head(), True
    head = decoders[1].decode(text)
    cols.add(head.traceEvents)
    head.traceEvents = []
    return head, False


def _not_a_trace(path: Path, cols: _Columns | _StepRows, has_events: bool) -> ConfigError:
    """Why a file that parsed as JSON holds no profiler event, as the error to raise."""
    if not has_events:
        try:
            with _open_bytes(path) as fh:
                keys = list(msgspec.json.decode(fh.read(64 << 20)))[:8]
        except (msgspec.DecodeError, OSError, EOFError, TypeError, zlib.error):
            keys = []
        what = f"this JSON has no traceEvents array (its keys: {', '.join(map(str, keys)) or 'none'})"
    elif not cols.seen:
        what = "its traceEvents array is empty"
    else:
        what = f"none of its {cols.seen} events is a complete ('ph': 'X') profiler event (kernel, cpu_op, ...)"
    return ConfigError("path", str(path), f"a torch profiler (Kineto) trace: {what}")


def _unreadable(path: Path, exc: BaseException) -> ConfigError:
    """A file that cannot be read to its end, as the error to raise (one line, naming the file)."""
    if isinstance(exc, EOFError) or "truncated" in str(exc):
        what = "a complete trace file: it ends early (truncated, as a job killed while writing leaves it)"
    elif isinstance(exc, (gzip.BadGzipFile, zlib.error)):
        what = f"a readable trace file: its gzip stream is corrupt ({exc})"
    elif isinstance(exc, msgspec.DecodeError):
        what = f"a profiler trace in Chrome trace JSON: it is not ({exc})"
    else:
        what = f"a readable trace file ({type(exc).__name__}: {exc})"
    return ConfigError("path", str(path), what)


def _rank_from(head: _Head, path: Path, fallback: int, alone: bool) -> int:
    """``distributedInfo.rank``; else ``rank<N>`` in the name; else (a folder's file) the name's
    last number; else ``fallback`` (the file's position; 0 for a lone file)."""
    info = head.distributedInfo or {}
    if isinstance(info.get("rank"), int):
        return int(info["rank"])
    stem = path.name.split(".")[0]
    m = _RANK_WORD.search(stem) or (None if alone else _LAST_NUMBER.search(stem))
    return int(m.group(1)) if m else fallback


def _read_into(path: Path, cols, decoders: tuple) -> tuple[_Head, bool]:
    """Stream the file at ``path`` into ``cols`` (:func:`_stream_events`); a missing, truncated,
    corrupt or non-JSON file raises one ``ConfigError`` naming it."""
    if not path.is_file():
        raise ConfigError("path", str(path), f"an existing trace file ending in one of {SUFFIXES}")
    try:
        with _open_bytes(path) as fh:
            return _stream_events(fh, cols, decoders)
    except (msgspec.DecodeError, OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
        raise _unreadable(path, exc) from None


def read_rank(path: str | Path, fallback_rank: int = 0, *, alone: bool = True) -> RankTrace:
    """Read one trace file (see the module note).  A file that is truncated, corrupt, not JSON or
    not a profiler trace raises one ``ConfigError`` naming it."""
    path = Path(path)
    cols = _Columns()
    head, has_events = _read_into(path, cols, _FULL)
    if not cols.n:
        raise _not_a_trace(path, cols, has_events)
    parts, t0 = _frame(cols)
    props = head.deviceProperties or []
    info = head.distributedInfo or {}
    gpu_dev = parts["gpu"]["device"]
    dev_id = int(gpu_dev.mode().iloc[0]) if len(gpu_dev) and (gpu_dev >= 0).any() else 0
    name = next((p.get("name") for p in props if p.get("id") == dev_id), None)
    whole, frac = numbers([m[0] for m in cols.memory])
    mem = pd.DataFrame({"ts": (whole - t0).astype(np.float64) + frac, "allocated": [m[1] for m in cols.memory],
                        "device_type": [m[2] for m in cols.memory]})  # fmt: skip
    return RankTrace(
        memory=mem,
        rank=_rank_from(head, path, fallback_rank, alone),
        path=str(path),
        t0_us=int(t0),
        device_name=name or (props[0].get("name") if props else None),
        world_size=info.get("world_size") if isinstance(info.get("world_size"), int) else None,
        distributed={k: v for k, v in info.items() if k in ("backend", "rank", "world_size", "nccl_version")},
        device_properties=[{k: p.get(k) for k in PROPERTIES} for p in props if isinstance(p, dict)],
        **parts,
    )


class _StepRows:
    """Keeps the ``ProfilerStep#N`` user annotations of a stream of slim events."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, bytes, float]] = []
        self.seen = 0
        self.n = 0  # 1 once a complete profiler event is seen (read_rank's test of a trace), else 0

    def add(self, events: list[_Slim]) -> None:
        self.seen += len(events)
        kinds = _Columns.KINDS
        if not self.n and any(e.ph == "X" and e.cat in kinds and len(e.ts) for e in events):
            self.n = 1
        self.rows += [(e.name, bytes(e.ts), e.dur) for e in events if e.ph == "X" and e.cat == "user_annotation"
                      and e.name.startswith("ProfilerStep") and len(e.ts)]  # fmt: skip


def read_steps(path: str | Path) -> pd.DataFrame:
    """The ``ProfilerStep`` user annotations of one trace file, without reading the rest of it into
    tables: name, ts (us after the first of them), dur; for choosing a step before the whole job is
    read.  The same errors as :func:`read_rank`."""
    path = Path(path)
    rows = _StepRows()
    _, has_events = _read_into(path, rows, _SLIM)
    if not rows.n:
        raise _not_a_trace(path, rows, has_events)
    whole, frac = numbers([r[1] for r in rows.rows])
    t0 = int(whole.min()) if len(whole) else 0
    return pd.DataFrame({"name": pd.array([r[0] for r in rows.rows], dtype=object),
                         "ts": (whole - t0).astype(np.float64) + frac, "dur": [r[2] for r in rows.rows],
                         "cat": "user_annotation"})  # fmt: skip


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
    ``stream``, ``Input Dims``, ``Input type``): the GPU activities, then the host events, the
    ``cuda_sync`` events and the GPU ranges, each table in file order.
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
            if isinstance(d, str):
                args["Input Dims"] = msgspec.json.decode(d)
            if isinstance(t, str):
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
