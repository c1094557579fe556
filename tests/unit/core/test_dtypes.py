"""lab_utils.core.dtypes: the one dtype-name table."""

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.core.dtypes import DTYPES, LAB_DTYPES, dtype_name, parse_dtype


def test_names_round_trip():
    for name, dt in DTYPES.items():
        assert parse_dtype("dtype", name) is dt
        assert dtype_name(dt) == name
        assert parse_dtype("dtype", dt) is dt
    assert set(LAB_DTYPES) <= set(DTYPES)


@pytest.mark.parametrize("value", ["fp32", "float8", 3, None, torch.int32])
def test_bad_names_name_the_parameter(value):
    with pytest.raises(ConfigError) as ei:
        parse_dtype("check_dtype", value)
    assert ei.value.param == "check_dtype"


def test_allowed_subset_is_enforced():
    assert parse_dtype("dtype", "bfloat16", LAB_DTYPES) is torch.bfloat16
    with pytest.raises(ConfigError, match="'float32', 'bfloat16', 'float16'"):
        parse_dtype("dtype", "float64", LAB_DTYPES)
