"""``perflab trace diff``: two traces compared by structure (ranks paired, steps by index, every kernel,
operator, category and phase), the device the traces' GPU, times gated and shares reported.  Synthetic
jobs whose answers are known by construction, and the real traces of the test data."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from lab_utils.run.cli import main as perflab
from lab_utils.traces import TraceAnalysis
from unit.traces.test_collectives import ann, kernel, launch, op, step, write

ROOT = Path(__file__).resolve().parents[3]
TRACES = ROOT.parent / "shared" / "data" / "gpu-traces"
real = pytest.mark.skipif(not TRACES.is_dir(), reason=f"real GPU traces not present at {TRACES}")
PROPS = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045149696, "numSms": 132}]
#: ten kernels, 100 us down to 10 us: the 8th by time is k7 (30 us), outside any top 5
KERNELS = {f"k{i}_gemm" if i < 3 else f"k{i}_elementwise": 100.0 - 10 * i for i in range(10)}


def job(path, *, rank=0, world=1, scale=None, steps=5, extra=None, drop=None):
    """``steps`` steps of the ten kernels, one after the other on one stream, each launched by its own
    ``aten::`` op inside ``## forward ##``; ``scale``: {kernel: factor}; a 0.1 us step-to-step jitter."""
    scale, ev, c = scale or {}, [], 1
    for s in range(steps):
        t0 = s * 2000.0
        ev += [step(s + 1, t0, 2000), ann("## forward ##", t0 + 1, 1500)]
        t = t0 + 10
        names = [n for n in KERNELS if n != drop] + ([extra] if extra else [])
        for name in names:
            dur = (KERNELS.get(name, 25.0) + 0.1 * ((s * 7 + c) % 3)) * scale.get(name, 1.0)
            ev += [op(f"aten::op_{name}", t, 5, c), launch(c, t + 1, ext=c), kernel(name, c, t + 10, dur, ext=c)]
            t += dur + 20
            c += 1
    return write(path, ev, deviceProperties=PROPS, distributedInfo={"rank": rank, "world_size": world})


def diff(tmp_path, a, b, *extra) -> tuple[int, dict]:
    out = tmp_path / "d"
    code = perflab(["trace", "diff", str(a), str(b), "--out", str(out), "--json", *extra])
    return code, json.loads((out / "compare.json").read_text()) | {"printed": None}


def rows(res: dict) -> dict[str, dict]:
    return {r["metric"]: r for r in res["rows"]}


def test_a_2x_kernel_outside_the_top_5_fails_the_gate_naming_it(tmp_path, capsys):
    base = job(tmp_path / "a.json")
    code, res = diff(tmp_path, base, job(tmp_path / "b.json", scale={"k7_elementwise": 2.0}))
    r = rows(res)
    assert code == 1 and r["kernel:k7_elementwise"]["verdict"] == "slower" and r["kernel:k7_elementwise"]["regression"]
    assert r["op:aten::op_k7_elementwise"]["verdict"] == "slower"
    bad = {m for m, x in r.items() if x["regression"]}
    assert bad <= {"kernel:k7_elementwise", "op:aten::op_k7_elementwise", "category:elementwise/activation",
                   "phase:forward", "kernel_time", "span"}, bad  # fmt: skip
    assert all(r[f"kernel:{k}"]["verdict"] == "same" for k in KERNELS if k != "k7_elementwise")
    assert "k7_elementwise" in capsys.readouterr().out
    assert diff(tmp_path, base, base)[0] == 0


def test_a_pure_2x_speed_up_passes_though_idle_rose(tmp_path):
    """The largest kernel twice as fast: it reads "faster"; the idle share rises, is reported
    ("changed"), and gates nothing."""
    code, res = diff(tmp_path, job(tmp_path / "a.json"), job(tmp_path / "b.json", scale={"k0_gemm": 0.5}))
    r = rows(res)
    assert code == 0 and r["kernel:k0_gemm"]["verdict"] == "faster"
    idle = r["idle_share"]
    assert idle["candidate"] > idle["base"] and idle["verdict"] == "changed" and not idle["regression"]
    assert idle["unit"] == "% of span" and r["share:COMPUTATION"]["unit"] == "% of kernel time"
    assert not any(x["regression"] for x in r.values())


