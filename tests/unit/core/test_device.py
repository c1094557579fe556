import re

import pytest
import torch

from lab_utils.core import device as D
from lab_utils.core.device import DATASHEET, datasheet_for, device_info, pick_device
from lab_utils.model import build_model, image_ids, text_ids


def test_cpu_info():
    info = device_info("cpu")
    assert info.kind == "cpu" and info.units >= 1 and info.memory_bytes > 0
    assert info.torch_version == torch.__version__
    assert re.fullmatch(r"[A-Za-z0-9_.+-]+", info.key())
    assert info.torch_device == torch.device("cpu")


def test_pick_device():
    assert pick_device("cpu").type == "cpu"
    assert pick_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="'device'"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            pick_device("cuda")


@pytest.mark.parametrize(
    "name,key",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM5"),
        ("NVIDIA H200", "H200-SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA B200", "B200"),
        ("Tesla V100-SXM2-32GB", "V100-SXM2"),
        ("Tesla V100-PCIE-16GB", "V100-PCIE"),
        ("Quadro GP100", "GP100"),
        ("Tesla P100-SXM2-16GB", "P100-SXM2"),
        ("AMD Instinct MI250X", "MI250X"),
        ("AMD Instinct MI210", "MI250"),
        ("AMD Instinct MI300X", "MI300X"),
    ],
)
def test_datasheet_lookup(name, key):
    assert datasheet_for(name) is DATASHEET[key]


@pytest.mark.parametrize("units,key", [(104, "MI250"), (110, "MI250X"), (304, "MI300X"), (64, None), (None, None)])
def test_an_unnamed_amd_part_is_known_by_its_compute_units(units, key):
    """ROCm names an MI250 die only "AMD Radeon Graphics" (the real trace in ../shared does)."""
    props = {"name": "AMD Radeon Graphics", "numSms": units}
    assert datasheet_for("AMD Radeon Graphics", props) is (DATASHEET[key] if key else None)
    assert datasheet_for("NVIDIA Tesla T4", {"numSms": 104}) is None  # units identify AMD parts only


def test_matmul_peak_by_input_type():
    """fp32: TF32 where the part has it, else its fp32 matrix rate (CDNA2), else CUDA cores; a half
    type without its own unit runs at the fp32 rate (bf16 on V100)."""
    h, v, m = DATASHEET["H100-SXM5"], DATASHEET["V100-SXM2"], DATASHEET["MI250"]
    assert (h.matmul_tflops("fp32"), h.matmul_tflops("fp16"), h.matmul_tflops("bf16")) == (494.7, 989.4, 989.4)
    assert (v.matmul_tflops("fp32"), v.matmul_tflops("fp16"), v.matmul_tflops("bf16")) == (15.7, 125.0, 15.7)
    assert (m.matmul_tflops("fp32"), m.matmul_tflops("bf16"), m.fp32_tflops) == (45.3, 181.0, 22.6)
    # one die of the two-die MI250X is half the card: 383 TF bf16, 3.2768 TB/s
    assert DATASHEET["MI250X"].bf16_tflops == pytest.approx(383.0 / 2) and DATASHEET["MI250X"].hbm_gbs == 1638.4
    with pytest.raises(ValueError, match="dtype='fp8'"):
        h.matmul_tflops("fp8")


def test_datasheet_is_dense():
    # Dense figures: Hopper fp8 is exactly twice bf16; the sparse sheet figures (2x) are not used.
    for k in ("H100-SXM5", "H100-PCIE", "H100-NVL", "H200-SXM", "H200-NVL"):
        p = DATASHEET[k]
        assert p.fp8_tflops == pytest.approx(2 * p.bf16_tflops, rel=1e-3)
        assert p.bf16_tflops < 1000
    assert DATASHEET["B200"].fp4_tflops == pytest.approx(2 * DATASHEET["B200"].fp8_tflops)
    assert datasheet_for("AMD EPYC 7B13") is None


def test_annotate_is_a_profiler_range_and_nvtx_only_on_cuda(monkeypatch):
    """Named ranges reach Nsight Systems through NVTX on CUDA; on CPU they must not touch
    the CUDA runtime, and they always show in the torch profiler."""

    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with D.annotate("forward"):
            torch.ones(3).sum()
    assert calls == []
    assert any(e.name == "forward" for e in prof.events())

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with D.annotate("double_blocks.0", "cuda"):
        pass
    with D.annotate("cpu-side", "cpu"):  # a CPU tensor's range on a CUDA machine: no NVTX
        pass
    assert calls == [("push", "double_blocks.0"), ("pop",)]


def test_model_blocks_and_trainer_phases_open_named_ranges():

    m = build_model("tiny", seed=0)
    c = m.cfg
    g = torch.Generator().manual_seed(0)
    img = torch.randn(1, 4, c.in_channels, generator=g)
    txt = torch.randn(1, 3, c.context_dim, generator=g)
    args = (
        img,
        image_ids(2, 2),
        txt,
        text_ids(3),
        torch.rand(1, generator=g),
        torch.randn(1, c.pooled_dim, generator=g),
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        m(*args, guidance=torch.ones(1))
    names = {e.name for e in prof.events()}
    expected = {f"double_blocks.{i}" for i in range(c.depth_double)} | {
        f"single_blocks.{i}" for i in range(c.depth_single)
    }
    assert expected <= names, f"missing block ranges: {sorted(expected - names)}"
