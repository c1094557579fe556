"""The live explorers without a browser: the shared machinery (cache by configuration,
reasons, records, interruption, the widget path driven from Python) on a toy explorer, and
each lab's explorer: its headless static render and one live measurement."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import holoviews as hv
import pandas as pd
import panel as pn
import pytest
from bokeh.models import ImportedStyleSheet, UIElement
from IPython.display import HTML

from lab_utils.core.ceilings import Ceilings
from lab_utils.core.config import ConfigError
from lab_utils.core.plots import init
from lab_utils.core.records import EXPLORE, Recorder, load_records
from lab_utils.studies.explore import LIVE_NOTE, Control, Explorer, Progress, Result, Unavailable, is_live

CEIL = Ceilings(
    device={"name": "test cpu"},
    copy_gbs=20.0,
    copy_bytes=1 << 24,
    matmul_tflops={"fp32": 0.2, "bf16": 0.1},
    matmul_n={"fp32": 256, "bf16": 256},
)


@dataclass
class Toy(Explorer):
    """Measures nothing heavy: counts its calls, can be told to wait for Stop."""

    lab: ClassVar[str] = "toy"
    title: ClassVar[str] = "Toy"
    controls: ClassVar[tuple[Control, ...]] = (Control("n", (1, 2, 3, 99), 1), Control("slow", (), False))

    def __post_init__(self):
        super().__post_init__()
        self.calls = 0

    def why_not(self, cfg):
        return "99 is too many" if cfg["n"] == 99 else None

    def measure(self, cfg, progress: Progress) -> Result:
        self.calls += 1
        steps = 50 if cfg["slow"] else 1
        for _ in progress.iter(list(range(steps)), "step"):
            if cfg["slow"]:
                time.sleep(0.02)
        self.rec.add("explore", f"n{cfg['n']}", "square", cfg["n"] ** 2, "", statistic="value")
        return Result(0, cfg, dict(n=cfg["n"], square=cfg["n"] ** 2))

    def figures(self, results):
        df = pd.DataFrame([dict(n=r.row["n"], square=r.row["square"]) for r in results], columns=["n", "square"])
        return [hv.Scatter(df, "n", "square")]


def _render(obj):
    hv.renderer("bokeh").get_plot(obj)  # raises when the figure cannot be drawn


def test_cache_reason_and_validation():
    ex = Toy()
    assert ex.run().ok and ex.calls == 1
    again = ex.run()
    assert again.cached and again.result is ex.results[0] and ex.calls == 1, "a repeated choice must not re-measure"
    assert ex.run(n=2).ok and ex.calls == 2 and len(ex.table()) == 2
    no = ex.run(n=99)
    assert not no.ok and no.reason == "99 is too many" and ex.status == "cannot run: 99 is too many"
    assert ex.run(n=99).cached and len(ex.results) == 2, "a configuration that cannot run adds no result"
    with pytest.raises(ConfigError, match="'n'"):
        ex.run(n=7)
    with pytest.raises(ConfigError, match="'slow'"):
        ex.run(slow="yes")
    with pytest.raises(ConfigError, match="nope"):
        Toy(defaults={"nope": 1})
    assert list(ex.table()["#"]) == [1, 2]


def test_unavailable_raised_while_measuring_is_a_reason():
    @dataclass
    class Fails(Toy):
        def measure(self, cfg, progress):
            raise Unavailable("not on this device")

    ex = Fails()
    out = ex.run()
    assert not out.ok and out.reason == "not on this device" and not ex.results


def test_every_result_is_a_record_that_save_keeps(tmp_path):
    rec = Recorder(lab="toy")
    ex = Toy(rec=rec)
    ex.run()
    ex.run(n=3)
    ex.run(n=3)  # cached: no new record
    df = load_records(rec.save(tmp_path / "records.json"))
    assert list(df.variant) == ["n1", "n3"] and list(df.value) == [1.0, 9.0]


def test_stop_interrupts_at_a_checkpoint():
    ex = Toy()
    stop = threading.Event()
    stop.set()
    out = ex.run(Progress(stop), slow=True)
    assert out.interrupted and not out.ok and ex.status.startswith("interrupted")
    assert ex.run(slow=True).ok, "an interrupted configuration is not cached"


def test_headless_static_render():
    assert not is_live(), "pytest has no kernel: explorers render statically"
    ex = Toy()
    objs = ex.static()
    assert isinstance(objs[0], HTML) and LIVE_NOTE in objs[0].data
    assert isinstance(objs[-2], pd.DataFrame) and len(objs[-2]) == 1
    _render(objs[-1])


def test_widget_change_measures_in_the_background():
    """The live path without a browser: a control's change runs the measurement in a worker,
    the table gains a row, the plot's stream gets the new results, a reason is shown."""
    ex = Toy()
    ex.run()
    box = ex.widget()
    ex.live_figure()
    seen = []
    ex._pipe.add_subscriber(lambda data: seen.append(len(data)))
    ex._ui["controls"]["n"].value = 2
    _wait(lambda: ex._worker is None and len(ex.results) == 2)
    assert ex._ui["table"].value.count("</tr>") == 3  # header + 2 rows
    assert seen and seen[-1] == 2
    ex._ui["controls"]["n"].value = 99
    _wait(lambda: ex._worker is None and "cannot run" in ex._ui["status"].value)
    assert "perflab-explore-reason" in ex._ui["status"].value and "99 is too many" in ex._ui["status"].value
    assert box.children


