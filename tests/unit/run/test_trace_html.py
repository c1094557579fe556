"""lab_utils.run.trace_html: what a person reads on ``trace.html``: numbers and units at their
thresholds (1,000 B is 1 kB, 1,000 µs is 1 ms, a share of 0.25 is 25%), table cells by what their
column holds, a table's and the call tree's row limits, the headline's sentences on a figures dict
written here (a sentence per rank up to ``max_ranks`` ranks), and the per-rank and per-step plots'
rows in ms."""

from __future__ import annotations

import pytest

from lab_utils.run.trace_html import (
    _time_plots,
    analysis_sentences,
    cell,
    fmt_bytes,
    fmt_num,
    fmt_pct,
    fmt_us,
    headline,
    launch_sentence,
    path_sentence,
    rank_sentence,
    table,
    tree_table,
)


@pytest.mark.parametrize(
    "v, text",
    [(999, "999 B"), (1000, "1.00 kB"), (1500, "1.50 kB"), (999_999, "1000 kB"), (1e6, "1.00 MB"), (2.5e9, "2.50 GB"),
     (0, "0 B"), (None, "–"), (float("nan"), "–")],
)  # fmt: skip
def test_bytes_at_their_unit_thresholds(v, text):
    assert fmt_bytes(v) == text


@pytest.mark.parametrize(
    "v, text",
    [(999.9, "1000 µs"), (1000.0, "1.00 ms"), (99_999.0, "100.00 ms"), (1e5, "100.0 ms"),
     (999_999.0, "1,000.0 ms"), (1e6, "1.00 s"), (-1500.0, "-1.50 ms"), (None, "–")],
)  # fmt: skip
def test_microseconds_at_their_unit_thresholds(v, text):
    assert fmt_us(v) == text


def test_numbers_and_percents():
    assert (fmt_num(999.5), fmt_num(1000.4), fmt_num(0.5), fmt_num(-0.00123)) == ("1000", "1,000", "0.500", "-0.00123")
    assert (fmt_num(12), fmt_num(False), fmt_num(0.0), fmt_num(None)) == ("12", "no", "0", "–")
    assert (fmt_pct(12.345), fmt_pct(None), fmt_pct(float("inf"))) == ("12.3%", "–", "–")


@pytest.mark.parametrize(
    "key, value, text",
    [("name", "a<b>", "a&lt;b&gt;"), ("name", None, ""), ("launch_bound", True, "yes"), ("span", 1500.0, "1.50 ms"),
     ("delay_us", 12.0, "12.0 µs"), ("window_ms", 1.5, "1.50 ms"), ("wait_us_rank3", 2000.0, "2.00 ms"),
     ("idle_pct", 12.5, "12.5%"), ("pct", 3.0, "3.0%"), ("share_of_step", 50.0, "50.0%"),
     ("share_computation", 75.0, "75.0%"), ("idle_share", 0.25, "25.0%"), ("host_wait_share_of_idle", 0.5, "50.0%"),
     ("bytes", 2048.0, "2.05 kB"), ("hbm_bytes", 1e9, "1.00 GB"), ("busbw_gbps", 123.456, "123 GB/s"),
     ("busbw_gbps", None, ""), ("count", 12345, "12,345"), ("ratio", 0.5, "0.500"), ("window_ms", None, "–")],
)  # fmt: skip
def test_a_cell_is_formatted_by_what_its_column_holds(key, value, text):
    assert cell(key, value) == text


def test_a_table_shows_fifty_rows_and_says_how_many_more():
    rows = [{"name": f"k{i}", "total": 10.0 * i} for i in range(51)]
    html = table(rows)
    assert html.count("<tr>") == 51 and "1 more rows in trace.json" in html  # the head and 50 rows
    assert "k49" in html and "k50" not in html
    assert "more rows" not in table(rows[:50]) and table(rows, limit=10).count("<tr>") == 11
    assert table([]) == "<p class='muted'>none</p>"
    right = table([{"name": "x", "total": 1.0}], labels={"total": "GPU time"})
    assert "<th class=''>name</th><th class='r'>GPU time</th>" in right and "<td class='r'>1.00 µs</td>" in right
    assert table([{"a": 1}], cols=["b", "a"]).count("<th") == 1  # a column no row has is left out


