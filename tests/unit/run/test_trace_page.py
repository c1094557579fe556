"""trace.html a person can read: the step timeline, the Perfetto export, readable numbers, verdicts
as sentences, legends outside the plots; on small Kineto traces written here with known answers."""

from __future__ import annotations

import gzip
import json
import re

import browser_util as B
import pandas as pd
import pytest
from bokeh.models import Legend

from lab_utils.core.config import ConfigError
from lab_utils.core.records import load_records
from lab_utils.run import trace_cli
from lab_utils.run.cli import main as perflab
from lab_utils.run.commands import trace as trace_args
from lab_utils.run.trace_analyses import job_timeline
from lab_utils.run.trace_cli import page_job
from lab_utils.run.trace_html import fmt_num, fmt_us, headline, timeline_figure
from lab_utils.traces import TraceAnalysis, read_rank
from lab_utils.traces.perfetto import perfetto_trace
from lab_utils.traces.timeline import representative_step, step_timeline
from unit.traces.test_collectives import ann, kernel, launch, op, step, write

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def rank_events(durs, *, shift=0.0, nccl_late=0.0, rank=0):
    """Steps of host duration ``durs`` (us) back to back; in each: ``## forward ##`` holding an
    ``aten::mm`` that launches a GEMM (stream 7, 40 us), then an all-reduce launched on stream 20
    (``nccl_late`` us later on this rank)."""
    ev, t, c = [], shift, 1
    for n, d in enumerate(durs, start=1):
        ev += [step(n, t, d), ann("## forward ##", t + 5, 30)]
        ev += [
            op("aten::mm", t + 10, 10, 100 * n),
            launch(c, t + 12, ext=100 * n),
            kernel("sm80_xmma_gemm", c, t + 20, 40, ext=100 * n),
        ]
        ev += [launch(c + 1, t + 50 + nccl_late), kernel(NCCL, c + 1, t + 70 + nccl_late, 15, stream=20, **{
            "Collective name": "allreduce", "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float",
            "Group size": 2})]  # fmt: skip
        t, c = t + d, c + 2
    return ev


def job(folder, durs=(100, 300, 200), ranks=2, late=0.0):
    folder.mkdir(exist_ok=True)
    for r in range(ranks):
        ev = rank_events(durs, shift=5.0 * r, nccl_late=late if r == ranks - 1 else 0.0, rank=r)
        write(folder / f"rank{r}.json", ev, distributedInfo={"rank": r, "world_size": ranks})
    return folder


def analysed(path):
    ta = TraceAnalysis(path, workers=1)
    return ta, {r: ta.attributed(r) for r in ta.ranks}


@pytest.mark.parametrize("durs,want", [((100, 300, 200), 3), ((100, 400, 200, 300), 3), ((250,), 1)])
def test_the_representative_step_is_the_median_duration_one(tmp_path, durs, want):
    """Odd count: the middle one; even: the shorter of the two middle ones; one step: it."""
    _, atts = analysed(job(tmp_path / "j", durs, ranks=1))
    assert representative_step(atts[0]) == want


def test_timeline_of_a_step_per_rank_and_stream(tmp_path):
    """Step 3 (ts 400..600 on rank 0, 5 us later on rank 1): per rank a range lane, the CPU op,
    stream 7's GEMM and stream 20's NCCL lane, in ms from rank 0's step start."""
    ta, atts = analysed(job(tmp_path / "j"))
    tl = step_timeline(ta.traces, atts)
    assert tl.step == 3 and tl.steps == [1, 2, 3] and tl.merged == 0
    assert tl.lanes == [f"r{r} · {x}" for r in (0, 1) for x in ("ranges 1", "CPU ops", "stream 7", "stream 20 · NCCL")]
    b = tl.bars.set_index(["lane"])
    assert len(tl.bars) == 8
    gemm1 = b.loc["r1 · stream 7"]
    assert gemm1["name"] == "sm80_xmma_gemm" and gemm1["category"] == "matmul"
    assert gemm1["start_ms"] == pytest.approx((400 + 5 + 20 - 400) / 1e3) and gemm1["dur_us"] == pytest.approx(40)
    assert gemm1["op"] == "aten::mm" and gemm1["phase"] == "forward"
    assert b.loc["r0 · stream 20 · NCCL", "category"] == "communication"
    assert b.loc["r0 · ranges 1", "category"] == "phase: forward"
    assert b.loc["r0 · CPU ops", "start_ms"] == pytest.approx(0.010)
    assert set(step_timeline(ta.traces, atts, 1).bars["start_ms"].round(4)) >= {0.005, 0.01, 0.02, 0.07}  # step 1
    with pytest.raises(ConfigError, match="step"):
        step_timeline(ta.traces, atts, 7)


