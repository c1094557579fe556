"""Context parallelism for the MMDiT's joint text+image attention.

Design note
-----------
Each context-parallel (CP) rank holds a contiguous shard of the text tokens and a
shard of the image tokens; the model concatenates them into its local part of the
joint sequence.  Every token-wise op (norms, modulation, projections, RoPE with the
shard's own position ids, the MLP) is then local; only attention needs all keys.
FLUX's joint attention is unmasked and not causal, so the order of the key shards does
not matter and the local ``cat([txt_shard, img_shard])`` is a valid shard.

Two schemes, both swapped in for ``F.scaled_dot_product_attention`` by
:class:`ContextParallelAttention`, a ``TorchFunctionMode`` active over forward *and*
backward (activation checkpointing recomputes attention inside the backward):

* ring attention (:class:`RingAttention`): K/V blocks travel round the CP ring by
  point-to-point send/recv (the next exchange is posted before the current block is
  computed, so it overlaps); each block's partial softmax is merged online with its
  log-sum-exp.  The backward sends (K, V, dK, dV) round the ring again: each rank adds
  its block's contribution to dK/dV, which arrive back at their owner after CP hops.
* Ulysses: an all-to-all turns (heads, sequence shard) into (head shard, full
  sequence), attention runs locally on H/CP heads, and the inverse all-to-all goes
  back.  Needs heads (per TP rank) divisible by CP.

Each CP run checks its scheme before training (:func:`check_against_sdpa`, called by the worker):
forward and backward on the run's own heads (per TP rank) and head dim, a few irregular tokens
per rank (:func:`check_shape`), against float64 attention on the whole sequence in one process.

Math runs in float32 (float64 stays float64); outputs take the input dtype.
Shapes: B batch, H heads, Lq/Lk local tokens, Dh head dim, n = CP degree.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

CP_SCHEMES = ("ring", "ulysses")


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ring_exchange(group, tensors: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
    """Post send of ``tensors`` to the next rank and recv of the same shapes from the previous one."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (me + 1) % n)
    prv = dist.get_global_rank(group, (me - 1) % n)
    tensors = [t.contiguous() for t in tensors]
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in recv]
    return dist.batch_isend_irecv(ops), recv


def _block_attention(q, k, v, scale):
    """Partial attention of q over one K/V block: (out (B H Lq Dh), lse (B H Lq))."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # B H Lq Lk
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


class RingAttention(torch.autograd.Function):
    """Exact softmax attention over the K/V shards of every rank in ``group`` (no mask)."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        dt = _math_dtype(q.dtype)
        qf, kf, vf = q.to(dt), k.to(dt), v.to(dt)
        n = dist.get_world_size(group)
        out = lse = None
        cur_k, cur_v = kf.contiguous(), vf.contiguous()
        for step in range(n):
            reqs, nxt = _ring_exchange(group, [cur_k, cur_v]) if step < n - 1 else ([], None)
            o_b, lse_b = _block_attention(qf, cur_k, cur_v, scale)
            if out is None:
                out, lse = o_b, lse_b
            else:  # online-softmax merge of two normalised partial results
                new = torch.logaddexp(lse, lse_b)
                out = out * torch.exp(lse - new)[..., None] + o_b * torch.exp(lse_b - new)[..., None]
                lse = new
            for r in reqs:
                r.wait()
            if nxt is not None:
                cur_k, cur_v = nxt
        ctx.save_for_backward(qf, kf, vf, out, lse)
        ctx.group, ctx.scale, ctx.in_dtype = group, scale, q.dtype
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        qf, kf, vf, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n = dist.get_world_size(group)
        do = d_out.to(qf.dtype)
        delta = (do * out).sum(-1)  # B H Lq
        dq = torch.zeros_like(qf)
        cur = [kf.contiguous(), vf.contiguous(), torch.zeros_like(kf), torch.zeros_like(vf)]
        for step in range(n):
            k_b, v_b, dk_b, dv_b = cur
            p = torch.exp(torch.matmul(qf, k_b.transpose(-1, -2)) * scale - lse[..., None])  # B H Lq Lk
            dv_b = dv_b + torch.matmul(p.transpose(-1, -2), do)
            ds = p * (torch.matmul(do, v_b.transpose(-1, -2)) - delta[..., None])
            dq = dq + torch.matmul(ds, k_b) * scale
            dk_b = dk_b + torch.matmul(ds.transpose(-1, -2), qf) * scale
            # K/V are not needed after the last hop; their gradients travel home.
            send = [k_b, v_b, dk_b, dv_b] if step < n - 1 else [dk_b, dv_b]
            reqs, recv = _ring_exchange(group, send)
            for r in reqs:
                r.wait()
            cur = recv if step < n - 1 else [None, None, *recv]
        dk, dv = cur[2], cur[3]
        dt = ctx.in_dtype
        return dq.to(dt), dk.to(dt), dv.to(dt), None, None


def ring_attention(q, k, v, group, scale: float | None = None) -> torch.Tensor:
    """Attention of local q (B H Lq Dh) over the keys of all ranks in ``group``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if dist.get_world_size(group) == 1:
        return _block_attention(
            q.to(_math_dtype(q.dtype)), k.to(_math_dtype(q.dtype)), v.to(_math_dtype(q.dtype)), scale
        )[0].to(q.dtype)
    return RingAttention.apply(q, k, v, group, scale)


class _AllToAll(torch.autograd.Function):
    """Equal-split all_to_all_single along dim 0; its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g, group=ctx.group)
        return out, None


