import math

import pytest
import torch

from lab_utils.core.checks import TOLERANCES, assert_bitwise_equal, assert_close, poison_, rel_error, sqnr_db, tolerance


def test_message_explains_mismatch():
    e = torch.zeros(40, 30, dtype=torch.float64)
    a = e.clone().float()
    a[3, 7] = 1.0
    a[5, 2] = math.nan
    with pytest.raises(AssertionError) as err:
        assert_close(a, e, name="dq")
    msg = str(err.value)
    assert "dq: 2 of 1200 elements mismatch" in msg
    assert "(3, 7)" in msg and "NaN disagreements: 1" in msg


def test_tolerances_tied_to_dtype():
    assert tolerance(torch.bfloat16) == TOLERANCES[torch.bfloat16]
    x = torch.randn(100, dtype=torch.float64)
    assert_close(x.to(torch.bfloat16), x)  # bf16 rounding passes bf16 tolerance
    with pytest.raises(AssertionError):
        assert_close(x.to(torch.bfloat16).float(), x)  # but not float32 tolerance


def test_poison_and_specials():
    for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = poison_(torch.empty(5, dtype=dt))
        assert torch.isnan(t.float()).all()
    assert (poison_(torch.empty(3, dtype=torch.int32)) == 2**31 - 1).all()
    inf = torch.tensor([math.inf, -math.inf])
    assert_close(inf, inf.double())
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([math.inf]), torch.tensor([-math.inf], dtype=torch.float64))


def test_bitwise_and_errors():
    a = torch.tensor([0.0, 1.0])
    assert_bitwise_equal(a, a.clone())
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise_equal(a, torch.tensor([-0.0, 1.0]))
    x = torch.randn(1000, dtype=torch.float64)
    assert rel_error(x, x) == 0 and sqnr_db(x, x) == math.inf
    assert sqnr_db(x * 1.01, x) == pytest.approx(40, abs=1e-6)
