"""The communication model of the projection, written out by hand: the bytes a ring algorithm
moves per collective, the DDP bucket count, FSDP's all-gather payloads and how often they run,
and the two profiler events a send/recv pair leaves."""

import math

import pytest

from lab_utils.distributed.comm import AlphaBeta
from lab_utils.distributed.projection import (
    DDP_BUCKET_BYTES,
    Comm,
    Links,
    RankBatch,
    comm_plan,
    plan_time_fitted,
    plan_time_links,
    project,
)
from lab_utils.model import analytic_param_count, build_model, forward_flops, resolve_config

P = 1e6  # payload bytes of one call
N = 4  # ranks in the group
# ring algorithms: what one rank sends per call (module note of lab_utils.distributed.projection)
RING_BYTES = {
    "all_reduce": 2 * (N - 1) / N * P,
    "all_gather": (N - 1) * P,  # the payload is the local shard
    "reduce_scatter": (N - 1) / N * P,
    "all_to_all": (N - 1) / N * P,
    "send_recv": P,
}


@pytest.mark.parametrize("kind", sorted(RING_BYTES))
def test_seconds_on_a_link_are_the_ring_bytes_over_its_bandwidth(kind):
    links = Links(nvlink_gbps=1.0, nvlink_alpha_us=0.0, gpus_per_node=8)  # 1 GB/s, no latency: seconds = bytes / 1e9
    t = plan_time_links([Comm(kind, P, 3, N, "dp", False)], links, (1, N, 1, 1))
    assert t["dp"] == pytest.approx(3 * RING_BYTES[kind] / 1e9, rel=1e-12)


def test_a_send_recv_pair_leaves_two_events_per_call():
    model = {
        "send_recv": AlphaBeta("send_recv", 10.0, 0.0, 0, 1.0, 0.0),
        "all_reduce": AlphaBeta("all_reduce", 7.0, 0.0, 0, 1.0, 0.0),
    }
    assert plan_time_fitted([Comm("send_recv", P, 3, 2, "cp", False)], model) == pytest.approx(3 * 2 * 10.0 / 1e3)
    assert plan_time_fitted([Comm("all_reduce", P, 3, 2, "dp", False)], model) == pytest.approx(3 * 7.0 / 1e3)


def test_ddp_gradients_go_in_buckets_of_at_most_25_mib():
    total = 4 * analytic_param_count(resolve_config("flux-dev"))  # float32 gradients, ~48 GB
    (c,) = comm_plan("flux-dev", "ddp", (2, 1, 1, 1), RankBatch(batch_per_dp=1, img_tokens=16, txt_tokens=8))
    assert c.kind == "all_reduce" and c.group == 2
    assert c.calls == math.ceil(total / DDP_BUCKET_BYTES) and c.payload_bytes <= DDP_BUCKET_BYTES
    assert c.payload_bytes * c.calls == pytest.approx(total)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_gathers_each_units_shard_once_or_twice(reshard):
    """Per unit (each block, then the root): an all-gather of the local shard (1/N of the unit),
    twice when parameters are resharded after the forward (forward and backward) except the
    root, which stays gathered; a reduce-scatter of the whole unit's gradient."""
    n = 2
    plan = comm_plan("tiny", "fsdp", (1, n, 1, 1), RankBatch(2, 16, 8), reshard_after_forward=reshard)
    gathers = [c for c in plan if c.kind == "all_gather"]
    scatters = [c for c in plan if c.kind == "reduce_scatter"]
    cfg = resolve_config("tiny")
    assert len(gathers) == len(scatters) == cfg.depth_double + cfg.depth_single + 1
    for ag, rs in zip(gathers, scatters):
        assert ag.payload_bytes * n == pytest.approx(rs.payload_bytes) and rs.calls == 1
    assert [c.calls for c in gathers] == [2 if reshard else 1] * (len(gathers) - 1) + [1]
    assert sum(c.payload_bytes for c in scatters) == pytest.approx(4 * analytic_param_count(cfg))


