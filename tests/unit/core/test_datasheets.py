"""lab_utils.core.datasheets: which exact part a GPU is (name, memory size, SM count, clock), the peak
each kind of matmul is held to, and the refusal of a name that is no part."""

from __future__ import annotations

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.core.datasheets import DATASHEET, DatasheetPeak, check_part, datasheet_for, identify
from lab_utils.core.device import DeviceInfo


@pytest.mark.parametrize(
    "name,props,part",
    [
        ("NVIDIA H100 PCIe", {}, "H100 PCIe"),
        ("NVIDIA H100 80GB HBM3", {}, "H100 SXM5"),
        ("NVIDIA H100 NVL", {}, "H100 NVL"),
        ("NVIDIA H100", {"numSms": 114}, "H100 PCIe"),  # the SM count tells PCIe (114) from SXM5/NVL (132)
        ("NVIDIA H100", {"numSms": 132, "totalGlobalMem": 100485038080}, "H100 NVL"),  # 94 GB
        ("NVIDIA H100", {"clockRate": 1755000}, "H100 PCIe"),
        ("NVIDIA A100-SXM4-40GB", {}, "A100 SXM4 40GB"),
        ("NVIDIA A100-SXM4-80GB", {"totalGlobalMem": 84990623744}, "A100 SXM4 80GB"),
        ("NVIDIA A100-PCIE-40GB", {}, "A100 PCIe 40GB"),
        ("NVIDIA A100 80GB PCIe", {}, "A100 PCIe 80GB"),
        ("NVIDIA A100-PG509-200", {"totalGlobalMem": 42505273344, "numSms": 108}, "A100 SXM4 40GB"),  # recsys_a100
        ("NVIDIA A100-PG509-200", {"totalGlobalMem": 42297524224}, "A100 SXM4 40GB"),  # ddp_a100_nccl's
        ("NVIDIA H200", {}, "H200 SXM"),
        ("NVIDIA H200 NVL", {}, "H200 NVL"),
        ("NVIDIA GH200 480GB", {"totalGlobalMem": 102625181696}, "GH200 96GB"),  # not H200, not its 480 GB LPDDR
        ("NVIDIA B200", {}, "B200 (HGX)"),
        ("NVIDIA L40S", {}, "L40S"),
        ("Tesla V100-SXM2-16GB", {}, "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", {}, "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", {}, "V100S PCIe"),
        ("Quadro GP100", {}, "Quadro GP100"),
        ("AMD Radeon Graphics", {"numSms": 104}, "MI250 (one GCD) / MI210"),
        ("AMD Instinct MI300X", {}, "MI300X"),
    ],
)
def test_the_exact_part(name, props, part):
    found = identify(name, props)
    assert found is not None and found.peak.name == part, found
    assert datasheet_for(name, props) is found.peak


def test_the_memory_size_decides_between_a100_40gb_and_80gb_and_says_so():
    """A100 bandwidth by part, from NVIDIA's datasheet: 1555 GB/s (40 GB), 1935 (80 GB PCIe), 2039 (80 GB SXM4)."""
    assert [DATASHEET[k].hbm_gbs for k in ("A100-SXM4-40GB", "A100-PCIE-80GB", "A100-SXM4-80GB")] == [
        1555.0,
        1935.0,
        2039.0,
    ]
    forty = identify("NVIDIA A100-PG509-200", {"totalGlobalMem": 42505273344})
    assert "42.5 GB of memory: the 40 GB part" in forty.how and not forty.assumed
    assert "the same peaks" in forty.how  # 40 GB SXM4 and PCIe are alike
    eighty = identify("NVIDIA A100-PG509-210", {"totalGlobalMem": 85e9})
    assert eighty.peak.hbm_gbs == 2039.0 and eighty.assumed  # SXM4 or PCIe 80 GB differ: the SXM4 one, said


def test_an_unknown_part_and_the_fallbacks():
    assert identify("NVIDIA Tesla T4", {"numSms": 40}) is None
    assert identify("NVIDIA Tesla T4", {"numSms": 104}) is None  # compute units name AMD parts only
    assert identify("AMD EPYC 7B13") is None and identify(None) is None
    h = identify("NVIDIA H100", {})
    assert h.peak.name == "H100 SXM5" and h.assumed and "assumed" in h.how


