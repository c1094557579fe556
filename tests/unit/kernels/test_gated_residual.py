"""gated_residual: what is specific to it ((B, 1, D) gate, bad inputs); the shared cases are in
test_fused_ops.py."""

import pytest
import torch

from lab_kernels import gated_residual as K
from lab_utils.core.checks import assert_close

OP = "gated_residual"


def test_non_contiguous_and_b1d_gate(gen):
    x = torch.randn(2, 96, 13, generator=gen).transpose(1, 2)
    y = torch.randn(2, 13, 96, generator=gen)
    gate = torch.randn(2, 1, 96, generator=gen)
    assert_close(
        K.gated_residual(x, gate, y),
        K.reference_gated_residual(x.double(), gate.double(), y.double()),
        dtype=torch.float32,
    )


def test_bad_inputs_name_the_parameter():
    x = torch.randn(2, 5, 64)
    with pytest.raises(ValueError, match="'gate'.*shape"):
        K.gated_residual(x, torch.randn(2, 65), x)
    with pytest.raises(ValueError, match="'y'.*shape"):
        K.gated_residual(x, torch.randn(2, 64), torch.randn(2, 6, 64))
    with pytest.raises(TypeError, match="'gate'.*int64"):
        K.gated_residual(x, torch.ones(2, 64, dtype=torch.int64), x)
