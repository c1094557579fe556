"""Which device we are on and what it is; its datasheet peaks are :mod:`lab_utils.core.datasheets`'
(re-exported here: ``datasheet_for(device_info())``).

Datasheet peaks are *reference* numbers (dense, no sparsity) from the vendor's
public spec sheets.  They are shown beside measured ceilings (``ceilings.py``) and
never stand in for them: rooflines and %-of-ceiling use the measured numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import re
import sys
from dataclasses import dataclass

import torch
import triton

from lab_utils.core.datasheets import DATASHEET, DatasheetPeak, datasheet_for


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" | "cpu"
    name: str  # "NVIDIA H200" | "Intel(R) Xeon(R) ..."
    index: int | None
    units: int  # streaming multiprocessors (CUDA) or logical cores (CPU)
    units_name: str  # "SMs" | "cores"
    memory_bytes: int
    capability: str | None  # "9.0" on Hopper
    torch_version: str
    triton_version: str | None
    cuda_version: str | None
    python_version: str
    threads: int  # torch intra-op threads (CPU timing depends on it)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind if self.index is None else f"{self.kind}:{self.index}")

    def key(self) -> str:
        """A filesystem-safe key for one machine + software stack (ceilings cache)."""
        raw = (
            f"{self.kind}-{self.name}-{self.units}{self.units_name}-torch{self.torch_version}-"
            f"triton{self.triton_version}-cuda{self.cuda_version}-t{self.threads}"
        )
        return re.sub(r"[^A-Za-z0-9_.+-]+", "_", raw)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _mem_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0


def _triton_version() -> str | None:
    return getattr(triton, "__version__", None)


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """``None``/"auto" picks CUDA when present, else CPU; "cuda" without a GPU is an error."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"parameter 'device' = {device!r} is not allowed: expected 'auto', 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("parameter 'device' = 'cuda' but no CUDA device is visible here; use 'cpu' or 'auto'")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"parameter 'device' = {device!r} is not allowed: expected 'auto', 'cpu' or 'cuda'")
    return dev


def device_info(device: str | torch.device | None = None) -> DeviceInfo:
    dev = pick_device(device)
    common = dict(
        torch_version=torch.__version__,
        triton_version=_triton_version(),
        python_version=sys.version.split()[0],
        threads=torch.get_num_threads(),
    )
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        return DeviceInfo(
            kind="cuda",
            name=p.name,
            index=idx,
            units=p.multi_processor_count,
            units_name="SMs",
            memory_bytes=p.total_memory,
            capability=f"{p.major}.{p.minor}",
            cuda_version=torch.version.cuda,
            **common,
        )
    return DeviceInfo(
        kind="cpu",
        name=_cpu_name(),
        index=None,
        units=os.cpu_count() or 1,
        units_name="cores",
        memory_bytes=_mem_total(),
        capability=None,
        cuda_version=torch.version.cuda,
        **common,
    )


@contextlib.contextmanager
def annotate(name: str, device: torch.device | str | None = None):
    """A named range in both the torch profiler (``record_function``) and, on CUDA, NVTX
    (what Nsight Systems shows); on CPU the NVTX part is skipped (no CUDA runtime)."""
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    with torch.profiler.record_function(name):
        if cuda:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if cuda:
                torch.cuda.nvtx.range_pop()


__all__ = ["DATASHEET", "DatasheetPeak", "DeviceInfo", "annotate", "datasheet_for", "device_info", "pick_device"]
