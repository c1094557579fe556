"""A step whose every byte is known by construction: four blocks of Linear(8, 8) -> ReLU ->
Linear(8, 8) on a batch of two rows (float32), trained by Adam on the output's sum.  One
activation of the batch is 2 x 8 x 4 = 64 bytes."""

from __future__ import annotations

import torch
from torch import nn

from lab_utils.step.contract import StepFactory

B, D = 2, 8
ACT = B * D * 4  # bytes of one activation


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def tiny_step(n: int = 4, batch: int = B) -> StepFactory:
    torch.manual_seed(0)
    model = Net(n)

    def make_batch(k):
        return torch.randn(batch, D, generator=torch.Generator().manual_seed(k))

    return StepFactory(model, torch.optim.Adam(model.parameters(), lr=1e-3), make_batch,
                       lambda m, x: m(x).sum())  # fmt: skip
