"""lab_utils.run.trace_cli: which rank files carry the page's extras (the first eight), how many workers
a folder's ranks start (one per file at most, never more than asked) and where (the command's resolved
cluster, else the arguments'), the page's step (no look-ahead for one file; a rank that chose another
read again alone), the figures and the text summary of a job with collectives (one rank and two, the
headline first), how two jobs' ranks pair and the rows only one side ran are filled with zeros and
counted, the records' context, ``main`` for both commands, and the page of a file with two cores of
the pool analysed in a forked child (the same page as in one process; made here if the child fails),
on small traces written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.run import trace_cli as T
from lab_utils.run.cluster import ClusterOptions
from lab_utils.run.commands import trace as trace_args
from lab_utils.run.executors import MapOptions, Outcome
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.summary import JobSummary, summarise

from ..traces.kineto import H100, ann, kernel, launch, op, step, write

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"


def rank_events(late: float = 0.0, gemm_us: float = 100.0) -> list[dict]:
    args = {"In msg nelems": 262144, "Out msg nelems": 262144, "dtype": "Float", "Group size": 2}
    ev = []
    for s in range(3):
        t = 1000.0 * s
        ev += [step(s + 1, t, 1000), ann("## forward ##", t, 400), op("aten::mm", t + 10, 10, 10 + s),
               launch(10 + s, t + 12, ext=10 + s), kernel("sm90_gemm", 10 + s, t + 50, gemm_us, ext=10 + s),
               launch(20 + s, t + 500),
               kernel(NCCL, 20 + s, t + 600 + late, 100.0 - late, stream=9, **args)]  # fmt: skip
    return ev


def folder(tmp_path, n: int, **kw):
    d = tmp_path / f"job{n}"
    d.mkdir(parents=True)
    for r in range(n):
        write(d / f"r{r}.json", rank_events(**kw), distributedInfo={"rank": r, "world_size": n},
              deviceProperties=[H100])  # fmt: skip
    return d


OPTS = {"step": None, "max_bars": 1000, "perfetto": "none"}


def test_the_first_eight_rank_files_carry_the_page_and_the_rest_do_not(tmp_path):
    d = folder(tmp_path, 9)
    eighth = T.load_job(d, options=OPTS, only=[7]).ranks_[7]
    ninth = T.load_job(d, options=OPTS, only=[8]).ranks_[8]
    assert "bars" in eighth.extras and "figures" in eighth.extras
    assert "bars" not in ninth.extras and "figures" not in ninth.extras and "stream_idle" in ninth.extras
    assert "critical_path" in set(eighth.per_step["metric"]) and "critical_path" not in set(ninth.per_step["metric"])
    assert eighth.extras["step"] == 2 and ninth.extras["steps"] == [1, 2, 3]


def _refuse_in(path, *_a, **_k):
    raise ConfigError("path", str(path), f"a file read in process {os.getpid()}")


def test_a_lone_file_is_read_in_a_worker_while_the_callers_work_runs(tmp_path, monkeypatch):
    """With ``meanwhile``, a lone file of the pool executor is read in a forked worker (so the
    caller's work, the page's imports, overlaps the reading); without it, here."""
    d = folder(tmp_path, 1)
    monkeypatch.setattr(T, "read_rank", _refuse_in)  # the worker is forked from this state
    calls = []
    with pytest.raises(ConfigError) as e:
        T.load_job(d, options=OPTS, meanwhile=lambda: calls.append(os.getpid()))
    pid = int(str(e.value).split("process ")[1].split()[0].rstrip(")"))
    assert calls == [os.getpid()] and pid != os.getpid()
    with pytest.raises(ConfigError) as e:
        T.load_job(d, options=OPTS)
    assert f"process {os.getpid()}" in str(e.value)


def test_the_trace_command_module_loads_no_plotting_library_until_the_page_is_drawn():
    """bokeh is most of ``perflab trace``'s import time: it loads while the ranks are read."""
    code = "import sys, lab_utils.run.trace_cli; print(sorted(m for m in ('bokeh', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    assert out.stdout.strip() == "[]"


def job_of(tmp_path, ranks: int, **kw) -> JobSummary:
    ta = TraceAnalysis(folder(tmp_path, ranks, **kw), workers=1)
    return JobSummary([summarise(ta, r) for r in ta.ranks], "job")