def test_the_peak_each_matmul_is_held_to():
    h, pcie, v, m = DATASHEET["H100-SXM5"], DATASHEET["H100-PCIE"], DATASHEET["V100-SXM2"], DATASHEET["MI250"]
    assert h.matmul_peak("fp32") == (494.7, "TF32 tensor cores")
    assert h.matmul_peak("fp32", tf32=False) == (66.9, "FP32 CUDA cores (no TF32 in the kernel name)")
    assert pcie.matmul_peak("bf16") == (756.5, "BF16 tensor cores") and pcie.hbm_gbs == 2000.0
    assert v.matmul_peak("fp32") == (15.7, "FP32 CUDA cores") and v.matmul_peak("fp16")[0] == 125.0
    assert v.matmul_peak("bf16") == (15.7, "FP32 CUDA cores (no BF16 unit)")
    assert m.matmul_peak("fp32") == (45.3, "FP32 matrix cores")
    for k in ("H100-SXM5", "H100-PCIE", "H100-NVL", "H200-SXM", "H200-NVL"):  # dense: fp8 = 2 x bf16
        assert DATASHEET[k].fp8_tflops == pytest.approx(2 * DATASHEET[k].bf16_tflops, rel=1e-3)


@pytest.mark.parametrize("name", ["H100 PCIe", "A100 SXM4 40GB", "NVIDIA A100-SXM4-80GB", "MI250X (one GCD)", None])
def test_a_part_name_is_accepted(name):
    check_part("gpu", name)


@pytest.mark.parametrize("name,words", [("A100", "could be A100 SXM4 80GB"), ("H100", "H100 PCIe, H100 NVL"),
                                        ("RTX 9090", "H100 SXM5; H100 PCIe")])  # fmt: skip
def test_a_name_that_is_no_one_part_is_refused_with_the_parts(name, words):
    with pytest.raises(ConfigError, match="gpu") as e:
        check_part("gpu", name)
    assert words in str(e.value)


# The vendors' sheets as printed (TFLOP/s, GB/s, GB, SMs or CUs): NVIDIA prints tensor-core peaks
# with 2:4 sparsity ("*"), so the dense peak is half; AMD prints one figure per two-die card, so one
# GCD's is half.  key: (bf16, fp8, tf32, fp32, hbm GB/s, memory GB, SMs, halve the tensor figures)
_SHEETS = {
    "A100-SXM4-80GB": (624, None, 312, 19.5, 2039, 80, 108, True),
    "A100-SXM4-40GB": (624, None, 312, 19.5, 1555, 40, 108, True),
    "A100-PCIE-80GB": (624, None, 312, 19.5, 1935, 80, 108, True),
    "A100-PCIE-40GB": (624, None, 312, 19.5, 1555, 40, 108, True),
    "H100-SXM5": (1979, 3958, 989, 67, 3350, 80, 132, True),
    "H100-PCIE": (1513, 3026, 756, 51, 2000, 80, 114, True),
    "H100-NVL": (1671, 3341, 835, 60, 3900, 94, 132, True),
    "H200-SXM": (1979, 3958, 989, 67, 4800, 141, 132, True),
    "H200-NVL": (1671, 3341, 835, 60, 4800, 141, 132, True),
    "GH200-96GB": (1979, 3958, 989, 67, 4000, 96, 132, True),
    "GH200-144GB": (1979, 3958, 989, 67, 4900, 144, 132, True),
    "L40S": (362.05, 733, 183, 91.6, 864, 48, 142, False),  # the L40S sheet prints both; its dense column
    "B200": (4500, 9000, 2200, 75, 8000, 180, None, True),  # HGX B200, per GPU
}
# AMD Instinct, per card (two GCDs for MI250X/MI250): fp16/bf16 matrix, fp32 vector, fp32 matrix, GB/s, GB, CUs
_AMD_CARDS = {
    "MI250X": (383.0, 47.9, 95.7, 3276.8, 128, 220, 2),
    "MI250": (362.1, 45.3, 90.5, 3276.8, 128, 208, 2),
    "MI300X": (1307.4, 163.4, None, 5300, 192, 304, 1),
}
# Volta and Pascal: fp16 (tensor or packed), fp32, GB/s, SMs
_FP16_SHEETS = {
    "V100-SXM2": (125, 15.7, 900, 80),
    "V100-PCIE": (112, 14, 900, 80),
    "V100S-PCIE": (130, 16.4, 1134, 80),
    "P100-SXM2": (21.2, 10.6, 732, 56),
    "P100-PCIE": (18.7, 9.3, 732, 56),
    "GP100": (20.7, 10.3, 717, 56),
}


