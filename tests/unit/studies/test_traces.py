"""Lab 09's study (lab_utils/studies/traces.py) and explorer on a trace given by path: parameters
refused by name, the checked facts, the tables, the explorer's selections and the takeaway."""

from __future__ import annotations

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.core.plots import init
from lab_utils.core.records import Recorder
from lab_utils.profiling.record import record_tiny_step
from lab_utils.studies import traces as study
from lab_utils.studies.explore.traces import ALL, TracesExplorer
from lab_utils.studies.headline import headline


@pytest.fixture(scope="module")
def given(tmp_path_factory):
    init()  # holoviews' bokeh extension: the explorer's and the study's plots take their options
    path = record_tiny_step(tmp_path_factory.mktemp("lab09"), steps=2, warmup=1)
    cfg = study.TracesLabConfig(trace_path=str(path))
    return cfg, study.load(cfg)


@pytest.mark.parametrize(
    "param, value",
    [
        ("trace_path", "/no/such/trace.json"),
        ("ranks", 1),
        ("scope", "everything"),
        ("device", "tpu"),
        ("top_n", 0),
        ("timeline_step", -1),
        ("timeline_step", "2"),
    ],  # fmt: skip
)
def test_bad_parameters_are_refused_by_name(param, value):
    with pytest.raises(ConfigError) as e:
        study.TracesLabConfig(**{param: value})
    assert e.value.param == param


def test_a_given_cpu_trace_is_read_by_the_cpu_rule_and_its_facts_hold(given):
    cfg, lt = given
    assert not lt.own and list(lt.analyses) == ["trace"] and study.main_name(lt) == "trace"
    assert study.source_lines(lt) == [
        "trace: 1 rank(s), given by trace_path, read by: CPU rule (leaf CPU operators as kernels)"
    ]
    assert study.rule_lines(lt) == ["trace rank 0: no GPU activity -> CPU rule"]
    assert study.total_lines(lt, cfg)[0].startswith("trace rank 0: 2 steps, 2 with activities")
    assert study.communication_lines(lt, cfg) == ["rank 0: 0 collective calls"]
    roof, plot, peaks = study.roofline_view(lt, "trace")
    assert plot is None and "no peaks" in peaks and len(roof) and (roof["flops"] > 0).all()
    t = study.temporal_tables(lt)
    assert list(t["trace"]) == ["trace"] and t["rule"].iloc[0] == "cpu"
    cats = study.category_table(lt.analyses["trace"])
    assert cats["pct"].sum() == pytest.approx(100.0, abs=0.01)  # each row rounded to 3 decimals


def test_explorer_selects_rank_step_and_phase(given):
    _, lt = given
    ta = lt.analyses["trace"]
    rec = Recorder("09_traces")
    ex = TracesExplorer(rec, analysis=ta)
    k = ta.kernels(0, "steps")
    step = int(k["step"].iloc[0])
    out = ex.run(step=step, phase="forward")
    want = k[(k["step"] == step) & (k["phase"] == "forward")]["dur"].sum() / 1e3
    assert out.ok and out.result.row["total_ms"] == pytest.approx(want, abs=1e-3)
    assert ex.run(step=ALL, phase=ALL).result.row["activities"] == len(k)
    with pytest.raises(ConfigError) as e:
        ex.run(step=999)
    assert e.value.param == "step"
    assert len(ex.figures(ex.results)) == 1


def test_records_fill_the_takeaway(given):
    _, lt = given
    rec = study.record(lt, Recorder("09_traces"))
    figs = headline("09_traces", rec)
    labels = [f.label for f in figs]
    assert "trace rank 0 compute" in labels and "trace rank 0 idle" in labels


def test_the_lab_shows_the_timeline_critical_path_call_tree_and_sequences(given):
    """The median step of two (the shorter), its timeline with the critical path lane; the path,
    the call tree and the idle per stream add up (analysis_lines asserts); a step the trace lacks
    is refused by the lab's parameter name."""
    _, lt = given
    ta = lt.analyses["trace"]
    steps = ta.steps(0).sort_values("dur")
    tl = study.timeline(ta)
    assert tl.step == int(steps["step"].iloc[0]) and tl.lanes[0] == "r0 · critical path"
    assert study.timeline_view(tl).object.right, "the legend sits right of the plot"
    text, parts, events = study.critical_path_view(ta)
    cp = ta.critical_path(0, tl.step)
    assert text.startswith(f"rank 0, step {tl.step}: critical path {cp.length_us / 1e3:.3f} ms")
    assert parts["us"].sum() == pytest.approx(cp.length_us, abs=0.01) and set(parts["category"]) <= {"CPU"}
    assert study.analysis_lines(ta, "trace") == [
        "trace rank 0: the critical path's parts add up to its length; the call tree's top rows add up to the kernel "
        "time; each stream's idle kinds add up to its idle time"
    ]
    tree = study.hierarchy_table(ta)
    assert tree["name"].iloc[0] == "ProfilerStep" and tree["gpu_pct"].iloc[0] == pytest.approx(100.0)
    assert len(study.sequence_table(ta, n=5)) <= 5
    st = study.stream_table(ta)
    assert {"host_wait", "kernel_wait", "other", "queue_max"} <= set(st.columns)
    with pytest.raises(ConfigError) as e:
        study.timeline(ta, 999)
    assert e.value.param == "timeline_step"
