"""lab_utils.traces.analysis: what each method of :class:`TraceAnalysis` hands back on a small job whose
figures are known by construction (two GPU ranks of two steps, a CPU rank, nine ranks for the
critical paths' limit): scopes, the rank read when none is given, the device and its part, per-rank
tables and their columns, the collectives' fit, the straggler's world, the CPU rule's verdict, and a
GPU given for traces naming none."""

from __future__ import annotations

import numpy as np
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.traces import TraceAnalysis

from .kineto import H100, ann, kernel, launch, op, step, write

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
#: all-reduces of 1, 2 and 4 kB-elements of fp32: 10 us + 1 ns per byte
SIZES = (1024, 2048, 4096)


def rank_events(late: float = 0.0) -> list[dict]:
    ev = [step(1, 0, 1000), step(2, 1000, 1000), ann("## forward ##", 0, 300), ann("## backward ##", 1000, 300),
          op("aten::mm", 10, 10, 1), launch(1, 12, ext=1), kernel("sm90_gemm", 1, 100, 50, ext=1),
          op("aten::mm", 1010, 10, 2), launch(2, 1012, ext=2), kernel("sm90_gemm", 2, 1100, 50, ext=2),
          launch(3, 2500), kernel("k_after", 3, 2600, 5),  # launched after the last step
          kernel("k_orphan", 99, 900, 7)]  # fmt: skip
    for i, n in enumerate(SIZES):
        dur = 10 + 4 * n * 1e-3
        args = {"In msg nelems": n, "Out msg nelems": n, "dtype": "Float", "Group size": 2}
        ev += [launch(10 + i, 400 + 100 * i), kernel(NCCL, 10 + i, 410 + 100 * i + late, dur, stream=9, **args)]
    return ev


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    props = [H100, {"id": 1, "name": "NVIDIA A100-SXM4-80GB"}]
    write(d / "r0.json", rank_events(), deviceProperties=props, distributedInfo={"rank": 0, "world_size": 2})
    write(d / "r1.json", rank_events(5.0), deviceProperties=props, distributedInfo={"rank": 1, "world_size": 4})
    return TraceAnalysis(d, workers=1)


def test_scopes_steps_and_windows(job):
    assert job.ranks == [0, 1] and "job" in job.path
    names = lambda scope: sorted(set(job.kernels(0, scope)["name"]))  # noqa: E731
    assert names("all") == sorted({"sm90_gemm", "k_after", "k_orphan", NCCL})
    assert names("steps") == [NCCL, "sm90_gemm"]
    assert names("hta") == [NCCL, "sm90_gemm"]  # launched in the trace, not after the last step
    w = job.windows()
    assert w[w["rank"] == 0].set_index("window")["count"].to_dict() == {"after": 1, "no launch": 1, "step": 5}
    assert w.set_index(["rank", "window"]).loc[(0, "after"), "total_us"] == 5.0
    assert job.steps(1)["step"].tolist() == [1, 2]
    with pytest.raises(ConfigError, match="rank"):
        job.kernels(5)
    with pytest.raises(ConfigError, match="scope"):
        job.kernels(0, "everything")


def test_a_method_given_no_rank_reads_the_lowest(job):
    """Rank 1's all-reduces start 5 us after rank 0's (410, 510, 610 us): no rank given is rank 0."""
    nccl = lambda k: k.loc[k["name"] == NCCL, "ts"].tolist()  # noqa: E731
    assert nccl(job.kernels(1)) == [415.0, 515.0, 615.0]
    assert nccl(job.kernels()) == [410.0, 510.0, 610.0]
    assert job.launch_outliers().table.loc[lambda t: t["name"] == NCCL, "delay_us"].tolist() == [6.0, 6.0, 6.0]


def test_the_device_its_properties_and_part(job):
    assert job.device(0) == H100["name"] and job.device_properties(0)["numSms"] == 132
    assert job.part(0).peak.name == "H100 SXM5" and job.datasheet(1).hbm_gbs == 3350.0
    assert job.rule(0) == "gpu"


