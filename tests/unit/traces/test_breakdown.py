"""lab_utils.traces.breakdown against a second implementation written here: every activity on an
integer microsecond grid, each unit cell painted by the HTA types covering it, the figures counted
cell by cell (drawn fresh per run, the seed in the failure), and on hand-made cases at the edges
(intervals that touch, one activity, nothing, no communication)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from lab_utils.traces import breakdown as B
from lab_utils.traces.categories import HTA_TYPES


def rng_of(gen: torch.Generator) -> np.random.Generator:
    return np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))


def table(rows) -> pd.DataFrame:
    """rows: (ts, dur, hta_type[, launch_ts, name, category, step])."""
    out = []
    for i, r in enumerate(rows):
        ts, dur, kind = r[:3]
        launch = r[3] if len(r) > 3 else np.nan
        name = r[4] if len(r) > 4 else f"k{i}"
        cat = r[5] if len(r) > 5 else kind.lower()
        st = r[6] if len(r) > 6 else 1
        out.append({"ts": float(ts), "dur": float(dur), "end": float(ts + dur), "hta_type": kind, "name": name,
                    "category": cat, "launch_ts": float(launch), "window": "step", "step": st})  # fmt: skip
    return pd.DataFrame(out, columns=["ts", "dur", "end", "hta_type", "name", "category", "launch_ts", "window",
                                      "step"])  # fmt: skip


def random_table(rng: np.random.Generator, n: int) -> pd.DataFrame:
    rows = []
    for _ in range(n):
        ts, dur = int(rng.integers(0, 60)), int(rng.integers(1, 16))
        kind = HTA_TYPES[int(rng.integers(0, 4))]
        launch = ts - int(rng.integers(0, 25)) if rng.random() < 0.8 else np.nan
        rows.append((ts, dur, kind, launch, f"k{int(rng.integers(0, 4))}", f"c{int(rng.integers(0, 3))}"))
    return table(rows)


def cells(k: pd.DataFrame, kinds=None) -> np.ndarray:
    """Which unit cells [t, t + 1) of 0..200 some activity (of ``kinds``) covers."""
    c = np.zeros(200, dtype=bool)
    for ts, end, kind in zip(k["ts"], k["end"], k["hta_type"]):
        if kinds is None or kind in kinds:
            c[int(ts) : int(end)] = True
    return c


def by_cells(k: pd.DataFrame) -> dict[str, float]:
    busy = cells(k)
    comp, comm, mem = (cells(k, {t}) for t in ("COMPUTATION", "COMMUNICATION", "MEMORY"))
    first, last = int(k["ts"].min()), int(k["end"].max())
    span = last - first
    out = {"span": span, "busy": busy.sum(), "compute": comp.sum(), "communication": (comm & ~comp).sum(),
           "memory": (mem & ~comp & ~comm).sum(), "other": (busy & ~comp & ~comm & ~mem).sum(),
           "idle": span - busy.sum(), "non_compute": busy.sum() - comp.sum(),
           "kernel_time": k["dur"].sum()}  # fmt: skip
    return {key: float(v) for key, v in out.items()}


def gaps_by_cells(k: pd.DataFrame) -> list[tuple[float, float, float]]:
    """(start, end, host wait) of every idle stretch between the first start and the last end."""
    busy = cells(k)
    first, last = int(k["ts"].min()), int(k["end"].max())
    out, t = [], first
    while t < last:
        if busy[t]:
            t += 1
            continue
        a = t
        while not busy[t]:
            t += 1
        starting = k[k["ts"] == t]["launch_ts"].dropna()
        host = 0.0 if not len(starting) else min(max(float(starting.min()), a), t) - a
        out.append((float(a), float(t), host))
    return out


def test_the_figures_equal_a_count_cell_by_cell(gen):
    rng = rng_of(gen)
    for _ in range(40):
        k = random_table(rng, int(rng.integers(1, 12)))
        t = B.temporal(k)
        want = by_cells(k)
        assert {key: t[key] for key in want} == pytest.approx(want), k
        assert t["span"] == pytest.approx(t["idle"] + t["compute"] + t["communication"] + t["memory"] + t["other"])
        total = k["dur"].sum()
        sh = B.shares(k)
        for kind in HTA_TYPES:
            assert sh[kind] == pytest.approx(100 * k.loc[k["hta_type"] == kind, "dur"].sum() / total)
        comm, comp = cells(k, {"COMMUNICATION"}), cells(k, {"COMPUTATION"})
        ov = B.overlap_pct(k)
        if comm.sum():
            assert ov == pytest.approx(100 * (comm & comp).sum() / comm.sum())
        else:
            assert math.isnan(ov)
        a, b, host = B.idle_gaps(k)
        want_gaps = gaps_by_cells(k) if len(k) > 1 else []
        got, want_g = np.column_stack([a, b, host]), np.array(want_gaps).reshape(-1, 3)
        assert got.shape == want_g.shape and np.allclose(got, want_g), (k, want_gaps)
        split = B.idle_split(k)
        assert split["idle"] == pytest.approx(want["idle"] if len(k) > 1 else 0.0)
        assert split["host_wait"] == pytest.approx(sum(h for *_, h in gaps_by_cells(k)) if len(k) > 1 else 0.0)
        assert split["other_wait"] == pytest.approx(split["idle"] - split["host_wait"])


def test_union_merges_touching_and_nested_intervals_and_keeps_gaps():
    s, e = B.union(np.array([5.0, 0.0, 2.0, 10.0, 10.0]), np.array([7.0, 3.0, 5.0, 11.0, 12.0]))
    assert s.tolist() == [0.0, 10.0] and e.tolist() == [7.0, 12.0]  # [0,3)+[2,5)+[5,7) touch: one piece
    s, e = B.union(np.array([0.0, 1.0]), np.array([10.0, 2.0]))  # nested: the outer one's end stays
    assert s.tolist() == [0.0] and e.tolist() == [10.0]
    s, e = B.union(np.array([4.0]), np.array([6.0]))
    assert s.tolist() == [4.0] and e.tolist() == [6.0] and B.length((s, e)) == 2.0
    assert [x.tolist() for x in B.union(np.zeros(0), np.zeros(0))] == [[], []]


def test_intersection_of_touching_sets_is_zero_and_of_nested_is_the_inner():
    a = (np.array([0.0, 10.0]), np.array([5.0, 20.0]))
    assert B.intersection(a, (np.array([5.0]), np.array([10.0]))) == 0.0  # touches both, covers neither
    assert B.intersection(a, (np.array([2.0]), np.array([12.0]))) == 5.0  # 2..5 and 10..12
    assert B.intersection(a, (np.array([11.0]), np.array([12.5]))) == 1.5
    assert B.intersection(a, (np.zeros(0), np.zeros(0))) == 0.0
    assert B.intersection((np.zeros(0), np.zeros(0)), a) == 0.0


def test_an_empty_selection_is_all_zero_and_one_activity_is_its_own_span():
    empty = B.temporal(table([]))
    assert set(empty.values()) == {0.0} and len(empty) == 9
    assert B.shares(table([])) == dict.fromkeys(HTA_TYPES, 0.0)
    one = B.temporal(table([(3, 4, "MEMORY")]))
    assert one == {"span": 4.0, "busy": 4.0, "idle": 0.0, "compute": 0.0, "communication": 0.0, "memory": 4.0,
                   "other": 0.0, "non_compute": 4.0, "kernel_time": 4.0}  # fmt: skip
    assert B.idle_split(table([(3, 4, "MEMORY", 0.0)])) == {"idle": 0.0, "host_wait": 0.0, "other_wait": 0.0}
    assert math.isnan(B.overlap_pct(table([(3, 4, "COMPUTATION")])))


def test_host_wait_is_the_gap_before_the_launch_of_what_ends_it():
    """Gap 10..30: the kernel at 30 was launched at 25: 15 us of host wait, 5 queued.  A launch before
    the gap counts it all as queued work; a launch after the kernel's start is clipped to the gap."""
    base = [(0, 10, "COMPUTATION", 0.0)]
    assert B.idle_split(table(base + [(30, 5, "COMPUTATION", 25.0)])) == {"idle": 20.0, "host_wait": 15.0,
                                                                          "other_wait": 5.0}  # fmt: skip
    assert B.idle_split(table(base + [(30, 5, "COMPUTATION", 4.0)]))["host_wait"] == 0.0
    assert B.idle_split(table(base + [(30, 5, "COMPUTATION", 40.0)]))["host_wait"] == 20.0
    assert B.idle_split(table(base + [(30, 5, "COMPUTATION")]))["host_wait"] == 0.0  # no launch: queued
    # two activities start at the gap's end: the earlier launch decides
    two = table(base + [(30, 5, "COMPUTATION", 28.0), (30, 2, "MEMORY", 12.0)])
    assert B.idle_split(two)["host_wait"] == 2.0