def test_stop_button_ends_a_running_measurement():
    ex = Toy()
    ex.run()
    ex.widget()
    ex.live_figure()
    ex._ui["controls"]["slow"].value = True
    _wait(lambda: not ex._ui["stop"].disabled)
    ex._ui["stop"].click()
    _wait(lambda: ex._worker is None)
    assert "interrupted" in ex._ui["status"].value and len(ex.results) == 1


def test_panel_stylesheets_are_inlined():
    """In a live JupyterLab panel (which renders holoviews objects and their widgets) would
    ask its CDN for each component's stylesheet; after ``plots.init`` none points outside."""
    init()
    root = pn.panel(hv.HoloMap({i: hv.Curve([1, i]) for i in range(3)}, "i")).get_root()
    sheets = [s for m in root.select({"type": UIElement}) for s in m.stylesheets]
    assert sheets, "panel attached no stylesheet: the check would be vacuous"
    urls = [s.url for s in sheets if isinstance(s, ImportedStyleSheet)]
    assert not [u for u in urls if u.startswith("http")], urls


def _wait(cond, timeout_s: float = 20):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the explorer's worker did not finish"
        time.sleep(0.02)


# ------------------------------------------------------------------ each lab's explorer


def _check_lab(ex, change: dict, unavailable: dict):
    """Headless render of the default state, one live measurement, one reason, records kept."""
    objs = ex.static()
    assert LIVE_NOTE in objs[0].data and len(ex.results) == 1, ex.status
    _render(objs[-1])
    n_rows = len(ex.rec.rows)
    out = ex.run(**change)
    assert out.ok and not out.cached, ex.status
    assert len(ex.rec.rows) > n_rows, "a live measurement writes records"
    assert len(ex.table()) == 2
    _render(ex.figure())
    no = ex.run(**unavailable)
    assert not no.ok and no.reason, f"{unavailable} should not run here"
    return out.result


def test_ceilings_explorer():
    from lab_utils.studies.explore.ceilings import CeilingsExplorer

    ex = CeilingsExplorer(ceilings=CEIL, device="cpu", reps=5, defaults=dict(size=4096))
    r = _check_lab(ex, dict(op="matmul", size=64), dict(op="matmul", size=4194304))
    assert r.row["bound"] in ("memory", "compute") and r.row["tflops"] > 0
    assert {"explore"} == {row["experiment"] for row in ex.rec.rows}


def test_fused_explorer_checks_then_times_and_never_times_triton_on_cpu():
    from lab_utils.studies.explore.fused_kernels import NOT_TIMED, FusedExplorer

    ex = FusedExplorer(ceilings=CEIL, device="cpu", reps=5, defaults=dict(tokens=61, hidden=96, head_dim=32))
    r = _check_lab(ex, dict(op="rope"), dict(op="gelu_tanh", variant="torch"))
    assert r.row["check"] == "ok" and r.row["gbs"] > 0
    t = ex.run(variant="triton", op="rms_norm").result
    assert t.row["check"] == "ok" and math.isnan(t.row["time_ms"]) and NOT_TIMED in t.row["note"]
    lg = ex.run(variant="liger", op="rms_norm").result  # the peer library's kernel: checked, not timed here
    assert lg.row["check"] == "ok" and math.isnan(lg.row["time_ms"]) and NOT_TIMED in lg.row["note"]
    assert "no variant 'liger'" in ex.why_not(dict(ex.defaults, op="gelu_tanh", variant="liger", dtype="float32"))


def test_attention_explorer():
    from lab_utils.studies.explore.attention import AttentionExplorer

    ex = AttentionExplorer(ceilings=CEIL, device="cpu", reps=4, defaults=dict(seq_len=64))
    r = _check_lab(ex, dict(mask="document", seq_len=127), dict(path="efficient"))
    assert r.row["check"] == "ok" and 0 < r.row["density"] < 1
    assert r.data["picture"].shape == (127, 127)


