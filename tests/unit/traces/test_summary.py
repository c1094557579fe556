"""lab_utils.traces.summary: the per-step record values of a two-step, two-rank job whose every figure
is counted by hand (spans, kernel time, shares of the span in %, per category, phase, kernel and
operator, in ms), the metric names of long kernels at the 200-character limit, the job's world
size, its collectives with and without a second rank, the rows it records, and none for a rank
with nothing launched in a step."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from lab_utils.core.records import Recorder
from lab_utils.traces import TraceAnalysis, read_rank
from lab_utils.traces.summary import GPU_STEPS, JobSummary, metric_name, per_step_values, summarise

from .kineto import ann, kernel, launch, op, runtime, step, write

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"


def rank_events(late: float = 0.0) -> list[dict]:
    """Step 1: a 300 us GEMM (100..400) and a 100 us all-reduce (350..450) 50 us under it.  Step 2:
    a 200 us GEMM (1100..1300), the all-reduce right after it, 100 us idle, a 20 us copy launched
    50 us into the gap.  ``late``: the all-reduces start that much later (a rank that arrives late)."""
    args = {"In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float", "Group size": 2}
    return [
        step(1, 0, 1000), step(2, 1000, 1000), ann("## forward ##", 0, 500), ann("## forward ##", 1000, 400),
        op("aten::mm", 10, 10, 1), launch(1, 12, ext=1), kernel("sm90_gemm", 1, 100, 300, ext=1),
        ann("nccl:all_reduce", 45, 10), launch(3, 50), kernel(NCCL, 3, 350 + late, 100 - late, stream=9, **args),
        op("aten::mm", 1010, 10, 2), launch(2, 1012, ext=2), kernel("sm90_gemm", 2, 1100, 200, ext=2),
        ann("nccl:all_reduce", 1045, 10), launch(5, 1050), kernel(NCCL, 5, 1300 + late, 100 - late, stream=9, **args),
        runtime("cudaMemcpyAsync", 4, 1450), kernel("Memcpy HtoD (Pageable -> Device)", 4, 1500, 20, cat="gpu_memcpy"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    r0 = read_rank(write(d / "r0.json", rank_events(), distributedInfo={"rank": 0, "world_size": 2}))
    r1 = read_rank(write(d / "r1.json", rank_events(20.0), distributedInfo={"rank": 1, "world_size": 4}))
    return TraceAnalysis({0: r0, 1: r1})


def values(ta, rank=0) -> dict[str, list[float]]:
    df = per_step_values(ta, rank)
    return {m: g.sort_values("step_index")["value"].round(9).tolist() for m, g in df.groupby("metric")}


def test_every_record_value_per_step_by_hand(job):
    v = values(job)
    assert v["span"] == [0.35, 0.42] and v["kernel_time"] == [0.4, 0.32]  # ms
    assert v["idle_share"] == pytest.approx([0.0, 100 * 100 / 420])
    assert v["compute_share"] == pytest.approx([100 * 300 / 350, 100 * 200 / 420])
    assert v["exposed_comm_share"] == pytest.approx([100 * 50 / 350, 100 * 100 / 420])
    assert v["memcpy_share"] == pytest.approx([0.0, 100 * 20 / 420]) and v["other_share"] == [0.0, 0.0]
    assert v["comm_overlap"] == pytest.approx([50.0, 0.0])
    assert v["share:COMPUTATION"] == pytest.approx([75.0, 62.5]) and v["share:MEMORY"] == pytest.approx([0, 6.25])
    assert v["category:matmul"] == [0.3, 0.2] and v["category:communication"] == [0.1, 0.1]
    assert v["category:memcpy"] == [0.0, 0.02]  # ran in step 2 only: 0 in step 1
    assert v["phase:forward"] == [0.3, 0.2] and v["phase:communication"] == [0.1, 0.1]
    assert v["phase:(none)"] == [0.0, 0.02]
    assert v["kernel:sm90_gemm"] == [0.3, 0.2] and v[f"kernel:{NCCL}"] == [0.1, 0.1]
    assert v["op:aten::mm"] == [0.3, 0.2] and not any(m == "op:" for m in v)  # unlaunched by an op: no op row
    df = per_step_values(job, 0)
    assert list(df.columns) == ["metric", "unit", "step_index", "value", "step"]
    span = df[df["metric"] == "span"]
    assert span["step"].tolist() == [1, 2] and span["unit"].tolist() == ["ms", "ms"]
    assert set(df.loc[df["metric"] == "idle_share", "unit"]) == {"% of span"}
    assert set(df.loc[df["metric"] == "comm_overlap", "unit"]) == {"% of communication"}
    assert set(df.loc[df["metric"] == "share:COMPUTATION", "unit"]) == {"% of kernel time"}


def test_a_kernel_name_is_cut_past_200_characters_with_a_hash_of_the_whole():
    at = "k" * 200
    assert metric_name("kernel", at) == f"kernel:{at}"
    over = "k" * 201
    want = "k" * 180 + "…" + hashlib.sha1(over.encode()).hexdigest()[:8]
    assert metric_name("kernel", over) == f"kernel:{want}"
    assert metric_name("op", "k" * 199 + "x" * 2) != metric_name("op", "k" * 199 + "y" * 2)


def test_a_rank_summary_holds_its_tables_and_steps(job):
    s = summarise(job, 1)
    assert (s.rank, s.steps, s.rule, s.world_size) == (1, 2, "gpu", 4)
    assert s.tables["kernels"]["name"].tolist()[0] == "sm90_gemm" and len(s.tables["kernels"]) == 3
    assert set(s.tables["temporal"]["rank"]) == {1}
    assert s.meta()["rank"] == 1 and "tables" not in s.meta()


def test_the_job_world_size_and_collectives_with_one_rank_and_with_two(job):
    both = JobSummary.of(job)
    assert both.ranks == [0, 1] and both.world_size() == 4  # the largest any rank records
    calls = both.collectives()
    assert len(calls) == 4 and {"wait_us", "transfer_us", "busbw_transfer_gbps"} <= set(calls.columns)
    r0 = calls[calls["rank"] == 0].sort_values("ts")
    assert r0["wait_us"].tolist() == pytest.approx([20.0, 20.0])  # rank 1 arrives 20 us later
    assert r0["transfer_us"].tolist() == pytest.approx([80.0, 80.0])
    alone = JobSummary([summarise(job, 0)]).collectives()
    assert len(alone) == 2 and "wait_us" not in alone.columns
    assert JobSummary([summarise(job, 0)]).world_size() == 2
    assert both.straggler().rank == 1 and both.skew()["last_rank"].tolist() == [1, 1]
    assert both.table("temporal")["rank"].tolist() == [0, 1]


def test_records_carry_each_step_as_a_sample_and_gpu_rows_are_stable(job):
    rec = JobSummary.of(job).record(Recorder("trace", device="cpu"))
    rows = {(r["variant"], r["metric"]): r for r in rec.rows}
    span = rows[("rank0", "span")]
    assert span["samples"] == [0.35, 0.42] and span["value"] == pytest.approx(0.385) and span["unit"] == "ms"
    assert span["statistic"] == "median" and span["stable"] is True and span["stability"] == GPU_STEPS
    assert rows[("rank1", "kernel_time")]["samples"] == pytest.approx([0.38, 0.30])  # its all-reduces 80 us
    pooled = JobSummary.of(job).record(Recorder("trace", device="cpu"), variants={0: "all", 1: "all"})
    (row,) = [r for r in pooled.rows if r["metric"] == "span"]
    assert row["variant"] == "all" and len(row["samples"]) == 4


def test_the_text_summary_reads_the_figures(job):
    text = JobSummary.of(job).summary()
    assert text.splitlines()[0] == "<traces>: 2 rank(s)"
    # both steps' activities: 100 .. 1520 us, 670 us busy, 500 computing, 150 of communication exposed
    assert ("rank 0 (device not recorded, 2 steps): span 1.4 ms, idle 52.8%, compute 35.2%, exposed comm 10.6%, "
            "memory 1.4%, comm overlapped 25.0%") in text  # fmt: skip
    assert "\n  host-bound, not launch-bound: idle 53% of the span" in text
    assert "\n       0.50 ms      2x matmul                 sm90_gemm\n" in text
    assert np.isfinite(JobSummary.of(job).ranks_[0].tables["overlap"]["overlap_pct"].iloc[0])


def test_a_rank_with_nothing_launched_in_a_step_records_nothing(tmp_path):
    """Its one kernel is launched after the last step: no record value, no record row, and the text
    summary still has its line."""
    ev = [step(1, 0, 100), op("aten::mm", 200, 10, 1), launch(1, 202, ext=1), kernel("sm90_gemm", 1, 210, 5, ext=1)]
    ta = TraceAnalysis({0: read_rank(write(tmp_path / "after.json", ev))})
    df = per_step_values(ta, 0)
    assert df.empty and {"metric", "unit", "step_index", "value"} <= set(df.columns)
    job = JobSummary.of(ta)
    assert job.record(Recorder("trace", device="cpu")).rows == []
    assert "rank 0 (device not recorded, 1 steps): span 0.0 ms" in job.summary()
