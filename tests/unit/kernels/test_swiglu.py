"""swiglu: what is specific to it (bad inputs); the shared cases are in tests/unit/fused/test_ops.py."""

import pytest
import torch

from lab_kernels import swiglu as K

OP = "swiglu"


def test_bad_inputs_name_the_parameter():
    with pytest.raises(ValueError, match="'up'.*shape"):
        K.swiglu(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(TypeError, match="'gate'.*int64"):
        K.swiglu(torch.ones(4, dtype=torch.int64), torch.ones(4))