def test_short_activities_beyond_the_limit_are_merged_per_lane_and_bin(tmp_path):
    """100 kernels in one step: 10 of 100 us, 90 of 1 us in 9 runs of 10 (one per 1/1000 of the
    step): with max_bars=20 the 10 long ones stay and each run becomes one bar of 10."""
    ev, c = [step(1, 0, 100_000)], 1
    for i in range(10):
        ev += [launch(c, 10 + 10_000 * i), kernel("sm80_xmma_gemm", c, 20 + 10_000 * i, 100)]
        c += 1
    for run in range(9):
        for j in range(10):
            t = 5_000 + 10_000 * run + 5 * j  # 10 kernels inside one 100 us bin
            ev += [launch(c, t - 2), kernel("vectorized_elementwise_kernel", c, t, 1)]
            c += 1
    ta, atts = analysed(write(tmp_path / "t.json", ev))
    tl = step_timeline(ta.traces, atts, max_bars=20)
    kinds = tl.bars["kind"].value_counts().to_dict()
    assert kinds == {"kernel": 10, "merged": 9}
    merged = tl.bars[tl.bars["kind"] == "merged"]
    assert (merged["count"] == 10).all() and merged["dur_us"].tolist() == pytest.approx([46.0] * 9)
    assert tl.merged == 90 and tl.merged_below_us == 100
    assert tl.note.startswith("90 activities shorter than 100 µs are merged into 9 bars")
    assert len(step_timeline(ta.traces, atts, max_bars=200).bars) == 100  # under the limit: nothing merged


# -- numbers and sentences ------------------------------------------------------------------
@pytest.mark.parametrize(
    "us,text",
    [(12_345.6, "12.35 ms"), (0.5, "0.500 µs"), (45.67, "45.7 µs"), (2.5e6, "2.50 s"), (250_000, "250.0 ms"), (0, "0")],
)
def test_times_read_in_ms_and_us(us, text):
    assert fmt_us(us) == text


@pytest.mark.parametrize("v", [1.2e-5, 3.4e-9, 7.0e12, 123456789.0, -2.5e-7, 1e21])
def test_no_number_is_printed_in_scientific_notation(v):
    assert not re.search(r"\d[eE][+-]?\d", fmt_num(v)) and not re.search(r"\d[eE][+-]?\d", fmt_us(v))


def test_fmt_num_keeps_a_few_significant_digits():
    assert fmt_num(1234567.0) == "1,234,567" and fmt_num(12.345) == "12.3" and fmt_num(0.0123456) == "0.0123"
    assert fmt_num(7) == "7" and fmt_num(True) == "yes" and fmt_num(float("nan")) == "–"


def test_page_has_the_timeline_sentences_and_readable_tables(tmp_path, capsys):
    """A 2-rank job whose rank 1 is 30 us late to every all-reduce: the straggler verdict is a
    sentence (no Python dict anywhere), the tables hold no scientific notation, the timeline and
    the Perfetto file are written."""
    out = tmp_path / "out"
    assert perflab(["trace", str(job(tmp_path / "j", late=30.0)), "--out", str(out), "--workers", "1"]) == 0
    text = capsys.readouterr().out
    assert "straggler: rank 1 is the straggler" in text and "{'" not in text
    page = (out / "trace.html").read_text()
    verdicts = re.search(r"<ul class='verdicts'>(.*?)</ul>", page, re.S).group(1)
    assert "<li>Rank 1 is the straggler" in verdicts and "3 collectives" in verdicts
    prose = re.sub(r"<script.*?</script>", "", page, flags=re.S)  # BokehJS and the plots' data aside
    assert "{'" not in prose and "&#x27;rank&#x27;:" not in prose
    cells = re.findall(r"<td[^>]*>(.*?)</td>", page)
    assert cells and not [c for c in cells if re.search(r"\d[eE][+-]?\d", c)]
    assert "step 3 (one of 3 steps)" in page and "sm80_xmma_gemm" in page
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert (out / "trace.perfetto.json.gz").is_file()


