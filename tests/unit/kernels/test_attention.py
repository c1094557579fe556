"""lab_kernels.attention's own entry points validate the packed layout's inputs (the library
lab_utils.attention.attend checks them too, but the registered "triton" variant can be called alone)."""

import pytest
import torch

from lab_kernels import attention as ka
from lab_kernels import get_variant
from lab_utils.core.checks import assert_close, poison_, tolerance

CU = torch.tensor([0, 30, 100], dtype=torch.int32)  # lengths 30 and 70


def _qkv(gen, total=100, heads=2, dh=64):
    return [torch.randn(total, heads, dh, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("entry", ["attention", "attention_forward", "variant"])
def test_max_seqlen_below_the_longest_sequence_is_refused(entry, gen):
    """With max_seqlen=20 the kernel launched too few query blocks: 38 of 100 rows were never written."""
    q, k, v = _qkv(gen)
    fn = {
        "attention": ka.attention,
        "attention_forward": ka.attention_forward,
        "variant": get_variant("attention", "triton"),
    }[entry]
    with pytest.raises(ValueError, match=r"'max_seqlen' = 20 is smaller than the longest packed sequence \(70"):
        fn(q, k, v, cu_seqlens=CU, max_seqlen=20)


def test_backward_entry_point_checks_too(gen):
    q, k, v = _qkv(gen)
    out, lse = ka.attention_forward(q, k, v, cu_seqlens=CU)
    with pytest.raises(ValueError, match="'max_seqlen' = 69"):
        ka.attention_backward(torch.ones_like(out), q, k, v, out, lse, cu_seqlens=CU, max_seqlen=69)


def test_other_packed_inputs_are_refused(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(ValueError, match="'max_seqlen'.*without 'cu_seqlens'"):
        ka.attention(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2),
                     max_seqlen=100)  # fmt: skip
    with pytest.raises(ValueError, match="'max_seqlen' must be an int"):
        ka.attention(q, k, v, cu_seqlens=CU, max_seqlen=70.5)
    with pytest.raises(ValueError, match="'cu_seqlens' must end at the packed length 100"):
        ka.attention(q, k, v, cu_seqlens=torch.tensor([0, 30, 90], dtype=torch.int32))
    with pytest.raises(ValueError, match="'cu_seqlens' must be strictly increasing"):
        ka.attention(q, k, v, cu_seqlens=torch.tensor([0, 30, 30, 100], dtype=torch.int32))
    with pytest.raises(ValueError, match="'cu_seqlens' must start at 0"):
        ka.attention(q, k, v, cu_seqlens=torch.tensor([5, 100], dtype=torch.int32))


def test_a_larger_max_seqlen_writes_every_row(gen):
    """max_seqlen above the longest sequence launches extra (empty) blocks: still every row written."""
    q, k, v = _qkv(gen)
    out = poison_(torch.empty_like(q))
    ka.attention_forward(q, k, v, cu_seqlens=CU, max_seqlen=96, out=out)
    ref = ka.reference_attention(q.double(), k.double(), v.double(), cu_seqlens=CU)
    assert_close(out, ref, dtype=torch.float32, name="packed out, max_seqlen 96")


def test_naming_scheme():
    assert issubclass(ka.AttentionFunction, torch.autograd.Function)
    assert get_variant("attention", "triton").fn is ka.attention
    assert get_variant("attention", "eager").fn is ka.eager_attention
    assert get_variant("attention", "reference").fn is ka.reference_attention


@pytest.mark.parametrize("causal,lengths", [(True, None), (False, (200, 77, 131))])
def test_gpu_tiles_compute_the_same_attention_in_the_interpreter(causal, lengths, gen, monkeypatch):
    """The GPU's tile sizes (dK/dV 64 x 64, dQ 128 x 64 at head dim 128), run through the interpreter
    instead of its own 32 x 32 tiles: forward and every gradient against float64, with tails
    (lengths not multiples of any tile) and the causal diagonal crossing tiles of unequal sizes."""
    from lab_kernels import _attention_inputs as ai
    from lab_kernels import _common

    real = ai.launch_config

    def gpu_tiles(kind, head_dim, dtype):
        with monkeypatch.context() as m:
            m.setattr(_common, "interpreted", lambda: False)
            return real(kind, head_dim, dtype)

    assert gpu_tiles("bwd_dq", 128, torch.float16)["BLOCK_M"] == 128
    assert gpu_tiles("bwd_dkdv", 128, torch.float16)["BLOCK_N"] == 64
    monkeypatch.setattr(ka, "launch_config", gpu_tiles)
    dt, D, H = torch.float16, 128, 2
    if lengths:
        T = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v, do = (torch.randn(T, H, D, generator=gen).to(dt) for _ in range(4))
    else:
        cu = None
        q, k, v, do = (torch.randn(1, H, 203, D, generator=gen).to(dt) for _ in range(4))
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = ka.attention(qq, kk, vv, causal=causal, cu_seqlens=cu)
    grads = torch.autograd.grad(out, (qq, kk, vv), do)
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    ref = ka.reference_attention(q64, k64, v64, causal=causal, cu_seqlens=cu)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    assert_close(out, ref, dtype=dt, name="out with GPU tiles")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        atol, rtol = tolerance(dt, 2.0)  # a backward chains several roundings to float16
        assert_close(g, r, atol=atol, rtol=rtol, name=f"{name} with GPU tiles")