@pytest.mark.parametrize("group, link", [(8, "nvlink"), (9, "ib"), (16, "ib")])
def test_a_group_within_one_node_runs_on_nvlink(group, link):
    """8 GPUs per node: a group of 8 fits one node (NVLink), 9 and 16 span nodes (InfiniBand).
    Links of 1 GB/s and 0.5 GB/s, no latency: a 1 MB reduce-scatter moves (n-1)/n MB."""
    links = Links(nvlink_gbps=1.0, ib_gbps=0.5, nvlink_alpha_us=0.0, ib_alpha_us=0.0, gpus_per_node=8)
    t = plan_time_links([Comm("reduce_scatter", P, 1, group, "dp", False)], links, (1, group, 1, 1))
    gbps = 1.0 if link == "nvlink" else 0.5
    assert t["dp"] == pytest.approx((group - 1) / group * P / (gbps * 1e9), rel=1e-12)


def test_link_latency_is_in_microseconds():
    """Three empty calls on NVLink at 10 us each (20 us across nodes): 30 us (60 us), in seconds."""
    links = Links(nvlink_alpha_us=10.0, ib_alpha_us=20.0, gpus_per_node=8)
    assert plan_time_links([Comm("all_reduce", 0.0, 3, 4, "dp", False)], links, (1, 4, 1, 1))["dp"] == pytest.approx(
        30e-6, rel=1e-12
    )
    t = plan_time_links([Comm("all_gather", 0.0, 3, 16, "dp", False)], links, (1, 16, 1, 1))
    assert t["dp"] == pytest.approx(60e-6, rel=1e-12)


def test_ulysses_sends_q_k_v_and_out_both_ways_per_block():
    """Ulysses context parallelism: per block an all-to-all of q, k, v and the output forward and
    of their gradients backward (8), each the local (B, L/cp, D) shard of one tensor."""
    cfg = resolve_config("tiny")
    batch = RankBatch(batch_per_dp=2, img_tokens=16, txt_tokens=8)
    (a2a,) = [
        c for c in comm_plan("tiny", "fsdp+cp_ulysses", (1, 1, 2, 1), batch, act_bytes=2) if c.kind == "all_to_all"
    ]
    assert a2a.calls == 8 * (cfg.depth_double + cfg.depth_single) and a2a.group == 2
    assert a2a.payload_bytes == 2 * (24 / 2) * cfg.hidden_size * 2


def test_a_projected_row_by_hand():
    """tiny at 8 GPUs, links so fast the communication is nil: the compute is 4 forwards (forward,
    recomputed forward, backward = 2 forwards) of counted FLOPs at 989 TFLOP/s x 40% MFU; samples/s
    = 8 data-parallel ranks x 2 samples over the step; the per-rank state 18 B per parameter
    (bf16 weight 2 + fp32 gradient 4 + fp32 master 4 + two fp32 moments 8), sharded 8 ways
    under FSDP and not under DDP (the activations are the same in both)."""
    cfg = resolve_config("tiny")
    n = sum(p.numel() for p in build_model("tiny", device="meta").parameters())
    batch = RankBatch(batch_per_dp=2, img_tokens=16, txt_tokens=8)
    fast = Links(nvlink_gbps=1e15, ib_gbps=1e15, nvlink_alpha_us=0.0, ib_alpha_us=0.0)
    df = project("tiny", gpus=(8,), links=fast, batch=batch).set_index("strategy")
    fwd = forward_flops(cfg, 2, 16, 8)["total"]
    compute_s = 4 * fwd / (989e12 * 0.4)
    fsdp = df.loc["fsdp"]
    assert fsdp.compute_ms == pytest.approx(compute_s * 1e3, rel=1e-9)
    assert fsdp.step_ms == pytest.approx(compute_s * 1e3, rel=1e-6)
    assert fsdp.samples_per_s == pytest.approx(8 * 2 / compute_s, rel=1e-6)
    assert df.loc["ddp", "memory_gb"] - fsdp.memory_gb == pytest.approx(n * 18 * (1 - 1 / 8) / 1e9, rel=1e-9)


def test_tensor_parallel_all_reduces_the_cp_ranks_tokens_per_row_parallel_layer():
    """flux-dev (19 double, 38 single blocks) with TP 2 and CP 2: an all-reduce per row-parallel
    output, each over the joint img + txt length (a double block: attention proj and fc2 = 2; a
    single block: linear2 = 1), forward and backward: 2 x (19 x 2 + 38) = 152 calls, each of
    the CP rank's 2 x 24 / 2 = 24 tokens x 3072 x 2 bytes."""
    batch = RankBatch(batch_per_dp=2, img_tokens=16, txt_tokens=8)
    (tp,) = [c for c in comm_plan("flux-dev", "fsdp+cp_ulysses", (1, 1, 2, 2), batch, act_bytes=2) if c.scope == "tp"]
    assert tp.kind == "all_reduce" and tp.group == 2
    assert tp.calls == 152
    assert tp.payload_bytes == 24 * 3072 * 2


