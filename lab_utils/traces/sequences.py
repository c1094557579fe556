"""Frequent kernel sequences: the runs of consecutive kernels that repeat, ranked by their time (fusion candidates).

On each stream, within each step, the activities in start order form a sequence of names; an
**n-gram** is ``n`` consecutive ones (``min_len`` <= n <= ``max_len``).  An n-gram's occurrences
are counted without overlap (left to right: ``A A A A`` holds ``A A`` twice, not three times) and
across all streams and steps.  Per pattern with at least ``min_count`` occurrences:

* ``count``; ``total_us``: the summed duration of its kernels over the occurrences; ``mean_us``
  per occurrence; ``gap_us``: the summed time *between* its kernels inside the occurrences (the
  launch gaps a fused kernel would not have); ``span_us`` = total + gaps;
* ``ops``: the launching operators of its first occurrence; ``categories``: its kernels' categories.

A pattern is left out when a pattern one kernel longer that contains it occurs as often (it is
that longer pattern's part, not a sequence of its own: only the longest form of a repeated run is
listed), and when it is a shorter pattern repeated (``A B A B``: ``A B`` twice; ``A A A``: a run of
one kernel, listed once as ``A A``, at ``min_len``).  ``short``: the pattern with each kernel's name
cut to its function (:func:`short_name`).  Rows are ranked by ``total_us``: the time a fusion of
that sequence would act on.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lab_utils.core.config import ConfigError, check_int


def _grams(codes: np.ndarray, group: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Start positions of n-grams lying inside one group, and their code rows."""
    if len(codes) < n:
        return np.zeros(0, dtype=np.int64), np.zeros((0, n), dtype=np.int64)
    starts = np.arange(len(codes) - n + 1)
    ok = group[starts] == group[starts + n - 1]
    starts = starts[ok]
    return starts, np.stack([codes[starts + j] for j in range(n)], axis=1)


def _runs(*cols: pd.Series) -> np.ndarray:
    """A group id per row of rows sorted by ``cols``: a new id wherever a column changes (two
    missing values are equal), so each (stream, step) is one run."""
    n = len(cols[0])
    change = np.zeros(n, dtype=bool)
    change[:1] = True
    for c in cols:
        a = pd.to_numeric(c).to_numpy(dtype=float, na_value=np.nan)
        same = (a[1:] == a[:-1]) | (np.isnan(a[1:]) & np.isnan(a[:-1]))
        change[1:] |= ~same
    return np.cumsum(change) - 1


def _non_overlapping(pos: np.ndarray, n: int) -> np.ndarray:
    """The occurrences kept left to right without overlap (``pos`` sorted)."""
    if len(pos) < 2 or bool((np.diff(pos) >= n).all()):
        return pos
    keep, until = [], -1
    for p in pos.tolist():
        if p >= until:
            keep.append(p)
            until = p + n
    return np.asarray(keep, dtype=np.int64)


def frequent_sequences(
    k: pd.DataFrame, *, min_len: int = 2, max_len: int = 8, min_count: int = 2, top: int = 20
) -> pd.DataFrame:
    """The repeated kernel sequences of the activities ``k`` (see the module note), ``top`` rows."""
    check_int("min_len", min_len, min=1)
    check_int("max_len", max_len, min=1)
    if max_len < min_len:
        raise ConfigError("max_len", max_len, f"at least min_len ({min_len})")
    check_int("min_count", min_count, min=2)
    cols = ["pattern", "short", "length", "count", "total_us", "mean_us", "gap_us", "span_us", "ops", "categories",
            "names"]  # fmt: skip
    if not len(k):
        return pd.DataFrame(columns=cols)
    s = k.sort_values(["stream", "step", "ts"], kind="stable")
    names = s["name"].astype(str).to_numpy()
    uniq, codes = np.unique(names, return_inverse=True)
    group = _runs(s["stream"], s["step"])
    dur, ts, end = s["dur"].to_numpy(), s["ts"].to_numpy(), s["end"].to_numpy()
    cum = np.concatenate([[0.0], np.cumsum(dur)])
    ops, cats = s["op"].astype(str).to_numpy(), s["category"].astype(str).to_numpy()
    found: dict[tuple, dict] = {}
    for n in range(min_len, max_len + 1):
        starts, rows = _grams(codes, group, n)
        if not len(starts):
            break
        keys, inv, counts = _unique_rows(rows, len(uniq))
        cand = np.flatnonzero(counts >= min_count)
        if not len(cand):
            break
        order = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[order], np.arange(len(keys) + 1))
        for c in cand:
            pos = _non_overlapping(starts[order[bounds[c] : bounds[c + 1]]], n)
            if len(pos) < min_count:
                continue
            busy = cum[pos + n] - cum[pos]
            span = end[pos + n - 1] - ts[pos]
            found[tuple(keys[c])] = {"count": len(pos), "total_us": float(busy.sum()), "span_us": float(span.sum()),
                                     "first": int(pos[0]), "length": n}  # fmt: skip
    extended: dict[tuple, int] = {}  # pattern -> the most occurrences of a pattern one longer holding it
    for key, f in found.items():
        for part in (key[1:], key[:-1]):
            extended[part] = max(extended.get(part, 0), f["count"])
    rows = []
    for key, f in found.items():
        if extended.get(key, 0) >= f["count"] or (len(key) > min_len and _periodic(key)):
            continue
        first, n = f["first"], f["length"]
        rows.append({"pattern": " → ".join(uniq[list(key)]),
                     "short": " → ".join(short_name(x) for x in uniq[list(key)]), "length": n, "count": f["count"],
                     "total_us": f["total_us"], "mean_us": f["total_us"] / f["count"],
                     "gap_us": max(f["span_us"] - f["total_us"], 0.0), "span_us": f["span_us"],
                     "ops": " → ".join(dict.fromkeys(ops[first : first + n])),
                     "categories": " → ".join(cats[first : first + n]), "names": list(uniq[list(key)])})  # fmt: skip
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(["total_us", "length"], ascending=[False, False]).head(top).reset_index(drop=True)


def _unique_rows(rows: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_inverse=True, return_counts=True)`` (rows of codes < ``base``),
    through one integer per row where the row fits in 63 bits (the same sorted order: the row's
    codes are its digits in ``base``, the first the most significant)."""
    n = rows.shape[1]
    if not len(rows) or base**n >= 2**63:
        keys, inv, counts = np.unique(rows, axis=0, return_inverse=True, return_counts=True)
        return keys, inv.reshape(-1), counts
    weights = np.asarray([base ** (n - 1 - j) for j in range(n)], dtype=np.int64)
    one = rows.astype(np.int64) @ weights
    vals, inv, counts = np.unique(one, return_inverse=True, return_counts=True)
    first = np.zeros(len(vals), dtype=np.int64)
    first[inv[::-1]] = np.arange(len(inv))[::-1]  # a row of each value
    return rows[first], inv.reshape(-1), counts


def _periodic(key: tuple) -> bool:
    """``key`` is a shorter pattern repeated: ``A B A B``, ``A A A``."""
    n = len(key)
    return any(n % p == 0 and key == key[:p] * (n // p) for p in range(1, n // 2 + 1))


def short_name(name: str) -> str:
    """A kernel's function name without its return type, template and call arguments:
    ``void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)`` ->
    ``at::native::vectorized_elementwise_kernel``."""
    text = name.strip()
    for stop in ("<", "("):
        cut = text.find(stop)
        if cut > 0:
            text = text[:cut]
    return text.removeprefix("void ").strip() or name
