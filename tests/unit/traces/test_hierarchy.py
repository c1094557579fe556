"""lab_utils.traces.hierarchy: where a kernel hangs when no host event holds its launch, a thread
without any host node, the tree's sums (a node's total is its children's, the top rows add up to the
kernel time), and the cut of :func:`top_levels` at its share threshold itself and by default; a kernel under its
launching operator whatever is nested around its launch, sub-microsecond operators, steps added up,
nesting at a node's boundaries, another thread's work under the main thread's ranges, an empty
selection and the depth-first order (checked by a walk written here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from lab_utils.traces import TraceAnalysis
from lab_utils.traces.hierarchy import NO_HOST, SEP, top_levels
from lab_utils.traces.hierarchy import tree as hierarchy_tree

from .kineto import ann, kernel, launch, op, step, write

EVENTS = [
    step(1, 0, 1000), ann("## forward ##", 10, 300),
    op("aten::mm", 20, 50, 11), launch(1, 30, ext=11), kernel("gemm", 1, 100, 60, ext=11),
    launch(2, 80, ext=900), kernel("outside_any_op", 2, 170, 30, ext=900),  # under the range around its launch
    launch(3, 500, ext=901), kernel("under_the_step", 3, 600, 10, ext=901),  # only the step holds its launch
    launch(4, 1200, ext=902), kernel("after_the_step", 4, 1300, 40, ext=902),  # nothing holds it
    launch(5, 50, tid=5, ext=903), kernel("lone_thread", 5, 210, 20, ext=903),  # thread 5 has no host node
]  # fmt: skip


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    ta = TraceAnalysis(write(tmp_path_factory.mktemp("h") / "t.json", EVENTS), workers=1)
    return ta.hierarchy(0, scope="all")


def test_each_kernel_hangs_under_the_innermost_host_node_holding_it(tree):
    t = tree.set_index("path")
    S, F = "ProfilerStep", f"ProfilerStep{SEP}## forward ##"
    assert t.loc[f"{F}{SEP}aten::mm{SEP}gemm", "gpu_total_us"] == 60
    assert t.loc[f"{F}{SEP}outside_any_op", "gpu_total_us"] == 30
    assert t.loc[f"{S}{SEP}under_the_step", "kind"] == "kernel"
    assert t.loc[f"{NO_HOST}{SEP}after_the_step", "gpu_total_us"] == 40  # launched outside every node
    assert t.loc[f"{NO_HOST}{SEP}lone_thread", "gpu_total_us"] == 20  # a thread without host events
    assert t.loc[NO_HOST, "gpu_total_us"] == 60 and t.loc[NO_HOST, "kernels"] == 2
    assert (t.loc[NO_HOST, "kind"], t.loc[NO_HOST, "cpu_us"]) == ("range", 0.0)  # no host event: no host time
    assert (t.loc[S, "cpu_us"], t.loc[F, "cpu_us"], t.loc[f"{F}{SEP}aten::mm", "cpu_us"]) == (1000, 300, 50)
    assert (t.loc[S, "gpu_total_us"], t.loc[S, "gpu_self_us"], t.loc[S, "kernels"]) == (100, 10, 3)
    assert t.loc[F, "gpu_self_us"] == 30 and t.loc[F, "depth"] == 1 and t.loc[F, "parent"] == S


def test_a_nodes_total_is_its_childrens_and_the_top_adds_up_to_the_kernel_time(tree):
    total = 60 + 30 + 10 + 40 + 20
    assert tree.loc[tree["depth"] == 0, "gpu_total_us"].sum() == total
    assert tree["gpu_pct"].tolist() == pytest.approx((100 * tree["gpu_total_us"] / total).tolist())
    for path, row in tree.set_index("path").iterrows():
        kids = tree[tree["parent"] == path]
        if len(kids):
            assert row["gpu_total_us"] == pytest.approx(kids["gpu_total_us"].sum()), path
    order = tree.loc[tree["depth"] == 0, "gpu_total_us"].tolist()
    assert order == sorted(order, reverse=True)  # the largest first among siblings


def test_top_levels_keeps_rows_at_the_share_itself():
    t = pd.DataFrame(
        {"path": ["a", "a > b", "a > b > c", "d"], "depth": [0, 1, 2, 0], "gpu_pct": [60.0, 1.0, 0.5, 0.99]}
    )
    assert top_levels(t, depth=3, min_pct=1.0)["path"].tolist() == ["a", "a > b"]
    assert top_levels(t, depth=2, min_pct=0.5)["path"].tolist() == ["a", "a > b", "d"]
    assert top_levels(t, depth=1, min_pct=0.0)["path"].tolist() == ["a", "d"]
    deep = pd.DataFrame({"path": ["a", "a > b", "a > b > c", "a > b > c > d"], "depth": [0, 1, 2, 3],
                         "gpu_pct": [100.0, 1.0, 1.0, 50.0]})  # fmt: skip
    assert top_levels(deep)["path"].tolist() == ["a", "a > b", "a > b > c"]  # by default three levels, 1% each
    assert top_levels(deep.assign(gpu_pct=0.99))["path"].tolist() == []


def hierarchy_of(tmp_path, events, scope="all"):
    return TraceAnalysis(write(tmp_path / "t.json", events), workers=1).hierarchy(0, scope=scope)


def assert_depth_first(t: pd.DataFrame) -> None:
    """Each row right after its parent or a sibling's subtree, siblings largest first: checked by
    walking the rows with a stack of open paths."""
    open_paths: list[str] = []
    last_child: dict[str, float] = {}
    for row in t.itertuples():
        while open_paths and open_paths[-1] != row.parent:
            open_paths.pop()
        assert (open_paths[-1] if open_paths else "") == row.parent, row.path
        assert row.gpu_total_us <= last_child.get(row.parent, float("inf")), row.path
        last_child[row.parent] = row.gpu_total_us
        open_paths.append(row.path)


@pytest.mark.parametrize("op_first", [True, False])
def test_a_kernel_hangs_under_its_launching_operator_even_with_a_deeper_node_around_its_launch(tmp_path, op_first):
    """aten::linear (External id 11) launches the GEMM from inside aten::addmm (no External id): the
    GEMM hangs under aten::linear, wherever the operator stands in the file (the first host event
    or not); a 0.5 us and a 0 us operator hold their kernels too."""
    linear = op("aten::linear", 10, 100, 11)
    ev = [step(1, 0, 1000), op("aten::addmm", 20, 50), launch(1, 30, ext=11), kernel("gemm", 1, 40, 60, ext=11),
          op("aten::view", 200, 0.5, 12), launch(2, 200.2, dur=0.1, ext=12), kernel("k_half", 2, 210, 5, ext=12),
          op("aten::zero_", 300, 0, 13), launch(3, 300, dur=0, ext=13),
          kernel("k_zero", 3, 310, 3, ext=13)]  # fmt: skip
    t = hierarchy_of(tmp_path, [linear, *ev] if op_first else [*ev, linear]).set_index("path")
    S = "ProfilerStep"
    assert t.loc[f"{S}{SEP}aten::linear{SEP}gemm", "gpu_total_us"] == 60
    assert not any("aten::addmm" in p for p in t.index)  # it holds no GPU time
    assert t.loc[f"{S}{SEP}aten::view", ["gpu_total_us", "gpu_self_us", "cpu_us"]].tolist() == [5, 5, 0.5]
    assert t.loc[f"{S}{SEP}aten::zero_{SEP}k_zero", "gpu_total_us"] == 3 and t.loc[f"{S}{SEP}aten::zero_", "depth"] == 1
    assert t.loc[S, "gpu_self_us"] == 0 and t.loc[S, "kernels"] == 3 and t.loc[S, "gpu_pct"] == 100


def test_steps_add_up_and_same_named_kernels_are_one_leaf(tmp_path):
    """Two steps (``ProfilerStep#1`` and ``ProfilerStep #2``) are one row, count 2, with the host time
    of both; each step's aten::mm launches two ``gemm`` kernels: one leaf row, count 4."""
    ev = [step(1, 0, 100), ann("ProfilerStep #2", 100, 150)]
    for s, t0 in enumerate((0, 100)):
        e = 20 + s
        ev += [op("aten::mm", t0 + 10, 30, e)]
        for j in range(2):
            c = 10 * s + j + 1
            ev += [launch(c, t0 + 12 + 5 * j, ext=e), kernel("gemm", c, t0 + 50 + 10 * j, 7 + j, ext=e)]
    t = hierarchy_of(tmp_path, ev, scope="steps")
    assert t["path"].tolist() == ["ProfilerStep", f"ProfilerStep{SEP}aten::mm", f"ProfilerStep{SEP}aten::mm{SEP}gemm"]
    assert t["count"].tolist() == [2, 2, 4] and t["kernels"].tolist() == [4, 4, 4]
    assert t["gpu_total_us"].tolist() == [30, 30, 30] and t["cpu_us"].tolist() == [250, 60, 0]
    assert t["gpu_pct"].tolist() == [100, 100, 100]


def test_nesting_at_the_boundaries_of_a_node(tmp_path):
    """An operator starting where another ends is its sibling, not its child; of two starting at one
    time the longer holds the shorter (whatever the file's order); a launch at a range's start is
    inside it, one at its end is not."""
    ev = [step(1, 0, 1000),
          op("aten::a", 10, 10, 11), launch(1, 12, ext=11), kernel("ka", 1, 100, 1, ext=11),
          op("aten::b", 20, 10, 12), launch(2, 22, ext=12), kernel("kb", 2, 110, 2, ext=12),
          op("aten::inner", 40, 5, 14), op("aten::outer", 40, 20, 13),
          launch(3, 41, ext=14), kernel("k_inner", 3, 120, 4, ext=14),
          ann("## r ##", 500, 50), launch(4, 500, ext=900), kernel("at_start", 4, 600, 8, ext=900),
          launch(5, 550, ext=901), kernel("at_end", 5, 610, 16, ext=901)]  # fmt: skip
    t = hierarchy_of(tmp_path, ev).set_index("path")
    S = "ProfilerStep"
    assert t.loc[f"{S}{SEP}aten::b{SEP}kb", "depth"] == 2 and t.loc[f"{S}{SEP}aten::a", "gpu_total_us"] == 1
    assert t.loc[f"{S}{SEP}aten::outer{SEP}aten::inner{SEP}k_inner", "gpu_total_us"] == 4
    assert t.loc[f"{S}{SEP}## r ##{SEP}at_start", "gpu_total_us"] == 8
    assert t.loc[f"{S}{SEP}at_end", "gpu_total_us"] == 16 and t.loc[S, "gpu_self_us"] == 16
    assert t.loc[S, "gpu_total_us"] == 1 + 2 + 4 + 8 + 16
    assert_depth_first(t.reset_index())


@pytest.mark.parametrize("other_first", [True, False])
def test_another_threads_work_hangs_under_the_main_threads_range_not_its_operator(tmp_path, other_first):
    """Thread 2's backward function starts inside ## backward ## and inside a main-thread operator:
    it hangs under the range (ranges and frames only), its own aten::mm under it, wherever thread 2's
    events stand in the file; one starting before any main-thread node is a top row of its own."""
    main = [step(1, 100, 900), ann("## backward ##", 200, 500), op("aten::copy_", 250, 100, 11)]
    other = [op("MmBackward0", 260, 50, 30, tid=2), op("aten::mm", 265, 40, 31, tid=2),
             launch(1, 270, tid=2, ext=31), kernel("gemm_bwd", 1, 300, 40, ext=31),
             op("early_op", 10, 20, 32, tid=2), launch(2, 15, tid=2, ext=32),
             kernel("early_k", 2, 50, 9, ext=32)]  # fmt: skip
    t = hierarchy_of(tmp_path, other + main if other_first else main + other).set_index("path")
    B = f"ProfilerStep{SEP}## backward ##"
    assert t.loc[f"{B}{SEP}MmBackward0{SEP}aten::mm{SEP}gemm_bwd", "gpu_total_us"] == 40
    assert t.loc[f"{B}{SEP}MmBackward0", "depth"] == 2 and t.loc[B, "gpu_total_us"] == 40
    assert t.loc[f"{B}{SEP}MmBackward0", "cpu_us"] == 50 and t.loc[B, "gpu_self_us"] == 0
    assert t.loc["early_op", "depth"] == 0 and t.loc[f"early_op{SEP}early_k", "gpu_total_us"] == 9
    assert t.loc["early_op", "gpu_pct"] == pytest.approx(100 * 9 / 49)
    assert t.index.tolist()[0] == "ProfilerStep"  # the larger top row first
    assert_depth_first(t.reset_index())


def test_a_selection_without_kernel_time_is_an_empty_tree(tmp_path):
    ev = [step(1, 0, 100), op("aten::mm", 10, 10, 11), launch(1, 200, ext=11), kernel("late", 1, 300, 5, ext=11)]
    t = hierarchy_of(tmp_path, ev, scope="steps")  # the kernel is launched after the step
    assert t.empty and list(t.columns) == ["path", "depth", "name", "kind", "parent", "count", "gpu_total_us",
                                           "gpu_self_us", "cpu_us", "kernels", "gpu_pct"]  # fmt: skip


def test_the_fixture_tree_is_depth_first(tree):
    assert_depth_first(tree)


def test_plain_text_columns_give_the_same_tree(tmp_path):
    """The reader's text columns are categorical; a trace or a kernel table whose names and threads
    are plain text (a table filtered, joined or built by hand) gives the same tree."""
    ta = TraceAnalysis(write(tmp_path / "t.json", EVENTS), workers=1)
    trace, att, k = ta.traces[0], ta.attributed(0), ta.kernels(0, "all")
    want = hierarchy_tree(trace, att, k)
    assert isinstance(trace.host["name"].dtype, pd.CategoricalDtype)
    plain = dataclasses.replace(trace, host=trace.host.astype({"name": object, "cat": object, "tid": object}))
    got = hierarchy_tree(plain, att, k.astype({"name": object}))
    pd.testing.assert_frame_equal(got, want)
    assert len(got) == 9 and got["gpu_total_us"].iloc[0] == 100


TEMPLATED = "void k<at::Functor<float> > >(at::Functor<float> > const&)"  # " > " inside, as C++ names write it


def test_a_name_holding_the_separator_keeps_its_row_under_its_parent(tmp_path):
    """Kernel names of templated C++ (``MulFunctor<float> > const&``) and user ranges may hold the
    path separator: the row still hangs under its operator, one level down, and the operator's
    total is its children's."""
    ev = [step(1, 0, 1000), op("aten::mul", 10, 50, 11), launch(1, 20, ext=11), kernel(TEMPLATED, 1, 100, 25, ext=11),
          ann(f"outer{SEP}inner", 200, 300), op("aten::add", 210, 20, 12), launch(2, 215, ext=12),
          kernel("add_k", 2, 400, 5, ext=12)]  # fmt: skip
    t = hierarchy_of(tmp_path, ev, scope="steps").set_index("path")
    op_path = f"ProfilerStep{SEP}aten::mul"
    row = t.loc[f"{op_path}{SEP}{TEMPLATED}"]
    assert (row["name"], row["kind"], row["depth"], row["parent"], row["gpu_total_us"]) == (
        TEMPLATED, "kernel", 2, op_path, 25)  # fmt: skip
    assert t.loc[op_path, "gpu_total_us"] == 25 and t.loc[op_path, "gpu_self_us"] == 25
    rng = f"ProfilerStep{SEP}outer{SEP}inner"
    assert (t.loc[rng, "depth"], t.loc[rng, "name"], t.loc[rng, "gpu_total_us"]) == (1, f"outer{SEP}inner", 5)
    assert t.loc[f"{rng}{SEP}aten::add", "parent"] == rng and t.loc[f"{rng}{SEP}aten::add", "depth"] == 2
    assert t.loc["ProfilerStep", "gpu_total_us"] == 30
    assert_depth_first(t.reset_index())


@pytest.mark.parametrize("job", ["v100_single_rank", "ddp_a100_nccl"])
def test_on_real_jobs_every_row_is_its_childrens_sum(job):
    """On real CUDA jobs (whose elementwise kernels' names hold ``> >``), every row's total is its
    own kernels' time plus its children's, and the top rows hold all the selection's kernel time."""
    folder = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "gpu-traces" / job
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent (the shared real traces)")
    ta = TraceAnalysis(folder, workers=1)
    r = ta.ranks[0]
    t = ta.hierarchy(r)
    assert t.loc[t["depth"] == 0, "gpu_total_us"].sum() == pytest.approx(float(ta.kernels(r)["dur"].sum()))
    kids = t.groupby("parent")["gpu_total_us"].sum()
    kernel_kids = t[t["kind"] == "kernel"].groupby("parent")["gpu_total_us"].sum()
    inner = t[t["kind"] != "kernel"].set_index("path")
    assert inner["gpu_total_us"].to_numpy() == pytest.approx(kids.reindex(inner.index).to_numpy())
    assert inner["gpu_self_us"].to_numpy() == pytest.approx(kernel_kids.reindex(inner.index).fillna(0.0).to_numpy())
    assert not t.duplicated(["path", "kind"]).any()