def test_one_ranks_sentence_names_what_its_time_went_to():
    t = {"span": 2000.0, "compute_pct": 70.0, "communication_pct": 20.0, "memory_pct": 0.05, "idle_pct": 9.95}
    s = rank_sentence(0, t, "NVIDIA H100", {"idle": 100.0, "host_wait": 25.0}, 60.0)
    assert s == (
        "Rank 0 (NVIDIA H100): over 2.00 ms of steps the GPU computes 70.0%, waits on communication not "
        "hidden by compute 20.0% and is idle 9.9% (of which 25% waiting for the host). Compute hides 60% "
        "of its communication time."
    )  # fmt: skip  (memory at 0.05%: not said)
    bare = rank_sentence(2, {"span": 10.0, "compute_pct": 0.0, "communication_pct": 0.05, "idle_pct": 100.0}, None,
                         {"idle": 0.0}, float("nan"))  # fmt: skip
    assert bare == "Rank 2 (device not recorded): over 10.0 µs of steps the GPU computes 0.0% and is idle 100.0%."


def test_launch_and_path_sentences():
    assert launch_sentence(1, {"launch_bound": False, "reason": "not launch-bound: idle 5% of the span < 20%"}) == (
        "Rank 1 is not launch-bound: idle 5% of the span < 20%."
    )
    assert launch_sentence(0, {"launch_bound": True, "reason": "launch-bound: kernels short."}) == (
        "Rank 0 is launch-bound: launch-bound: kernels short."
    )
    cp = {"step": 3, "length_us": 1500.0, "window_us": 2000.0, "share_of_step": 75.0,
          "by_bound": {"gpu_compute_bound": 60.0, "cpu_bound": 39.6, "gpu_kernel_launch_overhead": 0.4},
          "events": [{"name": "", "us": 5.0, "pct": 0.3},
                     {"name": "void at::native::gemm_kernel<float>(int)", "us": 900.0, "pct": 60.0}]}  # fmt: skip
    assert path_sentence("0", cp) == (
        "The critical path of step 3 on rank 0 is 1.50 ms (75% of the step's 2.00 ms): 60% GPU compute, 40% host "
        "work; the most of it is at::native::gemm_kernel (900 µs, 60%)."
    )
    assert path_sentence("1", cp | {"share_of_step": None, "by_bound": {}, "events": []}) == (
        "The critical path of step 3 on rank 1 is 1.50 ms: nothing on it."
    )


def figures(n_ranks=2):
    temporal = [{"rank": r, "span": 1000.0, "idle_pct": 10.0 * (r + 1), "compute_pct": 80.0, "communication_pct": 0.0,
                 "memory_pct": 0.0} for r in range(n_ranks)]  # fmt: skip
    return {"temporal": temporal, "idle": [], "overlap": [{"rank": r, "overlap_pct": None} for r in range(n_ranks)],
            "launch": [{"rank": r, "launch_bound": r == 1, "reason": "x"} for r in range(n_ranks)],
            "devices": {str(r): "GPU" for r in range(n_ranks)},
            "top_kernels": {str(r): [{"name": f"void top{r}<int>(int)", "category": "matmul", "total": 500.0,
                                      "count": 1200, "pct": 50.0}] for r in range(n_ranks)}}  # fmt: skip


def test_the_headline_of_a_small_and_of_a_big_job():
    small = headline(figures(2))
    assert small[0].startswith("Rank 0 (GPU): over 1.00 ms") and small[1] == "Rank 0 is not launch-bound: x."
    assert small[3] == "Rank 1 is launch-bound: x."
    assert small[-1] == "The top kernel of rank 0 is top0 (matmul): 500 µs over 1,200 calls, 50.0% of its kernel time."
    assert len([s for s in small if s.startswith("The top kernel")]) == 1  # the first rank's
    big = headline(figures(5), max_ranks=4)
    assert big[0] == ("Over 5 ranks the GPU computes a median 80.0% of the steps and is idle 30.0%; the most idle is "
                      "rank 4 (50.0%).")  # fmt: skip
    assert big[1] == "Of the 5 ranks, 1 are launch-bound: [1]."
    assert [s for s in big if s.startswith("The top kernel")] == [
        "The top kernel of rank 0 is top0 (matmul): 500 µs over 1,200 calls, 50.0% of its kernel time."
    ]
    at_limit = headline(figures(4), max_ranks=4)  # exactly max_ranks: still a sentence per rank
    assert [s.split(" (")[0] for s in at_limit if s.startswith("Rank ") and "(GPU)" in s] == [
        "Rank 0", "Rank 1", "Rank 2", "Rank 3"
    ]  # fmt: skip
    assert not any(s.startswith("Over ") for s in at_limit)
    assert headline(figures(1), max_ranks=1)[0].startswith("Rank 0 (GPU)")  # one rank, one allowed
    assert headline(figures(2), max_ranks=1)[0].startswith("Over 2 ranks")  # one over: the summary
    fig = figures(1) | {"straggler": {"verdict": "no straggler: the most frequent last arrival (rank 0)"}}
    assert "No straggler: the most frequent last arrival (rank 0)." in headline(fig)