def test_top_kernels_sum_per_name_rank_by_total_then_name_and_cut_at_n():
    k = table([(0, 4, "COMPUTATION", 0, "b", "matmul"), (10, 6, "COMPUTATION", 0, "b", "matmul"),
               (20, 10, "MEMORY", 0, "a", "memcpy"), (40, 10, "COMPUTATION", 0, "c", "reduction"),
               (60, 1, "OTHER", 0, "d", "other")])  # fmt: skip
    top = B.top_kernels(k, 3)
    assert top["name"].tolist() == ["a", "b", "c"]  # 10, 10, 10: ties by name
    b = top.set_index("name").loc["b"]
    assert (b["count"], b["total"], b["mean"], b["min"], b["max"]) == (2, 10.0, 5.0, 4.0, 6.0)
    assert (b["category"], b["hta_type"]) == ("matmul", "COMPUTATION")
    assert top["pct"].tolist() == pytest.approx([100 * 10 / 31] * 3)
    assert len(B.top_kernels(k, 10)) == 4 and len(B.top_kernels(k, 1)) == 1
    many = table([(10 * i, i + 1, "COMPUTATION", 0, f"n{i:02d}") for i in range(12)])
    assert B.top_kernels(many)["name"].tolist() == [f"n{i:02d}" for i in range(11, 1, -1)]  # the top 10


