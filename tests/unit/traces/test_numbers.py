"""lab_utils.traces.numbers: exact numbers (numpy's fast path for plain decimals, Python's decimal for
the rest, checked against each other) and ids kept as numbers where they are numbers."""

from __future__ import annotations

from decimal import ROUND_FLOOR, Decimal

import numpy as np
import pytest
import torch

from lab_utils.traces import numbers as N


def exact(text: str) -> tuple[int, float]:
    d = Decimal(text)
    w = int(d.to_integral_value(rounding=ROUND_FLOOR))
    return w, float(d - w)


@pytest.fixture
def no_slow_path(monkeypatch):
    def refuse(raws):
        raise AssertionError(f"the slow path read {len(raws)} plain decimals numpy reads")

    monkeypatch.setattr(N, "numbers_slowly", refuse)


def test_plain_decimals_of_every_layout_are_read_by_numpy_exactly(gen, no_slow_path):
    """Epoch microseconds with 0 to 6 decimals, short ones, integers: numpy's path alone, digit for digit."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    texts = ["1711964650123456.789", "1711964650123457", "5.25", "0", "7", "123456789012345678.5",
             "1.123456789012345678"]  # fmt: skip
    for _ in range(300):
        whole = int(rng.integers(0, 10**16))
        digits = int(rng.integers(0, 7))
        texts.append(f"{whole}" if not digits else f"{whole}.{int(rng.integers(0, 10**digits)):0{digits}d}")
    w, f = N.numbers([t.encode() for t in texts])
    for t, a, b in zip(texts, w, f):
        want_w, want_f = exact(t)
        assert int(a) == want_w and b == pytest.approx(want_f, abs=1e-12), t
    one = N.numbers([b"1711964650123456.789"])  # one value, one width
    assert int(one[0][0]) == 1711964650123456 and one[1][0] == pytest.approx(0.789, abs=1e-12)


@pytest.mark.parametrize(
    "texts",
    [
        ["-1.5", "1711964650123456.789"],  # a sign in the narrowest width (read first)
        ["1.5e3", "12.25"],  # an exponent
        [".5", "10.5"],  # no digit before the point
        ["1234567890123456789.5"],  # 19 digits before the point
        ["1." + "1" * 19],  # 19 after it
        ["0." + "0" * 39 + "1"],  # wider than 40
    ],
)
def test_numbers_numpy_cannot_hold_go_the_exact_slow_way(texts):
    w, f = N.numbers([t.encode() for t in texts])
    for t, a, b in zip(texts, w, f):
        want_w, want_f = exact(t)
        assert int(a) == want_w and b == pytest.approx(want_f, abs=1e-12), t
        assert 0 <= b < 1


def test_no_number_is_two_empty_columns():
    w, f = N.numbers([])
    assert w.dtype == np.int64 and len(w) == len(f) == 0


def test_named_streams_and_threads_keep_what_is_a_number():
    assert N.ints([7, None, "stream 7 [copy]", 3.0]).tolist() == [7, -1, -1, 3]
    codes, values = N.codes([5, 5, 9], numeric=True)
    assert [values[c] for c in codes] == [5, 5, 9]
    codes, values = N.codes(["PyTorch Profiler", 5, "PyTorch Profiler"], numeric=True)
    assert [values[c] for c in codes] == ["PyTorch Profiler", 5, "PyTorch Profiler"]
