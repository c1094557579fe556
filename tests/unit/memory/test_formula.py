"""lab_utils.memory.formula: the analytic saved-activation bytes equal the measured ones (hooks on
the MMDiT's step) for an MMDiT of one kind of block only, under every policy the formula covers."""

from __future__ import annotations

import pytest

from lab_utils import memory as mem
from lab_utils.model import resolve_config

SHAPE = mem.StepShape(3, 20, 7)  # batch 3, a 4x5 token grid, an odd text length


@pytest.mark.parametrize("blocks", [{"depth_double": 0}, {"depth_single": 0}], ids=["no-double", "no-single"])
def test_formula_equals_hooks_without_double_or_single_blocks(blocks):
    """An MMDiT of one kind of block only: without double blocks the embedders' outputs are only
    concatenated (nothing kept for them); without single blocks, offloading still keeps the joint
    sequence the final layer reads."""
    cfg, sh = resolve_config("tiny", **blocks), SHAPE
    for policy in mem.FORMULA_POLICIES:
        measured = mem.mmdit_saved(cfg, sh, "float32", policy, seed=0).by_region()
        assert measured == mem.saved_bytes_formula(cfg, sh, "float32", policy), (blocks, policy)
