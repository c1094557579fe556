"""The 2-D compositions at world size 4 (4 gloo processes on the cores there are): FSDP x TP (and SP),
FSDP x ring / Ulysses CP, HSDP 2x2, HSDP x TP, DDP x CP and TP x CP each reproduce the
single-process run within the float32 tolerances.  One spawn runs every case."""

from __future__ import annotations

import pytest
import torch

from lab_utils.distributed import DistConfig, launch_cases
from lab_utils.distributed.verify import ATTENTION_TOL, compare
from lab_utils.distributed.worker import single_process_run

BASE = dict(world_size=4, steps=2, profile=False, timeout_s=900.0, hang_timeout_s=300.0)
STRATEGIES = (
    "fsdp+tp",
    "fsdp+tp+sp",
    "fsdp+cp_ring",
    "fsdp+cp_ulysses",
    "hsdp",
    "hsdp+tp",
    "ddp+cp_ring",
    "tp+cp_ring",
)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist4")
    ref = single_process_run(DistConfig(**{**BASE, "strategy": "ddp"}), root / "reference")
    cfgs = [DistConfig(strategy=s, **BASE) for s in STRATEGIES]
    results = launch_cases(cfgs, root / "runs", progress=False)
    ref_losses = [ref["losses"][k] for k in sorted(ref["losses"])]
    return cfgs, results, ref_losses, torch.load(root / "reference" / "grads.pt")


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(STRATEGIES)), ids=STRATEGIES)
def test_composition_reproduces_single_process(world4, i):
    cfgs, results, ref_losses, ref_grads = world4
    res = results[i]
    a = compare(cfgs[i], res.losses, res.grads(), ref_losses, ref_grads)
    assert a.ok, a
    for rank in res.ranks:
        if "attention_check" in rank:
            assert max(rank["attention_check"].values()) <= ATTENTION_TOL, rank["attention_check"]