@pytest.mark.parametrize("cp,tp,on_ib", [(2, 4, False), (4, 2, False), (4, 4, True), (2, 8, True)])
def test_a_cp_group_spans_its_tp_stride(cp, tp, on_ib):
    """Ranks are laid out TP fastest: a CP group of cp ranks spans cp x tp GPUs, NVLink up to 8
    (one node), InfiniBand beyond.  Here IB is 1 GB/s and NVLink 1000 GB/s, no latency."""
    links = Links(nvlink_gbps=1000.0, ib_gbps=1.0, nvlink_alpha_us=0.0, ib_alpha_us=0.0, gpus_per_node=8)
    t = plan_time_links([Comm("all_to_all", P, 1, cp, "cp", True)], links, (1, 1, cp, tp))["cp"]
    seconds = (cp - 1) / cp * P / 1e9
    assert t == pytest.approx(seconds if on_ib else seconds / 1000, rel=1e-12)


def test_hsdp_all_reduces_each_units_gradient_shard_over_the_replicas():
    """HSDP (2 replicas x 2 shards): each unit's gradient is reduce-scattered whole within the
    shard group, then its 1/2 shard all-reduced over the 2 replicas: the all-reduces carry
    fp32 x parameters / 2 in all, the reduce-scatters fp32 x parameters."""
    cfg = resolve_config("tiny")
    n_params = analytic_param_count(cfg)
    plan = comm_plan("tiny", "hsdp", (2, 2, 1, 1), RankBatch(2, 16, 8))
    ars = [c for c in plan if c.kind == "all_reduce"]
    rss = [c for c in plan if c.kind == "reduce_scatter"]
    assert len(ars) == len(rss) == cfg.depth_double + cfg.depth_single + 1
    assert {c.group for c in ars} == {2} and {c.group for c in rss} == {2}
    assert sum(c.payload_bytes for c in ars) == pytest.approx(4 * n_params / 2)
    assert sum(c.payload_bytes for c in rss) == pytest.approx(4 * n_params)


@pytest.mark.parametrize("strategy", ["fsdp+cp_ring", "fsdp+cp_ulysses"])
def test_fsdp_with_context_parallel_shards_over_shard_times_cp_ranks(strategy):
    """Mesh (1, 2, 2, 1): FSDP's group is the 2 x 2 = 4 shard and CP ranks, so each unit's
    all-gather carries its quarter (the gathered shards, once per unit, sum to the model)."""
    n_params = analytic_param_count(resolve_config("tiny"))
    plan = comm_plan("tiny", strategy, (1, 2, 2, 1), RankBatch(2, 16, 8), param_bytes=2)
    ags = [c for c in plan if c.kind == "all_gather" and c.scope == "dp"]
    assert ags and {c.group for c in ags} == {4}
    assert sum(c.payload_bytes for c in ags) == pytest.approx(2 * n_params / 4)


def test_projected_state_memory_is_sharded_over_shard_times_cp():
    """At 8 GPUs, fsdp+cp_ring with CP 2 (mesh 1x4x2x1) shards the 18 B/parameter states 8 ways,
    as plain FSDP does; the activations (bf16, 2 B) are those of the rank's 24 / 2 tokens: per
    block one hidden row, plus 20 more rows, each of d values (the module's activation model)."""
    cfg = resolve_config("tiny")
    n_params = analytic_param_count(cfg)
    batch = RankBatch(batch_per_dp=2, img_tokens=16, txt_tokens=8)
    df = project("tiny", gpus=(8,), batch=batch)
    row = df[(df.strategy == "fsdp+cp_ring") & (df.mesh == "1x4x2x1")].iloc[0]
    tok = 2 * 24 / 2
    n_blocks = cfg.depth_double + cfg.depth_single
    acts = (n_blocks + 20) * tok * cfg.hidden_size * 2
    assert row.memory_gb == pytest.approx((n_params * 18 / 8 + acts) / 1e9, rel=1e-12)