def test_low_precision_explorer():
    from lab_utils.studies.explore.low_precision import LowPrecisionExplorer

    ex = LowPrecisionExplorer()
    r = _check_lab(ex, dict(hadamard=128), dict(hadamard="off", block_size=16))
    assert r.row["sqnr_db"] > ex.results[0].row["sqnr_db"], "rotating outlier channels raises the SQNR (seed 0)"
    assert math.isclose(r.data["hist"]["frac"].sum(), 1.0, rel_tol=1e-6)


def test_training_step_explorer():
    from lab_utils.studies.explore.training_step import TrainingStepExplorer
    from lab_utils.studies.training_step import TrainingStepLabConfig

    cfg = TrainingStepLabConfig(device="cpu", steps=1, warmup_steps=0, num_samples=4)
    ex = TrainingStepExplorer.for_lab(cfg)
    r = _check_lab(ex, dict(batch=1), dict(attention_path="efficient"))
    assert r.row["step_ms"] > 0 and r.row["peak_mib"] >= 0
    assert ex.run(kernels="triton").reason.startswith("kernels='triton' runs in Triton's interpreter")
    variants = {row["variant"].split(" | ")[0] for row in ex.rec.rows}
    assert len(variants) == 2, "each configuration's records carry its label"


def test_memory_explorer():
    from lab_utils.studies.explore.memory import MemoryExplorer

    ex = MemoryExplorer(device="cpu", reps=3, defaults=dict(batch=1))
    objs = ex.static()
    assert LIVE_NOTE in objs[0].data and len(ex.results) == 1, ex.status
    _render(objs[-1])
    r = ex.results[0].row
    assert r["saved_mib"] == r["formula_mib"] and r["grads_equal"], "saved bytes: measurement == analytic model"
    assert not ex.run(policy="offload").ok


def test_memory_explorer_measures_the_labs_step_and_lands_on_its_pareto_plot(monkeypatch):
    from lab_utils.core.timing import Timing
    from lab_utils.memory import PolicyResult
    from lab_utils.studies import memory as study
    from lab_utils.studies.explore import memory as ex_mod

    cfg = study.MemoryLabConfig(device="cpu", batch_size=3, resolution=96, txt_len=5, dtype="bfloat16")
    ex = ex_mod.MemoryExplorer.for_lab(cfg)
    assert {k: ex.config[k] for k in ("preset", "dtype", "batch", "resolution", "txt_len")} == dict(
        preset=cfg.preset, dtype=cfg.dtype, batch=cfg.batch_size, resolution=cfg.resolution, txt_len=cfg.txt_len
    )
    seen = []
    timing = Timing("step", "cpu", "torch.utils.benchmark", (5.0, 9.0, 5.1, 14.0, 5.0), 6.0)

    def fake(step, policies, **k):  # the policy's run itself is covered by test_memory_explorer
        shape = step.capabilities["memory_formula"]
        seen.append(
            (study.mem.step_shape(shape.cfg, shape.batch, shape.height, shape.width, shape.txt_len), shape.dtype)
        )
        return [PolicyResult(policies[0], 4, 10, 1000, 1.0, timing, True, True)]

    monkeypatch.setattr(ex_mod, "compare_policies", fake)
    lab = pd.DataFrame([dict(policy="none", time_ms=4.0, peak_bytes=900, stable=True, device="cpu")])
    ex = ex_mod.MemoryExplorer.for_lab(cfg, measured=lab)
    row = ex.run().result.row
    assert seen == [(cfg.step_shape(), cfg.dtype)], "the explorer's default step is the lab's"
    assert row["shape"] == study.sh_str(cfg.step_shape())
    assert row["stable"] is False and row["stability"].startswith("UNSTABLE"), row["stability"]
    (plot,) = ex.figures(ex.results)
    marks = {el.label: el for el in plot if el.label}
    assert list(marks[study.UNSTABLE].data.policy) == ["#1 none"], "the explored point is marked unstable"
    assert list(marks[study.FRONT].data.policy) == ["lab none"], "the lab's policies stand on the same plot"
    assert plot.opts.get().kwargs["ylabel"] == "peak above start (MiB)", "the lab's quantity: peak vs step time"


