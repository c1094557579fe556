"""A communication / compute / memory model of one training step: projection beyond this machine.

Design note
-----------
:func:`comm_plan` lists the collectives one rank issues per step for a strategy and
mesh: kind, payload bytes (the tensor handed to the collective, as the profiler records
it: the local shard for all-gather, the full buffer for reduce-scatter / all-reduce /
all-to-all, the block for send), calls and group size.  Two clocks turn it into time:

* :func:`plan_time_fitted` uses the alpha-beta model fitted on this machine (per kind);
  applied to the measured CPU runs it shows the model's error against the traces;
* :func:`plan_time_links` uses datasheet link figures (NVLink inside a node, InfiniBand
  across nodes; ring algorithms: all-reduce moves 2(n-1)/n of the buffer, reduce-scatter
  and all-to-all (n-1)/n, all-gather (n-1) shards).

:func:`project` evaluates flux-dev at N GPUs for every strategy and mesh shape: per-rank
memory (bf16 params, fp32 grads, fp32 master + AdamW moments; activations under full
activation checkpointing), compute time from counted FLOPs at a stated MFU, and the step
time = compute + the communication that cannot hide, from an overlap model
(:mod:`.overlap`: the overlap fraction the lab measured for the strategy, else a stated
default; never hiding more than the compute), with a low/high band from the alpha-beta
model's measured error and the overlap's range, and the assumption (overlap, bandwidth,
compute) that moves the step time most.  It is a projection: no GPU ran it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from lab_utils.distributed.comm import AlphaBeta
from lab_utils.distributed.overlap import OverlapModel, dominant, exposed_band, exposed_comm, sensitivity
from lab_utils.model import analytic_param_count, build_model, forward_flops, resolve_config

DDP_BUCKET_BYTES = 25 * 2**20


@dataclass
class Comm:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send_recv
    payload_bytes: float  # per call
    calls: int
    group: int  # ranks in the collective
    scope: str  # dp | tp | cp
    exposed: bool  # False: overlappable with compute


@dataclass(frozen=True)
class Links:
    """Datasheet figures, one direction per GPU (H100/H200 SXM: NVLink 4 = 450 GB/s; NDR IB = 50 GB/s)."""

    nvlink_gbps: float = 450.0
    ib_gbps: float = 50.0
    gpus_per_node: int = 8
    nvlink_alpha_us: float = 10.0
    ib_alpha_us: float = 20.0


@dataclass(frozen=True)
class RankBatch:
    """What one data-parallel rank processes per step: ``batch_per_dp`` samples of ``img_tokens``
    image and ``txt_tokens`` text tokens (defaults: FLUX at 1024x1024 with a 512-token prompt)."""

    batch_per_dp: int = 1
    img_tokens: int = 4096
    txt_tokens: int = 512

    @property
    def tokens(self) -> int:
        return self.img_tokens + self.txt_tokens


@dataclass(frozen=True)
class Gpu:
    """The GPU a projection assumes: its datasheet dense bf16 peak and HBM (H200 SXM: 989
    TFLOP/s, 141 GB) and the model FLOP utilisation (MFU) it is assumed to reach."""

    peak_tflops: float = 989.0
    mfu: float = 0.4
    hbm_gb: float = 141.0


def _block_params(mcfg) -> tuple[int, int]:
    d, m = mcfg.hidden_size, mcfg.mlp_hidden
    double = 2 * (d * 6 * d + 6 * d + d * 3 * d + 3 * d + 2 * mcfg.head_dim + d * d + d + d * m + m + m * d + d)
    single = d * 3 * d + 3 * d + d * (3 * d + m) + 3 * d + m + (d + m) * d + d + 2 * mcfg.head_dim
    return double, single


def comm_plan(
    preset: str,
    strategy: str,
    mesh: tuple[int, int, int, int],
    batch: RankBatch,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    act_bytes: int = 4,
    reshard_after_forward: bool = True,
) -> list[Comm]:
    """Collectives of one rank in one step (see the module note)."""
    mcfg = resolve_config(preset)
    rep, shard, cp, tp = mesh
    parts = set(strategy.split("+"))
    d = mcfg.hidden_size
    n_blocks = mcfg.depth_double + mcfg.depth_single
    p_total = analytic_param_count(mcfg)
    bd, bs = _block_params(mcfg)
    blocks = [bd] * mcfg.depth_double + [bs] * mcfg.depth_single
    root = p_total - sum(blocks)
    batch_per_dp, L = batch.batch_per_dp, batch.tokens
    plan: list[Comm] = []
    if "ddp" in parts and rep * cp > 1:
        total = p_total * grad_bytes
        calls = max(1, math.ceil(total / DDP_BUCKET_BYTES))
        plan.append(Comm("all_reduce", total / calls, calls, rep * cp, "dp", False))
    if parts & {"fsdp", "hsdp"}:
        n = shard * cp
        gathers = 2 if reshard_after_forward else 1
        for unit in [*blocks, root]:
            u = unit / tp
            if n > 1:
                # the root's parameters stay gathered after the forward (FSDP2 keeps the last unit)
                g = gathers if unit is not root else 1
                plan.append(Comm("all_gather", u * param_bytes / n, g, n, "dp", False))
                plan.append(Comm("reduce_scatter", u * grad_bytes, 1, n, "dp", False))
            if rep > 1:
                plan.append(Comm("all_reduce", u * grad_bytes / n, 1, rep, "dp", False))
    if tp > 1:
        tok = batch_per_dp * L / cp
        # forward: the row-wise outputs (double: attn proj + MLP fc2 of both streams over the joint
        # length; single: linear2); backward: the same count for the column-wise input gradients
        calls = 2 * (2 * mcfg.depth_double + mcfg.depth_single)
        plan.append(Comm("all_reduce", tok * d * act_bytes, calls, tp, "tp", True))
    if cp > 1:
        kv = batch_per_dp * (L / cp) * (d / tp) * act_bytes  # one of K or V, local shard
        if "cp_ring" in parts:
            # forward: K and V per hop; backward: K, V, dK, dV per hop, then dK, dV home
            pairs = (cp - 1) * 2 + (cp - 1) * 4 + 2
            plan.append(Comm("send_recv", kv, n_blocks * pairs, cp, "cp", False))
        else:
            plan.append(Comm("all_to_all", kv, n_blocks * 8, cp, "cp", True))  # q, k, v, out; both ways
        if not parts & {"ddp", "fsdp", "hsdp"}:  # gradients averaged over CP one tensor at a time
            tensors = sum(1 for _ in build_model(mcfg, device="meta").parameters())
            plan.append(Comm("all_reduce", p_total / tp * grad_bytes / tensors, tensors, cp, "dp", False))
    return plan


def events_per_call(c: Comm) -> int:
    """Profiler events one call leaves on a rank: a send/recv pair leaves a send and a recv."""
    return 2 if c.kind == "send_recv" else 1


def plan_time_fitted(plan: list[Comm], model: dict[str, AlphaBeta]) -> float:
    """Milliseconds of the plan's collectives under the alpha-beta model fitted on this machine."""
    us = 0.0
    for c in plan:
        m = model.get(c.kind) or model.get("all_reduce")
        us += c.calls * events_per_call(c) * m.predict_us(c.payload_bytes)
    return us / 1e3


