import re

import pytest
import torch

from lab_utils.device import DATASHEET, datasheet_for, device_info, pick_device


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
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_datasheet_lookup(name, key):
    assert datasheet_for(name) is DATASHEET[key]


def test_datasheet_is_dense():
    # Dense figures: Hopper fp8 is exactly twice bf16; the sparse sheet figures (2x) are not used.
    for k in ("H100", "H200"):
        p = DATASHEET[k]
        assert p.fp8_tflops == pytest.approx(2 * p.bf16_tflops, rel=1e-3)
        assert p.bf16_tflops < 1000
    assert DATASHEET["B200"].fp4_tflops == pytest.approx(2 * DATASHEET["B200"].fp8_tflops)
    assert datasheet_for("AMD EPYC 7B13") is None
