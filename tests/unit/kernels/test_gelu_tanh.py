"""gelu_tanh: what is specific to it (saturation, bad inputs); the shared cases are in tests/unit/fused/test_ops.py."""

import pytest
import torch

from lab_kernels import gelu_tanh as K
from lab_utils.core.checks import assert_close

OP = "gelu_tanh"


def test_extreme_inputs_stay_finite():
    # tanh through a sigmoid: saturates cleanly at ±1 for huge |u|, no inf/inf
    x = torch.tensor([-1e4, -30.0, -5.0, 0.0, 5.0, 30.0, 1e4])
    assert_close(K.gelu_tanh(x), K.reference_gelu_tanh(x.double()), dtype=torch.float32)


def test_bad_inputs_name_the_parameter():
    with pytest.raises(TypeError, match="'x'.*int64"):
        K.gelu_tanh(torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="'x'.*float64"):
        K.gelu_tanh(torch.ones(4, dtype=torch.float64))