def check_ulysses_heads(heads: int, n: int) -> None:
    """Ulysses gives each of the ``n`` CP ranks ``heads / n`` whole heads: refuse any other count."""
    if heads % n:
        raise ValueError(
            f"Ulysses attention needs the heads on a rank ({heads}) divisible by the CP degree ({n}): "
            f"each CP rank attends over heads / CP of them"
        )


def seq_chunks(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, H, Ls, Dh) sequence shard -> (n, B, H/n, Ls, Dh): chunk j (heads j*H/n ..) goes to rank j."""
    b, h, ls, d = x.shape
    check_ulysses_heads(h, n)
    return x.reshape(b, n, h // n, ls, d).permute(1, 0, 2, 3, 4)


def heads_from_chunks(recv: torch.Tensor) -> torch.Tensor:
    """(n, B, H/n, Ls, Dh), chunk j from rank j -> (B, H/n, n*Ls, Dh): the full sequence in rank order."""
    n, b, hn, ls, d = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(b, hn, n * ls, d)


def head_chunks(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, H/n, n*Ls, Dh) -> (n, B, H/n, Ls, Dh): sequence chunk j goes back to rank j."""
    b, hn, lfull, d = x.shape
    return x.reshape(b, hn, n, lfull // n, d).permute(2, 0, 1, 3, 4)


def seq_from_chunks(recv: torch.Tensor) -> torch.Tensor:
    """(n, B, H/n, Ls, Dh), head chunk j from rank j -> (B, H, Ls, Dh)."""
    n, b, hn, ls, d = recv.shape
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * hn, ls, d)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, Ls, Dh) sequence shard -> (B, H/n, n*Ls, Dh) head shard (shards in rank order)."""
    return heads_from_chunks(_AllToAll.apply(seq_chunks(x, dist.get_world_size(group)), group))


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: (B, H/n, n*Ls, Dh) -> (B, H, Ls, Dh)."""
    return seq_from_chunks(_AllToAll.apply(head_chunks(x, dist.get_world_size(group)), group))


def ulysses_attention(q, k, v, group, scale: float | None = None) -> torch.Tensor:
    """Attention over the full sequence via all-to-all: local heads, all tokens."""
    qh, kh, vh = (seq_to_heads(t, group) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
    return heads_to_seq(o, group)


class ContextParallelAttention(TorchFunctionMode):
    """Within this mode, ``F.scaled_dot_product_attention`` (unmasked, non-causal) runs
    as ring or Ulysses attention over the sequence shards of ``group``."""

    def __init__(self, group, scheme: str = "ring"):
        super().__init__()
        if scheme not in CP_SCHEMES:
            raise ValueError(f"scheme {scheme!r} is not one of {CP_SCHEMES}")
        self.group, self.scheme, self.calls = group, scheme, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if mask is not None or kwargs.get("is_causal") or kwargs.get("dropout_p", 0.0):
            raise NotImplementedError("context-parallel attention takes no mask, causal flag or dropout")
        self.calls += 1
        fn = ring_attention if self.scheme == "ring" else ulysses_attention
        return fn(q, k, v, self.group, kwargs.get("scale"))


#: The self-check's problem besides the heads: batch and tokens per rank (irregular on purpose).
CHECK_BATCH, CHECK_TOKENS = 2, 13


def check_shape(scheme: str, heads: int, head_dim: int, n: int) -> tuple[int, int, int, int]:
    """(batch, heads, tokens per rank, head dim) of :func:`check_against_sdpa` for a run whose
    attention has ``heads`` heads of ``head_dim`` on each rank (per TP rank) over ``n`` CP ranks:
    the heads and head dim are the run's, so the check runs what the run runs (Ulysses splits
    those heads over the ranks); every rank holds the same number of tokens, as both schemes need."""
    if scheme not in CP_SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {CP_SCHEMES}")
    if heads < 1 or head_dim < 1 or n < 1:
        raise ValueError(f"heads ({heads}), head_dim ({head_dim}) and the CP degree ({n}) must be >= 1")
    if scheme == "ulysses":
        check_ulysses_heads(heads, n)
    return CHECK_BATCH, heads, CHECK_TOKENS, head_dim


def check_against_sdpa(group, scheme: str, *, heads: int, head_dim: int, seed: int = 0) -> dict[str, float]:
    """Ring or Ulysses attention over this group's sequence shards against one-process
    attention in float64 on the full sequence (every rank draws the same global q, k, v
    from ``seed``) on the problem :func:`check_shape` gives: relative errors of the output and
    of dq, dk, dv (collective)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    b, h, lper, d = check_shape(scheme, heads, head_dim, n)
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n * lper, d, generator=g, dtype=torch.float64) for _ in range(4))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_ref = F.scaled_dot_product_attention(*ref)
    out_ref.backward(do)
    sl = slice(me * lper, (me + 1) * lper)
    loc = [t[:, :, sl].float().clone().requires_grad_(True) for t in (q, k, v)]
    fn = ring_attention if scheme == "ring" else ulysses_attention
    out = fn(*loc, group)
    out.backward(do[:, :, sl].float())
    errs = {"out": out.double() - out_ref[:, :, sl].detach()}
    for name, a, r in zip(("dq", "dk", "dv"), loc, ref):
        errs[name] = a.grad.double() - r.grad[:, :, sl]
    refs = {"out": out_ref[:, :, sl].detach(), "dq": ref[0].grad[:, :, sl], "dk": ref[1].grad[:, :, sl]}
    refs["dv"] = ref[2].grad[:, :, sl]
    result = {}
    for name, e in errs.items():
        num = torch.stack([e.pow(2).sum(), refs[name].pow(2).sum()])
        dist.all_reduce(num, group=group)  # the error over the whole sequence, not one shard
        result[name] = float(num[0].sqrt() / num[1].sqrt())
    return result
