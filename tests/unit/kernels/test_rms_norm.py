"""rms_norm: what is specific to it (bad inputs, the single-pass row limit); the shared cases
(float64 checks, poisoned outputs, compile, registry, GPU) are in tests/unit/fused/test_ops.py."""

import pytest
import torch

from lab_kernels import get_variant
from lab_kernels import rms_norm as K

OP = "rms_norm"


def test_bad_inputs_name_the_parameter():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="'weight'.*shape"):
        K.rms_norm(x, torch.randn(63))
    with pytest.raises(TypeError, match="'x'.*int64"):
        K.rms_norm(torch.ones(4, 64, dtype=torch.int64), torch.randn(64))
    with pytest.raises(TypeError, match="'weight'.*float64"):
        K.rms_norm(x, torch.randn(64, dtype=torch.float64))


def test_registry_capabilities():
    tri = get_variant(OP, "triton")
    assert "single-pass limit" in tri.why_not("cpu", torch.float32, shape=(2, 1 << 17))
    assert tri.why_not("cpu", torch.float32, shape=(2, 1 << 16)) is None
