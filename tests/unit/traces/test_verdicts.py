"""The verdicts of lab_utils.traces: host-bound and launch-bound (kernel durations against the launch
cost, waits between launches against stalls), collective bus bandwidth with and without the wait
for late ranks, and a straggler verdict that says on how many ranks it rests.  Synthetic traces
whose answers are known by construction, and the real jobs where they show it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from lab_utils.traces import TraceAnalysis
from lab_utils.traces.summary import JobSummary
from unit.traces.test_collectives import ann, kernel, launch, step, write

ROOT = Path(__file__).resolve().parents[3]
TRACES = ROOT.parent / "shared" / "data" / "gpu-traces"
real = pytest.mark.skipif(not TRACES.is_dir(), reason=f"real GPU traces not present at {TRACES}")


def one_by_one(tmp_path, *, kernel_us, launch_us=5.0, gap_us=10.0, stall_us=0.0, n=40, steps=3, name="lb.json"):
    """``steps`` steps: a ``stall_us`` wait for data (a range, no GPU work), then ``n`` kernels launched
    one by one, each ``gap_us`` after the previous one ended (nothing queued)."""
    ev, t, c = [], 0.0, 1
    for s in range(steps):
        t0 = t
        ev.append(ann("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", t, stall_us))
        t += stall_us
        for _ in range(n):
            ev += [launch(c, t, dur=launch_us), kernel(f"k{c % 3}", c, t + launch_us, kernel_us)]
            t += launch_us + kernel_us + gap_us
            c += 1
        ev.insert(0, step(s + 1, t0, t - t0))
    return TraceAnalysis(write(tmp_path / name, ev)).launch_stats().iloc[0]


def test_a_data_loader_bound_job_with_1ms_kernels_is_host_bound_not_launch_bound(tmp_path):
    """A 100 ms wait for data per step, then 1 ms kernels: the GPU waits for the host (82% idle, all
    of it host wait, nothing queued) but not for launches: a 5 us launch cannot starve a 1 ms kernel."""
    ls = one_by_one(tmp_path, kernel_us=1000.0, stall_us=100_000.0, n=20)
    assert ls["host_bound"] and not ls["launch_bound"]
    assert ls["kernel_median_us"] == 1000.0 and ls["launch_us"] == 5.0
    assert "host-bound, not launch-bound" in ls["reason"] and "kernels are long" in ls["reason"]
    assert "stalls longer than 100 launches" in ls["reason"]  # the 100 ms waits are no launch gaps
    assert ls["launch_gap_share"] < 0.5


def test_short_kernels_issued_one_by_one_are_launch_bound(tmp_path):
    ls = one_by_one(tmp_path, kernel_us=4.0, launch_us=6.0, gap_us=8.0)
    assert ls["host_bound"] and ls["launch_bound"] and ls["launch_gap_share"] == 1.0
    assert ls["reason"].startswith("launch-bound")


@pytest.mark.parametrize("kernel_us,bound", [(20.0, True), (20.5, False)])
def test_the_kernel_against_launch_boundary_is_four_launches(tmp_path, kernel_us, bound):
    """Launch 5 us: a 20 us kernel (4 launches) is short enough to starve, 20.5 us is not."""
    ls = one_by_one(tmp_path, kernel_us=kernel_us, launch_us=5.0, gap_us=20.0)
    assert ls["host_bound"] and ls["launch_bound"] == bound


def test_short_kernels_behind_one_long_stall_are_host_bound(tmp_path):
    """Tiny kernels, but most of the wait is one 50 ms stall per step: fewer launches would not help."""
    ls = one_by_one(tmp_path, kernel_us=3.0, launch_us=5.0, gap_us=10.0, stall_us=50_000.0, n=100)
    assert ls["host_bound"] and not ls["launch_bound"] and "stalls" in ls["reason"]


def _raw(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


@real
def test_the_real_ddp_a100_job_is_launch_bound_and_alexnet_is_not():
    """ddp_a100_nccl: its kernels' median (5.7 us, from the JSON) is below one launch call (9.2 us),
    and most of the GPU's wait is between launches: launch-bound.  alexnet_a100: 51 us kernels
    waiting in a 7 s stall: host-bound, not launch-bound."""
    ta = TraceAnalysis(TRACES / "ddp_a100_nccl")
    ls = ta.launch_stats().iloc[0]
    ev = _raw(next((TRACES / "ddp_a100_nccl").iterdir()))
    k = ta.kernels(0, "steps")
    corr = set(k["correlation"])
    launches = [e["dur"] for e in ev if e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") in corr]
    durs = [e["dur"] for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and e["args"]["correlation"] in corr]  # fmt: skip
    assert ls["launch_us"] == pytest.approx(np.median(launches)) and ls["kernel_median_us"] == pytest.approx(
        np.median(durs)
    )
    assert ls["kernel_median_us"] < ls["launch_us"] and ls["launch_bound"] and ls["launch_gap_share"] > 0.5
    alex = TraceAnalysis(TRACES / "alexnet_a100").launch_stats().iloc[0]
    assert alex["host_bound"] and not alex["launch_bound"] and alex["longest_host_wait_us"] > 1e6


def two_ranks(tmp_path, *, late_us=50.0, transfer_us=100.0, world=2, nbytes=64 << 20, calls=4):
    """Two ranks' all-reduces of ``nbytes`` (float32): rank 1 arrives ``late_us`` after rank 0, both
    end ``transfer_us`` after rank 1's start."""
    folder = tmp_path / "job"
    folder.mkdir(exist_ok=True)
    args = {"In msg nelems": nbytes // 4, "Out msg nelems": nbytes // 4, "dtype": "Float", "Group size": world}
    name = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    for r in range(2):
        ev = [step(1, 0, 10_000)]
        for i in range(calls):
            start = 1000 * i + (late_us if r == 1 else 0.0)
            end = 1000 * i + late_us + transfer_us
            ev += [launch(i + 1, start - 5), kernel(name, i + 1, start, end - start, stream=20, **args)]
        write(folder / f"rank{r}.json", ev, distributedInfo={"rank": r, "world_size": world})
    return folder


def test_bus_bandwidth_with_the_wait_and_from_the_transfer_alone(tmp_path):
    """The early rank's kernel spans the 50 us wait and the 100 us transfer: with the wait its bus
    bandwidth is bytes/150 us x 2(n-1)/n, from the transfer alone bytes/100 us x 2(n-1)/n (1.5x);
    the late rank's kernel is the transfer alone."""
    ta = TraceAnalysis(two_ranks(tmp_path), workers=1)
    job = JobSummary.of(ta)
    calls = job.collectives().set_index("rank")
    nbytes, factor = 64 << 20, 2 * (2 - 1) / 2
    r0, r1 = calls.loc[0].iloc[0], calls.loc[1].iloc[0]
    assert r0["busbw_gbps"] == pytest.approx(nbytes / 150e3 * factor)
    assert r0["busbw_transfer_gbps"] == pytest.approx(nbytes / 100e3 * factor)
    assert r0["wait_us"] == pytest.approx(50.0) and r1["wait_us"] == 0.0
    assert r1["busbw_gbps"] == pytest.approx(r1["busbw_transfer_gbps"])
    sk = ta.skew()
    assert list(sk["busbw_transfer_gbps"]) == pytest.approx([nbytes / 100e3 * factor] * 4)
    assert list(sk["skew_us"]) == pytest.approx([50.0] * 4) and (sk["last_rank"] == 1).all()


def test_one_rank_has_only_the_bandwidth_with_the_wait(tmp_path):
    folder = two_ranks(tmp_path)
    one = JobSummary.of(TraceAnalysis(folder / "rank0.json"))
    assert "busbw_transfer_gbps" not in one.collectives() or one.collectives()["busbw_transfer_gbps"].isna().all()


@pytest.mark.parametrize("world,words", [(128, "drawn from 2 of the job's 128 ranks"), (2, "all 2 ranks")])
def test_a_straggler_verdict_says_on_how_many_ranks_it_rests(tmp_path, world, words):
    st = TraceAnalysis(two_ranks(tmp_path, world=world), workers=1).straggler()
    assert st.rank == 1 and st.ranks == 2 and st.world_size == world and words in st.verdict


@real
def test_the_real_2_of_128_ranks_say_so():
    st = TraceAnalysis(TRACES / "multirank_2of128", workers=1).straggler()
    assert st.world_size == 128 and st.ranks == 2
    assert "drawn from 2 of the job's 128 ranks: the other 126 are not in the traces" in st.verdict