def test_per_rank_tables_by_hand(job):
    t = job.temporal().set_index("rank")
    calls = sum(10 + 4 * n * 1e-3 for n in SIZES)
    assert t.loc[0, "compute"] == 100.0 and t.loc[0, "communication"] == pytest.approx(calls)
    assert t.loc[0, "idle_pct"] == pytest.approx(100 * t.loc[0, "idle"] / t.loc[0, "span"])
    # the steps' kernels run from 100 to 1150 us; all that is not compute is the all-reduces
    assert t.loc[0, "span"] == 1050.0 and t.loc[0, "non_compute_pct"] == pytest.approx(100 * calls / 1050)
    assert list(job.temporal().columns[:2]) == ["rank", "rule"]
    by_step = job.temporal(by="step")
    assert by_step[by_step["rank"] == 0]["step"].tolist() == [1, 2]
    sh = job.shares().set_index("rank")
    assert sh.loc[0, "COMPUTATION"] == pytest.approx(100 * 100 / (100 + calls))
    assert job.overlap().set_index("rank").loc[0, "overlap_pct"] == 0.0
    assert set(job.idle().columns) == {"rank", "rule", "idle", "host_wait", "other_wait"}
    cats = job.categories()
    assert cats[cats["rank"] == 1].set_index("category")["total"].to_dict() == pytest.approx(
        {"matmul": 100.0, "communication": calls}
    )
    assert len(job.top_kernels(0)) == 2 and job.top_kernels(0, n=1)["name"].tolist() == ["sm90_gemm"]
    ph = job.phases().set_index(["rank", "step", "phase"])["gpu_us"]
    assert ph.loc[(0, 1, "forward")] == 50.0 and ph.loc[(0, 2, "backward")] == 50.0
    assert ph.loc[(0, 1, "(none)")] == pytest.approx(calls)
    idle = job.stream_idle()
    assert list(idle.columns[:2]) == ["rank", "stream"] and set(idle["rank"]) == {0, 1}
    assert idle.index.tolist() == [0, 1, 2, 3]  # two streams on each rank, one row each
    assert job.launch_outliers(0).launches == 5 and len(job.queue_length(0)) == 10
    assert job.memory_bw(0).empty and len(job.sequences(0, min_len=1, max_len=1)) == 2


def test_shares_of_a_span_under_a_microsecond(tmp_path):
    """One step, one 0.5 us kernel: all of the span computes, none of it idles, per rank and per step."""
    ta = TraceAnalysis(write(tmp_path / "t.json", [step(1, 0, 100), launch(1, 5), kernel("sm90_gemm", 1, 10, 0.5)]))
    for t in (ta.temporal(), ta.temporal(by="step")):
        row = t.iloc[0]
        assert row["span"] == 0.5 and (row["compute_pct"], row["idle_pct"], row["non_compute_pct"]) == (100.0, 0.0, 0.0)


def test_top_kernels_default_to_ten(tmp_path):
    ev = [step(1, 0, 10_000)]
    for i in range(12):
        ev += [launch(i + 1, 10 * i), kernel(f"k{i:02d}", i + 1, 100 * i + 50, i + 1)]
    ta = TraceAnalysis(write(tmp_path / "t.json", ev), workers=1)
    assert ta.top_kernels(0)["name"].tolist() == [f"k{i:02d}" for i in range(11, 1, -1)]


