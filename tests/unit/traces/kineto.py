"""Small Kineto (``torch.profiler``) traces written by the tests, whose every figure is known by
construction: the events of a CUDA trace as Kineto writes them (complete ``ph: "X"`` events with
``cat``, ``ts``/``dur`` in microseconds and the ``args`` the reader keeps), and :class:`Job` that
hands out correlation and External ids so a test writes only times and names."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

HOST_PID, GPU_PID = 1, 0


def step(n: int, ts: float, dur: float, tid: int = 1) -> dict:
    return ann(f"ProfilerStep#{n}", ts, dur, tid)


def ann(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": HOST_PID, "tid": tid, "ts": ts, "dur": dur}


def module(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "python_function", "name": name, "pid": HOST_PID, "tid": tid, "ts": ts, "dur": dur}


def op(name: str, ts: float, dur: float, ext: int = -1, tid: int = 1, **args) -> dict:
    """A ``cpu_op``; ``args`` as Kineto names them (``**{"Input Dims": [[4, 8]]}``)."""
    a = ({"External id": ext} if ext >= 0 else {}) | args
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": HOST_PID, "tid": tid, "ts": ts, "dur": dur, "args": a}


def runtime(name: str, corr: int, ts: float, dur: float = 4.0, tid: int = 1, ext: int | None = None) -> dict:
    """A runtime call (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ``cudaDeviceSynchronize`` ...)."""
    args = {"correlation": corr, "External id": corr if ext is None else ext}
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": HOST_PID, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def launch(corr: int, ts: float, dur: float = 4.0, tid: int = 1, ext: int | None = None) -> dict:
    return runtime("cudaLaunchKernel", corr, ts, dur, tid, ext)


def kernel(name: str, corr: int, ts: float, dur: float, stream: int = 7, cat: str = "kernel",
           ext: int | None = None, device: int = 0, **args) -> dict:  # fmt: skip
    a = {"correlation": corr, "External id": corr if ext is None else ext, "stream": stream, "device": device}
    return {"ph": "X", "cat": cat, "name": name, "pid": GPU_PID, "tid": stream, "ts": ts, "dur": dur, "args": a | args}


def sync(name: str, corr: int, ts: float, dur: float, stream: int = 7, **args) -> dict:
    """A ``cuda_sync`` event (``Context Sync``, ``Stream Sync``, ``Event Sync``, ``Stream Wait Event``)."""
    return {"ph": "X", "cat": "cuda_sync", "name": name, "pid": GPU_PID, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0, **args}}  # fmt: skip


def write(path: Path, events: list[dict], *, gz: bool = False, literal: dict | None = None, **meta) -> Path:
    """The trace as Kineto's JSON object (``meta``: ``distributedInfo``, ``deviceProperties`` ...);
    ``literal``: {"TS1": "1711964650123456.789"} puts number text a Python float cannot hold."""
    doc = {"schemaVersion": 1, **meta, "traceEvents": events, "traceName": "written by tests/unit/traces/kineto.py"}
    text = json.dumps(doc, indent=1)
    for key, number in (literal or {}).items():
        text = text.replace(f'"{key}"', number)
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


H100 = {"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132, "totalGlobalMem": 85_045_854_208,
        "computeMajor": 9, "computeMinor": 0}  # fmt: skip


@dataclass
class Job:
    """One rank's events with ids handed out: :meth:`gpu` adds a launch call and its activity."""

    events: list[dict] = field(default_factory=list)
    corr: int = 0

    def add(self, *evs: dict) -> Job:
        self.events += evs
        return self

    def gpu(self, name: str, launch_ts: float, ts: float, dur: float, *, stream: int = 7, cat: str = "kernel",
            launch_dur: float = 4.0, tid: int = 1, ext: int | None = None, call: str = "cudaLaunchKernel",
            **args) -> int:  # fmt: skip
        """A ``call`` at ``launch_ts`` on thread ``tid`` and the activity it launches (``ext``: the
        launching operator's External id); returns the correlation id."""
        self.corr += 1
        c = self.corr
        self.events += [
            runtime(call, c, launch_ts, launch_dur, tid, ext if ext is not None else 100_000 + c),
            kernel(name, c, ts, dur, stream, cat, ext if ext is not None else 100_000 + c, **args),
        ]
        return c

    def write(self, path: Path, **meta) -> Path:
        return write(path, self.events, **meta)