def test_figures_and_summary_of_one_rank_and_of_two(tmp_path):
    one = job_of(tmp_path / "a", 1)
    fig = T.figures(one)
    assert "skew" not in fig and "straggler" not in fig and len(fig["collectives"]) == 3
    assert fig["ranks"] == [0] and fig["devices"] == {"0": H100["name"]}
    # the GEMM and the all-reduce both total 300 us: equal totals go in name order
    assert len(fig["top_kernels"]["0"]) == 2 and T.figures(one, top=1)["top_kernels"]["0"][0]["name"] == NCCL
    text = T.summary_text(one, fig)
    # three calls of 1 MiB in 100 us: 10.49 GB/s algorithm bandwidth, x 2(n-1)/n = 1 for two ranks
    assert "\n  0 all_reduce               3     0.300     10.49 |       nan" in text
    assert "collectives (rank, collective, calls, total ms" in text and "straggler" not in text
    assert "per step (ms): rank step span busy idle compute communication memory\n     0    1    0.650" in text
    # the headline first: the GPU's span runs from the first GEMM (50 us) to the last all-reduce's end
    # (2,700 us), 2,650 us holding 3 x 100 us of GEMM and 3 x 100 us of all-reduce alone
    assert ("\nin one look:\n  Rank 0 (NVIDIA H100 80GB HBM3): over 2.65 ms of steps the GPU computes 11.3%, waits "
            "on communication not hidden by compute 11.3% and is idle 77.4%") in text  # fmt: skip
    two = job_of(tmp_path / "b", 2, late=0.0)
    fig2 = T.figures(two)
    assert "skew" in fig2 and fig2["straggler"]["ranks"] == 2 and "straggler: no straggler" in T.summary_text(two, fig2)
    none = T.summary_text(one, fig | {"collectives": []})
    assert "collectives: none in this trace" in none


def test_ranks_pair_the_same_by_rank_one_each_by_position_else_pooled():
    assert T.pair_ranks([0, 1], [0, 1]) == ({0: "rank0", 1: "rank1"}, {0: "rank0", 1: "rank1"},
                                            "rank by rank (2 rank(s))")  # fmt: skip
    assert T.pair_ranks([3], [5]) == ({3: "rank"}, {5: "rank"}, "one rank each: rank 3 vs rank 5")
    assert T.pair_ranks([0, 1], [4, 6]) == ({0: "rank#0", 1: "rank#1"}, {4: "rank#0", 6: "rank#1"},
                                            "by position (0-4, 1-6)")  # fmt: skip
    b, c, how = T.pair_ranks([0, 1], [0, 1, 2])
    assert set(b.values()) == set(c.values()) == {"all ranks"} and how.startswith("pooled: 2 rank(s) vs 3")


def test_a_time_row_only_one_side_ran_is_zero_on_the_other_per_step():
    a, b = Recorder("trace", device="cpu"), Recorder("trace", device="cpu")
    a.add("trace", "rank0", "span", 1.0, "ms", samples=[1.0, 1.1, 0.9])
    b.add("trace", "rank0", "span", 1.0, "ms", samples=[1.0, 1.0])
    b.add("trace", "rank0", "kernel:new_kernel", 0.5, "ms", samples=[0.5, 0.5], stable=True)
    b.add("trace", "rank0", "idle_share", 5.0, "% of span", samples=[5.0, 5.0])  # a share: never filled
    b.add("trace", "rank9", "kernel:other", 0.5, "ms", samples=[0.5])  # a variant a lacks: not filled
    a.add("trace", "rank0", "op:aten::mm", 0.2, "ms", samples=[0.2, 0.2, 0.2])
    assert T.zero_fill(a, b) == (1, 1, 3)
    rows_a = {(r["variant"], r["metric"]): r for r in a.rows}
    filled = rows_a[("rank0", "kernel:new_kernel")]
    assert filled["samples"] == [0.0, 0.0, 0.0] and filled["value"] == 0.0 and filled["stable"] is True
    assert ("rank0", "idle_share") not in rows_a and ("rank9", "kernel:other") not in rows_a
    rows_b = {(r["variant"], r["metric"]): r for r in b.rows}
    assert rows_b[("rank0", "op:aten::mm")]["samples"] == [0.0, 0.0]


def test_records_name_the_traces_gpu(tmp_path):
    job = job_of(tmp_path, 1)
    ctx = T.trace_context(job)
    info = {"name": H100["name"], "units": 132, "memory_bytes": H100["totalGlobalMem"]}
    assert ctx == {"device": H100["name"], "device_kind": "gpu trace", "device_info": info}
    rec = T.records(job)
    assert rec.context()["device"] == H100["name"] and {r["variant"] for r in rec.rows} == {"rank0"}
    cpu = TraceAnalysis(write(tmp_path / "c.json", [step(1, 0, 100), op("aten::mm", 10, 20)]))
    assert T.trace_context(JobSummary([summarise(cpu, 0)]))["device_kind"] == "cpu trace"


