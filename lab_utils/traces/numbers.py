"""JSON numbers and ids of a profiler trace as numpy columns, exactly.

* :func:`numbers`: numbers as their JSON text -> (integer part, fraction), exact at any width
  (a ns-resolution timestamp ``1711964650123456.789`` keeps its nanoseconds);
* :func:`ints`: ids (streams, devices, correlations) as int64, what is not a number as a fill;
* :func:`codes`: values as integer codes into the table of their distinct values.
"""

from __future__ import annotations

import decimal

import numpy as np

_POW10 = 10 ** np.arange(19, dtype=np.int64)


def numbers(raws) -> tuple[np.ndarray, np.ndarray]:
    """JSON numbers as their text (``msgspec.Raw`` or bytes) -> (integer part as int64, fraction
    as float64), exactly: ``1711964650123456.789`` -> (1711964650123456, 0.789).  Plain decimals
    are read by numpy, the values of one width at a time (a trace writes its timestamps in one or
    two widths); anything else (a sign, an exponent) value by value."""
    n = len(raws)
    if not n:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    a = np.frombuffer(b",".join(raws) + b",", dtype=np.uint8)
    ends = np.flatnonzero(a == 44)
    if len(ends) != n:
        return numbers_slowly(raws)
    starts = np.empty(n, dtype=np.int64)
    starts[0], starts[1:] = 0, ends[:-1] + 1
    widths = ends - starts
    whole, frac = np.zeros(n, dtype=np.int64), np.zeros(n)
    uniform = bool((widths == widths[0]).all())
    for w in np.unique(widths):
        rows = np.flatnonzero(widths == w)
        if w < 1 or w > 40:
            return numbers_slowly(raws)
        # one value per row, its digits as numbers (one width: the text is already that matrix)
        m = (a.reshape(n, w + 1)[:, :w] if uniform else a[starts[rows, None] + np.arange(w)]) - 48
        dot = m == 254  # '.' - '0' in uint8
        point = np.where(dot.any(axis=1), dot.argmax(axis=1), w)
        if not ((m <= 9) | dot).all() or dot.sum() > len(rows):
            return numbers_slowly(raws)
        for p in np.unique(point):  # one layout: p digits, then (w - p - 1) after the point
            sel = point == p
            if p > 18 or w - p - 1 > 18 or p == 0:
                return numbers_slowly(raws)
            mm = m[sel].astype(np.int64)
            whole[rows[sel]] = mm[:, :p] @ _POW10[p - 1 :: -1]
            if p < w - 1:
                k = w - p - 1
                frac[rows[sel]] = (mm[:, p + 1 :] @ _POW10[k - 1 :: -1]) / float(_POW10[k])
    return whole, frac


def numbers_slowly(raws: list) -> tuple[np.ndarray, np.ndarray]:
    whole, frac = np.zeros(len(raws), dtype=np.int64), np.zeros(len(raws))
    for i, r in enumerate(raws):
        v = decimal.Decimal(bytes(r).decode())
        w = int(v.to_integral_value(rounding=decimal.ROUND_FLOOR))
        whole[i], frac[i] = w, float(v - w)
    return whole, frac


def ints(values: list, fill: int = -1) -> np.ndarray:
    """Integers; None, and ids that are not numbers (a named stream "stream 7 [copy]"), become ``fill``."""
    try:
        x = np.array(values, dtype=np.float64)  # None -> NaN
    except (TypeError, ValueError):
        return np.array([v if type(v) is int else to_int(v, fill) for v in values], dtype=np.int64)
    return np.where(np.isnan(x), fill, x).astype(np.int64)


def codes(values: list, numeric: bool) -> tuple[np.ndarray, list]:
    """``values`` as integer codes into the list of their distinct values (first seen first);
    ``numeric``: values that are mostly integers (process and thread ids), coded by numpy."""
    if numeric:
        try:
            uniq, codes = np.unique(np.array(values, dtype=np.int64), return_inverse=True)
            return codes.astype(np.int32), uniq.tolist()
        except (TypeError, ValueError, OverflowError):  # a named thread ("PyTorch Profiler")
            pass
    table: dict = {}
    codes = [table.setdefault(v, len(table)) for v in values]
    return np.array(codes, dtype=np.int32), list(table)


def to_int(v, fill: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return fill