def _algo_bytes(c: Comm) -> float:
    n = c.group
    if c.kind == "all_reduce":
        return 2 * (n - 1) / n * c.payload_bytes
    if c.kind == "all_gather":
        return (n - 1) * c.payload_bytes
    if c.kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * c.payload_bytes
    return c.payload_bytes  # send_recv: one block per hop


def plan_time_links(plan: list[Comm], links: Links, mesh: tuple[int, int, int, int]) -> dict[str, float]:
    """Seconds per scope ("dp", "tp", "cp") on datasheet links; a group spanning nodes runs at IB speed."""
    rep, shard, cp, tp = mesh
    # ranks are laid out tp fastest, then cp, then shard, then replicate
    stride = {"tp": 1, "cp": tp, "dp": tp * cp}
    out = {"dp": 0.0, "tp": 0.0, "cp": 0.0}
    for c in plan:
        span = c.group * stride[c.scope] if c.scope != "dp" or c.kind != "all_reduce" else rep * shard * tp * cp
        intra = span <= links.gpus_per_node
        bw, alpha = (links.nvlink_gbps, links.nvlink_alpha_us) if intra else (links.ib_gbps, links.ib_alpha_us)
        out[c.scope] += c.calls * (alpha * 1e-6 + _algo_bytes(c) / (bw * 1e9))
    return out


