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
)
from lab_utils.model import analytic_param_count, resolve_config

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
