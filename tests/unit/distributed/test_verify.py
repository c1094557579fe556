"""Distributed strategies on real gloo process groups at world size 2 (4 for DCP resharding).

Every strategy's losses over the steps and gradients after step 1 equal the single-process
run within the tolerances of ``lab_utils.distributed.verify``; a DCP checkpoint written at
world size 2 resumes at 1 and 4 with the uninterrupted losses; a raising and a hanging rank
end the run within its timeout and leave no process behind; bad input is refused before
any process starts.  The world-2 strategies share one spawn (one process group).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.distributed import DistConfig, DistRunError, launch, launch_cases
from lab_utils.distributed.verify import ATTENTION_TOL, EMULATED_TOL, compare
from lab_utils.distributed.worker import emulated_dp_step, single_process_run
from lab_utils.model import analytic_param_count, resolve_config

STEPS = 3
# a healthy run's limits are generous: they only end a run that is stuck, and CI's 2 cores may be
# shared with a dozen other processes (ranks that import torch for a minute before their first step)
BASE = dict(world_size=2, steps=STEPS, profile=False, timeout_s=900.0, hang_timeout_s=300.0)
CASES = [
    dict(strategy="ddp", profile=True),
    dict(strategy="fsdp"),
    dict(strategy="fsdp", reshard_after_forward=False, prefetch=False),
    dict(strategy="fsdp", activation_checkpoint="selective"),
    dict(strategy="fsdp", mixed_precision=True),
    dict(strategy="hsdp"),
    dict(strategy="tp"),
    dict(strategy="tp", activation_checkpoint="every_other"),
    dict(strategy="tp+sp"),
    dict(strategy="tp+sp", activation_checkpoint="full"),
    dict(strategy="cp_ring"),
    dict(strategy="cp_ring", activation_checkpoint="full"),
    dict(strategy="cp_ulysses"),
    # the uninterrupted runs of the DCP round trips: each writes its checkpoint after step 2
    dict(strategy="tp", steps=4, save_step=2, keep_grads=False),
    dict(strategy="fsdp", steps=4, save_step=2, keep_grads=False, profile=True),
]
#: the fault runs: a rank that raises or is killed must be reported as such, not as a hang or a timeout
FAULT = dict(strategy="ddp", world_size=2, steps=2, profile=False, timeout_s=900.0, hang_timeout_s=300.0)
COMPARED = [i for i, c in enumerate(CASES) if not c.get("save_step")]


def _case_id(c: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in c.items() if k not in ("keep_grads", "profile"))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    ckpt = {c["strategy"]: root / f"ckpt-{c['strategy']}" for c in CASES if c.get("save_step")}
    for d in ckpt.values():
        d.mkdir()
    cfgs = [
        DistConfig(**{**BASE, **c, **({"ckpt_dir": str(ckpt[c["strategy"]])} if c.get("save_step") else {})})
        for c in CASES
    ]
    ref = single_process_run(DistConfig(**{**BASE, "strategy": "ddp"}), root / "reference")
    ref_losses = [ref["losses"][k] for k in sorted(ref["losses"])]
    ref_grads = torch.load(root / "reference" / "grads.pt")
    results = launch_cases(cfgs, root / "runs", progress=False)
    return dict(cfgs=cfgs, results=results, ref_losses=ref_losses, ref_grads=ref_grads, ckpt=ckpt, root=root)


@pytest.mark.parametrize("i", COMPARED, ids=[_case_id(CASES[i]) for i in COMPARED])
def test_strategy_reproduces_single_process(world2, i):
    cfg, res = world2["cfgs"][i], world2["results"][i]
    a = compare(cfg, res.losses, res.grads(), world2["ref_losses"], world2["ref_grads"])
    assert a.ok, a


def test_fsdp_bf16_compute_reduces_gradients_in_fp32(world2):
    """Against the float32 reference a bf16 run's gradients differ by up to 16% per parameter, which
    hides a bf16 reduction (1e-3); against its own bf16 step emulated in one process with an fp32 sum
    every parameter agrees to EMULATED_TOL (measured: bitwise), and MixedPrecisionPolicy(reduce_dtype=
    torch.bfloat16) fails here (measured: 1.1e-3 to 2.6e-3 on every parameter)."""
    i = next(k for k, c in enumerate(world2["cfgs"]) if c.mixed_precision)
    cfg, res = world2["cfgs"][i], world2["results"][i]
    emu = emulated_dp_step(cfg)
    a = compare(cfg, res.losses, res.grads(), world2["ref_losses"], world2["ref_grads"], emulated=emu)
    assert a.emulated_worst <= EMULATED_TOL, a
    assert a.ok, a


@pytest.mark.parametrize("strategy", ["cp_ring", "cp_ulysses"])
def test_context_parallel_attention_matches_one_process_attention(world2, strategy):
    """Forward and backward of ring / Ulysses attention on sequence shards against float64 SDPA."""
    res = next(r for r in world2["results"] if r.cfg.strategy == strategy)
    for rank in res.ranks:
        errs = rank["attention_check"]
        assert set(errs) == {"out", "dq", "dk", "dv"}
        assert max(errs.values()) <= ATTENTION_TOL, errs


def test_profiled_step_has_collectives_and_overlap(world2):
    res = world2["results"][-1]
    for rank in res.ranks:
        ov = rank["overlap"]
        assert ov["collectives"] > 0 and ov["comm_bytes"] > 0
        assert 0.0 <= ov["overlap_fraction"] <= 1.0
        assert ov["compute_ms"] > 0 and ov["exposed_ms"] >= 0 and ov["idle_ms"] >= 0
        kinds = {c["kind"] for c in rank["collectives"]}
        assert "all_gather" in kinds, kinds  # FSDP2 gathers parameters


def test_ddp_all_reduces_every_gradient_byte_once(world2):
    """The profiled DDP step's all-reduce traffic is the float32 gradient of every parameter, exactly
    (the trace's byte count read independently of the projection's plan, which must agree with it)."""
    i = next(k for k, c in enumerate(world2["cfgs"]) if c.strategy == "ddp")
    params = analytic_param_count(resolve_config("tiny"))
    for rank in world2["results"][i].ranks:
        got = sum(c["bytes"] for c in rank["collectives"] if c["kind"] == "all_reduce")
        assert got == 4 * params, (rank["rank"], got, 4 * params)


@pytest.mark.parametrize(("strategy", "world"), [("single", 1), ("fsdp", 4)])
def test_dcp_checkpoint_from_world_2_resumes(world2, tmp_path, strategy, world):
    full = world2["results"][-1].losses  # steps 1..4, checkpoint after step 2
    cfg = DistConfig(
        strategy=strategy,
        world_size=world,
        steps=4,
        resume=True,
        ckpt_dir=str(world2["ckpt"]["fsdp"]),
        profile=False,
        keep_grads=False,
        timeout_s=900.0,
        hang_timeout_s=300.0,
    )
    res = launch(cfg, tmp_path, progress=False)
    assert res.losses == pytest.approx(full[2:], rel=1e-5)


def test_dcp_checkpoint_of_tp_resumes_in_other_layouts_and_tp_resumes_others(world2, tmp_path):
    """TP permutes the fused projections' rows into per-rank blocks; its checkpoint holds them (and
    their AdamW moments) in the single-process order, so it resumes in one process and under FSDP,
    and a TP run resumes from FSDP's checkpoint.  A wrong layout of any of them moves the losses
    by far more than the float32 tolerance; the uninterrupted TP run is itself checked too (a save
    that disturbed its optimizer state would move its step-4 loss)."""
    writers = {c.strategy: r.losses for c, r in zip(world2["cfgs"], world2["results"]) if c.save_step}
    kw = dict(steps=4, resume=True, profile=False, keep_grads=False, timeout_s=900.0, hang_timeout_s=300.0)
    ck = {k: str(v) for k, v in world2["ckpt"].items()}
    one = launch(DistConfig(strategy="single", world_size=1, ckpt_dir=ck["tp"], **kw), tmp_path / "one", progress=False)
    two = launch_cases(
        [
            DistConfig(strategy="fsdp", world_size=2, ckpt_dir=ck["tp"], **kw),
            DistConfig(strategy="tp", world_size=2, ckpt_dir=ck["fsdp"], **kw),
        ],
        tmp_path / "two",
        progress=False,
    )
    assert writers["tp"] == pytest.approx(writers["fsdp"], rel=1e-5)
    assert one.losses == pytest.approx(writers["tp"][2:], rel=1e-5)
    assert two[0].losses == pytest.approx(writers["tp"][2:], rel=1e-5)
    assert two[1].losses == pytest.approx(writers["fsdp"][2:], rel=1e-5)


def _all_gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_raising_rank_ends_run_with_its_error_and_leaves_no_folder(tmp_path, monkeypatch):
    """Without ``out`` the ranks write into a temporary folder, removed when the run fails."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = DistConfig(**FAULT, fault="raise", fault_rank=1, fault_step=2)
    t0 = time.monotonic()
    with pytest.raises(DistRunError) as ei:
        launch(cfg, progress=False)
    assert ei.value.kind == "raised" and ei.value.rank == 1
    assert "injected fault: rank 1 raised at step 2" in str(ei.value)
    assert time.monotonic() - t0 < cfg.timeout_s
    assert len(ei.value.pids) == 2 and _all_gone(ei.value.pids)
    assert ei.value.out is None and list(tmp_path.glob("perflab-*")) == []


