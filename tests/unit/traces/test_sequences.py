"""lab_utils.traces.sequences against a second implementation written here (every n-gram of each
stream and step counted left to right without overlap, the shorter forms and the periodic ones left
out), on sequences drawn fresh per run, and the short names of kernels."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from lab_utils.traces import sequences as seq
from lab_utils.traces.sequences import frequent_sequences, short_name


def frame(names, streams=None, steps=None, durs=None, gap=1.0) -> pd.DataFrame:
    n = len(names)
    durs = list(durs) if durs is not None else [float(1 + (i % 3)) for i in range(n)]
    ts, t = [], 0.0
    for d in durs:
        ts.append(t)
        t += d + gap
    return pd.DataFrame({"name": names, "stream": streams or [7] * n, "step": steps or [1] * n, "ts": ts,
                         "dur": durs, "end": [a + d for a, d in zip(ts, durs)], "op": [f"aten::{x}" for x in names],
                         "category": ["c"] * n})  # fmt: skip


def by_hand(k: pd.DataFrame, min_len: int, max_len: int, min_count: int) -> dict[tuple, tuple[int, float, float]]:
    """pattern -> (count, total us, span us)."""
    s = k.sort_values(["stream", "step", "ts"], kind="stable")
    groups = [g for _, g in s.groupby(["stream", "step"], sort=True)]
    found = {}
    for n in range(min_len, max_len + 1):
        occ: dict[tuple, list] = {}
        for g in groups:
            names, dur, ts, end = list(g["name"]), list(g["dur"]), list(g["ts"]), list(g["end"])
            for i in range(len(names) - n + 1):
                occ.setdefault(tuple(names[i : i + n]), []).append(
                    (id(g), i, sum(dur[i : i + n]), end[i + n - 1] - ts[i])
                )
        for key, where in occ.items():
            kept, until = [], {}
            for gid, i, busy, span in where:  # left to right, without overlap, within each group
                if i >= until.get(gid, -1):
                    kept.append((busy, span))
                    until[gid] = i + n
            if len(kept) >= min_count:
                found[key] = (len(kept), sum(b for b, _ in kept), sum(s for _, s in kept))
    out = {}
    for key, v in found.items():
        longer = [w[0] for other, w in found.items() if len(other) == len(key) + 1 and key in (other[1:], other[:-1])]
        periodic = any(len(key) % p == 0 and key == key[:p] * (len(key) // p) for p in range(1, len(key) // 2 + 1))
        if (longer and max(longer) >= v[0]) or (len(key) > min_len and periodic):
            continue
        out[key] = v
    return out


def test_the_sequences_equal_a_count_written_here(gen):
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    for _ in range(25):
        n = int(rng.integers(2, 30))
        names = [str(x) for x in rng.choice(list("ABC"), n)]
        streams = [int(x) for x in rng.choice([7, 9], n)]
        steps = [int(x) for x in rng.choice([1, 2], n)]
        k = frame(names, streams, steps, durs=rng.integers(1, 6, n).astype(float))
        lo = int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 4))
        got = frequent_sequences(k, min_len=lo, max_len=hi, min_count=2, top=1000)
        want = by_hand(k, lo, hi, 2)
        got_counts = {tuple(r.names): (r.count, r.total_us) for r in got.itertuples()}
        assert got_counts == {key: (c, t) for key, (c, t, _) in want.items()}, (names, streams, steps, lo, hi)
        for r in got.itertuples():
            c, t, span = want[tuple(r.names)]
            assert r.span_us == pytest.approx(span) and r.gap_us == pytest.approx(max(span - t, 0.0))
            assert r.mean_us == pytest.approx(t / c) and r.length == len(r.names)
        assert got["total_us"].tolist() == sorted(got["total_us"], reverse=True)


def test_a_repeated_pair_is_listed_once_and_its_repeats_are_not():
    got = frequent_sequences(frame(list("ABABABAB")), min_len=2, max_len=8).set_index("pattern")
    assert got["count"].to_dict() == {"A → B": 4, "B → A": 3}  # A B A B (twice) is A B repeated: not listed
    runs = frequent_sequences(frame(list("AAAAAA")), min_len=2, max_len=6)
    assert [tuple(n) for n in runs["names"]] == [("A", "A")]  # a run of one kernel: listed once, at min_len
    assert runs["count"].tolist() == [3]


def test_ops_and_categories_of_the_first_occurrence_and_top():
    k = frame(list("XYZXYZ"))
    k["op"] = ["aten::mm", "aten::mm", "aten::add", "o4", "o5", "o6"]
    row = frequent_sequences(k, min_len=3, max_len=3).iloc[0]
    assert row["pattern"] == "X → Y → Z" and row["ops"] == "aten::mm → aten::add" and row["count"] == 2
    assert row["categories"] == "c → c → c" and row["short"] == "X → Y → Z"
    assert len(frequent_sequences(frame(list("ABCABCDEDE")), min_len=2, max_len=2, top=1)) == 1


@pytest.mark.parametrize(
    "name, short",
    [("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, float)",
      "at::native::vectorized_elementwise_kernel"),
     ("ampere_sgemm_128x64_nn", "ampere_sgemm_128x64_nn"),
     ("<lambda>(int)", "<lambda>"),  # a name starting with its template bracket keeps it
     ("(anonymous)", "(anonymous)"),
     ("void kernel(float*)", "kernel")],
)  # fmt: skip
def test_short_names(name, short):
    assert short_name(name) == short


def test_many_distinct_kernels_are_counted_as_with_few(gen):
    """Over 300 distinct names an 8-kernel pattern no longer fits one 63-bit key: the patterns are
    then told apart row by row, and the count is the same as the one written here."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    motif = [f"k{i}" for i in rng.choice(300, 8, replace=False)]
    names = []
    for _ in range(6):
        names += motif + [f"k{int(i)}" for i in rng.choice(300, int(rng.integers(0, 4)))]
    names += [f"k{i}" for i in range(300)]  # every name occurs
    k = frame(names, durs=rng.integers(1, 6, len(names)).astype(float))
    got = frequent_sequences(k, min_len=2, max_len=8, min_count=2, top=10_000)
    want = by_hand(k, 2, 8, 2)
    assert {tuple(r.names): (r.count, r.total_us) for r in got.itertuples()} == {
        key: (c, t) for key, (c, t, _) in want.items()
    }
    assert tuple(motif) in {tuple(r.names) for r in got.itertuples()}


@pytest.mark.parametrize("base,n", [(5, 3), (300, 7), (300, 8), (2000, 8)])
def test_distinct_rows_are_numpys_whether_or_not_a_row_fits_one_integer(gen, base, n):
    """The distinct n-grams, their inverse and counts are ``np.unique(axis=0)``'s, in its order, both
    where a row of codes below ``base`` fits 63 bits (300**7) and where it does not (300**8)."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    rows = rng.integers(0, base, (400, n))
    rows[200:] = rows[rng.integers(0, 200, 200)]  # repeats
    rows[0] = base - 1  # the largest row
    keys, inv, counts = seq._unique_rows(rows, base)
    want_keys, want_inv, want_counts = np.unique(rows, axis=0, return_inverse=True, return_counts=True)
    assert np.array_equal(keys, want_keys) and np.array_equal(inv, want_inv.reshape(-1))
    assert np.array_equal(counts, want_counts)