def test_collectives_skew_straggler_and_the_alpha_beta_fit(job):
    calls = job.collectives()
    assert len(calls) == 6 and set(calls["rank"]) == {0, 1}
    assert calls["bytes"].tolist()[:3] == [4096.0, 8192.0, 16384.0]
    assert len(job.collectives_of(1)) == 3 and set(job.collectives_of(1)["rank"]) == {1}
    sk = job.skew()
    assert sk["skew_us"].tolist() == pytest.approx([5.0] * 3) and sk["last_rank"].tolist() == [1, 1, 1]
    st = job.straggler()
    assert st.world_size == 4 and st.ranks == 2  # the largest world size a rank records
    fit = job.alpha_beta()["all_reduce"]
    assert fit.alpha_us == pytest.approx(10.0, abs=1e-6) and fit.beta_us_per_byte == pytest.approx(1e-3)
    assert fit.n_events == 6 and fit.gbps == pytest.approx(1.0)
    exposed = job.alpha_beta("exposed_us")["all_reduce"]
    assert exposed.alpha_us == pytest.approx(10.0, abs=1e-6)  # nothing computes under them: the same fit


def test_critical_paths_of_the_first_eight_ranks_that_have_the_step(tmp_path):
    d = tmp_path / "nine"
    d.mkdir()
    for r in range(9):
        steps = [step(1, 0, 100)] + ([step(2, 100, 100)] if r != 3 else [])
        write(d / f"r{r}.json", steps + [op("aten::mm", 110, 10, 1), op("aten::add", 10, 10, 2)],
              distributedInfo={"rank": r})  # fmt: skip
    ta = TraceAnalysis(d, workers=1)
    assert sorted(ta.critical_paths()) == list(range(8))
    assert sorted(ta.critical_paths(step=2)) == [0, 1, 2, 4, 5, 6, 7]  # rank 3 has no step 2
    assert ta.critical_path(0, 2).length_us == pytest.approx(10.0)


def test_a_cpu_rank_gets_no_launch_verdict_and_a_gpu_given_names_unnamed_traces(tmp_path):
    cpu = TraceAnalysis(write(tmp_path / "c.json", [step(1, 0, 100), op("aten::mm", 10, 20)]), gpu="H100 SXM5")
    row = cpu.launch_stats().iloc[0]
    assert cpu.rule(0) == "cpu" and not row["host_bound"] and not row["launch_bound"]
    assert row["reason"].startswith("CPU trace (CPU rule): each operator runs where it is called")
    assert cpu.device(0) is None  # no GPU activity: no GPU named for it
    gpu = TraceAnalysis(write(tmp_path / "g.json", [step(1, 0, 100), launch(1, 5), kernel("k", 1, 10, 5)]),
                        gpu="H100 SXM5")  # fmt: skip
    assert gpu.device(0) == "H100 SXM5" and gpu.part(0).peak.name == "H100 SXM5"
    named = TraceAnalysis(write(tmp_path / "n.json", [launch(1, 5), kernel("k", 1, 10, 5)], deviceProperties=[H100]),
                          gpu="H100 PCIe")  # fmt: skip
    assert named.device(0) == H100["name"]  # a trace that names its GPU keeps it
    with pytest.raises(ConfigError, match="gpu"):
        TraceAnalysis(write(tmp_path / "x.json", [launch(1, 5), kernel("k", 1, 10, 5)]), gpu="A100")
    assert np.isnan(cpu.overlap().iloc[0]["overlap_pct"])


def test_the_categories_of_every_rank_are_one_table_numbered_through(job):
    """Two categories on each of the two ranks (the GEMMs' matmul, the all-reduces' communication):
    four rows numbered 0-3, so a row is found by its label once, not once per rank."""
    cats = job.categories()
    assert cats.index.tolist() == [0, 1, 2, 3] and cats["rank"].tolist() == [0, 0, 1, 1]
    assert sorted(cats.loc[cats["rank"] == 0, "category"]) == ["communication", "matmul"]


def test_the_timeline_shows_the_ranks_asked_for_else_every_rank(job):
    """Step 1 of rank 1 alone: its bars only; no ranks given: both ranks' bars."""
    one = job.timeline(step=1, ranks=[1])
    assert one.ranks == [1] and set(one.bars["rank"]) == {1} and one.step == 1
    both = job.timeline(step=1)
    assert both.ranks == [0, 1] and set(both.bars["rank"]) == {0, 1}
