"""Context parallelism at a CP degree that does not divide 4, and at 8 without processes.

World size 3 (3 gloo processes, one spawn): ring CP on the tiny MMDiT and Ulysses CP on the
6-head ``small`` preset (Ulysses splits the heads over the CP ranks: 4 heads do not split in 3)
each pass their built-in attention self-check on the run's own heads and reproduce the
single-process run within the float32 tolerances.  World size 8 is checked without processes:
flux-dev's 24 heads under Ulysses CP 8 (and TP 2 x CP 4) get a self-check problem they can run,
the all-to-all layout at n = 8, emulated in one process, gives float64 attention on the whole
sequence, and the projection plans that mesh's all-to-alls.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lab_utils.core.config import ConfigError
from lab_utils.distributed import DistConfig, launch_cases
from lab_utils.distributed.context_parallel import (
    check_shape,
    head_chunks,
    heads_from_chunks,
    seq_chunks,
    seq_from_chunks,
)
from lab_utils.distributed.projection import RankBatch, comm_plan, project
from lab_utils.distributed.verify import ATTENTION_TOL, compare
from lab_utils.distributed.worker import attention_check_shape, single_process_run
from lab_utils.model import resolve_config

# 48x64 pixels = 3x4 = 12 image tokens and 6 text tokens: both split into 3 shards
BASE = dict(world_size=3, steps=2, batch_size=2, height=48, width=64, txt_len=6, profile=False)
BASE |= dict(timeout_s=900.0, hang_timeout_s=300.0)  # generous: they only end a stuck run
CASES = {"cp_ring": dict(strategy="cp_ring"), "cp_ulysses": dict(strategy="cp_ulysses", preset="small")}


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist3")
    cfgs = {name: DistConfig(**{**BASE, **kw}) for name, kw in CASES.items()}
    refs = {}
    for name, cfg in cfgs.items():
        ref = single_process_run(cfg, root / f"reference-{name}")
        grads = torch.load(root / f"reference-{name}" / "grads.pt")
        refs[name] = ([ref["losses"][k] for k in sorted(ref["losses"])], grads)
    results = launch_cases(list(cfgs.values()), root / "runs", progress=False)
    return cfgs, dict(zip(cfgs, results)), refs


@pytest.mark.slow  # one spawn of 3 ranks and two references: about 30 s on 2 busy cores
@pytest.mark.parametrize("name", list(CASES))
def test_cp_at_world_3_reproduces_single_process(world3, name):
    cfgs, results, refs = world3
    cfg, res = cfgs[name], results[name]
    assert cfg.mesh.cp == 3
    a = compare(cfg, res.losses, res.grads(), *refs[name])
    assert a.ok, a


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_cp_self_check_at_world_3_runs_the_runs_heads(world3, name):
    cfgs, results, _ = world3
    m = resolve_config(cfgs[name].preset)
    assert attention_check_shape(cfgs[name]) == (2, m.num_heads, 13, m.head_dim)
    for rank in results[name].ranks:
        errs = rank["attention_check"]
        assert set(errs) == {"out", "dq", "dk", "dv"}
        assert max(errs.values()) <= ATTENTION_TOL, (rank["rank"], errs)


# ------------------------------------------------------------------ world size 8, no processes
FLUX_8 = dict(preset="flux-dev", world_size=8, height=1024, width=1024, txt_len=512)


@pytest.mark.parametrize(
    ("kw", "heads", "cp"),
    [
        (dict(strategy="cp_ulysses"), 24, 8),
        (dict(strategy="tp+cp_ulysses", tp_degree=2, cp_degree=4), 12, 4),
        (dict(strategy="cp_ring"), 24, 8),
    ],
)
def test_flux_dev_on_8_gpus_gets_a_self_check_it_can_run(kw, heads, cp):
    cfg = DistConfig(**FLUX_8, **kw)
    assert cfg.mesh.cp == cp
    b, h, lper, d = attention_check_shape(cfg)
    assert (b, h, d) == (2, heads, 128) and h % cp == 0 and lper >= 1


def test_ulysses_refuses_heads_that_do_not_split_before_any_exchange():
    with pytest.raises(ValueError, match=r"heads on a rank \(4\) divisible by the CP degree \(3\)"):
        check_shape("ulysses", 4, 16, 3)
    with pytest.raises(ValueError, match=r"divisible by the CP degree \(8\)"):
        seq_chunks(torch.zeros(1, 12, 2, 4), 8)
    assert check_shape("ring", 4, 16, 3) == (2, 4, 13, 16)  # the ring splits no heads
    with pytest.raises(ConfigError) as ei:  # and the config says so first, naming the parameter
        DistConfig(strategy="cp_ulysses", world_size=3, height=48, width=64, txt_len=6)
    assert ei.value.param == "cp_degree"


def _ulysses_emulated(q, k, v, n):
    """Ulysses attention of ``n`` ranks in one process: rank r holds tokens r*Ls.., and the
    all-to-all is recv[r][j] = send[j][r] (a second implementation of the exchange)."""
    ls = q.shape[2] // n
    shards = [[t[:, :, r * ls : (r + 1) * ls] for t in (q, k, v)] for r in range(n)]
    sends = [[seq_chunks(t, n) for t in sh] for sh in shards]  # per rank: q, k, v chunks
    heads = [[heads_from_chunks(torch.stack([sends[j][i][r] for j in range(n)])) for i in range(3)] for r in range(n)]
    outs = [F.scaled_dot_product_attention(*hq) for hq in heads]  # rank r: heads r*H/n.., every token
    back = [head_chunks(o, n) for o in outs]
    return [seq_from_chunks(torch.stack([back[j][r] for j in range(n)])) for r in range(n)]


@pytest.mark.parametrize(("heads", "n"), [(24, 8), (6, 3), (12, 4)])
def test_ulysses_layout_at_n_ranks_is_attention_over_the_whole_sequence(gen, heads, n):
    """flux-dev's 24 heads of 128 at CP 8 (and 6 / 12 heads at 3 / 4): each rank's output rows are
    the float64 attention of its tokens over all tokens, every head, up to float64 rounding."""
    b, _, lper, d = check_shape("ulysses", heads, 128 if heads == 24 else 16, n)
    q, k, v = (torch.randn(b, heads, n * lper, d, generator=gen, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v)
    got = _ulysses_emulated(q, k, v, n)
    for r, o in enumerate(got):
        assert o.shape == (b, heads, lper, d)
        torch.testing.assert_close(o, ref[:, :, r * lper : (r + 1) * lper], rtol=1e-12, atol=1e-12)


def test_projection_plans_ulysses_at_cp_8_for_flux_dev():
    """Four all-to-alls (q, k, v, out) each way per block, each of one rank's K-sized shard:
    batch x (tokens / 8) x hidden x 2 bytes, over the 8 CP ranks."""
    m = resolve_config("flux-dev")
    rb = RankBatch()
    (a2a,) = [c for c in comm_plan("flux-dev", "fsdp+cp_ulysses", (1, 1, 8, 1), rb, act_bytes=2) if c.scope == "cp"]
    assert a2a.kind == "all_to_all" and a2a.group == 8
    assert a2a.calls == 8 * (m.depth_double + m.depth_single)
    assert math.isclose(a2a.payload_bytes, rb.batch_per_dp * (rb.tokens / 8) * m.hidden_size * 2)
    rows = project("flux-dev", gpus=(8,))
    assert ((rows.strategy == "fsdp+cp_ulysses") & (rows.mesh == "1x1x8x1")).sum() == 1
