"""Lab 07's attention logit max on any step (``lab_utils.stability.telemetry.SdpaTelemetry``): read from
each block's own ``scaled_dot_product_attention`` calls, no seam needed.  Against a float64 count
written here on a toy model (grouped-query keys, an explicit scale), and present for every
attention block of the three models no one here wrote."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.stability.telemetry import SdpaTelemetry, Telemetry, telemetry_of
from lab_utils.step.contract import StepFactory, blocks
from lab_utils.step.load import DEFAULT_STEP, build_step


def telemetry(step: StepFactory) -> SdpaTelemetry:
    return SdpaTelemetry(step.model, blocks(step))


HEADS, KV_HEADS, DIM, TOKENS = 4, 2, 8, 5


class Attn(nn.Module):
    """q from 4 heads, k / v from 2 (grouped), scale 0.3; ``seen`` keeps the float64 logit max."""

    def __init__(self, width: int):
        super().__init__()
        self.q = nn.Linear(width, HEADS * DIM)
        self.kv = nn.Linear(width, 2 * KV_HEADS * DIM)
        self.out = nn.Linear(HEADS * DIM, width)
        self.seen: list[float] = []

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, KV_HEADS, DIM).permute(2, 0, 3, 1, 4)
        kk = k.repeat_interleave(HEADS // KV_HEADS, dim=1).double()
        self.seen.append(float(torch.einsum("bhqd,bhkd->bhqk", q.detach().double(), kk.detach()).amax() * 0.3))
        o = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
        return x + self.out(o.transpose(1, 2).reshape(b, n, HEADS * DIM))


class Toy(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList([Attn(width), Attn(width)])

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def toy_step(gen) -> StepFactory:
    width = 16
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = Toy(width)
    x = torch.randn(2, TOKENS, width, generator=gen) * 3
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return StepFactory(model, opt, lambda k: x, lambda m, b: m(b).square().mean())


def test_the_logit_max_of_each_block_equals_a_float64_count(gen):
    step = toy_step(gen)
    tel = telemetry(step)
    try:
        for i in range(2):
            tel.begin_step(i)
            step.loss(step.model, step.make_batch(i)).backward()
            tel.after_backward()
            tel.end_step()
    finally:
        tel.close()
    got = tel.frame()
    got = got[got.stat == "logit_max"].set_index(["step", "block"]).value
    for b, blk in (("blocks.0", step.model.blocks[0]), ("blocks.1", step.model.blocks[1])):
        assert len(blk.seen) == 2
        for i, want in enumerate(blk.seen):
            assert math.isclose(got[(i, b)], want, rel_tol=1e-5), (i, b, got[(i, b)], want)
    # outside a sampled step (and once closed) nothing is read
    assert tel.mode is None
    step.loss(step.model, step.make_batch(2))
    assert tel.logit_max == {} and len(step.model.blocks[0].seen) == 3


@pytest.mark.parametrize(
    "spec, n_blocks",
    [
        ("lab_utils.step.examples:flux_step", 4),
        ("lab_utils.step.examples:sd3_step", 2),
        ("lab_utils.step.examples:llama_step", 2),
    ],
)
def test_every_attention_block_of_a_model_no_one_here_wrote_gets_a_logit_max(spec, n_blocks):
    print("seed 0 (the factory's)")
    step = build_step(spec, batch_size=1)
    tel = telemetry_of(step.model, blocks(step))
    assert isinstance(tel, SdpaTelemetry)  # no seam: its SDPA calls
    try:
        tel.begin_step(0)
        step.loss(step.model, step.make_batch(0)).backward()
        tel.after_backward()
        tel.end_step()
    finally:
        tel.close()
    df = tel.frame()
    lm = df[df.stat == "logit_max"]
    assert len(lm) == n_blocks and lm.block.nunique() == n_blocks, lm
    assert (lm.stream == "attn").all() and lm.value.map(math.isfinite).all() and (lm.value.abs() > 0).all()


def test_on_perflabs_mmdit_the_sdpa_logit_max_is_its_seams():
    """The MMDiT's own telemetry reads q and k at its ``qk_norm_rope`` seam (stream ``g0``); the
    generic reading of its SDPA calls (stream ``attn``) must give the same figure per block."""
    print("seed 0 (the factory's)")
    step = build_step(DEFAULT_STEP, batch_size=1)
    seam = telemetry_of(step.model, blocks(step))
    assert type(seam) is Telemetry  # the lab reads the seam
    seam.close()
    tel = telemetry(step)
    try:
        tel.begin_step(0)
        step.loss(step.model, step.make_batch(0)).backward()
        tel.after_backward()
        tel.end_step()
    finally:
        tel.close()
    lm = tel.frame().query("stat == 'logit_max'")
    seam, sdpa = (lm[lm.stream == s].set_index("block").value for s in ("g0", "attn"))
    assert len(seam) > 0 and set(seam.index) == set(sdpa.index), (seam, sdpa)
    for b in seam.index:
        assert math.isclose(seam[b], sdpa[b], rel_tol=1e-4), (b, seam[b], sdpa[b])
