"""The full-step profiler: phases add up, categories present, trace valid, FLOPs, CUDA-trace analysis."""

from __future__ import annotations

import json

import pytest
import torch

from lab_utils.config import ConfigError
from lab_utils.model.train import PHASES, TrainConfig, Trainer, rf_loss, synthetic_batch
from lab_utils.profiler import (
    CATEGORIES,
    IDLE,
    analyse_trace,
    categorize,
    count_flops,
    profile_training,
    training_step_flops,
)
from lab_utils.records import Recorder


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    tr = Trainer(
        TrainConfig(
            device="cpu",
            num_samples=8,
            ckpt_every=2,
            ckpt_format="torch",
            buckets=[[64, 64], [48, 80]],
            max_caption_len=12,
        )
    )
    out = tmp_path_factory.mktemp("prof")
    tr.checkpointer.dir = out / "ckpt"
    tr.checkpointer.dir.mkdir()
    try:
        rep = profile_training(tr, active=3, warmup=1, out_dir=out)
    finally:
        tr.close()
        torch.set_num_threads(n)
    return rep


def test_phases_add_up_to_step_time(report):
    st = report.analysis.steps
    assert len(st) == 3
    for r in st.itertuples():
        assert abs(r.phase_sum_ms - r.step_ms) / r.step_ms < 0.05, (r.step, r.phase_sum_ms, r.step_ms)
    seen = set(report.analysis.phases.phase)
    assert seen >= {"data_loading", "text_encoding", "image_encoding", "forward", "backward", "optimizer"}
    assert "checkpoint" in seen  # ckpt_every=2 saves on profiled steps 2 and 4
    assert seen <= set(PHASES)


def test_categories_present_and_account_for_the_step(report):
    cat = report.analysis.categories.set_index("category").ms
    assert list(cat.index) == [*CATEGORIES, IDLE]
    for c in ("matmul", "attention", "normalization", "elementwise/activation", "reduction", "copy/cast", "optimizer"):
        assert cat[c] > 0, c
    total = report.analysis.steps.step_ms.sum()
    # one CPU thread: operators' self times + uncovered time == step time
    assert abs(cat.sum() - total) / total < 0.05
    top = report.analysis.top_ops
    assert 0 < len(top) <= 15 and (top.ms.diff().dropna() <= 1e-9).all()


def test_trace_is_valid_json_and_recorded(report, tmp_path):
    data = json.loads(report.trace_path.read_text())
    names = {e.get("name") for e in data["traceEvents"]}
    assert {"forward", "backward", "optimizer"} <= names
    rec = Recorder(lab="01_training_step")
    report.record(rec)
    df = rec.frame()
    row = df[df.metric == "trace_file"].iloc[0]
    assert json.loads(row.extra)["path"] == str(report.trace_path)
    assert (df.metric == "step_time").any() and (df.experiment == "categories").sum() == len(CATEGORIES) + 1
    assert len(report.analysis.memory) > 0 and report.analysis.peak_allocated_bytes > 0


def test_flops_per_step_meta_equals_real_cpu_count(report):
    cfg = TrainConfig(device="cpu").model_config()
    assert all(f > 0 for f in report.step_flops)
    meta = training_step_flops(cfg, 2, (3, 5), 9)
    from lab_utils.model.mmdit import build_model

    model = build_model(cfg).train()
    batch = synthetic_batch(cfg, 2, height=48, width=80, txt_len=9)
    real, per_op = count_flops(lambda: rf_loss(model, batch).backward())
    assert real == meta
    assert any("flash_attention_for_cpu" in k for k in per_op) or any("bmm" in k for k in per_op)


def test_categorize_cuda_kernel_names():
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert categorize("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>") == "attention"
    assert categorize("void at::native::vectorized_layer_norm_kernel<float>") == "normalization"
    assert categorize("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert (
        categorize("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>") == "elementwise/activation"
    )
    assert categorize("void at::native::reduce_kernel<512, 1>") == "reduction"
    assert categorize("Memcpy HtoD (Pinned -> Device)") == "copy/cast"
    assert categorize("void at::native::elementwise_kernel<128, 2>", "aten::add_", under_optimizer=True) == "optimizer"


