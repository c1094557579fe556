"""Measured ceilings of this machine: copy bandwidth and dense matmul throughput.

Measured once per machine + software stack (``DeviceInfo.key()``) and cached as JSON
under ``$PERFLAB_CACHE`` (default ``~/.cache/perflab``); ``force=True`` (CLI:
``perflab ceilings --force``) re-measures.

* copy: ``dst.copy_(src)`` on a buffer far larger than the last-level cache;
  bytes = read + write = 2 × nbytes; GB/s = 1e9 bytes/s.
* matmul: ``a @ b`` with square n×n operands; FLOPs = 2·n³; fp8 through
  ``torch._scaled_mm`` (e4m3 operands, per-tensor scales, bf16 out) where it runs.
  fp32 is measured with TF32 disabled (true fp32), tf32 separately on CUDA.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lab_utils.core.device import DeviceInfo, datasheet_for, device_info, pick_device
from lab_utils.core.timing import BenchError, Timing, bench

CACHE_VERSION = 1


def cache_dir() -> Path:
    return Path(os.environ.get("PERFLAB_CACHE", Path.home() / ".cache" / "perflab"))


@dataclass(frozen=True)
class Ceilings:
    device: dict  # DeviceInfo.as_dict()
    copy_gbs: float
    copy_bytes: int
    matmul_tflops: dict[str, float]  # dtype name -> TFLOP/s (measured)
    matmul_n: dict[str, int]
    unsupported: dict[str, str] = field(default_factory=dict)  # dtype -> why not measured
    measured_at: str = ""
    seconds_to_measure: float = 0.0
    quick: bool = False
    version: int = CACHE_VERSION
    unstable: dict[str, str] = field(default_factory=dict)  # quantity -> why its timing was unstable

    def matmul(self, dtype: str | torch.dtype) -> float | None:
        """Measured dense matmul TFLOP/s for a dtype (fp16 falls back to bf16)."""
        key = dtype_key(dtype)
        if key in self.matmul_tflops:
            return self.matmul_tflops[key]
        if key == "fp16":
            return self.matmul_tflops.get("bf16")
        if key.startswith("fp8"):
            return self.matmul_tflops.get("fp8")
        return None

    @property
    def device_name(self) -> str:
        return self.device["name"]

    def as_dict(self) -> dict:
        return asdict(self)

    def summary_rows(self) -> list[dict]:
        """Measured ceilings beside the datasheet, one row per quantity."""
        peak = datasheet_for(self.device["name"])
        rows = [
            dict(
                quantity="copy bandwidth", unit="GB/s", measured=self.copy_gbs, datasheet=peak.hbm_gbs if peak else None
            )
        ]
        for k in ("fp32", "tf32", "bf16", "fp8", "fp4"):
            ds = None
            if peak:
                ds = {
                    "tf32": peak.tf32_tflops,
                    "bf16": peak.bf16_tflops,
                    "fp8": peak.fp8_tflops,
                    "fp4": peak.fp4_tflops,
                    "fp32": None,
                }[k]
            meas = self.matmul_tflops.get(k)
            if meas is None and ds is None and k not in self.unsupported:
                continue
            rows.append(
                dict(
                    quantity=f"matmul {k}",
                    unit="TFLOP/s",
                    measured=meas,
                    datasheet=ds,
                    note=self.unsupported.get(k, ""),
                )
            )
        for r in rows:
            r.setdefault("note", "")
            why = self.unstable.get(r["quantity"].replace("copy bandwidth", "copy"))
            if why:
                r["note"] = (r["note"] + "; " if r["note"] else "") + f"UNSTABLE timing: {why}"
            r["measured/datasheet"] = r["measured"] / r["datasheet"] if r["measured"] and r["datasheet"] else None
        return rows


def dtype_key(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, str):
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    return {
        torch.float32: "fp32",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float64: "fp64",
        torch.float8_e4m3fn: "fp8",
        torch.float8_e5m2: "fp8",
    }.get(dtype, str(dtype))


def _cache_path(info: DeviceInfo, quick: bool) -> Path:
    return cache_dir() / "ceilings" / f"{info.key()}{'-quick' if quick else ''}.json"


def measure_copy(dev: torch.device, nbytes: int, *, unstable: dict | None = None) -> tuple[float, int]:
    n = nbytes // 4
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), name="copy", device=dev, reps=15, check_finite=False, retries=1)
    _note_unstable(unstable, "copy", t)
    moved = 2 * src.numel() * src.element_size()
    return moved / (t.median_ms * 1e-3) / 1e9, moved


def _note_unstable(unstable: dict | None, key: str, t: Timing) -> None:
    if unstable is not None and not t.stable:
        unstable[key] = t.stability.reason


def _matmul_fn(dtype_name: str, n: int, dev: torch.device):
    if dtype_name in ("fp32", "tf32", "bf16", "fp16"):
        dt = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        a = torch.randn(n, n, device=dev, dtype=dt)
        b = torch.randn(n, n, device=dev, dtype=dt)
        return lambda: torch.mm(a, b)
    if dtype_name == "fp8":
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()  # column-major as cuBLASLt wants
        one = torch.ones((), device=dev)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    raise ValueError(dtype_name)


def measure_matmul(dtype_name: str, dev: torch.device, n: int, *, unstable: dict | None = None) -> float:
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
    try:
        fn = _matmul_fn(dtype_name, n, dev)
        t = bench(fn, name=f"matmul-{dtype_name}", device=dev, reps=10, budget_s=60, retries=1)
        _note_unstable(unstable, f"matmul {dtype_name}", t)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def measure_ceilings(device=None, *, quick: bool = False, progress: bool = False) -> Ceilings:
    dev = pick_device(device)
    info = device_info(dev)
    t_start = time.perf_counter()
    if dev.type == "cuda":
        copy_bytes = 1 << 30
        sizes = {"fp32": 8192, "tf32": 8192, "bf16": 8192, "fp16": 8192, "fp8": 8192}
    else:
        copy_bytes = (64 << 20) if quick else (256 << 20)
        sizes = {"fp32": 512 if quick else 1024, "bf16": 512 if quick else 1024, "fp8": 256 if quick else 512}
    if quick and dev.type == "cuda":
        copy_bytes, sizes = 256 << 20, {k: 4096 for k in sizes}
    unstable: dict[str, str] = {}
    copy_gbs, moved = measure_copy(dev, copy_bytes, unstable=unstable)
    tflops, ns, unsupported = {}, {}, {}
    for k, n in tqdm(list(sizes.items()), desc="matmul ceilings", disable=not progress):
        try:
            tflops[k] = measure_matmul(k, dev, n, unstable=unstable)
            ns[k] = n
        except (BenchError, RuntimeError, NotImplementedError, TypeError) as e:
            msg = str(e).splitlines()[0][:200]
            unsupported[k] = f"not measured here: {msg}"
    return Ceilings(
        device=info.as_dict(),
        copy_gbs=copy_gbs,
        copy_bytes=moved,
        matmul_tflops=tflops,
        matmul_n=ns,
        unsupported=unsupported,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        seconds_to_measure=time.perf_counter() - t_start,
        quick=quick,
        unstable=unstable,
    )


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON so that a reader (another run, a parallel test worker) sees the old file
    or the new one, never a half-written one: a uniquely named temporary file in the same
    folder, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def cached_ceilings(device=None) -> Ceilings | None:
    """This machine's cached ceilings without measuring anything: the full measurement when
    there is one, else the quick one (what CPU smoke runs measure); None when neither is cached."""
    info = device_info(pick_device(device))
    for quick in (False, True):
        path = _cache_path(info, quick)
        try:
            data = json.loads(path.read_text())
            if data.get("version") == CACHE_VERSION:
                return Ceilings(**data)
        except (OSError, json.JSONDecodeError, TypeError):
            continue
    return None


def get_ceilings(device=None, *, force: bool = False, quick: bool = False, progress: bool = False) -> Ceilings:
    """Cached measured ceilings for this machine and software stack."""
    dev = pick_device(device)
    path = _cache_path(device_info(dev), quick)
    if path.exists() and not force:
        try:
            data = json.loads(path.read_text())
            if data.get("version") == CACHE_VERSION:
                return Ceilings(**data)
        except (json.JSONDecodeError, TypeError):
            pass  # a corrupt cache is re-measured
    c = measure_ceilings(dev, quick=quick, progress=progress)
    write_json_atomic(path, c.as_dict())
    return c