@pytest.mark.parametrize("key", sorted(_SHEETS))
def test_nvidia_tensor_core_peaks_are_the_sheets_dense_figures(key):
    bf16, fp8, tf32, fp32, hbm, gb, sms, sparse = _SHEETS[key]
    p, d = DATASHEET[key], (2 if sparse else 1)
    # printed figures are rounded (1,979 for 1978.9): a tenth of a percent
    assert p.bf16_tflops == pytest.approx(bf16 / d, rel=2e-3)
    assert p.matmul_tflops("fp16") == p.matmul_tflops("bf16") == p.bf16_tflops  # one half-precision unit
    assert (p.fp8_tflops is None) == (fp8 is None) and (fp8 is None or p.fp8_tflops == pytest.approx(fp8 / d, rel=2e-3))
    assert p.tf32_tflops == pytest.approx(tf32 / d, rel=1e-2)  # 2.2 PF on the B200 sheet
    assert p.fp32_tflops == pytest.approx(fp32, rel=1e-2)  # 66.9 printed as 67
    # B200: the HGX sheet's total (62-64 TB/s over 8 GPUs) has been printed as 7.7 and as 8 TB/s per GPU
    assert p.hbm_gbs == pytest.approx(hbm, rel=0.04 if key == "B200" else 1e-9)
    assert p.memory_gib == gb and p.sms == sms
    assert (p.fp4_tflops is not None) == (key == "B200")


def test_b200_fp4_is_twice_its_fp8():
    assert DATASHEET["B200"].fp4_tflops == pytest.approx(18000 / 2) == 2 * DATASHEET["B200"].fp8_tflops