def test_legends_sit_outside_the_plot_area(tmp_path):
    ta, atts = analysed(job(tmp_path / "j"))
    fig = timeline_figure(step_timeline(ta.traces, atts))
    assert [type(m) for m in fig.right] == [Legend] and not [m for m in fig.center if isinstance(m, Legend)]
    labels = [i.label["value"] for i in fig.right[0].items]
    assert {"matmul", "communication", "CPU op", "phase: forward"} <= set(labels)


def test_headline_is_sentences_for_a_big_job():
    rows = [{"rank": r, "span": 1e5, "idle_pct": 10.0 + r, "compute_pct": 80.0, "communication_pct": 5.0,
             "memory_pct": 1.0} for r in range(8)]  # fmt: skip
    fig = {"temporal": rows, "idle": [], "overlap": [], "launch": [], "devices": {}, "top_kernels": {}}
    lines = headline(fig)
    assert lines[0] == (
        "Over 8 ranks the GPU computes a median 80.0% of the steps and is idle 13.5%; the most idle is rank 7 (17.0%)."
    )
    assert all(s.endswith(".") and s[0].isupper() for s in lines)


def test_a_step_the_trace_lacks_is_refused_naming_it_and_nothing_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    assert perflab(["trace", str(job(tmp_path / "j", ranks=1)), "--out", str(out), "--step", "9"]) == 2
    err = capsys.readouterr().err
    assert "'--step' = 9" in err and "[1, 2, 3]" in err
    assert not out.exists() or not any(out.iterdir())


