"""lab_utils.traces.hierarchy: where a kernel hangs when no host event holds its launch, a thread
without any host node, the tree's sums (a node's total is its children's, the top rows add up to the
kernel time), and the cut of :func:`top_levels` at its share threshold itself."""

from __future__ import annotations

import pandas as pd
import pytest

from lab_utils.traces import TraceAnalysis
from lab_utils.traces.hierarchy import NO_HOST, SEP, top_levels

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