def test_rank_killed_by_a_signal_is_named_with_every_rank_status(tmp_path):
    """A rank killed by SIGKILL writes no error file while its peer fails on the closed connection
    and writes one: the report names the killed rank and the signal, not the peer."""
    cfg = DistConfig(**FAULT, fault="kill", fault_rank=1, fault_step=2)
    with pytest.raises(DistRunError) as ei:
        launch(cfg, tmp_path, progress=False)
    e = ei.value
    assert (e.kind, e.rank) == ("killed", 1), str(e)
    assert str(e).startswith("rank 1 was killed by SIGKILL"), str(e)
    assert e.statuses[1] == "killed by SIGKILL (exit status -9)", e.statuses
    assert len(e.statuses) == 2 and e.statuses[0].startswith(("exit code", "running, ended by the launcher"))
    assert "exit status per rank: rank 0: " in str(e) and "; rank 1: killed by SIGKILL" in str(e)
    assert _all_gone(e.pids)


def test_hanging_rank_is_ended_by_the_watchdog(tmp_path):
    cfg = DistConfig(
        strategy="ddp", world_size=2, steps=2, fault="hang", fault_rank=0, fault_step=2, profile=False, hang_timeout_s=4
    )
    t0 = time.monotonic()
    with pytest.raises(DistRunError) as ei:
        launch(cfg, tmp_path, progress=False)
    assert ei.value.kind == "hang" and "watchdog" in str(ei.value)
    assert time.monotonic() - t0 < cfg.timeout_s
    assert _all_gone(ei.value.pids)


