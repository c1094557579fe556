"""lab_utils.core.datasheets: which exact part a GPU is (name, memory size, SM count, clock), the peak
each kind of matmul is held to, and the refusal of a name that is no part."""

from __future__ import annotations

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.core.datasheets import DATASHEET, check_part, datasheet_for, identify


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