def test_by_category_sums_counts_and_shares_largest_first():
    k = table([(0, 4, "COMPUTATION", 0, "x", "matmul"), (10, 6, "COMPUTATION", 0, "y", "matmul"),
               (20, 30, "MEMORY", 0, "z", "memcpy")])  # fmt: skip
    c = B.by_category(k)
    assert c["category"].tolist() == ["memcpy", "matmul"]
    assert c["count"].tolist() == [1, 2] and c["total"].tolist() == [30.0, 10.0]
    assert c["pct"].tolist() == pytest.approx([75.0, 25.0])


def test_per_step_splits_by_step_and_leaves_other_windows_out():
    k = table([(0, 10, "COMPUTATION", 0.0, "a", "m", 1), (15, 5, "COMMUNICATION", 14.0, "n", "c", 1),
               (100, 20, "COMPUTATION", 90.0, "a", "m", 2), (110, 20, "COMMUNICATION", 95.0, "n", "c", 2),
               (500, 50, "COMPUTATION", 0.0, "a", "m", 3)])  # fmt: skip
    k.loc[4, "window"] = "after"
    per = B.per_step(k).set_index("step")
    assert per.index.tolist() == [1, 2]
    one, two = per.loc[1], per.loc[2]
    assert (one["span"], one["busy"], one["idle"], one["compute"], one["communication"]) == (20, 15, 5, 10, 5)
    assert (one["host_wait"], one["other_wait"]) == (4.0, 1.0)  # gap 10..15, launched at 14
    assert one["share_computation"] == pytest.approx(100 * 10 / 15) and one["share_communication"] == pytest.approx(
        100 * 5 / 15
    )
    assert one["overlap_pct"] == 0.0  # no compute over its communication
    assert (two["span"], two["compute"], two["communication"]) == (30, 20, 10)
    assert two["overlap_pct"] == pytest.approx(50.0)  # 110..120 of 110..130 under compute
    assert B.per_step(k[k["window"] == "after"]).empty


def test_per_step_is_each_steps_own_figures_on_many_random_steps(gen):
    """The table of every step at once holds, step by step, what the figures of that step's rows
    alone are (those are counted cell by cell above); rows of the steps interleaved in time and in
    the table, other windows left out."""
    rng = rng_of(gen)
    for _ in range(15):
        rows = []
        for _ in range(int(rng.integers(1, 40))):
            st = int(rng.integers(1, 6))
            ts, dur = 100 * st + int(rng.integers(-30, 60)), int(rng.integers(1, 16))
            launch = ts - int(rng.integers(0, 25)) if rng.random() < 0.8 else np.nan
            rows.append((ts, dur, HTA_TYPES[int(rng.integers(0, 4))], launch, "k", "c", st))
        k = table(rows)
        k.loc[rng.random(len(k)) < 0.1, "window"] = "gap"
        per = B.per_step(k)
        steps = sorted(set(k.loc[k["window"] == "step", "step"]))
        assert (per["step"].tolist() if len(per) else []) == steps
        for row in per.itertuples(index=False):
            one = k[(k["window"] == "step") & (k["step"] == row.step)]
            want = B.temporal(one)
            assert {c: getattr(row, c) for c in want} == pytest.approx(want), one
            for kind, share in B.shares(one).items():
                assert getattr(row, f"share_{kind.lower()}") == pytest.approx(share)
            ov = B.overlap_pct(one)
            assert (math.isnan(row.overlap_pct) and math.isnan(ov)) or row.overlap_pct == pytest.approx(ov)
            split = B.idle_split(one)
            assert (row.host_wait, row.other_wait) == pytest.approx((split["host_wait"], split["other_wait"]))


def test_a_gap_ending_where_two_activities_start_takes_the_earliest_launch():
    """Two activities start when the gap ends; the one launched first decides the host wait, and an
    activity without a launch among them does not hide the other's."""
    k = table([(0, 10, "COMPUTATION", 0.0), (30, 5, "COMPUTATION", np.nan), (30, 8, "COMPUTATION", 25.0),
               (30, 2, "COMPUTATION", 27.0)])  # fmt: skip
    a, b, host = B.idle_gaps(k)
    assert (a.tolist(), b.tolist(), host.tolist()) == ([10.0], [30.0], [15.0])
    per = B.per_step(k).iloc[0]
    assert (per["host_wait"], per["other_wait"]) == (15.0, 5.0)


def test_two_activities_with_a_gap_between_them_have_that_gap():
    k = table([(0, 10, "COMPUTATION", 0.0), (30, 5, "COMPUTATION", 22.0)])
    a, b, host = B.idle_gaps(k)
    assert (a.tolist(), b.tolist(), host.tolist()) == ([10.0], [30.0], [12.0])
    assert B.per_step(k).iloc[0][["host_wait", "other_wait"]].tolist() == [12.0, 8.0]
    assert B.idle_gaps(k.iloc[:1])[0].size == 0