def _late_python(tmp_path, seconds: float | None):
    """A Python for the ranks that starts rank 1 ``seconds`` late (as a loaded node may), or never
    (``None``: it sleeps in the rank's own process, which the launcher ends)."""
    script = tmp_path / "late-python"
    late = "exec sleep 3600" if seconds is None else f"sleep {seconds}"
    script.write_text(f'#!/bin/sh\nif [ "$RANK" = "1" ]; then {late}; fi\nexec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return str(script)


def test_the_watchdog_waits_for_every_rank_to_start_then_for_progress():
    """Before every rank has started only the start-up limit counts; after, only the progress limit."""
    from lab_utils.distributed.launch import _stalled  # noqa: PLC0415

    last = {0: (0, 1), 1: (0, 0)}
    assert _stalled(2, {0}, 300.0, 300.0, 299.0, 30.0, last) is None  # at the start-up limit itself
    msg = _stalled(2, {0}, 300.5, 300.0, 0.0, 30.0, last)
    assert msg.startswith("watchdog: ranks [1] did not start") and "startup_timeout_s = 300 s" in msg
    assert _stalled(2, set(), 301.0, 300.0, 0.0, 30.0, last).startswith("watchdog: ranks [0, 1] did not start")
    assert _stalled(2, {0, 1}, 1e6, 300.0, 30.0, 30.0, last) is None  # started late, no stall yet
    msg = _stalled(2, {0, 1}, 10.0, 300.0, 30.5, 30.0, last)
    assert msg.startswith("watchdog: no rank reported progress for 30 s") and str(last) in msg


def test_a_rank_slower_to_start_than_the_hang_watchdog_is_not_a_hang(tmp_path, monkeypatch):
    """Start-up (Python, torch's import, joining the process group) has its own limit: a rank that
    takes longer than ``hang_timeout_s`` to start runs to the end."""
    monkeypatch.setattr(sys, "executable", _late_python(tmp_path, 25))
    cfg = DistConfig(strategy="ddp", world_size=2, steps=2, profile=False, backend="gloo", hang_timeout_s=20)
    res = launch(cfg, tmp_path / "run", progress=False)
    assert len(res.ranks) == 2 and all(len(r["losses"]) == 2 for r in res.ranks)


def test_a_rank_that_never_starts_is_ended_at_the_startup_limit_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", _late_python(tmp_path, None))
    cfg = DistConfig(strategy="ddp", world_size=2, steps=2, profile=False, backend="gloo", hang_timeout_s=1,
                     startup_timeout_s=6)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(DistRunError) as ei:
        launch(cfg, tmp_path / "run", progress=False)
    msg = str(ei.value)
    assert ei.value.kind == "hang" and "startup_timeout_s = 6 s" in msg, msg
    assert "ranks [" in msg and "1]" in msg.split("did not start")[0], msg  # rank 1 is named (rank 0 waits for it)
    assert 6 <= time.monotonic() - t0 < cfg.timeout_s
    assert _all_gone(ei.value.pids)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (dict(strategy="fsdp+tp", world_size=3), "world_size"),  # mesh 2 x tp does not divide 3
        (dict(strategy="tp", world_size=3), "tp_degree"),  # 4 heads not divisible by 3
        (dict(strategy="cp_ring", world_size=2, txt_len=7), "txt_len"),
        (dict(strategy="cp_ring", world_size=4, height=48, width=48), "height"),  # 9 image tokens, cp 4
        (dict(strategy="pipeline", world_size=2), "strategy"),
        (dict(strategy="ddp+fsdp", world_size=2), "strategy"),
        (dict(strategy="hsdp", world_size=4, replicate_degree=3), "replicate_degree"),
        (dict(strategy="cp_ulysses", world_size=8), "cp_degree"),  # 4 heads over 8 ranks
        (dict(strategy="ddp", world_size=2, batch_size=3), "batch_size"),
        (dict(strategy="fsdp+sp", world_size=2), "strategy"),  # sequence parallelism needs tp
        (dict(strategy="ddp", world_size=2, startup_timeout_s=0), "startup_timeout_s"),
    ],
)
def test_bad_input_is_refused_before_any_process_starts(params, param):
    with pytest.raises(ConfigError) as ei:
        DistConfig(**params)
    assert ei.value.param == param
