"""Which device we are on and what it is; its datasheet peaks are :mod:`lab_utils.core.datasheets`'
(re-exported here: ``datasheet_for(device_info())``).

Datasheet peaks are *reference* numbers (dense, no sparsity) from the vendor's
public spec sheets.  They are shown beside measured ceilings (``ceilings.py``) and
never stand in for them: rooflines and %-of-ceiling use the measured numbers.

The module imports no torch: the trace reader (``perflab[traces]``, no torch) reads the
datasheets, and :data:`HOST` describes the machine from its package metadata.  The functions
that ask torch about a device import it where they run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from lab_utils.core.config import device_target
from lab_utils.core.datasheets import DATASHEET, DatasheetPeak, datasheet_for

if TYPE_CHECKING:
    import torch

#: the machine itself, no torch device: the context of records read here rather than measured
#: here (a profiler trace from a file), which must not import torch to describe the machine
HOST = "host"


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
        import torch  # noqa: PLC0415  (torch: optional under perflab[traces]; seconds to import)

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


def package_version(name: str) -> str | None:
    """The installed version of a distribution (``torch``, ``triton``) from its metadata,
    without importing it; None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def triton_version() -> str | None:
    """Triton's version without importing it (Triton must not be imported before ``lab_kernels``
    decides ``TRITON_INTERPRET``): PyPI's ``triton``, or the builds PyTorch's own index ships."""
    for name in ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu"):
        v = package_version(name)
        if v:
            return v
    return None


def cuda_devices() -> int:
    """CUDA devices where the labs run: this machine's, or the target's while a suite is validated for one."""
    t = device_target()
    if t is not None:
        return t.gpus
    import torch  # noqa: PLC0415  (torch: optional under perflab[traces]; seconds to import)

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def no_cuda_reason() -> str:
    """Why ``cuda_devices()`` is 0, in words."""
    t = device_target()
    return f"{t.where} have no GPU" if t is not None else "no CUDA device is visible here"


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """``None``/"auto" picks CUDA when present, else CPU; "cuda" without a GPU is an error."""
    import torch  # noqa: PLC0415  (torch: optional under perflab[traces]; seconds to import)

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


def host_info() -> DeviceInfo:
    """This machine's CPU and software, torch left unimported: versions from the packages'
    metadata (None when absent), no intra-op thread count (0: no torch asked)."""
    return DeviceInfo(
        kind="cpu",
        name=_cpu_name(),
        index=None,
        units=os.cpu_count() or 1,
        units_name="cores",
        memory_bytes=_mem_total(),
        capability=None,
        torch_version=package_version("torch"),
        triton_version=triton_version(),
        cuda_version=None,
        python_version=sys.version.split()[0],
        threads=0,
    )


def device_info(device: str | torch.device | None = None) -> DeviceInfo:
    """The device a measurement runs on (``None``/"auto": CUDA when present, else CPU), or
    :data:`HOST` for :func:`host_info` (no torch)."""
    if isinstance(device, str) and device == HOST:
        return host_info()
    import torch  # noqa: PLC0415  (torch: optional under perflab[traces]; seconds to import)

    dev = pick_device(device)
    common = dict(
        torch_version=torch.__version__,
        triton_version=triton_version(),
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
    import torch  # noqa: PLC0415  (torch: optional under perflab[traces]; seconds to import)

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