def test_two_ranks_pair_by_structure_and_show_their_gpu(tmp_path, capsys):
    """Rank 3 of one job against rank 1 of another: paired as one rank each, every row matched; the
    device of each side is the trace's GPU, not the machine that read it."""
    a = job(tmp_path / "rank3.json", rank=3, world=8)
    b = job(tmp_path / "rank1.json", rank=1, world=8)
    out = tmp_path / "d"
    assert perflab(["trace", "diff", str(a), str(b), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows_in_both"] == printed["rows_total"] > 20 and "rank 3 vs rank 1" in printed["ranks"]
    res = json.loads((out / "compare.json").read_text())
    assert {r["variant"] for r in res["rows"]} == {"rank"}
    for side in ("base", "candidate"):
        assert res[side]["context"]["device"] == "NVIDIA H100 80GB HBM3"
        assert res[side]["context"]["device_kind"] == "gpu trace"
    assert "NVIDIA H100 80GB HBM3" in (out / "compare.html").read_text()


def test_folders_pair_rank_by_rank_or_by_position(tmp_path, capsys):
    for name, ranks in (("a", (0, 1)), ("b", (0, 1)), ("c", (4, 5))):
        (tmp_path / name).mkdir()
        for r in ranks:
            job(tmp_path / name / f"rank-{r}.json", rank=r, world=8, steps=4)
    code, res = diff(tmp_path, tmp_path / "a", tmp_path / "b", "--workers", "1")
    assert code == 0 and {r["variant"] for r in res["rows"]} == {"rank0", "rank1"}
    code, res = diff(tmp_path, tmp_path / "a", tmp_path / "c", "--workers", "1")
    assert code == 0 and {r["variant"] for r in res["rows"]} == {"rank#0", "rank#1"}
    assert "by position (0-4, 1-5)" in capsys.readouterr().out


def test_a_kernel_only_one_side_ran_is_zero_on_the_other(tmp_path):
    """A kernel the candidate no longer runs took 0 ms there (faster, not "missing"); a new one is
    reported slower from 0 ms, without samples to judge noise on, so not gated."""
    a = job(tmp_path / "a.json")
    code, res = diff(tmp_path, a, job(tmp_path / "b.json", drop="k9_elementwise", extra="k10_new_copy"))
    r = rows(res)
    assert r["kernel:k9_elementwise"]["candidate"] == 0.0 and r["kernel:k9_elementwise"]["verdict"] == "faster"
    new = r["kernel:k10_new_copy"]
    assert new["base"] == 0.0 and new["verdict"] == "slower" and not new["regression"]
    assert not any(x["verdict"] in ("only in base", "only in candidate") for x in r.values() if x["unit"] == "ms")


@real
def test_two_ranks_of_the_real_128_rank_job_match_90_percent_of_rows(tmp_path, capsys):
    folder = TRACES / "multirank_2of128"
    a, b = folder / "sampled_rank-0.json.gz", folder / "sampled_rank-1.json.gz"
    perflab(["trace", "diff", str(a), str(b), "--out", str(tmp_path / "d"), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows_in_both"] / printed["rows_total"] >= 0.9, printed["ranks"]
    ctx = printed["base"]["context"]
    assert ctx["device"] == "GPU not recorded" and ctx["device_kind"] == "gpu trace"


def planted(tmp_path, src: Path, nth: int = 8) -> tuple[Path, str]:
    """``src`` with the ``nth`` kernel by time (in the steps) twice as long at every call."""
    ta = TraceAnalysis(src)
    name = ta.top_kernels(ta.ranks[0], nth)["name"].iloc[nth - 1]
    with gzip.open(src, "rt") as fh:
        doc = json.load(fh)
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and e.get("name") == name and e.get("cat") == "kernel":
            e["dur"] = 2 * e["dur"]
    out = tmp_path / "planted.json.gz"
    with gzip.open(out, "wt", compresslevel=1) as fh:
        json.dump(doc, fh)
    return out, name


@real
def test_the_real_job_against_itself_and_against_a_planted_2x_kernel(tmp_path, capsys):
    src = next((TRACES / "v100_single_rank").iterdir())  # 5 steps
    assert perflab(["trace", "diff", str(src), str(src), "--out", str(tmp_path / "self")]) == 0
    bad, name = planted(tmp_path, src)
    capsys.readouterr()
    code, res = diff(tmp_path, src, bad)
    r = [x for x in res["rows"] if x["regression"]]
    assert code == 1 and any(x["metric"].startswith("kernel:" + name[:60]) for x in r), [x["metric"] for x in r]
    assert name[:60] in capsys.readouterr().out


@real
def test_the_real_a100_and_v100_jobs_differ_in_device_named_as_the_traces_say(tmp_path, capsys):
    a, b = TRACES / "recsys_a100_rank3", TRACES / "recsys_v100_rank1"
    assert perflab(["trace", "diff", str(a), str(b), "--out", str(tmp_path / "d")]) == 3
    out = capsys.readouterr().out
    assert "NVIDIA A100-PG509-200 vs Tesla V100-SXM2-16GB" in out and "--allow-device-mismatch" in out
    code = perflab(["trace", "diff", str(a), str(b), "--out", str(tmp_path / "d"), "--allow-device-mismatch"])
    assert code != 3 and not math.isnan(code)
