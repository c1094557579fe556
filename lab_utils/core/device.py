"""Which device we are on, what it is, and the datasheet peaks it claims.

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


@dataclass(frozen=True)
class DatasheetPeak:
    """Vendor peaks, dense (no 2:4 sparsity).  TFLOP/s and GB/s; None = no such unit."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    fp4_tflops: float | None
    tf32_tflops: float
    hbm_gbs: float
    memory_gib: float
    source: str
    fp32_tflops: float | None = None  # CUDA-core fp32 (no tensor cores: what a matmul gets with TF32 off)


# Dense tensor-core peaks from NVIDIA's public datasheets (SXM parts).  Sparse figures
# on those sheets are exactly twice these and are deliberately not used.
DATASHEET: dict[str, DatasheetPeak] = {
    "A100": DatasheetPeak(
        "A100 SXM4 80GB", 312.0, None, None, 156.0, 2039.0, 80, "NVIDIA A100 datasheet (dense)", fp32_tflops=19.5
    ),
    "H100": DatasheetPeak(
        "H100 SXM5",
        989.4,
        1978.9,
        None,
        494.7,
        3350.0,
        80,
        "NVIDIA H100 datasheet (dense = half the sparse figure)",
        fp32_tflops=66.9,
    ),
    "H200": DatasheetPeak(
        "H200 SXM",
        989.4,
        1978.9,
        None,
        494.7,
        4800.0,
        141,
        "NVIDIA H200 datasheet (dense = half the sparse figure)",
        fp32_tflops=66.9,
    ),
    "B200": DatasheetPeak(
        "B200 (HGX)",
        2250.0,
        4500.0,
        9000.0,
        1100.0,
        8000.0,
        180,
        "NVIDIA HGX B200 datasheet (dense = half the sparse figure)",
        75.0,
    ),
}


def datasheet_for(info: DeviceInfo | str | None) -> DatasheetPeak | None:
    """The datasheet row for a device name, or None (CPUs, unknown GPUs)."""
    name = info.name if isinstance(info, DeviceInfo) else (info or "")
    up = name.upper()
    for key in ("B200", "H200", "H100", "A100"):
        if key in up:
            return DATASHEET[key]
    return None


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