def test_memory_explorer_offers_the_labs_gpu_sizes_on_cuda():
    from lab_utils.studies import memory as study
    from lab_utils.studies.explore.memory import explorer_controls

    gpu = study.gpu_set()
    on_gpu = {c.name: c.options for c in explorer_controls("cuda")}
    on_cpu = {c.name: c.options for c in explorer_controls("cpu")}
    keys = dict(preset="preset", batch="batch_size", resolution="resolution", txt_len="txt_len")
    for name, key in keys.items():
        assert gpu[key] in on_gpu[name], (name, on_gpu[name])
    assert gpu["resolution"] not in on_cpu["resolution"] and gpu["preset"] not in on_cpu["preset"]


def test_stability_explorer():
    from lab_utils.studies.explore.stability import StabilityExplorer

    ex = StabilityExplorer(steps=4)
    objs = ex.static()
    assert LIVE_NOTE in objs[0].data and len(ex.results) == 1, ex.status
    _render(objs[-1])
    assert len(ex.results[0].data["steps"]) == 4
    assert any(row["metric"] == "final_loss" for row in ex.rec.rows)


@pytest.mark.slow
def test_distributed_explorer():
    from lab_utils.studies.explore.distributed import DistributedExplorer

    ex = DistributedExplorer(defaults=dict(strategy="single", world_size=1))
    objs = ex.static()
    assert LIVE_NOTE in objs[0].data and len(ex.results) == 1, ex.status
    _render(objs[-1])
    out = ex.run(strategy="ddp", world_size=2)
    assert out.ok and out.result.row["collectives"] > 0, ex.status
    assert "world_size" in ex.run(strategy="single").reason


def test_training_step_explorer_swaps_the_precision_recipe():
    from lab_utils.studies.explore.training_step import TrainingStepExplorer
    from lab_utils.studies.training_step import TrainingStepLabConfig

    cfg = TrainingStepLabConfig(device="cpu", steps=1, warmup_steps=0, num_samples=4, batch_size=1)
    ex = TrainingStepExplorer.for_lab(cfg)
    assert ex.step_config(dict(ex.defaults, recipe="fp8_tensor")).model_config().recipe == "fp8_tensor"
    r = ex.run(recipe="fp8_tensor")
    assert r.ok, r.reason
    assert r.result.config["recipe"] == "fp8_tensor"
    with pytest.raises(ConfigError, match="'recipe'"):
        ex.run(recipe="fp7")


def test_training_step_explorer_reuses_the_labs_own_profile(monkeypatch):
    """The default configuration is the lab's: its profile becomes result #1, not a second run."""
    from lab_utils.studies.explore import training_step as ex_mod
    from lab_utils.studies.training_step import TrainingStepLabConfig, profile_step

    cfg = TrainingStepLabConfig(device="cpu", steps=1, warmup_steps=0, num_samples=4, batch_size=1)
    measured = profile_step(cfg, ex_mod.device_info("cpu"))

    def no_second_profile(*a, **k):
        raise AssertionError("the lab's configuration was profiled again")

    monkeypatch.setattr(ex_mod, "profile_step", no_second_profile)
    # the lab hands its own recorder, the one its profile wrote into
    lab_rows = [dict(r) for r in measured.rec.rows]
    ex = ex_mod.TrainingStepExplorer.for_lab(cfg, rec=measured.rec, measured=measured)
    out = ex.run()
    assert measured.rec.rows == lab_rows, "the lab's own configuration adds no copy of the lab's rows"
    assert out.ok and out.result.index == 1
    assert out.result.row["step_ms"] == pytest.approx(float(measured.report.steps.step_ms.median()))
    # the explorer cell run again in the same kernel: a new explorer on the same recorder, nothing nested
    again = ex_mod.TrainingStepExplorer.for_lab(cfg, rec=measured.rec, measured=measured)
    assert again.run().ok and measured.rec.rows == lab_rows
    with pytest.raises(AssertionError, match="profiled again"):
        ex.run(batch=2)

    # an explored configuration (its own fresh recorder, as profile_step gives) lands once, as "explore"
    def explored(sc, info, lab):
        fresh = Recorder(lab=lab, rows=[dict(r) for r in lab_rows])
        return dataclasses.replace(measured, rec=fresh)

    monkeypatch.setattr(ex_mod, "profile_step", explored)
    assert ex.run(batch=2).ok and again.run(batch=2).ok
    new = measured.rec.rows[len(lab_rows) :]
    assert len(new) == 2 * len(lab_rows), "each explored configuration's rows once per explorer that measured it"
    assert {r["experiment"] for r in new} == {EXPLORE}
    assert not any(r["experiment"].startswith("explore_") for r in measured.rec.rows)
    label = ex.label(dict(ex.config, batch=2))
    assert {r["variant"] for r in new} == {f"{label} | {r['experiment']}/{r['variant']}" for r in lab_rows}