def _meshes(n: int, heads: int) -> list[tuple[str, tuple[int, int, int, int]]]:
    cands = [("ddp", (n, 1, 1, 1)), ("fsdp", (1, n, 1, 1))]
    if n >= 16:
        cands.append(("hsdp", (n // 8, 8, 1, 1)))
    for k in (2, 4, 8):
        if n % k == 0 and heads % k == 0:
            cands.append(("fsdp+tp", (1, n // k, 1, k)))
            cands.append(("fsdp+cp_ring", (1, n // k, k, 1)))
            cands.append(("fsdp+cp_ulysses", (1, n // k, k, 1)))
    return cands


def project(
    preset: str = "flux-dev",
    gpus: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024),
    *,
    links: Links | None = None,
    batch: RankBatch | None = None,
    gpu: Gpu | None = None,
    overlap: OverlapModel | None = None,
    comm_rel_err: float = 0.0,
    compute_rel_err: float = 0.25,
) -> pd.DataFrame:
    """One row per (N, strategy, mesh): memory, compute, communication, exposed communication with
    its low/high band, step time (and band), samples/s and the dominant assumption.

    ``links``, ``batch``, ``gpu``: the interconnect, each data-parallel rank's batch and the GPU
    (defaults: :class:`Links`, :class:`RankBatch`, :class:`Gpu`); ``overlap``: the overlap model
    (default: nothing measured, 0.5 over 0..1); ``comm_rel_err``: the alpha-beta model's measured
    relative error; ``compute_rel_err``: the stated error of the compute time (the MFU is an
    assumption)."""
    links, batch, gpu = links or Links(), batch or RankBatch(), gpu or Gpu()
    overlap = overlap or OverlapModel()
    mcfg = resolve_config(preset)
    p_total = analytic_param_count(mcfg)
    batch_per_dp, L = batch.batch_per_dp, batch.tokens
    n_blocks = mcfg.depth_double + mcfg.depth_single
    fl = forward_flops(mcfg, batch_per_dp, batch.img_tokens, batch.txt_tokens)
    rows = []
    for n in gpus:
        for strategy, mesh in _meshes(n, mcfg.num_heads):
            rep, shard, cp, tp = mesh
            dp = rep * shard
            # full activation checkpointing: forward + recomputed forward + backward = 4x forward FLOPs
            flops_rank = 4 * fl["total"] / (cp * tp)
            compute_s = flops_rank / (gpu.peak_tflops * 1e12 * gpu.mfu)
            plan = comm_plan(preset, strategy, mesh, batch, param_bytes=2, grad_bytes=4, act_bytes=2)
            t = plan_time_links(plan, links, mesh)
            comm_s = t["dp"] + t["tp"] + t["cp"]
            ov = overlap.for_strategy(strategy)
            exposed_s = exposed_comm(comm_s, compute_s, ov.point)
            ex_lo, ex_hi = exposed_band(comm_s, compute_s, ov, comm_rel_err)
            swings = sensitivity(compute_s, comm_s, ov, comm_rel_err, compute_rel_err)
            step_s = compute_s + exposed_s
            k_lo, k_hi = compute_s * (1 - compute_rel_err), compute_s * (1 + compute_rel_err)
            step_lo = k_lo + exposed_band(comm_s, k_lo, ov, comm_rel_err)[0]
            step_hi = k_hi + exposed_band(comm_s, k_hi, ov, comm_rel_err)[1]
            shard_n = {"ddp": 1, "hsdp": shard}.get(strategy, shard * cp)
            states_gb = p_total * 18 / (shard_n * tp) / 1e9
            tokens_rank = batch_per_dp * L / cp
            acts_gb = (
                n_blocks * tokens_rank * mcfg.hidden_size * 2 + 20 * tokens_rank * mcfg.hidden_size * 2 / tp
            ) / 1e9
            rows.append(
                dict(
                    gpus=n,
                    strategy=strategy,
                    mesh="x".join(map(str, mesh)),
                    dp=dp,
                    memory_gb=states_gb + acts_gb,
                    fits=states_gb + acts_gb <= gpu.hbm_gb,
                    compute_ms=compute_s * 1e3,
                    comm_dp_ms=t["dp"] * 1e3,
                    comm_tp_ms=t["tp"] * 1e3,
                    comm_cp_ms=t["cp"] * 1e3,
                    comm_ms=comm_s * 1e3,
                    overlap=ov.point,
                    overlap_source=ov.source,
                    exposed_ms=exposed_s * 1e3,
                    exposed_lo_ms=ex_lo * 1e3,
                    exposed_hi_ms=ex_hi * 1e3,
                    step_ms=step_s * 1e3,
                    step_lo_ms=step_lo * 1e3,
                    step_hi_ms=step_hi * 1e3,
                    samples_per_s=dp * batch_per_dp / step_s,
                    dominant=dominant(swings),
                )
            )
    return pd.DataFrame(rows)


def fastest(df: pd.DataFrame) -> pd.DataFrame:
    """The configuration with the most samples/s at each N among those that fit in memory."""
    ok = df[df["fits"]]
    idx = ok.groupby("gpus")["samples_per_s"].idxmax()
    cols = ["gpus", "strategy", "mesh", "memory_gb", "step_ms", "overlap", "exposed_ms", "exposed_lo_ms"]
    return ok.loc[idx, [*cols, "exposed_hi_ms", "samples_per_s", "dominant"]]
