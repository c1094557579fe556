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


def test_a_checks_bound_for_its_max_abs_figure_is_exact(gen):
    """``max_abs_bound``: the finite elements pass exactly while max_abs <= it (what a record of the
    figure carries as its ``tolerance``), for an atol + rtol * |expected| check."""
    from lab_utils.core.checks import compare

    atol, rtol = 1e-5, 1e-4
    e = torch.randn(257, generator=gen, dtype=torch.float64) * 3
    noise = torch.rand(257, generator=gen, dtype=torch.float64) * 0.5 * (atol + rtol * e.abs())
    a = e + noise
    r = compare(a, e, atol=atol, rtol=rtol)
    assert r.ok and 0 < r.worst_share <= 0.5
    # the worst element by share, by hand
    d = (a - e).abs()
    share = d / (atol + rtol * e.abs())
    assert math.isclose(r.worst_share, float(share.max()), rel_tol=1e-12)
    assert math.isclose(r.max_abs_bound, float(d.max()) / float(share.max()), rel_tol=1e-12)
    # scale the errors to the bound: at it every element still passes, a hair beyond the worst fails
    k = 1 / r.worst_share
    at = compare(e + noise * k * (1 - 1e-9), e, atol=atol, rtol=rtol)
    past = compare(e + noise * k * (1 + 1e-6), e, atol=atol, rtol=rtol)
    assert at.ok and at.max_abs <= at.max_abs_bound * (1 + 1e-9)
    assert not past.ok and past.max_abs > past.max_abs_bound * (1 - 1e-9)
    # no error at all: the tightest element's bound (any error is judged against it)
    exact = compare(e, e, atol=atol, rtol=rtol)
    assert exact.worst_share == 0 and exact.max_abs_bound == pytest.approx(float((atol + rtol * e.abs()).min()))
