"""Labs 01, 04 and 06: each explorer starts on the lab's own step (its
parameters), shows a stability verdict on every timing it shows, and offers the lab's GPU
set's sizes on a GPU (lab 05's and lab 08's explorers: test_explore.py, test_explore_plan.py)."""

from __future__ import annotations

import math

import holoviews as hv
import pytest
import yaml

from lab_utils.core.records import Recorder
from lab_utils.core.timing import judge_samples

hv.extension("bokeh")


def _sets(lab: str) -> dict:
    from lab_utils.studies.explore.training_step import GPU_SET

    return yaml.safe_load((GPU_SET.parents[1] / lab / "gpu.yaml").read_text())


# --------------------------------------------------------------------------- lab 01
def test_training_step_explorer_shows_the_verdict_of_every_timing():
    from lab_utils.studies.explore import training_step as ex_mod
    from lab_utils.studies.training_step import TrainingStepLabConfig, profile_step

    cfg = TrainingStepLabConfig(device="cpu", steps=3, warmup_steps=0, num_samples=6, batch_size=3)
    measured = profile_step(cfg, ex_mod.device_info("cpu"))
    ex = ex_mod.TrainingStepExplorer.for_lab(cfg, rec=measured.rec, measured=measured)
    assert ex.config["batch"] == 3 and ex.config["bucket"] == "lab", "the explorer does not start at the lab's step"
    row = ex.run().result.row
    step_v = judge_samples(list(measured.report.amortised_step_ms))  # the step time's own samples, judged here
    assert row["step_stability"] == str(step_v) and row["stable"] == step_v.stable
    wide = measured.report.phase_frame()
    unstable = [
        p
        for p in wide.columns
        if measured.report.periods.get(p, 1) == 1 and wide[p].size and not judge_samples(list(wide[p])).stable
    ]
    shown = [] if row["unstable_phases"] == "none" else row["unstable_phases"].split(", ")
    assert set(unstable) <= set(shown), (unstable, shown)
    bars = ex.figures(ex.results)[0]
    assert "stability" in [d.name for d in bars.vdims], "the phase bars' hover has no verdict"
    assert set(bars.dframe()["stability"]) - {"not run"}, "no phase of the bars carries a verdict"
    # the lab's figure (time per step by phase), the lab's own step as "#1 lab"
    assert [d.name for d in bars.kdims] == ["phase", "config"] and bars.opts.get().kwargs["ylabel"] == "ms per step"
    assert "Time per step by phase" in bars.opts.get().kwargs["title"]
    first = bars.dframe().query("config == '#1 lab'").set_index("phase")["ms"]
    want = {f.phase: f.ms for f in measured.report.phase_figures()}
    assert first.to_dict() == pytest.approx({p: want.get(p, 0.0) for p in first.index}), "#1 is not the lab's step"


def test_training_step_explorer_offers_the_labs_gpu_sizes_on_cuda():
    from lab_utils.studies.explore.training_step import explorer_controls

    gpu = _sets("01_training_step")
    on_gpu = {c.name: c.options for c in explorer_controls("cuda")}
    on_cpu = {c.name: c.options for c in explorer_controls("cpu")}
    buckets = [f"{h}x{w}" for h, w in gpu["buckets"]]
    assert set(buckets) <= set(on_gpu["bucket"]) and gpu["batch_size"] in on_gpu["batch"], on_gpu
    assert not set(buckets) & set(on_cpu["bucket"]), "a CPU explorer offers 1024-px buckets"


# --------------------------------------------------------------------------- lab 04
def test_low_precision_explorer_quantizes_the_labs_tensor():
    from lab_utils.precision.numerics import error_stats, make_tensor
    from lab_utils.studies.explore.low_precision import LowPrecisionExplorer, explorer_controls
    from lab_utils.studies.low_precision import LowPrecisionLabConfig

    cfg = LowPrecisionLabConfig(device="cpu", tensor_shape=[64, 96], distributions=["laplace", "gaussian"])
    ex = LowPrecisionExplorer(Recorder("04_low_precision", params=cfg.to_dict()))
    assert (ex.config["shape"], ex.config["dist"]) == ("64x96", "laplace")
    row = ex.run().result.row
    want = error_stats(make_tensor("laplace", (64, 96), seed=0), ex.config["fmt"], **ex.quant_kw(ex.config))
    other = error_stats(make_tensor("laplace", (128, 256), seed=0), ex.config["fmt"], **ex.quant_kw(ex.config))
    assert want.sqnr_db != other.sqnr_db, "the check cannot tell the shapes apart"
    assert row["shape"] == "64x96" and row["sqnr_db"] == round(want.sqnr_db, 2)
    assert {r["shape"] for r in ex.rec.rows} == {"64x96"}
    heat = ex.figures(ex.results)[1].get(0)  # the lab's SQNR map: tensor x variant
    assert isinstance(heat, hv.HeatMap) and [d.name for d in heat.kdims] == ["tensor", "variant"]
    cells = heat.dframe()
    assert cells["sqnr_db"].tolist() == [round(row["sqnr_db"], 1)] and cells.tensor.tolist() == ["laplace 64x96"]
    gpu = "x".join(map(str, _sets("04_low_precision")["tensor_shape"]))
    assert gpu in dict((c.name, c.options) for c in explorer_controls(cfg.to_dict(), "cuda"))["shape"]
    assert gpu not in dict((c.name, c.options) for c in explorer_controls(cfg.to_dict(), "cpu"))["shape"]


# --------------------------------------------------------------------------- lab 06
def test_distributed_explorer_runs_the_labs_step_with_a_verdict_on_its_timings():
    from lab_utils.studies.distributed import DistributedLabConfig
    from lab_utils.studies.explore.distributed import DistributedExplorer

    cfg = DistributedLabConfig(world_sizes=[1, 2], batch_size=2, height=32, width=32, txt_len=8, steps=4)
    ex = DistributedExplorer(Recorder("06_distributed", params=cfg.to_dict()), defaults=dict(strategy="single"))
    assert ex.config["world_size"] == 2, "the default world size is not the lab's largest"
    dc = ex.dist_config(dict(ex.config, world_size=1))
    assert (dc.batch_size, dc.height, dc.width, dc.txt_len, dc.steps) == (2, 32, 32, 8, 4)
    out = ex.run(world_size=1)
    assert out.ok, ex.status
    row = out.result.row
    rows = {r["metric"]: r for r in ex.rec.rows}
    step = rows["step_time"]
    assert len(step["samples"]) == 3, "the step time's samples: every step after the first"
    assert row["step_stability"] == str(judge_samples(step["samples"])) and step["stable"] == row["stable"]
    assert row["step_ms"] == pytest.approx(sorted(step["samples"])[1], rel=1e-12)
    assert rows["comm_time"]["stable"] is False and "1 sample" in row["comm_stability"]
    assert math.isfinite(row["final_loss"])
    bars = ex.figures(ex.results)[1]  # the lab's figure: compute / exposed / idle per run and rank
    assert [d.name for d in bars.kdims] == ["run_rank", "part"] and "per rank" in bars.opts.get().kwargs["title"]
    parts = bars.dframe()
    assert set(parts.part) == {"compute", "exposed", "idle"} and parts.run_rank.str.startswith("#1").all()


def test_distributed_explorer_offers_the_labs_world_sizes():
    from lab_utils.studies.explore.distributed import world_size_controls

    sizes = {c.name: c for c in world_size_controls({"world_sizes": [1, 8]})}["world_size"]
    assert 8 in sizes.options and sizes.default == 8
    assert {c.name: c for c in world_size_controls({})}["world_size"].options == (1, 2, 4)
