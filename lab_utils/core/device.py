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

from .config import device_target


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


def cuda_devices() -> int:
    """CUDA devices where the labs run: this machine's, or the target's while a suite is validated for one."""
    t = device_target()
    if t is not None:
        return t.gpus
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def no_cuda_reason() -> str:
    """Why ``cuda_devices()`` is 0, in words."""
    t = device_target()
    return f"{t.where} have no GPU" if t is not None else "no CUDA device is visible here"


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
    """Vendor peaks, dense (no 2:4 sparsity).  TFLOP/s and GB/s; None = no such unit.

    ``bf16_tflops`` is also the fp16 peak unless ``fp16_tflops`` differs (V100 and P100 have fp16
    units and no bf16 one).  ``tf32_tflops`` is None on parts without TF32; an fp32 GEMM there runs
    at ``fp32_matmul_tflops`` (CDNA2's fp32 matrix cores, twice its vector rate) or, when that is
    None, at the CUDA-core ``fp32_tflops``.  On AMD's two-die MI250/MI250X each die (GCD) is one
    device to the profiler, so their rows are one GCD's half of the card's figures."""

    name: str
    bf16_tflops: float | None
    fp8_tflops: float | None
    fp4_tflops: float | None
    tf32_tflops: float | None
    hbm_gbs: float
    memory_gib: float
    source: str
    fp32_tflops: float | None = None  # CUDA-core fp32 (no tensor cores: what a matmul gets with TF32 off)
    fp16_tflops: float | None = None  # None: the same as bf16_tflops
    fp32_matmul_tflops: float | None = None  # fp32 GEMM on matrix units without TF32 (CDNA2)

    def matmul_tflops(self, dtype: str) -> float | None:
        """The matmul peak for inputs of ``dtype`` ("fp32", "fp16", "bf16"): for fp32 the TF32
        tensor-core peak where the part has one (what cuBLAS reaches when TF32 is allowed; an upper
        bound otherwise); a half type without its own unit gets the fp32 rate it runs at."""
        fp32 = self.tf32_tflops or self.fp32_matmul_tflops or self.fp32_tflops
        if dtype == "fp32":
            return fp32
        if dtype == "fp16":
            return self.fp16_tflops or self.bf16_tflops or fp32
        if dtype == "bf16":
            return self.bf16_tflops or fp32
        raise ValueError(f"dtype={dtype!r}: allowed 'fp32', 'fp16', 'bf16'")


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
    # Volta and Pascal: fp16 units, no bf16 and no TF32.
    "V100-PCIE": DatasheetPeak(
        "V100 PCIe", None, None, None, None, 900.0, 32, "NVIDIA V100 datasheet (PCIe)", 14.0, fp16_tflops=112.0
    ),
    "V100": DatasheetPeak(
        "V100 SXM2", None, None, None, None, 900.0, 32, "NVIDIA V100 datasheet (SXM2)", 15.7, fp16_tflops=125.0
    ),
    "GP100": DatasheetPeak(
        "Quadro GP100", None, None, None, None, 717.0, 16, "NVIDIA Quadro GP100 datasheet", 10.3, fp16_tflops=20.7
    ),
    "P100": DatasheetPeak(
        "P100 SXM2", None, None, None, None, 732.0, 16, "NVIDIA Tesla P100 datasheet (SXM2)", 10.6, fp16_tflops=21.2
    ),
    # AMD Instinct, dense matrix-core peaks; one GCD of the two-die parts (see the class note).
    "MI300X": DatasheetPeak(
        "MI300X", 1307.4, 2614.9, None, 653.7, 5300.0, 192, "AMD Instinct MI300X datasheet (dense)", 163.4
    ),
    "MI250X": DatasheetPeak(
        "MI250X (one GCD)",
        191.5,
        None,
        None,
        None,
        1638.4,
        64,
        "AMD Instinct MI250X datasheet, halved per GCD",
        23.95,
        fp32_matmul_tflops=47.85,
    ),
    "MI250": DatasheetPeak(
        "MI250 (one GCD) / MI210",
        181.0,
        None,
        None,
        None,
        1638.4,
        64,
        "AMD Instinct MI250 datasheet, halved per GCD (= MI210's)",
        22.6,
        fp32_matmul_tflops=45.3,
    ),
}
# A device name that holds a key is that row; earlier keys are the more specific names.
_KEYS = ("B200", "H200", "H100", "A100", "V100-PCIE", "V100", "GP100", "P100", "MI300X", "MI250X", "MI250", "MI210")
# ROCm often names a CDNA part only "AMD Radeon Graphics": its compute units (``numSms``) say which.
_AMD_BY_UNITS = {110: "MI250X", 104: "MI250", 304: "MI300X"}


def datasheet_for(info: DeviceInfo | str | None, properties: dict | None = None) -> DatasheetPeak | None:
    """The datasheet row for a device name, or None (CPUs, unknown GPUs).  ``properties``: the
    device's entry of a trace's ``deviceProperties``; it identifies an AMD part that ROCm names
    only "AMD Radeon Graphics" by its compute units (104: an MI250 die or an MI210, 110: an MI250X
    die, 304: MI300X)."""
    name = info.name if isinstance(info, DeviceInfo) else (info or "")
    up = name.upper()
    for key in _KEYS:
        if key in up:
            return DATASHEET["MI250" if key == "MI210" else key]
    units = (properties or {}).get("numSms")
    if ("AMD" in up or "RADEON" in up) and units in _AMD_BY_UNITS:
        return DATASHEET[_AMD_BY_UNITS[units]]
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
