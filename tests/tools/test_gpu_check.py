"""benchmarks/gpu_check.py: its CPU path runs end to end with the notebook/plotting packages
unimportable (as on a bare GPU machine), writes records that compare and baseline accept, and
a failing correctness check or a raising section changes the exit code."""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from lab_kernels import attention as KA
from lab_kernels import quant as Q
from lab_utils.core.records import load_records
from lab_utils.run.compare import baseline_kind, compare, store_baseline
from lab_utils.run.runner import notebook_config_class

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
#: What a GPU machine with only torch, triton and pandas lacks; none may be imported.
BLOCKED = (
    "holoviews",
    "bokeh",
    "panel",
    "jupyter",
    "jupyter_client",
    "jupyter_core",
    "jupyterlab",
    "notebook",
    "ipykernel",
    "IPython",
    "ipywidgets",
    "papermill",
    "nbformat",
    "nbconvert",
    "nbclient",
    "nbval",
    "diffusers",
    "transformers",
    "torchao",
)

RUNNER = textwrap.dedent(
    """
    import importlib.abc, runpy, sys
    BLOCKED = set(sys.argv[1].split(","))

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (not on a bare GPU machine)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code
    print("LOADED-BLOCKED:", sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED))
    sys.exit(rc)
    """
)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One full CPU run of the check (every section), in a fresh interpreter with the
    notebook and plotting packages made unimportable."""
    out = tmp_path_factory.mktemp("gpu_check") / "run"
    env = {**os.environ, "PERFLAB_CACHE": str(out.parent / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, ",".join(BLOCKED), str(SCRIPT), "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    return proc, out


@pytest.mark.slow
def test_cpu_run_without_notebook_packages(cpu_run):
    proc, out = cpu_run
    log = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "LOADED-BLOCKED: []" in proc.stdout, log
    status = json.loads((out / "status.json").read_text())
    assert [s["notebook"] for s in status] == [
        f"gpu_check:{x}" for x in ("ceilings", "fused", "attention", "fp8", "torchao", "train", "plan")
    ]
    assert all(s["status"] == "ok" for s in status), status
    summary = (out / "summary.txt").read_text()
    assert "0 failed" in summary and "targets (benchmarks, not tests)" in summary
    for word in ("fused", "attention", "fp8", "train"):  # progress lines carry elapsed time per section
        assert f"s] == {word} ok in" in proc.stdout
    # the encoder libraries are blocked here as on a bare GPU machine: the plan says why it did not run
    assert "plan: not run: the Trainer's encoders need transformers, diffusers" in proc.stdout


@pytest.mark.slow
def test_cpu_run_records(cpu_run):
    proc, out = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:]
    df = load_records(out)
    ctx = json.loads((out / "context.json").read_text())
    assert ctx["device_kind"] == "cpu" and ctx["baseline_kind"] == "cpu" and ctx["checks"] >= 20
    assert set(df["device_kind"]) == {"cpu"} and df["run_id"].nunique() == 1
    # every Triton fused op checked forward and backward (outputs and every gradient)
    fc = df[df["experiment"] == "fused_check"]
    ops = {json.loads(e)["op"] for e in fc["extra"]}
    assert ops == {"rms_norm", "layer_norm_modulate", "gated_residual", "gelu_tanh", "swiglu", "rope", "qk_norm_rope"}
    assert any("grad" in json.loads(e)["tensor"] for e in fc["extra"])
    # Liger's variant of each op it implements, checked beside Triton (bf16 ones Liger computes in
    # bf16 in float32 here: the interpreter's bf16 arithmetic is wrong), never timed on CPU
    lc = fc[(fc["variant"] == "liger") & (fc["statistic"] == "max")]
    assert {json.loads(e)["op"] for e in lc["extra"]} == {"rms_norm", "layer_norm_modulate", "swiglu", "rope"}
    assert all(json.loads(e)["ok"] for e in lc["extra"])
    lt = df[(df["experiment"] == "fused_time") & (df["variant"] == "liger") & (df["metric"] == "time")]
    assert len(lt) and set(lt["statistic"]) == {"not_timed"}
    # torchao is blocked here as on a bare GPU machine: refused with the reason, not failed
    ao = df[df["experiment"] == "torchao_time"]
    assert len(ao) == 3 and all("torchao is not importable" in json.loads(e)["reason"] for e in ao["extra"])
    # attention: full, causal and varlen checked on the Triton path, dq/dk/dv included
    ac = df[(df["experiment"] == "attention_check") & (df["variant"] == "triton") & (df["statistic"] == "max")]
    cases = {(json.loads(e)["mask"], json.loads(e)["tensor"]) for e in ac["extra"]}
    assert {(m, t) for m in ("full", "causal", "varlen") for t in ("out", "dq", "dk", "dv")} <= cases
    # the interpreter is never timed: Triton rows say so, and no Triton row carries a time
    tri = df[df["variant"].str.startswith("triton") & (df["metric"] == "time")]
    assert len(tri) and set(tri["statistic"]) == {"not_timed"}
    assert all("interpreted" in json.loads(e)["reason"] for e in tri["extra"])
    # eager is timed (samples kept), with GB/s and % of the measured copy ceiling
    eager = df[(df["experiment"] == "fused_time") & (df["variant"] == "eager") & (df["metric"] == "time")]
    med = eager[eager["statistic"] == "median"]
    assert len(med) == 14 and all(len(s) >= 3 for s in med["samples"])
    pct = df[(df["metric"] == "pct_of_copy_ceiling") & (df["variant"] == "eager")]
    assert len(pct) == 14 and pct["value"].map(math.isfinite).all()
    # how each time was taken (on CPU: host time, one call per timeit block; on CUDA: graph replay)
    assert {json.loads(e)["method"] for e in pct["extra"]} == {"torch.utils.benchmark"}
    # profiler traces stay out of the result folder by default
    assert not list(out.rglob("*.trace.json"))
    # fp8: _scaled_mm (CPU) and the Triton GEMM checked against float64 of the dequantized operands
    f8 = df[df["experiment"] == "fp8_check"]
    assert set(f8["variant"]) == {"scaled_mm/tensor", "scaled_mm/row", "triton/tensor", "triton/row"}
    assert (f8["value"] < 1e-2).all()
    # the training step: phases profiled, CUDA graphs refused with their reason on CPU
    ph = df[df["experiment"] == "train_phases"]
    assert {json.loads(e).get("phase") for e in ph["extra"]} >= {"forward", "backward", "optimizer"}
    graph = df[(df["experiment"] == "train_step") & (df["variant"] == "eager+cuda_graph")]
    assert "CUDA graphs need a CUDA device" in json.loads(graph["extra"].iloc[0])["reason"]


@pytest.mark.slow
def test_cpu_run_is_read_by_compare_and_baseline(cpu_run, tmp_path):
    proc, out = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:]
    cmp = compare(out, out, max_unstable_share=1.0)  # a busy CPU's timings may be mostly unstable
    assert cmp.exit_code == 0
    assert (cmp.rows["verdict"] == "same").sum() > 50
    dest = store_baseline(out, root=tmp_path / "baselines")
    assert dest.name == "cpu" and json.loads((dest / "baseline.json").read_text())["rows"] == len(load_records(out))


# ------------------------------------------------------------------ in-process: exit codes, tables
@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve the script's annotations through sys.modules
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("gpu_check", None)


def test_failing_check_exits_1(gc, monkeypatch, tmp_path, capsys):
    """A wrong Triton FP8 result is caught by the float64 check: status failed, exit code 1."""
    real = gc.LM.triton_fp8_matmul
    monkeypatch.setattr(gc.LM, "triton_fp8_matmul", lambda *a, **k: real(*a, **k) * 1.5)
    rc = gc.main(["--device", "cpu", "--sections", "ceilings,fp8", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_CHECK_FAILED
    status = {s["notebook"]: s for s in json.loads((tmp_path / "r" / "status.json").read_text())}
    assert status["gpu_check:fp8"]["status"] == "failed" and status["gpu_check:ceilings"]["status"] == "ok"
    assert "triton/tensor" in (tmp_path / "r" / "summary.txt").read_text()


def test_fp8_gpu_branch_records_the_target_figures(gc, monkeypatch, tmp_path):
    """The branch that times the Triton GEMM (GPU only) writes the figures the targets read.
    Exercised with a plain-torch stand-in for the kernel, so no interpreted kernel is timed."""

    class Timeable:
        def why_not(self, *a, **k):
            return None

        def timeable(self, device):
            return True

    def stand_in(a, b, sa, sb, *, out_dtype=None, fast_accum=False):
        return gc._dequant_reference(a, b, sa, sb).to(out_dtype)

    monkeypatch.setattr(gc, "get_variant", lambda op, name: Timeable())
    monkeypatch.setattr(gc.LM, "triton_fp8_matmul", stand_in)
    rc = gc.main(["--device", "cpu", "--sections", "ceilings,fp8", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    df = load_records(tmp_path / "r")
    ratios = df[(df["metric"] == "vs_scaled_mm") & (df["statistic"] == "median")]
    assert set(ratios["variant"]) == {"triton/tensor", "triton/row"} and (ratios["value"] > 0).all()
    assert len(df[df["metric"] == "speedup_vs_bf16"]) == 2
    ev = {e["key"]: e for e in gc.evaluate_targets(df)}
    assert ev["fp8_triton"]["measured"] and ev["fp8_rowwise"]["verdict"] == "not measured"  # 8192^3 only


def test_raising_section_is_recorded_and_the_rest_run(gc, monkeypatch, tmp_path):
    def boom(s):
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gc.SECTION_FNS, "fused", boom)
    rc = gc.main(
        ["--device", "cpu", "--sections", "ceilings,fused,fp8", "--out", str(tmp_path / "r"), "--commit", "abc123"]
    )
    assert rc == gc.EXIT_SECTION_FAILED
    assert set(load_records(tmp_path / "r")["commit"]) == {"abc123"}
    status = {s["notebook"]: s for s in json.loads((tmp_path / "r" / "status.json").read_text())}
    assert status["gpu_check:fused"]["status"] == "failed"
    assert "planted failure" in status["gpu_check:fused"]["error"]
    assert status["gpu_check:fp8"]["status"] == "ok" and status["gpu_check:fp8"]["rows"] > 0


def test_torchao_float8_training_is_checked_on_cpu_and_a_bad_result_fails(gc, monkeypatch, tmp_path):
    """torchao's float8 MLP (tensorwise, rowwise; emulated on CPU) against float64, SQNR in dB held
    to the floor; never timed on CPU; a floor no result can meet fails the run (exit 1)."""
    rc = gc.main(["--device", "cpu", "--sections", "torchao", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    df = load_records(tmp_path / "r")
    chk = df[df["experiment"] == "torchao_check"]
    assert set(chk["variant"]) == {"float8_tensorwise", "float8_rowwise"} and len(chk) == 6
    assert (chk["value"] >= gc.peers.MIN_SQNR_DB).all() and (chk["value"] < 60).all()  # float8, not a no-op
    t = df[df["experiment"] == "torchao_time"]
    assert set(t["statistic"]) == {"not_timed"} and len(t) == 3
    monkeypatch.setattr(gc.peers, "MIN_SQNR_DB", 1000.0)
    assert gc.main(["--device", "cpu", "--sections", "torchao", "--out", str(tmp_path / "r2")]) == gc.EXIT_CHECK_FAILED


def test_device_kind_is_the_one_compare_gives(gc):
    for ctx in (
        {"device_kind": "cuda", "device": "NVIDIA H200"},
        {"device_kind": "cuda", "device": "NVIDIA H100 80GB HBM3"},
        {"device_kind": "cpu", "device": "Intel(R) Xeon(R)"},
        {},
    ):
        assert gc.baseline_kind(ctx) == baseline_kind(ctx)
    assert gc.baseline_kind({"device_kind": "cuda", "device": "NVIDIA H200"}) == "cuda-nvidia-h200"


def test_bad_options_are_refused(gc, capsys):
    assert gc.main(["--sections", "fused,nope"]) == gc.EXIT_SECTION_FAILED
    assert "parameter 'sections'" in capsys.readouterr().err
    assert gc.main(["--budget-s", "0"]) == gc.EXIT_SECTION_FAILED


def _row(experiment, variant, metric, value, shape="s", **extra):
    return dict(
        lab="gpu_check",
        experiment=experiment,
        variant=variant,
        shape=shape,
        dtype="",
        metric=metric,
        value=value,
        unit="",
        statistic="median",
        samples=None,
        extra=json.dumps(extra),
    )


def test_targets_and_readme_table(gc, tmp_path):
    df = pd.DataFrame(
        [
            _row("fused_time", "triton", "pct_of_copy_ceiling", 91.0, op="rms_norm", direction="fwd"),
            _row("fused_time", "triton", "pct_of_copy_ceiling", 80.0, op="swiglu", direction="fwd"),
            _row("fused_time", "eager", "pct_of_copy_ceiling", 10.0, op="swiglu", direction="fwd"),
            _row("fused_time", "triton", "pct_of_copy_ceiling", 76.0, op="rope", direction="fwd+bwd"),
            _row("attention_time", "triton", "pct_of_bf16_matmul", 20.0, direction="fwd", seq_len=4096, mask="full"),
            _row("attention_time", "triton", "pct_of_bf16_matmul", 61.0, direction="fwd", seq_len=8192, mask="full"),
            _row("fp8_gemm", "triton/row", "vs_scaled_mm", 0.5, granularity="row"),
            _row("fp8_gemm", "scaled_mm/row", "speedup_vs_bf16", 1.7, "8192x8192x8192", granularity="row"),
            _row("fp8_gemm", "scaled_mm/row", "speedup_vs_bf16", 1.1, "4096x4096x4096", granularity="row"),
        ]
    )
    ev = {e["key"]: e for e in gc.evaluate_targets(df)}
    assert ev["fused_fwd"]["verdict"] == "MISSED (1 of 2)" and ev["fused_fwd"]["measured"] == "80%"
    assert "swiglu" in ev["fused_fwd"]["case"]  # the worst Triton case, never an eager row
    assert ev["fused_fwdbwd"]["verdict"] == "met"
    assert ev["attn_fwd"]["verdict"] == "met"  # 4k tokens are below the target's 8k threshold
    assert ev["attn_bwd"]["verdict"] == "not measured"
    assert ev["fp8_triton"]["verdict"].startswith("MISSED")
    assert ev["fp8_rowwise"]["verdict"] == "met"  # only 8192^3 is held to 1.6x
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n\n{gc.README_BEGIN}\nold\n{gc.README_END}\nafter\n")
    gc.update_readme(readme, gc.readme_table(df, {"run_id": "r1", "device": "NVIDIA H200"}))
    text = readme.read_text()
    assert "old" not in text and "after" in text and "| >= 85% | 80% (worst of 2: swiglu s) | MISSED (1 of 2) |" in text


def test_committed_results_readme_has_the_table_block(gc):
    text = (ROOT / "benchmarks" / "results" / "README.md").read_text()
    assert gc.README_BEGIN in text and gc.README_END in text
    for t in gc.TARGETS:
        assert t.figure in text


def test_gpu_set_of_lab04_asks_only_for_fp8_pairs_cublaslt_runs():
    """lab 04's matmul sweep multiplies each listed format with itself; cuBLASLt refuses
    e5m2 x e5m2, so the GPU set must not list it (and the set must stay valid)."""
    params = yaml.safe_load((ROOT / "parameterized" / "sets" / "04_low_precision" / "gpu.yaml").read_text())
    notebook_config_class(ROOT / "labs" / "04_low_precision.ipynb")(**params)  # the lab's LabConfig
    assert all(Q.FORMATS[f].elem != "e5m2" for f in params["matmul_formats"]), params["matmul_formats"]


# ------------------------------------------------------------------ the GPU machine's stack
def _one_call(fn, **kw):
    """A stand-in for try_bench where the test is not about timing: one call, a made-up timing."""
    from lab_utils.core.timing import Timing

    fn()
    return Timing(kw.get("name", ""), "cpu", "fake", (1.0, 1.0, 1.0), 1.0)


def test_an_unusable_interpreter_is_refused_with_its_reason(gc, monkeypatch, tmp_path):
    """triton 3.6 with numpy >= 2.4 (the GPU machine's stack): every interpreted kernel raised, and
    --device cpu exited 2 with three sections failed.  The probe's verdict refuses the Triton
    checks, with the reason, and the rest of the check runs."""
    why = "Triton 3.6.0's interpreter cannot run kernels with numpy 2.5.5 here (a tiny probe kernel raised TypeError)"
    monkeypatch.setattr(gc, "interpreter_why_not", lambda: why)
    monkeypatch.setattr(gc.Section, "over_budget", lambda self, what: True)  # the checks are the point here
    rc = gc.main(["--device", "cpu", "--sections", "fused,attention,fp8", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    assert all(st["status"] == "ok" for st in status), status
    ctx = json.loads((tmp_path / "r" / "context.json").read_text())
    assert len(ctx["refused"]) == 3 and all(why in r for r in ctx["refused"]), ctx["refused"]
    assert ctx["failures"] == []
    summary = (tmp_path / "r" / "summary.txt").read_text()
    assert "refused (not run by this machine's software)" in summary and "numpy 2.5.5" in summary
    df = load_records(tmp_path / "r")
    assert len(df[(df["experiment"] == "fused_check") & (df["statistic"] == "not_run")]) == 7
    f8 = df[df["experiment"] == "fp8_check"]
    assert set(f8["variant"]) == {"scaled_mm/tensor", "scaled_mm/row"}  # _scaled_mm still checked


def test_the_interpreter_probe_finds_the_numpy_failure_and_shims_it(monkeypatch):
    """The probe reproduces triton 3.6's failure (int() of a 1-element array, refused by numpy 2.5)
    on the pinned stack by planting it, then finds that the shim (triton's own later fix) works;
    without a way to shim, the verdict is the reason."""
    import numpy as np
    from triton.runtime import interpreter as ti

    from lab_kernels import _common

    real = ti._patch_lang_tensor

    def triton_3_6(tensor, scope):  # the 3.6 interpreter's index conversion, under numpy >= 2.5
        real(tensor, scope)

        def index(self):
            if np.ndim(self.handle.data):
                raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
            return int(self.handle.data)

        scope.set_attr(tensor, "__index__", index)

    monkeypatch.setattr(ti, "_patch_lang_tensor", triton_3_6)
    monkeypatch.setattr(_common, "_PROBE", {})
    assert _common.interpreter_why_not() is None
    assert "scalar indices shimmed" in _common.interpreter_note() and "0-dimensional" in _common.interpreter_note()
    monkeypatch.setattr(ti, "_patch_lang_tensor", triton_3_6)  # the shim undone
    monkeypatch.setattr(_common, "_PROBE", {})
    monkeypatch.setattr(_common, "_shim_scalar_index", lambda: False)
    why = _common.interpreter_why_not()
    assert why and "0-dimensional" in why and f"numpy {np.__version__}" in why
    from lab_kernels import get_variant

    assert why in get_variant("rms_norm", "triton").why_not("cpu")


def test_records_are_on_disk_after_every_section_and_an_interrupt_keeps_them(gc, monkeypatch, tmp_path):
    """Records and status were written only at the end: a run stopped at a time limit returned
    nothing.  Section 2 sees section 1's records on disk (so a SIGKILL there keeps them), and a
    KeyboardInterrupt in it leaves both sections' rows and an 'interrupted' status."""
    out = tmp_path / "r"
    seen = {}

    def second(s):
        seen["rows"] = len(load_records(out))
        seen["status"] = json.loads((out / "status.json").read_text())
        s.rec.add("fp8_gemm", "partial", "time", 1.0, "ms", statistic="median")
        raise KeyboardInterrupt

    monkeypatch.setitem(gc.SECTION_FNS, "fp8", second)
    rc = gc.main(["--device", "cpu", "--sections", "ceilings,fp8,train", "--out", str(out)])
    assert rc == gc.EXIT_INTERRUPTED
    assert seen["rows"] > 0 and [st["status"] for st in seen["status"]] == ["ok"]
    status = json.loads((out / "status.json").read_text())
    assert [(st["notebook"], st["status"]) for st in status] == [
        ("gpu_check:ceilings", "ok"),
        ("gpu_check:fp8", "interrupted"),
    ]
    df = load_records(out)
    assert "partial" in set(df["variant"]) and "ceilings" in set(df["experiment"])
    assert json.loads((out / "context.json").read_text())["complete"] is False
    assert not list(out.glob(".*.tmp"))  # written through temporary files, all renamed


def test_a_sigterm_keeps_what_was_measured(tmp_path):
    """A time limit's kill (SIGTERM) during a section: the process exits 130 with the records of
    the finished sections on disk."""
    out = tmp_path / "r"
    code = textwrap.dedent(
        f"""
        import importlib.util, os, signal, sys, time
        spec = importlib.util.spec_from_file_location("gpu_check", {str(SCRIPT)!r})
        gc = importlib.util.module_from_spec(spec); sys.modules["gpu_check"] = gc; spec.loader.exec_module(gc)
        def slow(s):
            s.rec.add("fp8_gemm", "before_kill", "time", 1.0, "ms", statistic="median")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        gc.SECTION_FNS["fp8"] = slow
        gc.SECTION_FNS["fused"] = lambda s: s.rec.add("fused_time", "done", "time", 1.0, "ms", statistic="median")
        gc.get_ceilings = lambda dev, quick=False: None
        sys.exit(gc.main(["--device", "cpu", "--sections", "fused,fp8", "--out", {str(out)!r}]))
        """
    )
    env = {**os.environ, "PERFLAB_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 130, proc.stdout[-2000:] + proc.stderr[-2000:]
    status = {st["notebook"]: st["status"] for st in json.loads((out / "status.json").read_text())}
    assert status == {"gpu_check:fused": "ok", "gpu_check:fp8": "interrupted"}
    assert {"done", "before_kill"} <= set(load_records(out)["variant"])


def test_fallback_ceilings_are_measured_before_the_first_sections_budget(gc, monkeypatch, tmp_path):
    """With --sections fp8 the fallback ceilings were measured after fp8's deadline was set, so a
    slow measurement spent fp8's budget (its items were then skipped).  The section now starts
    with its whole budget ahead of it."""
    left = []

    def slow_ceilings(dev, quick=False):
        time.sleep(1.5)
        return None

    monkeypatch.setattr(gc, "get_ceilings", slow_ceilings)
    monkeypatch.setitem(gc.SECTION_FNS, "fp8", lambda s: left.append(s.deadline - s.run.elapsed()))
    rc = gc.main(["--device", "cpu", "--sections", "fp8", "--budget-s", "2", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    assert len(left) == 1 and left[0] > 1.8, left  # the bug left 2 - 1.5 = 0.5 s


def test_correctness_checks_run_even_when_the_budget_is_spent(gc, monkeypatch, tmp_path):
    """The budget used to skip an op's float64 check with its timings: with no time left, every
    fused op and attention case is still checked; only timings are skipped."""
    monkeypatch.setattr(gc.Section, "over_budget", lambda self, what: self.run.skipped.append(what) or True)
    rc = gc.main(["--device", "cpu", "--sections", "fused,attention,fp8", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    df = load_records(tmp_path / "r")
    fc = df[df["experiment"] == "fused_check"]
    assert {json.loads(e)["op"] for e in fc["extra"]} == set(gc.F.OP_NAMES)
    ac = df[(df["experiment"] == "attention_check") & (df["variant"] == "triton")]
    assert {json.loads(e)["mask"] for e in ac["extra"]} == {"full", "causal", "varlen"}
    assert len(df[df["experiment"] == "fp8_check"]) == 4
    assert not len(df[(df["metric"] == "time") & (df["statistic"] == "median")])  # no timing ran
    ctx = json.loads((tmp_path / "r" / "context.json").read_text())
    assert not [x for x in ctx["skipped"] if "check" in x], ctx["skipped"]


def test_one_attention_path_that_raises_does_not_lose_the_section(gc, monkeypatch, tmp_path):
    real = gc.A.check_path

    def check_path(path, *a, **k):
        if path == "cudnn":
            raise RuntimeError("cuDNN refuses: no valid execution plans")
        return real(path, *a, **k)

    monkeypatch.setattr(gc.A, "check_path", check_path)
    monkeypatch.setattr(gc.Section, "over_budget", lambda self, what: True)  # checks only
    rc = gc.main(["--device", "cpu", "--sections", "attention", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    df = load_records(tmp_path / "r")
    raised = df[df["statistic"] == "raised"]
    assert set(raised["variant"]) == {"cudnn"} and len(raised) == 3
    assert "no valid execution plans" in json.loads(raised["extra"].iloc[0])["reason"]
    tri = df[(df["experiment"] == "attention_check") & (df["variant"] == "triton") & (df["statistic"] == "max")]
    assert {json.loads(e)["mask"] for e in tri["extra"]} == {"full", "causal", "varlen"}


def test_fp8_sides_share_the_accumulation_mode_and_the_tolerance_depends_on_k(gc, monkeypatch, tmp_path):
    """_scaled_mm ran with use_fast_accum=False while the Triton GEMM used fast accumulation: each
    mode is now asked of both sides, and the recorded tolerance is fp8_gemm_tolerance(K, mode)."""
    asked = []
    real_sm, real_tr = gc.LM.scaled_mm, gc.LM.triton_fp8_matmul

    def sm(*a, use_fast_accum=False, **k):
        asked.append(("scaled_mm", use_fast_accum))
        return real_sm(*a, use_fast_accum=use_fast_accum, **k)

    def tr(*a, fast_accum=False, **k):
        asked.append(("triton", fast_accum))
        return real_tr(*a, fast_accum=fast_accum, **k)

    monkeypatch.setattr(gc.LM, "scaled_mm", sm)
    monkeypatch.setattr(gc.LM, "triton_fp8_matmul", tr)
    monkeypatch.setitem(gc.PLANS, "cpu", dataclasses.replace(gc.PLANS["cpu"], fp8_fast_accum=(False, True)))
    rc = gc.main(["--device", "cpu", "--sections", "fp8", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    assert sorted(set(asked)) == [("scaled_mm", False), ("scaled_mm", True), ("triton", False), ("triton", True)]
    f8 = load_records(tmp_path / "r").query("experiment == 'fp8_check'")
    assert len(f8) == 8
    for _, row in f8.iterrows():
        ex = json.loads(row["extra"])
        assert ex["fast_accum"] == row["variant"].endswith("+fast_accum")
        assert ex["tolerance"] == gc.LM.fp8_gemm_tolerance(96, fast_accum=ex["fast_accum"])
        assert ex["out_dtype"] == "bfloat16"


def test_varlen_timed_calls_read_nothing_back_from_the_device(gc, monkeypatch):
    """Each varlen call validated cu_seqlens again (several .tolist(), a device sync each): the
    timed callables are validated once, outside, and read nothing back."""
    lengths = (23, 41, 9)
    inputs = gc.A.random_qkv(3, 2, 41, 64, dtype=torch.float32, seed=0, lengths=list(lengths))
    q, k, v, cu = (inputs[n] for n in ("q", "k", "v", "cu_seqlens"))
    reads = []
    for name in ("tolist", "item", "__int__", "__index__", "__bool__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k)
        )
    for path in ("triton", "math"):
        fn = gc.varlen_fn(path, lengths, cu)
        reads.clear()
        out = fn(q, k, v)
        assert [r for r in reads if r in ("tolist", "item", "__int__", "__index__")] == [], (path, reads)
        ref = gc.A.attend(q, k, v, path="reference", cu_seqlens=cu)
        assert torch.allclose(out, ref.to(out.dtype), atol=1e-4), path


def test_the_graph_variant_leaves_no_gradients_to_the_next(gc, monkeypatch, tmp_path):
    """After the CUDA-graph variant the parameters kept graph-pool .grad tensors that the next
    variant's first backward added into.  With a fake capture (on CPU) every variant's first step
    starts from no gradient."""
    dirty = []

    class Step(gc.SyntheticStep):
        first = True

        def body(self, zero_grad=True):
            if self.first:
                self.first = False
                dirty.append([n for n, p in self.model.named_parameters() if p.grad is not None][:3])
            return super().body(zero_grad)

    class FakeGraph:
        def replay(self):
            return None

    def fake_capture(step, dev):
        loss = step.body(zero_grad=False)  # as in a capture: gradients stay allocated
        return FakeGraph(), loss

    monkeypatch.setattr(gc, "SyntheticStep", Step)
    monkeypatch.setattr(gc, "_capture_graph", fake_capture)
    monkeypatch.setattr(gc, "graphs_available", lambda dev: True)
    monkeypatch.setattr(gc, "compile_blocks", lambda model: None)  # "compile" runs eager here
    monkeypatch.setattr(gc, "_profile_steps", lambda s, step, variant: "")
    monkeypatch.setattr(gc, "try_bench", _one_call)
    monkeypatch.setitem(gc.PLANS, "cpu", dataclasses.replace(gc.PLANS["cpu"], train_compile=True, train_warmup=1))
    rc = gc.main(["--device", "cpu", "--sections", "train", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    assert len(dirty) == 4 and dirty == [[]] * 4, dirty


def test_the_plan_section_has_no_compile_lever_and_stops_at_its_budget(gc, monkeypatch, tmp_path):
    """With the encoder libraries present the plan section ran minutes of measurements (compile
    levers among them) past its budget: it measures no compile lever and stops between measurements."""
    seen = {}

    def fake_plan(cfg, levers, *, steps, warmup, top, measure):
        seen["levers"] = list(levers)
        for _ in range(100):
            measure(cfg)
        raise AssertionError("the budget never stopped the plan")

    monkeypatch.setattr(gc, "_importable", lambda name: True)
    monkeypatch.setattr(gc, "plan_and_verify", fake_plan)
    monkeypatch.setattr(gc, "measure_step", lambda c, **k: time.sleep(0.3))
    rc = gc.main(["--device", "cpu", "--sections", "plan", "--budget-s", "1", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    assert not {"compile", "kernels"} & set(seen["levers"])
    df = load_records(tmp_path / "r")
    reason = json.loads(df.query("experiment == 'plan'")["extra"].iloc[0])["reason"]
    assert reason.startswith("skipped:") and "budget" in reason
    ctx = json.loads((tmp_path / "r" / "context.json").read_text())
    assert any("plan: skipped" in x for x in ctx["skipped"])


def test_fused_ops_are_timed_as_graph_replays_on_cuda(monkeypatch):
    """One Python-dispatched call per sample timed the host at flux-dev widths: on CUDA the call is
    replayed as a CUDA graph, or (capture refused) run CALLS_PER_SAMPLE times per sample, and the
    timing's method says which.  Exercised with a fake try_bench (no GPU here)."""
    from lab_utils.core.timing import BenchFailure, Timing
    from lab_utils.fused import ops as F

    asked, calls = [], []

    def fake(fn, *, cuda_graph=False, **kw):
        asked.append(cuda_graph)
        if cuda_graph and capture_fails:
            return BenchFailure(kw["name"], "raised", "RuntimeError: operation not permitted when stream is capturing")
        fn()
        return Timing(kw["name"], "cuda:0", "do_bench_cudagraph" if cuda_graph else "do_bench", (32.0,) * 5, 40.0)

    monkeypatch.setattr(F, "try_bench", fake)
    op = lambda: calls.append(1)  # noqa: E731
    capture_fails = False
    t = F.time_op(op, name="rms_norm/triton/fwd+bwd", device="cuda", reps=5, budget_s=10)
    assert asked == [True] and t.method == "do_bench_cudagraph" and t.median_ms == 32.0
    capture_fails, calls[:] = True, []
    t = F.time_op(op, name="rms_norm/triton/fwd+bwd", device="cuda", reps=5, budget_s=10)
    assert asked[1:] == [True, False] and len(calls) == F.CALLS_PER_SAMPLE
    assert t.median_ms == 32.0 / F.CALLS_PER_SAMPLE and t.meta["calls_per_sample"] == F.CALLS_PER_SAMPLE
    assert f"{F.CALLS_PER_SAMPLE} calls per sample" in t.method and "stream is capturing" in t.method
    asked.clear()
    F.time_op(op, name="x", device="cpu", reps=5, budget_s=10)
    assert asked == [False]  # CPU: host time is the op's time


def test_packed_kernel_calls_without_validation_need_the_launch_length(gen):
    """validate=False skips the host read of cu_seqlens; the launch length must then be given."""
    q, k, v = (torch.randn(73, 2, 64, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 23, 64, 73], dtype=torch.int32)
    with pytest.raises(ValueError, match="parameter 'max_seqlen' = None is not allowed with validate=False"):
        KA.attention(q, k, v, cu_seqlens=cu, validate=False)
    out = KA.attention(q, k, v, cu_seqlens=cu, max_seqlen=41, validate=False)
    ref = KA.reference_attention(q.double(), k.double(), v.double(), cu_seqlens=cu)
    assert torch.allclose(out.double(), ref, atol=1e-4)


def test_profiler_traces_stay_out_of_the_result_folder_unless_asked(gc, monkeypatch, tmp_path):
    """Traces (several MB on a GPU) went to the result folder's artifacts/: the folder brought back
    from a lent machine must stay small.  They are analysed and deleted unless --traces keeps them."""
    monkeypatch.setattr(gc, "try_bench", _one_call)  # the profiled steps are what matters here
    rc = gc.main(["--device", "cpu", "--sections", "train", "--out", str(tmp_path / "r")])
    assert rc == gc.EXIT_OK
    assert not list((tmp_path / "r").rglob("*.trace.json"))
    art = load_records(tmp_path / "r").query("experiment == 'artifacts'")
    assert len(art) == 1 and art["statistic"].iloc[0] == "deleted" and art["value"].iloc[0] > 0
    assert "--traces" in json.loads(art["extra"].iloc[0])["note"]
    assert gc.parse_args(["--traces", str(tmp_path / "t")]).traces == str(tmp_path / "t")
