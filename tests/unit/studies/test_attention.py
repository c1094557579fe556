"""Lab 03's study module: its config, its correctness checks (a wrong path fails the lab),
its tables from records, and the computed padding/packing figures."""

from __future__ import annotations

import dataclasses
import json
import math

import pandas as pd
import pytest
import torch

from lab_utils.attention import attend as A
from lab_utils.attention import masks as M
from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.core.session import Session
from lab_utils.studies import attention as S

SMALL = dict(
    check_paths=["sdpa", "math", "triton"],
    check_len=29,
    check_lengths=[13, 29, 7],
    paths=["sdpa"],
    masks=["causal"],
    seq_lens=[32],
    directions=["fwd"],
    reps=3,
    budget_s=5.0,
)


def test_config_defaults_and_dtype():
    cfg = S.AttentionLabConfig()
    assert cfg.torch_dtype is torch.float32
    assert S.AttentionLabConfig(dtype="bfloat16").torch_dtype is torch.bfloat16


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(dtype="float64"), "dtype"),
        (dict(dtype="fp16"), "dtype"),
        (dict(paths=["sdpa", "fast"]), "paths"),
        (dict(mask="diagonal"), "mask"),
        (dict(txt_len=[9, 3]), "txt_len"),
        (dict(varlen_buckets=[[256]]), "varlen_buckets"),
        (dict(reps=2), "reps"),
    ],
)
def test_config_refuses_bad_values_by_name(kw, param):
    with pytest.raises(ConfigError) as ei:
        S.AttentionLabConfig(**kw)
    assert ei.value.param == param


def test_checks_pass_and_are_recorded():
    cfg = S.AttentionLabConfig(**SMALL)
    rec = Recorder(lab="03_attention")
    checks = S.check_paths(cfg, "cpu", rec)
    checks.assert_ok()
    t = checks.tables()
    assert set(t.index.get_level_values(0)) == {"dense", "dense_causal", "packed"}
    # triton cannot honour the custom lab mask: listed as skipped with its reason, never compared
    dense = checks.table("dense").set_index(["path", "tensor"])
    assert dense.loc[("triton", "out"), "verdict"] == "skipped" and dense.loc[("triton", "out"), "note"]
    assert (checks.table("packed").verdict == "ok").all()
    assert len(rec.rows) == len(t)
    assert {json.loads(r["extra"])["verdict"] for r in rec.rows} == {"ok", "skipped"}


def test_a_wrong_path_fails_the_lab(monkeypatch):
    """A path that computes something else must raise, not print FAIL and go on."""
    math_path = A.get_path("math")

    def off_by_a_bit(q, k, v, mask, scale, **kw):
        return math_path.fn(q, k, v, mask, scale, **kw) * 1.01

    monkeypatch.setitem(A.REGISTRY, "math", dataclasses.replace(math_path, fn=off_by_a_bit))
    checks = S.check_paths(S.AttentionLabConfig(**SMALL), "cpu")
    bad = checks.failures()
    assert set(bad.path) == {"math"} and len(bad) >= 3  # out of every problem (and gradients)
    with pytest.raises(AssertionError, match="math:out"):
        checks.assert_ok()


def test_mask_census_counts():
    c = S.mask_census(["full", "causal"], 64, block_size=16).set_index("name")
    assert c.loc["full", "density"] == 1.0 and c.loc["full", "full"] == 16
    assert c.loc["causal", "density"] == pytest.approx(64 * 65 / 2 / 64**2)
    assert (c.loc["causal", ["full", "partial", "empty"]].tolist()) == [6, 4, 6]
    assert c.loc["causal", "fwd_flops_per_head"] == M.attention_flops(M.causal(), 1, 1, 64, 64, 64).fwd


def test_mask_census_raises_when_a_count_is_wrong(monkeypatch):
    real = M.block_stats

    def one_tile_moved(*a, **kw):  # a partial tile counted as full
        bs = real(*a, **kw)
        return dataclasses.replace(bs, full_blocks=bs.full_blocks + 1, partial_blocks=bs.partial_blocks - 1)

    monkeypatch.setattr(M, "block_stats", one_tile_moved)
    with pytest.raises(AssertionError, match="mask census off its direct count: causal"):
        S.mask_census(["causal"], 64, block_size=16)


def test_mask_census_raises_when_the_flops_are_wrong(monkeypatch):
    real = M.attention_flops
    monkeypatch.setattr(M, "attention_flops", lambda *a, **kw: dataclasses.replace(real(*a, **kw), fwd=0.0))
    with pytest.raises(AssertionError, match="full: "):
        S.mask_census(["full"], 32, block_size=16)


def test_pad_pack_costs_raise_when_a_count_is_wrong(monkeypatch, capsys):
    real = S.V.pad_pack_costs

    def padded_by_total(*a, **kw):  # the padded layout counted over the sum of lengths, not B * Lmax
        c = real(*a, **kw)
        return [dataclasses.replace(c[0], pairs=c[1].pairs), c[1]]

    monkeypatch.setattr(S.V, "pad_pack_costs", padded_by_total)
    cfg = S.AttentionLabConfig()
    with pytest.raises(AssertionError, match="padded: "):
        S.print_pad_pack_costs(S.varlen_batch(cfg), cfg)


def test_pad_pack_costs_printed(capsys):
    cfg = S.AttentionLabConfig()
    vb = S.varlen_batch(cfg)
    S.print_pad_pack_costs(vb, cfg)
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"lengths: {list(vb.lengths)}")
    assert out[2].startswith("padded tokens") and out[3].startswith("packed tokens")
    assert "useful 100.0%" in out[3] and "useful 100.0%" not in out[2]


def test_sweep_tables_read_the_records():
    cfg = S.AttentionLabConfig(**{**SMALL, "masks": ["causal", "mmdit"]})
    rec = Recorder(lab="03_attention")
    sweep_df = S.run_sweep(cfg, Session("cpu", rec))
    timed = sweep_df[sweep_df.path == "sdpa"]
    assert len(timed) == 2 and timed.time_ms.map(math.isfinite).all()
    cost = S.block_mask_cost(sweep_df)
    assert list(cost["mask"]) == ["causal", "mmdit"] and "sdpa_fwd_ms" in cost.columns
    frame = rec.frame()
    extra = frame[frame.experiment == "sweep"].extra.map(json.loads)
    assert set(extra.map(lambda e: e["flop_convention"])) == {"kernel"}
    table = S.sweep_table(frame, "time")
    assert table.shape == (2, 1) and list(table.index.get_level_values("mask")) == ["causal", "mmdit"]
    assert S.not_run(sweep_df).empty
    assert S.not_run(pd.DataFrame([dict(seq_len=8, mask="m", path="p", direction="fwd", note="x", time_ms=math.nan)]))[
        "note"
    ].tolist() == ["x"]