# -- the Perfetto export ---------------------------------------------------------------------
def check_trace_event_json(doc: dict) -> dict:
    """The Trace Event Format's JSON object form, as Perfetto's importer reads it: the required
    fields of each phase, processes and threads named by metadata events, slices nesting on each
    thread, flow starts matched by flow ends.  Returns the X events by (pid, tid)."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    names, threads, tracks, flows = {}, {}, {}, {}
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M", "s", "f"), e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
            assert isinstance(e["args"], dict) and e["args"]
            if e["name"] == "process_name":
                names[e["pid"]] = e["args"]["name"]
            if e["name"] == "thread_name":
                threads[(e["pid"], e["tid"])] = e["args"]["name"]
            continue
        assert isinstance(e["tid"], int) and isinstance(e["ts"], int | float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0 and isinstance(e.get("args", {}), dict)
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
        else:
            flows.setdefault(e["id"], {})[e["ph"]] = e
    for (pid, tid), evs in tracks.items():
        assert pid in names and (pid, tid) in threads, f"track {(pid, tid)} is not named"
        stack = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-9, f"{e['name']} does not nest on {pid}/{tid}"
            stack.append(e["ts"] + e["dur"])
    for fid, pair in flows.items():
        assert set(pair) == {"s", "f"} and pair["s"]["ts"] <= pair["f"]["ts"], fid
    return tracks


def test_perfetto_export_is_valid_trace_event_json_with_the_attribution(tmp_path, capsys):
    folder = job(tmp_path / "j")
    out = tmp_path / "out"
    assert perflab(["trace", str(folder), "--out", str(out), "--perfetto", "all", "--workers", "1"]) == 0
    with gzip.open(out / "trace.perfetto.json.gz", "rt") as fh:
        doc = json.load(fh)
    tracks = check_trace_event_json(doc)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "rank 0 · host", 2: "rank 0 · GPU", 3: "rank 1 · host", 4: "rank 1 · GPU"}
    ta = TraceAnalysis(folder, workers=1)
    for r in ta.ranks:
        k = ta.kernels(r).set_index("correlation")
        got = {e["args"]["correlation"]: e for (pid, _), evs in tracks.items() if pid == 2 * r + 2 for e in evs}
        assert set(got) == set(k.index)
        for corr, e in got.items():
            row = k.loc[corr]
            assert e["name"] == row["name"] and e["tid"] == row["stream"]
            want = {x: (None if pd.isna(row[x]) else row[x]) for x in ("step", "phase", "category", "op")}
            assert {x: e["args"][x] for x in want} == want
            assert e["ts"] == pytest.approx(ta.traces[r].t0_us + row["ts"]) and e["dur"] == pytest.approx(row["dur"])
    n_flows = sum(e["ph"] == "s" for e in doc["traceEvents"])
    assert n_flows == sum(len(ta.kernels(r)) for r in ta.ranks)  # one launch arrow per activity
    back = tmp_path / "back.json"  # the export reads back as a trace: the same kernels, the same times
    back.write_text(json.dumps({"traceEvents": [e for e in doc["traceEvents"] if e["pid"] in (1, 2)]}))
    again = read_rank(back).gpu.sort_values("ts")
    orig = ta.traces[0].gpu.sort_values("ts")
    assert list(again["name"].astype(str)) == list(orig["name"].astype(str))
    assert (again["ts"].to_numpy() - again["ts"].min()) == pytest.approx(orig["ts"].to_numpy() - orig["ts"].min())


def test_perfetto_keeps_events_that_do_not_nest_on_a_thread_of_their_own(tmp_path):
    ev = [step(1, 0, 1000), ann("a", 10, 100), ann("b", 50, 150), launch(1, 20), kernel("k", 1, 30, 5)]
    ta, atts = analysed(write(tmp_path / "t.json", ev))
    doc = perfetto_trace(ta.traces, atts)
    tracks = check_trace_event_json(doc)
    host = {e["name"]: e["tid"] for (pid, _), evs in tracks.items() if pid == 1 for e in evs}
    assert set(host) == {"ProfilerStep#1", "a", "b", "cudaLaunchKernel"}
    assert host["a"] == host["ProfilerStep#1"] != host["b"]
    thread = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 1}
    assert thread[host["b"]] == "thread 1 (overlap 1)"
    only = perfetto_trace(ta.traces, atts, steps=1)
    assert len([e for e in only["traceEvents"] if e["ph"] == "X"]) == 5


@pytest.mark.skipif(B.skip_reason() is not None, reason=str(B.skip_reason()))
def test_the_page_draws_in_chromium_and_asks_the_network_for_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert perflab(["trace", str(job(tmp_path / "j", late=30.0)), "--out", str(out), "--workers", "1"]) == 0
    with B.browser(tmp_path / "chrome") as ctx:
        page = ctx.new_page()
        watch = B.Watch.on(page)
        page.goto((out / "trace.html").as_uri())
        ps = B.wait_for_plots(page, 4)  # the timeline, the launch queue, the two breakdowns
        assert len(ps) == 4 and not B.undrawn(ps), ps
        assert ps[0]["height"] >= 8 * 22, "the timeline has a row per lane"
        assert not watch.errors and not watch.outside and not ctx.blocked


def test_trace_json_page_and_records_carry_the_analyses(tmp_path, capsys):
    """The critical path of the timeline's step, the call tree, the sequences and the idle per
    stream reach trace.json, the summary, the page and the records, with the figures of a direct call."""
    folder = job(tmp_path / "j")
    out = tmp_path / "out"
    assert perflab(["trace", str(folder), "--out", str(out), "--workers", "1"]) == 0
    text = capsys.readouterr().out
    assert "rank 0 critical path of step 3:" in text and "idle per stream (ms)" in text
    fig = json.loads((out / "trace.json").read_text())
    ta = TraceAnalysis(folder, workers=1)
    cp = ta.critical_path(0, 3)
    got = fig["analyses"]["0"]["critical_path"]
    assert got["step"] == 3 and got["length_us"] == pytest.approx(cp.length_us) and cp.length_us > 0
    assert got["by_bound"] == pytest.approx(cp.by_bound())
    assert {r["path"] for r in fig["analyses"]["1"]["hierarchy"]} >= {"ProfilerStep > ## forward ## > aten::mm"}
    assert fig["analyses"]["0"]["sequences"] == []  # one kernel per stream and step: no sequence repeats
    assert {(r["rank"], r["stream"]) for r in fig["stream_idle"]} == {(0, 7), (0, 20), (1, 7), (1, 20)}
    page = (out / "trace.html").read_text()
    for heading in ("critical path, rank 0, step 3", "call tree, rank 1", "idle per stream", "launch outliers, rank 0"):
        assert f"<h2>{heading}" in page, heading
    assert "The critical path of step 3 on rank 0 is" in page
    # the launch queue over step 3 (400..600 us): empty at its start, one kernel queued 412..420 on
    # stream 7 and one all-reduce 450..470 on stream 20; no copy, so no bandwidth plot
    series = fig["analyses"]["0"]["series"]
    assert series["step"] == 3 and series["memory_bw"] == []
    by_stream = {st: [x for r in series["queue"] if r["stream"] == st for x in (r["ts"], r["queue_length"])]
                 for st in (7, 20)}  # fmt: skip
    assert by_stream[7] == pytest.approx([0.0, 0.0, 0.012, 1.0, 0.020, 0.0])
    assert by_stream[20] == pytest.approx([0.0, 0.0, 0.050, 1.0, 0.070, 0.0])
    assert "launch queue per stream over step 3" in page and "memory bandwidth in flight" not in page
    tl = ta.timeline(3, paths={0: cp.edges})
    assert tl.lanes[0] == "r0 · critical path" and (tl.bars["kind"] == "path").sum() == (cp.edges["weight"] > 0).sum()
    rows = load_records(out / "records.json")
    per_step = rows[(rows["metric"] == "critical_path") & (rows["variant"] == "rank0")].iloc[0]
    assert list(per_step["samples"]) == pytest.approx([ta.critical_path(0, s).length_us / 1e3 for s in (1, 2, 3)])


def test_the_pages_step_is_the_first_files_median_step_and_each_rank_is_read_once(tmp_path, capsys, monkeypatch):
    """Rank 0's median-duration step is 3, rank 1's is 2: the first file's step annotations are read
    before the ranks' jobs start, so both ranks draw step 3 in one pass (one map of the jobs, no rank
    read twice); ``--step 1`` draws step 1."""
    folder = tmp_path / "j"
    folder.mkdir()
    for r, durs in ((0, (100, 300, 200)), (1, (100, 200, 300))):
        write(folder / f"rank{r}.json", rank_events(durs, rank=r), distributedInfo={"rank": r, "world_size": 2})
    maps = []
    real = trace_cli._job
    monkeypatch.setattr(trace_cli, "_job", lambda *args, **kw: maps.append(args[2:] or kw) or real(*args, **kw))
    out = tmp_path / "out"
    assert perflab(["trace", str(folder), "--out", str(out), "--workers", "1"]) == 0
    assert len(maps) == 1 and maps[0][0]["step"] == 3
    fig = json.loads((out / "trace.json").read_text())
    assert fig["timeline_step"] == 3
    assert {r: a["critical_path"]["step"] for r, a in fig["analyses"].items()} == {"0": 3, "1": 3}
    a = trace_args.parser().parse_args([str(folder), "--workers", "1"])
    job, step = page_job(a)
    tl = job_timeline(job, step, a.max_bars)
    assert step == 3 and {"r0 · stream 7", "r1 · stream 7", "r1 · critical path"} <= set(tl.lanes)
    assert perflab(["trace", str(folder), "--out", str(out), "--workers", "1", "--step", "1"]) == 0
    fig = json.loads((out / "trace.json").read_text())
    assert {r: a["critical_path"]["step"] for r, a in fig["analyses"].items()} == {"0": 1, "1": 1}


def test_a_rank_whose_job_ended_on_another_step_is_read_again_for_the_pages_step(tmp_path, capsys, monkeypatch):
    """When the first file's steps cannot be read ahead (here: the look-ahead refuses), each rank's job
    picks its own median step and the rank that chose another is read again for the first rank's."""
    folder = tmp_path / "j"
    folder.mkdir()
    for r, durs in ((0, (100, 300, 200)), (1, (100, 200, 300))):
        write(folder / f"rank{r}.json", rank_events(durs, rank=r), distributedInfo={"rank": r, "world_size": 2})

    def refuse(path):
        raise ConfigError("path", str(path), "a readable trace")

    monkeypatch.setattr(trace_cli, "read_steps", refuse)
    maps = []
    real = trace_cli._job
    monkeypatch.setattr(trace_cli, "_job", lambda *args, **kw: maps.append(args[2:]) or real(*args, **kw))
    out = tmp_path / "out"
    assert perflab(["trace", str(folder), "--out", str(out), "--workers", "1"]) == 0
    assert len(maps) == 2 and maps[0][0]["step"] is None and maps[1][0]["step"] == 3 and maps[1][1] == [1]
    fig = json.loads((out / "trace.json").read_text())
    assert {r: a["critical_path"]["step"] for r, a in fig["analyses"].items()} == {"0": 3, "1": 3}