def test_main_runs_the_trace_and_the_diff(tmp_path, capsys):
    base, cand = tmp_path / "a.json", tmp_path / "b.json"
    write(base, rank_events(), deviceProperties=[H100])
    write(cand, rank_events(gemm_us=200.0), deviceProperties=[H100])
    out = tmp_path / "out"
    assert T.main([str(base), "--out", str(out), "--perfetto", "none"]) == 0
    assert {p.name for p in out.iterdir()} == {"records.json", "trace.json", "trace.html"}
    assert json.loads((out / "trace.json").read_text())["ranks"] == [0]
    assert T.main(["diff", str(base), str(cand), "--out", str(tmp_path / "d")]) == 1  # the 2x GEMM fails the gate
    printed = capsys.readouterr().out
    assert "kernel:sm90_gemm" in printed and "ranks one rank each: rank 0 vs rank 0" not in printed
    assert "rows recorded in both traces" in printed
    assert T.main(["diff", str(base), str(base), "--out", str(tmp_path / "same")]) == 0
    assert T.main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    assert "perflab trace: parameter 'path'" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_rank_file_that_cannot_be_read_is_named_and_counted(tmp_path):
    d = folder(tmp_path, 1)
    (d / "r1.json").write_text('{"traceEvents": [{"ph": "X", "cat": "kernel"')
    bad = T.analyse_rank((str(d / "r1.json"), 1, False, None))
    assert isinstance(bad, T.RankError) and "r1.json" in bad.message and "\n" not in bad.message
    with pytest.raises(ConfigError, match=r"r1\.json.*\(1 of 2 rank files failed\)"):
        T.load_job(d, jobs=MapOptions(workers=1))
    with pytest.raises(ConfigError, match=r"r1\.json") as alone:  # one file: no count of rank files
        T.load_job(d / "r1.json")
    assert "rank files failed" not in str(alone.value)
    assert T.one_line("Traceback:\n  File x\nValueError: boom\n\n") == "ValueError: boom"
    assert T.one_line("") == "no error message"


@pytest.mark.parametrize("asked, files, used", [(2, 3, 2), (8, 3, 3), (3, 3, 3), (1, 2, 1)])
def test_a_folder_takes_at_most_one_worker_per_rank_file_and_never_more_than_asked(tmp_path, monkeypatch, asked,
                                                                                    files, used):  # fmt: skip
    """min(--workers, files): 8 workers asked for 3 files start 3; 2 asked for 3 files start 2."""
    seen = []

    def in_process(fn, items, opts, folder, **kw):
        seen.append(opts.workers)
        return [Outcome(str(i), "ok", fn(item)) for i, item in enumerate(items)]

    monkeypatch.setattr(T, "map_jobs", in_process)
    job = T.load_job(folder(tmp_path, files), jobs=MapOptions(workers=asked), jobs_dir=tmp_path)
    assert seen == [used] and job.ranks == list(range(files))


def test_a_callers_resolved_cluster_is_used_as_is_else_the_options_are_resolved(tmp_path, monkeypatch):
    """``_job`` takes ``a.cluster`` when the command resolved it (the site is not asked twice); a caller
    that did not gets the options resolved from its arguments (local: --time-limit 7, --mem-gb 3)."""
    got = []
    monkeypatch.setattr(T, "load_job", lambda path, *, jobs, **kw: got.append(jobs.cluster))
    a = trace_args.parser().parse_args(["x.json", "--executor", "local", "--time-limit", "7", "--mem-gb", "3",
                                        "--out", str(tmp_path / "out")])  # fmt: skip
    T._job(a, "x.json")
    assert (got[0].executor, got[0].timeout_min, got[0].mem_gb) == ("local", 7, 3)
    a.cluster = ClusterOptions("local", partition="mine", timeout_min=11)

    def asked_again(_):
        raise AssertionError("the cluster was resolved again")

    monkeypatch.setattr(T, "_cluster", asked_again)
    T._job(a, "x.json")
    assert got[1] is a.cluster