def test_analysis_sentences_of_the_ranks_shown():
    seq = {"short": "a → b", "count": 3, "total_us": 30.0, "gap_us": 6.0}
    cp = {"step": 1, "length_us": 10.0, "window_us": 20.0, "share_of_step": 50.0, "by_bound": {}, "events": []}
    fig = {"analyses": {"0": {"critical_path": cp, "sequences": [seq]}, "1": {"critical_path": None, "sequences": []}},
           "analysed_ranks": [0, 1]}  # fmt: skip
    out = analysis_sentences(fig, [0, 1])
    assert out[1] == ("The costliest repeated kernel sequence on rank 0 is a → b: 3 times, 30.0 µs of kernels and "
                      "6.00 µs of gaps between them (a fusion candidate).")  # fmt: skip
    assert len(out) == 2 and analysis_sentences(fig, [1]) == []
    assert len(analysis_sentences(fig, [])) == 2  # many ranks: the first analysed one


def test_the_per_rank_plot_reads_ms():
    """A rank's span parts are µs in the figures and ms on the plot; a part the table lacks is 0."""
    fig = {"temporal": [{"rank": 0, "compute": 2500.0, "communication": 1000.0, "idle": 250.0},
                        {"rank": 3, "compute": 1.0, "communication": 0.0, "idle": 1e6}],
           "temporal_by_step": []}  # fmt: skip
    (plot,) = _time_plots(fig)
    data = plot.renderers[0].data_source.data
    assert data["row"] == ["rank 0", "rank 3"]
    assert data["compute"] == [2.5, 0.001] and data["communication"] == [1.0, 0.0]
    assert data["idle"] == [0.25, 1000.0] and data["memory"] == [0.0, 0.0] and data["other"] == [0.0, 0.0]
    assert _time_plots({"temporal": [], "temporal_by_step": []}) == []


def test_the_per_step_plot_reads_ms_per_rank_and_step():
    fig = {"temporal": [], "temporal_by_step": [{"rank": 0, "step": 7, "compute": 1500.0, "idle": 500.0},
                                                 {"rank": 1, "step": 7, "compute": 1000.0, "idle": 0.0}]}  # fmt: skip
    (plot,) = _time_plots(fig)
    data = plot.renderers[0].data_source.data
    assert data["row"] == ["rank 0 · step 7", "rank 1 · step 7"]
    assert data["compute"] == [1.5, 1.0] and data["idle"] == [0.5, 0.0] and data["memory"] == [0.0, 0.0]


def test_the_call_tree_indents_by_depth():
    rows = [{"path": "a", "depth": 0, "name": "a", "kind": "range", "count": 1, "gpu_total_us": 10.0,
             "gpu_self_us": 0.0, "gpu_pct": 100.0, "cpu_us": 5.0},
            {"path": "a > b", "depth": 2, "name": "b<x>", "kind": "op", "count": 2, "gpu_total_us": 10.0,
             "gpu_self_us": 10.0, "gpu_pct": 100.0, "cpu_us": 1.0}]  # fmt: skip
    html = tree_table(rows)
    assert "<td title='a &gt; b'>" + "&nbsp;" * 8 + "b&lt;x&gt;</td>" in html and html.count("<tr>") == 3
    assert tree_table([]) == "<p class='muted'>none</p>" and tree_table(rows, limit=1).count("<tr>") == 2
    many = [rows[0] | {"path": f"p{i}", "name": f"n{i}"} for i in range(121)]
    page = tree_table(many)  # by default the first 120 rows: the head and 120
    assert page.count("<tr>") == 121 and "title='p119'" in page and "title='p120'" not in page
    assert tree_table(many[:120]).count("<tr>") == 121
