"""The vendors' datasheet peaks, by exact part, and which part a device is.

Peaks are *reference* numbers (dense, no 2:4 sparsity) from the vendors' public datasheets; they
are shown beside measured ceilings (``ceilings.py``) and never stand in for them on this machine.
A GPU trace (:mod:`lab_utils.traces`) is held to them, since the machine that recorded it is gone.

Which part (:func:`identify`): the family from the name (``GH200`` before ``H200``, which its name
contains), then, among the family's parts, the form factor the name says (``PCIe``, ``SXM``,
``NVL``; ``HBM3`` is the H100 SXM5), the memory size (in the name, else ``totalGlobalMem`` of the
trace's ``deviceProperties``: the nearest nominal size within 15%, so a "40 GB" A100 reporting
42.5e9 bytes is the 40 GB part), the SM count (``numSms``: H100 PCIe 114, SXM5 and NVL 132) and the
boost clock (``clockRate``, kHz, where recorded).  Where the evidence leaves several parts with the
same peaks (A100 40 GB SXM4 and PCIe), that is said; where their peaks differ, the family's first
part (the SXM one) is taken and the row says it was assumed.  ROCm may name a CDNA part only
"AMD Radeon Graphics": its compute units (``numSms``) say which.  A name that is only a family
(``--gpu A100``) is refused by :func:`check_part` with the parts it could be.

Sources (dense = half the sparse figure where the sheet gives only that):

* A100: NVIDIA A100 Tensor Core GPU datasheet (2021): FP32 19.5, TF32 156, BF16/FP16 312 TFLOP/s;
  HBM 1,555 GB/s (40 GB, SXM4 and PCIe), 1,935 GB/s (80 GB PCIe), 2,039 GB/s (80 GB SXM4); 108 SMs.
* H100: NVIDIA H100 Tensor Core GPU datasheet and architecture whitepaper: SXM5 FP32 66.9, TF32
  494.7, BF16 989.4, FP8 1,978.9, 3.35 TB/s, 132 SMs; PCIe FP32 51, TF32 378, BF16 756.5, FP8 1,513,
  2.0 TB/s, 114 SMs; NVL (94 GB) FP32 60, TF32 417.5, BF16 835.5, FP8 1,670.5, 3.9 TB/s, 132 SMs.
* H200: NVIDIA H200 Tensor Core GPU datasheet: SXM as H100 SXM5's compute, 4.8 TB/s, 141 GB; NVL
  as H100 NVL's compute, 4.8 TB/s.  GH200: NVIDIA GH200 Grace Hopper Superchip datasheet: H100 SXM5
  compute, 96 GB HBM3 at 4.0 TB/s or 144 GB HBM3e at 4.9 TB/s.
* B200: NVIDIA HGX B200 datasheet, per GPU.  L40S: NVIDIA L40S datasheet: FP32 91.6, TF32 183,
  BF16 362.05, FP8 733, 864 GB/s, 48 GB, 142 SMs.
* V100: NVIDIA Tesla V100 datasheet: SXM2 FP32 15.7, tensor 125; PCIe 14, 112; 900 GB/s; V100S
  PCIe 16.4, 130, 1,134 GB/s.  P100: NVIDIA Tesla P100 datasheet (SXM2 10.6 / 21.2, 732 GB/s; PCIe
  16 GB 9.3 / 18.7, 732 GB/s).  Quadro GP100 datasheet (10.3 / 20.7, 717 GB/s).
* AMD Instinct MI300X, MI250X and MI250 datasheets (dense matrix peaks); the two-die MI250/MI250X
  are one device per die (GCD) to the profiler, so their rows are one die's half of the card.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lab_utils.core.config import ConfigError


@dataclass(frozen=True)
class DatasheetPeak:
    """Vendor peaks, dense (no 2:4 sparsity).  TFLOP/s and GB/s; None = no such unit.

    ``bf16_tflops`` is also the fp16 peak unless ``fp16_tflops`` differs (V100 and P100 have fp16
    units and no bf16 one).  ``tf32_tflops`` is None on parts without TF32; an fp32 GEMM there runs
    at ``fp32_matmul_tflops`` (CDNA2's fp32 matrix cores, twice its vector rate) or, when that is
    None, at the CUDA-core ``fp32_tflops``."""

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
    family: str = ""
    form: str = ""  # "SXM", "PCIe", "NVL", "OAM", "board" ...
    sms: int | None = None  # SMs (NVIDIA) or compute units (AMD, per device)
    boost_mhz: float | None = None

    def matmul_tflops(self, dtype: str, *, tf32: bool = True) -> float | None:
        """The matmul peak for inputs of ``dtype`` ("fp32", "fp16", "bf16"): for fp32 the TF32
        tensor-core peak where the part has one and ``tf32`` (the GEMM ran in TF32), else the fp32
        matrix or CUDA-core rate; a half type without its own unit gets the fp32 rate it runs at."""
        return self.matmul_peak(dtype, tf32=tf32)[0]

    def matmul_peak(self, dtype: str, *, tf32: bool = True) -> tuple[float | None, str]:
        """(:meth:`matmul_tflops`, which peak that is, in words)."""
        fp32 = (self.fp32_matmul_tflops, "FP32 matrix cores") if self.fp32_matmul_tflops else (
            self.fp32_tflops, "FP32 CUDA cores")  # fmt: skip
        if dtype == "fp32":
            if self.tf32_tflops and tf32:
                return self.tf32_tflops, "TF32 tensor cores"
            if self.tf32_tflops:
                return fp32[0], fp32[1] + " (no TF32 in the kernel name)"
            return fp32
        if dtype == "fp16":
            if self.fp16_tflops or self.bf16_tflops:
                return self.fp16_tflops or self.bf16_tflops, "FP16 tensor cores"
            return fp32[0], fp32[1] + " (no FP16 unit)"
        if dtype == "bf16":
            if self.bf16_tflops:
                return self.bf16_tflops, "BF16 tensor cores"
            return fp32[0], fp32[1] + " (no BF16 unit)"
        raise ValueError(f"dtype={dtype!r}: allowed 'fp32', 'fp16', 'bf16'")


_A100 = "NVIDIA A100 datasheet (dense)"
_H100 = "NVIDIA H100 datasheet (dense = half the sparse figure)"
_H200 = "NVIDIA H200 datasheet (dense = half the sparse figure)"
_GH200 = "NVIDIA GH200 Grace Hopper datasheet (dense = half the sparse figure)"
_L40S = "NVIDIA L40S datasheet (dense = half the sparse figure)"
# fmt: off
#: NVIDIA's tensor-core parts: key, name, family, form, GB, SMs, boost MHz, bf16, fp8, tf32, fp32 TFLOP/s,
#: GB/s, source.  A family's first part is the one assumed when the evidence leaves several whose
#: peaks differ.
_NVIDIA = (
    ("A100-SXM4-80GB", "A100 SXM4 80GB", "A100", "SXM", 80, 108, 1410, 312.0, None, 156.0, 19.5, 2039.0, _A100),
    ("A100-SXM4-40GB", "A100 SXM4 40GB", "A100", "SXM", 40, 108, 1410, 312.0, None, 156.0, 19.5, 1555.0, _A100),
    ("A100-PCIE-80GB", "A100 PCIe 80GB", "A100", "PCIe", 80, 108, 1410, 312.0, None, 156.0, 19.5, 1935.0, _A100),
    ("A100-PCIE-40GB", "A100 PCIe 40GB", "A100", "PCIe", 40, 108, 1410, 312.0, None, 156.0, 19.5, 1555.0, _A100),
    ("H100-SXM5", "H100 SXM5", "H100", "SXM", 80, 132, 1980, 989.4, 1978.9, 494.7, 66.9, 3350.0, _H100),
    ("H100-PCIE", "H100 PCIe", "H100", "PCIe", 80, 114, 1755, 756.5, 1513.0, 378.0, 51.0, 2000.0, _H100),
    ("H100-NVL", "H100 NVL", "H100", "NVL", 94, 132, 1785, 835.5, 1670.5, 417.5, 60.0, 3900.0, _H100),
    ("H200-SXM", "H200 SXM", "H200", "SXM", 141, 132, 1980, 989.4, 1978.9, 494.7, 66.9, 4800.0, _H200),
    ("H200-NVL", "H200 NVL", "H200", "NVL", 141, 132, 1785, 835.5, 1670.5, 417.5, 60.0, 4800.0, _H200),
    ("GH200-96GB", "GH200 96GB", "GH200", "board", 96, 132, 1980, 989.4, 1978.9, 494.7, 66.9, 4000.0, _GH200),
    ("GH200-144GB", "GH200 144GB", "GH200", "board", 144, 132, 1980, 989.4, 1978.9, 494.7, 66.9, 4900.0, _GH200),
    ("L40S", "L40S", "L40S", "PCIe", 48, 142, 2520, 362.05, 733.0, 183.0, 91.6, 864.0, _L40S),
)
#: Volta and Pascal, fp16 units and no bf16 or TF32: key, name, family, form, GB, SMs, MHz, fp16, fp32, GB/s, source
_FP16_ONLY = (
    ("V100-SXM2", "V100 SXM2", "V100", "SXM", 32, 80, 1530, 125.0, 15.7, 900.0, "NVIDIA V100 datasheet (SXM2)"),
    ("V100-PCIE", "V100 PCIe", "V100", "PCIe", 32, 80, 1380, 112.0, 14.0, 900.0, "NVIDIA V100 datasheet (PCIe)"),
    ("V100S-PCIE", "V100S PCIe", "V100S", "PCIe", 32, 80, 1601, 130.0, 16.4, 1134.0, "NVIDIA V100S datasheet"),
    ("GP100", "Quadro GP100", "GP100", "PCIe", 16, 56, 1442, 20.7, 10.3, 717.0, "NVIDIA Quadro GP100 datasheet"),
    ("P100-SXM2", "P100 SXM2", "P100", "SXM", 16, 56, 1480, 21.2, 10.6, 732.0, "NVIDIA Tesla P100 datasheet (SXM2)"),
    ("P100-PCIE", "P100 PCIe 16GB", "P100", "PCIe", 16, 56, 1303, 18.7, 9.3, 732.0, "NVIDIA Tesla P100 datasheet"),
)
#: every part, keyed by a short name (see the module note for the sources)
DATASHEET: dict[str, DatasheetPeak] = {
    r[0]: DatasheetPeak(r[1], r[7], r[8], None, r[9], r[11], r[4], r[12], r[10], family=r[2], form=r[3], sms=r[5],
                        boost_mhz=r[6])
    for r in _NVIDIA
}
DATASHEET["B200"] = DatasheetPeak("B200 (HGX)", 2250.0, 4500.0, 9000.0, 1100.0, 8000.0, 180,
                                  "NVIDIA HGX B200 datasheet (dense = half the sparse figure)", 75.0, family="B200",
                                  form="SXM")
DATASHEET |= {
    r[0]: DatasheetPeak(r[1], None, None, None, None, r[9], r[4], r[10], r[8], fp16_tflops=r[7], family=r[2],
                        form=r[3], sms=r[5], boost_mhz=r[6])
    for r in _FP16_ONLY
}
# AMD Instinct, dense matrix-core peaks; one GCD of the two-die parts (see the module note).
DATASHEET |= {
    "MI300X": DatasheetPeak("MI300X", 1307.4, 2614.9, None, 653.7, 5300.0, 192, "AMD Instinct MI300X datasheet (dense)",
                            163.4, family="MI300X", form="OAM", sms=304, boost_mhz=2100),
    "MI250X": DatasheetPeak("MI250X (one GCD)", 191.5, None, None, None, 1638.4, 64,
                            "AMD Instinct MI250X datasheet, halved per GCD", 23.95, fp32_matmul_tflops=47.85,
                            family="MI250X", form="OAM", sms=110, boost_mhz=1700),
    "MI250": DatasheetPeak("MI250 (one GCD) / MI210", 181.0, None, None, None, 1638.4, 64,
                           "AMD Instinct MI250 datasheet, halved per GCD (= MI210's)", 22.6, fp32_matmul_tflops=45.3,
                           family="MI250", form="OAM", sms=104, boost_mhz=1700),
}
# fmt: on
#: family -> the pattern its device names match, most specific first (GH200 holds H200, GP100 holds P100)
FAMILIES = (
    ("GH200", r"GH200"),
    ("H200", r"H200"),
    ("H100", r"H100"),
    ("B200", r"B200"),
    ("A100", r"A100"),
    ("L40S", r"L40S"),
    ("V100S", r"V100S"),
    ("V100", r"V100"),
    ("GP100", r"GP100"),
    ("P100", r"P100"),
    ("MI300X", r"MI300X"),
    ("MI250X", r"MI250X"),
    ("MI250", r"MI250|MI210"),
)  # fmt: skip
#: ROCm often names a CDNA part only "AMD Radeon Graphics": its compute units say which
AMD_BY_UNITS = {110: "MI250X", 104: "MI250", 304: "MI300X"}
_FORMS = (("PCIe", r"PCI-?E"), ("NVL", r"\bNVL\b"), ("SXM", r"SXM|HBM3\b"))
PART_HELP = "; ".join(p.name for p in DATASHEET.values())


@dataclass(frozen=True)
class Identified:
    """A device's datasheet row and how it was told apart (``how``: the evidence, in words)."""

    peak: DatasheetPeak
    how: str
    assumed: bool = False  # the evidence left parts with different peaks: the first was taken


def _sizes(name: str, properties: dict) -> list[tuple[float, str]]:
    """Memory sizes the evidence gives, in GiB: the name's (``80GB``), then ``totalGlobalMem``'s."""
    out = [(float(m.group(1)), f"{m.group(1)} GB in its name") for m in re.finditer(r"(\d+)\s*GB?\b", name.upper())]
    mem = properties.get("totalGlobalMem")
    if isinstance(mem, (int, float)) and mem > 0:
        out.append((mem / 2**30, f"{mem / 1e9:.1f} GB of memory"))
    return out


def _narrow(cands: list[DatasheetPeak], keep, why: str, how: list[str]) -> list[DatasheetPeak]:
    """The candidates ``keep`` accepts, if any (evidence that fits no part is ignored)."""
    left = [p for p in cands if keep(p)]
    if left and len(left) < len(cands):
        how.append(why)
        return left
    return cands


def _same_peaks(a: DatasheetPeak, b: DatasheetPeak) -> bool:
    keys = ("bf16_tflops", "fp8_tflops", "fp4_tflops", "tf32_tflops", "hbm_gbs", "fp32_tflops", "fp16_tflops")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def identify(name: str | None, properties: dict | None = None) -> Identified | None:
    """The part a device is, from its name and (a trace's) ``deviceProperties`` entry (module note);
    None for CPUs and GPUs without a row."""
    name = name or ""
    props = properties or {}
    up = name.upper()
    family = next((f for f, pat in FAMILIES if re.search(pat, up)), None)
    how = [f"named {name!r}"] if name else []
    units = props.get("numSms")
    if family is None and ("AMD" in up or "RADEON" in up) and units in AMD_BY_UNITS:
        family = AMD_BY_UNITS[units]
        how.append(f"{units} compute units")
    if family is None:
        return None
    cands = [p for p in DATASHEET.values() if p.family == family]
    form = next((f for f, pat in _FORMS if re.search(pat, up)), None)
    if form:
        cands = _narrow(cands, lambda p: p.form == form, f"{form} in its name", how)
    for gib, said in _sizes(name, props):  # the first size that fits a part (GH200's "480GB" is its LPDDR)
        near = min(cands, key=lambda p: abs(p.memory_gib - gib))
        if len(cands) > 1 and abs(near.memory_gib - gib) / near.memory_gib <= 0.15:
            cands = _narrow(cands, lambda p, g=near.memory_gib: p.memory_gib == g,
                            f"{said}: the {near.memory_gib:g} GB part", how)  # fmt: skip
            break
    if isinstance(units, int) and len(cands) > 1:
        cands = _narrow(cands, lambda p: p.sms == units, f"{units} SMs", how)
    clock = props.get("clockRate")
    if isinstance(clock, (int, float)) and clock > 0 and len(cands) > 1:
        mhz = clock / 1e3
        cands = _narrow(cands, lambda p: p.boost_mhz and abs(p.boost_mhz - mhz) / p.boost_mhz < 0.05,
                        f"{mhz:.0f} MHz clock", how)  # fmt: skip
    first = cands[0]
    if len(cands) > 1:
        others = ", ".join(p.name for p in cands[1:])
        if all(_same_peaks(first, p) for p in cands[1:]):
            how.append(f"{first.name} or {others}: the same peaks")
        else:
            how.append(f"{first.name} assumed (the trace does not tell it from {others})")
            return Identified(first, "; ".join(how), assumed=True)
    return Identified(first, "; ".join(how))


def datasheet_for(info, properties: dict | None = None) -> DatasheetPeak | None:
    """The datasheet row of a device: a name, or a :class:`lab_utils.core.device.DeviceInfo` (its
    memory and SM count then count as its properties); ``properties``: a trace's
    ``deviceProperties`` entry.  None for CPUs and unknown GPUs."""
    if info is not None and not isinstance(info, str):  # a DeviceInfo
        props = {"totalGlobalMem": info.memory_bytes, "numSms": info.units} if info.kind == "cuda" else {}
        info, properties = info.name, {**props, **(properties or {})}
    found = identify(info, properties)
    return found.peak if found else None


def check_part(param: str, name: str | None) -> None:
    """``name`` (``--gpu``, a lab parameter) must be one part: refused with the parts perflab knows,
    or those a family name could be, before any work."""
    if name is None:
        return
    found = identify(name)
    if found is None:
        raise ConfigError(param, name, f"a GPU with a datasheet row: {PART_HELP} (or the name the driver reports)")
    if found.assumed:
        could = [p.name for p in DATASHEET.values() if p.family == found.peak.family]
        raise ConfigError(param, name, f"one part, not a family: {name!r} could be {', '.join(could)}")


__all__ = ["AMD_BY_UNITS", "DATASHEET", "DatasheetPeak", "FAMILIES", "Identified", "PART_HELP", "check_part",
           "datasheet_for", "identify"]  # fmt: skip