def test_one_trace_file_is_read_once_for_its_page(tmp_path, monkeypatch):
    """The look-ahead at the first file's steps is for a folder's ranks to agree on one step; a lone
    file reads none ahead and its own job picks its median step (three steps of 1000 us: step 2)."""
    ahead = []
    real = T.read_steps
    monkeypatch.setattr(T, "read_steps", lambda path: ahead.append(path) or real(path))
    d = folder(tmp_path, 1)
    a = trace_args.parser().parse_args([str(d), "--workers", "1", "--out", str(tmp_path / "out")])
    job, step = T.page_job(a)
    assert ahead == [] and step == 2 and job.ranks_[0].extras["step"] == 2
    two = folder(tmp_path / "two", 2)
    asked = []

    # the ranks' jobs are not run: the look-ahead is what is checked
    def stop(a, path, options=None, only=None, meanwhile=None):
        asked.append(options["step"])
        raise LookupError("stopped after the look-ahead")

    monkeypatch.setattr(T, "_job", stop)
    with pytest.raises(LookupError, match="stopped after the look-ahead"):
        T.page_job(trace_args.parser().parse_args([str(two), "--workers", "1"]))
    assert ahead == [two / "r0.json"] and asked == [2]  # a folder: its first file's steps, read ahead


def test_the_timeline_takes_two_bars_at_least(tmp_path, capsys):
    """--max-bars 1 is refused naming the option, nothing written; 2, the least, draws the page."""
    trace = write(tmp_path / "a.json", rank_events(), deviceProperties=[H100])
    assert T.main([str(trace), "--out", str(tmp_path / "one"), "--max-bars", "1", "--perfetto", "none"]) == 2
    err = capsys.readouterr().err
    assert "--max-bars" in err and "at least 2 bars" in err and not (tmp_path / "one").exists()
    assert T.main([str(trace), "--out", str(tmp_path / "two"), "--max-bars", "2", "--perfetto", "none"]) == 0
    assert (tmp_path / "two" / "trace.html").is_file()


DIFF = {"paths": True, "page": False}  # what each side of a diff reads