@pytest.mark.parametrize("key", sorted(_AMD_CARDS))
def test_amd_peaks_are_the_cards_figures_per_device(key):
    half, vec, mat, hbm, gb, cus, dies = _AMD_CARDS[key]
    p = DATASHEET[key]
    assert p.bf16_tflops == pytest.approx(half / dies, rel=3e-3)
    assert p.fp32_tflops == pytest.approx(vec / dies, rel=3e-3)
    assert p.hbm_gbs == pytest.approx(hbm / dies, rel=1e-3) and p.memory_gib == gb / dies
    assert p.sms == cus // dies
    if mat is None:  # MI300X: fp32 GEMMs at its TF32 rate (half the fp16 one), no separate fp32 matrix peak
        assert p.fp32_matmul_tflops is None and p.tf32_tflops == pytest.approx(half / 2, rel=1e-3)
        assert p.fp8_tflops == pytest.approx(2 * half, rel=1e-3)
    else:  # CDNA2: no TF32, fp32 matrix cores at twice the vector rate
        assert p.tf32_tflops is None and p.fp8_tflops is None
        assert p.matmul_peak("fp32") == (pytest.approx(mat / dies, rel=3e-3), "FP32 matrix cores")
    assert identify("AMD Radeon Graphics", {"numSms": cus // dies}).peak is p  # ROCm's bare name, by CUs


@pytest.mark.parametrize("key", sorted(_FP16_SHEETS))
def test_volta_and_pascal_peaks(key):
    fp16, fp32, hbm, sms = _FP16_SHEETS[key]
    p = DATASHEET[key]
    assert p.matmul_peak("fp16") == (fp16, "FP16 tensor cores")
    assert p.matmul_peak("fp32") == (fp32, "FP32 CUDA cores")  # no TF32: the CUDA cores, tf32 or not
    assert p.matmul_peak("fp32", tf32=False) == (fp32, "FP32 CUDA cores")
    assert p.matmul_peak("bf16") == (fp32, "FP32 CUDA cores (no BF16 unit)")
    assert p.hbm_gbs == hbm and p.sms == sms and p.bf16_tflops is None


def test_a_part_without_half_precision_units_runs_half_types_at_its_fp32_rate():
    old = DatasheetPeak("Maxwell-like", None, None, None, None, 336.0, 12, "test", fp32_tflops=7.0)
    assert old.matmul_peak("fp16") == (7.0, "FP32 CUDA cores (no FP16 unit)")
    assert old.matmul_peak("bf16") == (7.0, "FP32 CUDA cores (no BF16 unit)")
    assert old.matmul_tflops("fp32", tf32=True) == 7.0
    cdna = DatasheetPeak("matrix fp32 only", None, None, None, None, 1.0, 1, "test", 10.0, fp32_matmul_tflops=20.0)
    assert cdna.matmul_peak("fp16") == (20.0, "FP32 matrix cores (no FP16 unit)")
    for bad in ("fp8", "FP32", "float32", ""):
        with pytest.raises(ValueError, match="allowed 'fp32', 'fp16', 'bf16'"):
            DATASHEET["H100-SXM5"].matmul_peak(bad)


@pytest.mark.parametrize(
    "name,props,part",
    [  # the names torch.cuda.get_device_name / nvidia-smi / Kineto's deviceProperties give
        ("NVIDIA GH200 144G HBM3e", {}, "GH200 144GB"),
        ("NVIDIA GH200 480GB", {"totalGlobalMem": 151e9}, "GH200 144GB"),  # 140.6 GiB: the 144 GB part
        ("Tesla P100-SXM2-16GB", {}, "P100 SXM2"),
        ("Tesla P100-PCIE-16GB", {}, "P100 PCIe 16GB"),
        ("Tesla V100-SXM2-32GB", {"numSms": 80}, "V100 SXM2"),
        ("Tesla V100-PCIE-16GB", {}, "V100 PCIe"),
        ("NVIDIA H100 80GB HBM3", {"numSms": 132}, "H100 SXM5"),
        ("NVIDIA A100-SXM4-80GB", {"totalGlobalMem": 42.5e9}, "A100 SXM4 80GB"),  # the name's size comes first
        ("NVIDIA H200 NVL", {"totalGlobalMem": 150e9}, "H200 NVL"),
        ("NVIDIA L40S", {"numSms": 142, "clockRate": 2520000}, "L40S"),
        ("AMD Radeon Graphics", {"numSms": 110}, "MI250X (one GCD)"),
        ("AMD Instinct MI210", {}, "MI250 (one GCD) / MI210"),
        ("AMD Instinct MI250X", {"numSms": 104}, "MI250X (one GCD)"),  # the name wins over the CUs
    ],
)
def test_the_exact_part_from_more_driver_names(name, props, part):
    found = identify(name, props)
    assert found is not None and found.peak.name == part and not found.assumed, found


@pytest.mark.parametrize("name", ["NVIDIA H800", "NVIDIA GeForce RTX 4090", "AMD Radeon Graphics", "cpu", ""])
def test_no_row_is_none(name):
    assert identify(name, {"numSms": 128}) is None and datasheet_for(name) is None


def test_the_memory_window_is_15_percent_of_the_nominal_size():
    """A100 40 vs 80 GB from ``totalGlobalMem`` (GiB): within 15% of 40 is the 40 GB part; beyond,
    the size is ignored and the family's first part (SXM4 80GB) is assumed."""
    gib = 2**30
    assert identify("NVIDIA A100", {"totalGlobalMem": int(40 * 1.149 * gib)}).peak.memory_gib == 40
    assert identify("NVIDIA A100", {"totalGlobalMem": int(40 * 0.851 * gib)}).peak.memory_gib == 40
    for edge in (34, 46):  # exactly 15% off 40 GiB: inside the window
        assert identify("NVIDIA A100", {"totalGlobalMem": edge * gib}).peak.memory_gib == 40
    past = identify("NVIDIA A100", {"totalGlobalMem": int(40 * 1.151 * gib)})
    assert past.peak.name == "A100 SXM4 80GB" and past.assumed and "GB of memory" not in past.how
    eighty = identify("NVIDIA A100", {"totalGlobalMem": int(80 * 0.86 * gib)})
    assert eighty.peak.memory_gib == 80 and "73.9 GB of memory: the 80 GB part" in eighty.how
    # a unit change: totalGlobalMem is bytes, a size in GiB passed by mistake fits nothing
    assert identify("NVIDIA A100", {"totalGlobalMem": 40}).assumed
    assert identify("NVIDIA A100", {"totalGlobalMem": 0}).assumed  # no memory recorded


def test_the_evidence_said_is_only_the_evidence_that_told_parts_apart():
    # 108 SMs: every A100 has them, so they decide nothing and are not given as the reason
    a = identify("NVIDIA A100 80GB", {"numSms": 108, "clockRate": 1410000})
    assert a.assumed and "108 SMs" not in a.how and "MHz" not in a.how
    assert a.how == "named 'NVIDIA A100 80GB'; 80 GB in its name: the 80 GB part; A100 SXM4 80GB assumed " \
                    "(the trace does not tell it from A100 PCIe 80GB)"  # fmt: skip
    one = identify("NVIDIA L40S PCIe", {"numSms": 142})
    assert one.how == "named 'NVIDIA L40S PCIe'" and not one.assumed  # one part: nothing to tell apart
    h = identify("NVIDIA H100", {"numSms": 114})
    assert h.how == "named 'NVIDIA H100'; 114 SMs" and h.peak.name == "H100 PCIe"


def test_the_clock_is_kilohertz_and_matches_within_5_percent():
    """``clockRate`` is in kHz (CUDA's cudaDeviceProp): 1,755,000 kHz is the H100 PCIe's 1755 MHz boost."""
    pcie = identify("NVIDIA H100", {"clockRate": 1755000, "numSms": 114})
    assert pcie.peak.name == "H100 PCIe" and pcie.how.endswith("114 SMs")  # SMs decided it before the clock
    sxm = identify("NVIDIA H100", {"clockRate": 1980000})
    assert sxm.peak.name == "H100 SXM5" and "1980 MHz clock" in sxm.how and not sxm.assumed
    # H200: 1883 MHz is 4.9% under the SXM's 1980 and 5.5% over the NVL's 1785: the SXM alone
    near = identify("NVIDIA H200", {"clockRate": 1980000 * 0.951})
    assert near.peak.name == "H200 SXM" and not near.assumed and "1883 MHz clock" in near.how
    low = identify("NVIDIA H100", {"clockRate": 1755000 * 0.955})  # 1676 MHz: PCIe (4.5%) and not NVL (6.1%)
    assert low.peak.name == "H100 PCIe" and "1676 MHz clock" in low.how and not low.assumed
    edge = identify("NVIDIA H100", {"clockRate": 1690000})  # PCIe 3.7% off, NVL 5.3%: PCIe alone
    assert edge.peak.name == "H100 PCIe" and not edge.assumed
    both = identify("NVIDIA H100", {"clockRate": 1770000})  # within 5% of PCIe and NVL, whose peaks differ
    assert both.peak.name == "H100 PCIe" and both.assumed and "from H100 NVL" in both.how
    edge = identify("NVIDIA H200", {"clockRate": 1881000})  # exactly 5% under 1980 MHz: outside the window
    assert edge.assumed and "MHz" not in edge.how
    off = identify("NVIDIA H100", {"clockRate": 1500000})  # no part within 5%: ignored
    assert off.assumed and "MHz" not in off.how


def test_a_device_info_counts_its_memory_and_sms_as_properties():
    def info(kind, name, units, mem):
        return DeviceInfo(kind, name, 0, units, "SMs", mem, "9.0", "2.13.0", None, None, "3.11", 1)

    assert datasheet_for(info("cuda", "NVIDIA H100", 114, 85e9)).name == "H100 PCIe"
    assert datasheet_for(info("cuda", "NVIDIA H100", 132, 100485038080)).name == "H100 NVL"
    assert datasheet_for(info("cuda", "NVIDIA H100", 132, 85e9), {"numSms": 114}).name == "H100 PCIe"  # trace wins
    assert datasheet_for(info("cpu", "AMD EPYC 7B13", 104, 2**36)) is None  # CPU cores are no compute units


@pytest.mark.parametrize(
    "name,parts",
    [
        ("V100", ["V100 SXM2", "V100 PCIe"]),
        ("H200", ["H200 SXM", "H200 NVL"]),
        ("GH200", ["GH200 96GB", "GH200 144GB"]),
    ],
)
def test_a_family_with_differing_parts_is_refused_naming_each(name, parts):
    with pytest.raises(ConfigError) as e:
        check_part("--gpu", name)
    msg = str(e.value)
    assert "--gpu" in msg and "one part, not a family" in msg and all(p in msg for p in parts)


@pytest.mark.parametrize("name", ["B200", "L40S", "NVIDIA A100-PCIE-40GB", "MI300X", "Tesla V100-SXM2-16GB"])
def test_a_name_that_is_one_part_or_parts_with_the_same_peaks_is_accepted(name):
    check_part("--gpu", name)


def test_an_unknown_gpu_is_refused_with_every_known_part():
    with pytest.raises(ConfigError) as e:
        check_part("gpu", "NVIDIA Tesla T4")
    msg = str(e.value)
    assert "gpu" in msg and "NVIDIA Tesla T4" in msg
    assert all(p.name in msg for p in DATASHEET.values())