def _memory_event(ts: int, allocated: int) -> dict:
    """A profiler memory instant event: the CUDA allocator's total at time ``ts``."""
    return dict(
        ph="i",
        cat="cpu_instant_event",
        name="[memory]",
        ts=ts,
        pid=1,
        tid=1,
        args={"Total Allocated": allocated, "Device Type": 1},
    )


def test_analyse_synthetic_cuda_trace(tmp_path):
    """The CUDA path on a hand-made trace: kernels categorised through their launching op,
    idle = step time minus the union of kernel intervals."""
    ev = [
        dict(ph="X", cat="user_annotation", name="ProfilerStep#4", ts=0, dur=1000, pid=1, tid=1),
        dict(ph="X", cat="gpu_user_annotation", name="ProfilerStep#4", ts=90, dur=700, pid=0, tid=7),
        dict(ph="X", cat="gpu_user_annotation", name="forward", ts=90, dur=300, pid=0, tid=7),
        dict(ph="X", cat="user_annotation", name="forward", ts=10, dur=500, pid=1, tid=1),
        dict(ph="X", cat="cpu_op", name="aten::mm", ts=20, dur=30, pid=1, tid=1, args={"External id": 7}),
        dict(ph="X", cat="user_annotation", name="optimizer", ts=520, dur=470, pid=1, tid=1),
        dict(ph="X", cat="user_annotation", name="Optimizer.step#AdamW.step", ts=530, dur=400, pid=1, tid=1),
        dict(ph="X", cat="cpu_op", name="aten::_foreach_mul_", ts=540, dur=20, pid=1, tid=1, args={"External id": 8}),
        dict(ph="X", cat="kernel", name="sm90_xmma_gemm_f32", ts=100, dur=300, pid=0, tid=7, args={"External id": 7}),
        dict(
            ph="X",
            cat="kernel",
            name="multi_tensor_apply_kernel",
            ts=600,
            dur=100,
            pid=0,
            tid=7,
            args={"External id": 8},
        ),
        dict(ph="X", cat="kernel", name="flash_fwd_kernel", ts=650, dur=100, pid=0, tid=8),  # overlaps
        _memory_event(5, 1 << 20),
        _memory_event(300, 3 << 20),
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    a = analyse_trace(p)
    assert a.device_kind == "cuda" and a.source == "cuda kernels"
    assert len(a.steps) == 1 and set(a.phases.phase) == {"forward", "optimizer"}  # host ranges only
    st = a.steps.iloc[0]
    assert st.step == 4 and st.step_ms == pytest.approx(1.0) and st.phase_sum_ms == pytest.approx(0.97)
    assert st.busy_ms == pytest.approx(0.45)  # 300 + union(600-700, 650-750) = 450 us
    assert st.idle_ms == pytest.approx(0.55)
    cat = a.categories.set_index("category").ms
    assert cat["matmul"] == pytest.approx(0.3) and cat["optimizer"] == pytest.approx(0.1)
    assert cat["attention"] == pytest.approx(0.1) and cat[IDLE] == pytest.approx(0.55)
    assert a.peak_allocated_bytes == 3 << 20
    assert a.top_ops.iloc[0]["name"] == "aten::mm"


def test_bad_profile_steps():
    with pytest.raises(ConfigError) as e:
        profile_training(None, active=0)
    assert e.value.param == "steps"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: kernel categories, memory history")
def test_cuda_profile_kernels_and_memory_history(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_ARTIFACTS_DIR", str(tmp_path))
    tr = Trainer(
        TrainConfig(
            device="cuda",
            num_samples=8,
            autocast="bf16",
            ckpt_every=2,
            ckpt_format="dcp_async",
            pin_memory=True,
            num_workers=1,
        )
    )
    try:
        rep = profile_training(tr, active=2, warmup=1, out_dir=tmp_path)
    finally:
        tr.close()
    a = rep.analysis
    assert a.device_kind == "cuda" and a.source == "cuda kernels"
    cat = a.categories.set_index("category").ms
    assert cat["matmul"] > 0 and cat["attention"] > 0 and cat["optimizer"] > 0
    for r in a.steps.itertuples():
        assert abs(r.phase_sum_ms - r.step_ms) / r.step_ms < 0.05
    assert rep.cuda_peak_bytes > 0 and rep.memory_snapshot_path.exists()
    assert rep.memory_html_path is None or rep.memory_html_path.stat().st_size > 0