def test_the_diff_counts_the_rows_of_both_sides_and_of_each_alone(tmp_path, capsys):
    """Rows in both, only in the base, only in the candidate add up to the union of the two sides'
    (variant, metric) rows, counted here from each side's own records; the sentence says so in %."""
    extra = [launch(90 + s, 1000.0 * s + 700) for s in range(3)]
    extra += [kernel("only_in_the_candidate", 90 + s, 1000.0 * s + 710, 5.0) for s in range(3)]
    base, cand = tmp_path / "a.json", tmp_path / "b.json"
    write(base, rank_events(), deviceProperties=[H100])
    write(cand, rank_events() + extra, deviceProperties=[H100])
    keys = [
        {(r["variant"], r["metric"]) for r in T.records(T.load_job(p, options=DIFF), {0: "rank"}).rows}
        for p in (base, cand)
    ]
    both, only_b, only_c = len(keys[0] & keys[1]), len(keys[0] - keys[1]), len(keys[1] - keys[0])
    assert only_c > 0 and only_b == 0
    assert T.main(["diff", str(base), str(cand), "--out", str(tmp_path / "d"), "--json"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert (doc["rows_in_both"], doc["rows_total"]) == (both, both + only_b + only_c)
    T.main(["diff", str(cand), str(base), "--out", str(tmp_path / "e")])
    assert (f"rows recorded in both traces: {both} of {both + only_c} ({100 * both / (both + only_c):.0f}%), "
            f"{only_c} only in the base, 0 only in the candidate") in capsys.readouterr().out  # fmt: skip


def test_a_rank_that_chose_another_step_is_read_again_alone_for_the_first_ranks(tmp_path, monkeypatch):
    """The look-ahead refused: each rank's job takes its own median step (rank 0's steps of 1000,
    3000, 2000 us: step 3; rank 1's of 1000, 2000, 3000 us: step 2); rank 1 alone is read again for step 3."""
    d = tmp_path / "j"
    d.mkdir()
    for r, durs in ((0, (1000, 3000, 2000)), (1, (1000, 2000, 3000))):
        ev, t = [], 0.0
        for n, dur in enumerate(durs, start=1):
            ev += [step(n, t, dur), launch(n, t + 10), kernel("k", n, t + 20, 5.0)]
            t += dur
        write(d / f"r{r}.json", ev, distributedInfo={"rank": r, "world_size": 2})

    def refuse(path):
        raise ConfigError("path", str(path), "a readable trace")

    def in_process(fn, items, opts, folder, **kw):
        return [Outcome(str(i), "ok", fn(item)) for i, item in enumerate(items)]

    asked = []
    real = T._job
    monkeypatch.setattr(T, "read_steps", refuse)
    monkeypatch.setattr(T, "map_jobs", in_process)
    monkeypatch.setattr(T, "_job", lambda a, path, options=None, only=None, meanwhile=None: asked.append(
                        (options["step"], only)) or real(a, path, options, only, meanwhile))  # fmt: skip
    job, chosen = T.page_job(trace_args.parser().parse_args([str(d), "--workers", "1"]))
    assert chosen == 3 and asked == [(None, None), (3, [1])]
    assert {r: job.ranks_[r].extras["step"] for r in job.ranks} == {0: 3, 1: 3}
    assert job.ranks_[1].extras["figures"]["critical_path"]["step"] == 3


@pytest.mark.parametrize(
    ("executor", "workers", "files", "split"),
    [("pool", 2, 1, True), ("pool", 6, 3, True), ("pool", 5, 3, False), ("pool", 1, 1, False), ("local", 4, 2, False)],
)
def test_a_file_with_two_cores_of_the_pool_has_its_page_analysed_beside_its_summary(
    tmp_path, monkeypatch, executor, workers, files, split
):
    """Where the pool has two workers per file, each file's job is asked to fork its page's analyses
    beside its summary; not with fewer, nor on submitit's executors (one CPU a job on SLURM)."""
    seen = []

    def in_process(fn, items, opts, folder, **kw):
        seen.extend(it[4].get("split", False) for it in items)
        return [Outcome(str(i), "ok", fn(item)) for i, item in enumerate(items)]

    monkeypatch.setattr(T, "map_jobs", in_process)
    jobs = MapOptions(executor=executor, workers=workers)
    T.load_job(folder(tmp_path, files), jobs=jobs, jobs_dir=tmp_path, options=OPTS, meanwhile=lambda: None)
    assert seen == [split] * files


def _extras_with_pid(monkeypatch):
    real = T.rank_extras

    def tagged(*a, **k):
        return real(*a, **k) | {"pid": os.getpid()}

    monkeypatch.setattr(T, "rank_extras", tagged)


def test_the_page_forked_beside_the_summary_is_the_page_made_in_one_process(tmp_path, monkeypatch):
    """The same summary and the same extras, the extras made in another process; where the child
    fails, they are made here."""
    import pandas as pd  # noqa: PLC0415

    path = str(write(tmp_path / "r.json", rank_events(late=30.0), deviceProperties=[H100]))
    _extras_with_pid(monkeypatch)
    opts = OPTS | {"page": True, "paths": True}
    one = T.analyse_rank((path, 0, True, None, opts))
    two = T.analyse_rank((path, 0, True, None, opts | {"split": True}))
    assert one.extras.pop("pid") == os.getpid() and two.extras.pop("pid") != os.getpid()
    assert set(one.extras) == set(two.extras) and "figures" in two.extras and "bars" in two.extras
    for key in one.extras:
        a, b = one.extras[key], two.extras[key]
        if isinstance(a, pd.DataFrame):
            pd.testing.assert_frame_equal(a, b)
        else:
            assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str), key
    pd.testing.assert_frame_equal(one.per_step, two.per_step)
    assert set(one.tables) == set(two.tables)
    for name, table in one.tables.items():
        pd.testing.assert_frame_equal(table, two.tables[name])

    def failed(self):
        raise T.ChildFailed("killed")

    monkeypatch.setattr(T.Forked, "result", failed)
    here = T.analyse_rank((path, 0, True, None, opts | {"split": True}))
    assert here.extras.pop("pid") == os.getpid() and set(here.extras) == set(one.extras)


def test_the_text_summary_ends_with_the_page_ranks_analyses(tmp_path):
    """A job read with its page's extras: the text goes on past the collectives with the analyses of
    step 2, counted here from the events written: 6 launch calls of 4 us (none over 50 us; the
    all-reduce's, 100 us before its kernel, is not over 100 us), three 100 us GEMMs under aten::mm
    (0.300 ms of GPU time, all of it its own), and the idle of both streams last."""
    job = T.load_job(folder(tmp_path, 1), options=OPTS)
    text = T.summary_text(job, T.figures(job, step=2))
    after = text.split("\ncollectives (rank, collective")[1]
    assert "\nrank 0 critical path of step 2: " in after
    assert "\nrank 0 call tree (GPU time, total / self):\n" in after
    assert "        0.300 ms /     0.300 ms  ProfilerStep > ## forward ## > aten::mm\n" in after
    assert "\nrank 0 launches: 6 calls, 0 over 50 us, 0 with a launch delay over 100 us\n" in after
    tail = after.split("\nidle per stream (ms): rank stream host_wait kernel_wait other\n")[1].splitlines()
    assert [ln.split()[:2] for ln in tail] == [["0", "7"], ["0", "9"]]
