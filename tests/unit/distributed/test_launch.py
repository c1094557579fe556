"""The pieces of lab_utils.distributed that need no process group: mesh derivation, trace
reading and overlap arithmetic, the alpha-beta fit, the communication plan and the projection,
and the TP row permutations."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.distributed import DistConfig, launch
from lab_utils.distributed.__main__ import main as dist_cli
from lab_utils.distributed.comm import CollectiveEvent, collectives, fit_alpha_beta, overlap, predict_comm_ms
from lab_utils.distributed.launch import check_local_devices
from lab_utils.distributed.parallel import linear2_permutation, qkv_permutation
from lab_utils.distributed.projection import RankBatch, comm_plan, fastest, project
from lab_utils.model import analytic_param_count, resolve_config
from lab_utils.studies import distributed as study
from lab_utils.studies.distributed import DistributedLabConfig, case_params, run_lab


@pytest.mark.parametrize(
    ("params", "shape"),
    [
        (dict(strategy="ddp", world_size=4), (4, 1, 1, 1)),
        (dict(strategy="fsdp", world_size=4), (1, 4, 1, 1)),
        (dict(strategy="hsdp", world_size=4), (2, 2, 1, 1)),
        (dict(strategy="tp", world_size=2), (1, 1, 1, 2)),
        (dict(strategy="cp_ring", world_size=4), (1, 1, 4, 1)),
        (dict(strategy="fsdp+tp", world_size=4), (1, 2, 1, 2)),
        (dict(strategy="fsdp+cp_ulysses", world_size=4), (1, 2, 2, 1)),
        (dict(strategy="hsdp+tp", world_size=8, replicate_degree=2), (2, 2, 1, 2)),
    ],
)
def test_mesh_shapes(params, shape):
    assert DistConfig(**params).mesh.shape == shape


def test_mesh_coordinates_follow_init_device_mesh_layout():
    m = DistConfig(strategy="hsdp+tp", world_size=8, replicate_degree=2).mesh
    coords = [m.coords(r) for r in range(8)]
    assert coords == [(r, s, 0, t) for r in range(2) for s in range(2) for t in range(2)]


def test_spec_round_trips_through_json():
    c = DistConfig(strategy="fsdp+cp_ring", world_size=4, mixed_precision=True, activation_checkpoint="selective")
    assert DistConfig.from_json(c.to_json()) == c


def test_tp_permutation_gives_each_rank_its_heads():
    dim, heads, n, mlp = 8, 4, 2, 12  # head_dim 2, 2 heads per rank
    p = qkv_permutation(dim, heads, n, extra=mlp)
    assert sorted(p.tolist()) == list(range(3 * dim + mlp))
    rank0 = p[: len(p) // n].tolist()
    # q rows of heads 0,1, then k rows of heads 0,1, then v, then the first half of the MLP rows
    assert rank0 == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, *range(24, 30)]
    p2 = linear2_permutation(dim, mlp, n)
    assert p2[: len(p2) // n].tolist() == [0, 1, 2, 3, *range(8, 14)]


def _trace(tmp_path, events):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return json.loads(path.read_text())["traceEvents"]


def test_overlap_splits_compute_exposed_and_idle(tmp_path):
    main, gloo = 1, 2
    ev = _trace(
        tmp_path,
        [
            dict(ph="X", name="perflab_dist_step", cat="user_annotation", ts=0, dur=100, tid=main),
            dict(ph="X", name="aten::mm", cat="cpu_op", ts=0, dur=40, tid=main),
            dict(ph="X", name="aten::add", cat="cpu_op", ts=60, dur=20, tid=main),
            dict(ph="X", name="c10d::allreduce_", cat="cpu_op", ts=40, dur=1, tid=main),
            dict(
                ph="X",
                name="gloo:all_reduce",
                cat="cpu_op",
                ts=30,
                dur=40,
                tid=gloo,
                args={"Input Dims": [[10, 10]], "Input type": ["float"]},
            ),
        ],
    )
    s = overlap(ev)
    # comm 30..70; compute 0..40 and 60..80: hidden 10 + 10, exposed 20, idle 100 - (60 + 40 - 20)
    assert (s.step_ms, s.comm_ms, s.hidden_ms, s.exposed_ms) == pytest.approx((0.1, 0.04, 0.02, 0.02))
    assert s.compute_ms == pytest.approx(0.06) and s.idle_ms == pytest.approx(0.02)
    assert s.overlap_fraction == pytest.approx(0.5)
    assert [(c.kind, c.bytes) for c in collectives(ev)] == [("all_reduce", 400)]


def test_alpha_beta_fit_recovers_a_line_and_predicts():
    rng = np.random.default_rng(0)
    print("seed 0")
    alpha, beta = 50.0, 1e-3  # 50 us, 1 GB/s
    ev = [
        CollectiveEvent("all_gather", b, 0.0, (alpha + beta * b) * (1 + 0.01 * rng.standard_normal()))
        for b in (4096, 16384, 65536, 262144, 1048576)
        for _ in range(5)
    ]
    fit = fit_alpha_beta(ev)["all_gather"]
    # 1% noise on 5 samples per size: the fit is within 0.1% here (alpha 50.04 us, 1.0013 GB/s); a
    # percent-level error in the fit or the byte counts fails these bounds
    assert fit.alpha_us == pytest.approx(alpha, rel=0.02) and fit.gbps == pytest.approx(1.0, rel=0.01)
    pred, meas, missing = predict_comm_ms([CollectiveEvent("all_gather", 65536, 0, 115.5)], {"all_gather": fit})
    assert missing == 0 and meas == pytest.approx(0.1155) and pred == pytest.approx(0.1155, rel=0.01)


def test_comm_plan_bytes_of_ddp_and_fsdp():
    batch = RankBatch(batch_per_dp=2, img_tokens=16, txt_tokens=8)
    ddp = comm_plan("tiny", "ddp", (2, 1, 1, 1), batch)
    fsdp = comm_plan("tiny", "fsdp", (1, 2, 1, 1), batch)
    p = analytic_param_count(resolve_config("tiny"))
    assert sum(c.payload_bytes * c.calls for c in ddp) == pytest.approx(4 * p)
    rs = sum(c.payload_bytes * c.calls for c in fsdp if c.kind == "reduce_scatter")
    assert rs == pytest.approx(4 * p)


def test_projection_is_labelled_and_picks_a_configuration_that_fits():
    df = project(gpus=(8, 64))
    assert {"fits", "memory_gb", "step_ms", "samples_per_s"} <= set(df.columns)
    assert not df[df.strategy == "ddp"].fits.any()  # 11.9 B params with AdamW state do not fit unsharded
    best = fastest(df)
    assert list(best.gpus) == [8, 64] and best.memory_gb.max() <= 141


def test_lab_config_refuses_bad_input_before_running():
    with pytest.raises(ConfigError) as ei:
        DistributedLabConfig(strategies=("fsdp", "pipeline"))
    assert ei.value.param == "strategies"
    with pytest.raises(ConfigError) as ei:
        DistributedLabConfig(world_sizes=(3,), strategies=("tp",))
    assert ei.value.param == "tp_degree"
    assert case_params("fsdp/no_reshard/bf16") == {
        "strategy": "fsdp",
        "reshard_after_forward": False,
        "mixed_precision": True,
    }


def test_cli_refuses_a_bad_configuration_in_one_line_with_exit_code_2():
    r = subprocess.run(
        [sys.executable, "-m", "lab_utils.distributed", "run", "--world-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    want = "python -m lab_utils.distributed run: parameter 'world_size' = 0 is not allowed: expected an integer >= 1"
    assert r.stderr == want + "\n"


@pytest.mark.parametrize(
    ("args", "param"),
    [
        (["--strategy", "pipeline"], "strategy"),
        (["--param", "steps=[1"], "steps"),
        (["--param", "world_size"], "--param"),
        (["--param", "stepz=3"], "stepz"),
    ],
)
def test_cli_names_the_refused_parameter(capsys, args, param):
    assert dist_cli([*["run"], *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"python -m lab_utils.distributed run: parameter {param!r} = "), err


def test_nccl_without_a_gpu_is_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as ei:
        launch(DistConfig(strategy="ddp", world_size=2, backend="nccl"), tmp_path, progress=False)
    assert ei.value.param == "backend" and "without a CUDA GPU" in str(ei.value)
    assert list(tmp_path.iterdir()) == []  # no spec written, no rank started
    assert dist_cli(["run", "--strategy", "ddp", "--param", "backend=nccl", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parameter 'backend' = 'nccl' is not allowed" in err, err


@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(tmp_path, monkeypatch, backend):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as ei:
        launch(DistConfig(strategy="ddp", world_size=2, backend=backend), tmp_path, progress=False)
    assert ei.value.param == "world_size" and "at most 1 (the visible GPUs" in str(ei.value)
    assert list(tmp_path.iterdir()) == []
    check_local_devices(DistConfig(strategy="ddp", world_size=2, backend="gloo"))  # CPU ranks: any number


def test_lab_refuses_nccl_without_gpus_before_the_reference_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = DistributedLabConfig(strategies=("ddp",), backend="nccl", fault_demo=False)
    with pytest.raises(ConfigError) as ei:
        run_lab(cfg, Recorder(lab="06_distributed"), tmp_path)
    assert ei.value.param == "backend" and list(tmp_path.iterdir()) == []


def test_lab_removes_its_temporary_folder_when_interrupted(tmp_path, monkeypatch):
    """Without ``out``, the lab's runs (about 100 MB of traces) live in a temporary folder, removed
    also when the run is interrupted (Ctrl-C between the reference and the spawns here)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "launch_cases", interrupted)
    cfg = DistributedLabConfig(strategies=("ddp",), steps=1, fault_demo=False)
    with pytest.raises(KeyboardInterrupt):
        run_lab(cfg, Recorder(lab="06_distributed"))
    assert list(tmp_path.glob("perflab-*")) == []  # (torch's own caches may land beside it)
