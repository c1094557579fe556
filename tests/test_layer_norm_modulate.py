"""layer_norm_modulate: what is specific to it ((B, 1, D) modulation, bad inputs, row limit);
the shared cases are in test_fused_ops.py."""

import pytest
import torch

from lab_kernels import get_variant
from lab_kernels import layer_norm_modulate as K
from lab_utils.core.checks import assert_close

OP = "layer_norm_modulate"


def test_modulation_as_b1d_and_non_contiguous_x(gen):
    x = torch.randn(2, 96, 13, generator=gen).transpose(1, 2)  # (2, 13, 96), not contiguous
    sh, sc = torch.randn(2, 1, 96, generator=gen), torch.randn(2, 1, 96, generator=gen)
    out = K.layer_norm_modulate(x, sh, sc)
    assert_close(out, K.reference_layer_norm_modulate(x.double(), sh.double(), sc.double()), dtype=torch.float32)


def test_bad_inputs_name_the_parameter():
    x, v = torch.randn(2, 5, 64), torch.randn(2, 64)
    with pytest.raises(ValueError, match="'shift'.*shape"):
        K.layer_norm_modulate(x, torch.randn(2, 63), v)
    with pytest.raises(ValueError, match="'scale'.*shape"):
        K.layer_norm_modulate(x, v, torch.randn(3, 64))
    with pytest.raises(ValueError, match="'x'.*\\(B, L, D\\)"):
        K.layer_norm_modulate(torch.randn(5, 64), v, v)
    with pytest.raises(TypeError, match="'x'.*int32"):
        K.layer_norm_modulate(x.int(), v, v)


def test_registry_capabilities():
    assert "limit" in get_variant(OP, "triton").why_not("cpu", torch.bfloat16, shape=(1, 4, 100_000))
