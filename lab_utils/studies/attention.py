"""Lab 03 (``labs/03_attention.ipynb``): its parameters, checks, sweeps, tables and plots.

The attention paths, their registry and the timing sweep are :mod:`lab_utils.attention.attend`'s;
masks and mask-aware FLOPs are :mod:`lab_utils.attention.masks`'; padding vs packing is
:mod:`lab_utils.attention.varlen`'s.  This module runs them with the lab's parameters, writes the
records and draws what the records say (plots never measure).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import holoviews as hv
import pandas as pd
import torch
from tqdm.auto import tqdm

from lab_utils.attention import attend as A
from lab_utils.attention import masks as M
from lab_utils.attention import varlen as V
from lab_utils.attention.varlen import normalize_buckets
from lab_utils.core.config import (
    ConfigError,
    LabConfig,
    check_bool,
    check_choice,
    check_choices,
    check_float,
    check_int,
    check_int_list,
)
from lab_utils.core.dtypes import LAB_DTYPES, parse_dtype
from lab_utils.core.records import Recorder
from lab_utils.core.session import Session
from lab_utils.core.timing import BenchOptions
from lab_utils.studies.headline import Figure, fmt, register, rows


@dataclass(frozen=True)
class AttentionLabConfig(LabConfig):
    """Parameters of labs/03_attention.ipynb (names == the notebook's parameters)."""

    device: str = "auto"
    dtype: str = "float32"
    mask: str = "mmdit"  # the mask of the pictures and the correctness table
    masks: tuple = ("full", "causal", "mmdit", "neighborhood")  # the sweep and the HoloMap
    check_paths: tuple = ("sdpa", "math", "flash", "flex_eager", "triton")
    paths: tuple = ("sdpa", "math", "flash")  # timed paths
    check_len: int = 97
    check_head_dim: int = 64
    check_lengths: tuple = (37, 97, 58)  # packed varlen correctness
    seq_lens: tuple = (128, 256)
    head_dims: tuple = (64,)
    heads: int = 2
    batch: int = 1
    directions: tuple = ("fwd", "fwd+bwd")
    picture_len: int = 96
    block_size: int = 16
    varlen_batch: int = 4
    varlen_buckets: tuple = ((256, 256), (224, 288), (128, 128), (96, 160))
    txt_len: tuple = (16, 64)
    pixels_per_token: int = 16
    varlen_heads: int = 2
    reps: int = 5
    budget_s: float = 10.0
    quick_ceilings: bool = True

    def __post_init__(self):
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        parse_dtype("dtype", self.dtype, LAB_DTYPES)
        check_choice("mask", self.mask, M.MASK_NAMES)
        check_choices("masks", self.masks, M.MASK_NAMES)
        check_choices("check_paths", self.check_paths, A.PATHS)
        check_choices("paths", self.paths, A.PATHS)
        for p in ("check_len", "picture_len"):
            check_int(p, getattr(self, p), min=8)
        check_choice("check_head_dim", self.check_head_dim, (16, 32, 64, 128, 256))
        check_int_list("check_lengths", self.check_lengths, min=1)
        check_int_list("seq_lens", self.seq_lens, min=8)
        check_int_list("head_dims", self.head_dims, min=8)
        for p in ("heads", "batch", "varlen_batch", "varlen_heads", "pixels_per_token"):
            check_int(p, getattr(self, p), min=1)
        check_int("block_size", self.block_size, min=1)
        check_choices("directions", self.directions, ("fwd", "fwd+bwd"))
        if (
            isinstance(self.txt_len, (str, bytes))
            or not isinstance(self.txt_len, (list, tuple))
            or len(self.txt_len) != 2
        ):
            raise ConfigError("txt_len", self.txt_len, "a pair [min, max] of caption token counts")
        check_int_list("txt_len", self.txt_len, min=0)
        if self.txt_len[0] > self.txt_len[1]:
            raise ConfigError("txt_len", self.txt_len, "[min, max] with min <= max")
        normalize_buckets(self.varlen_buckets, "varlen_buckets")
        check_int("reps", self.reps, min=3)
        check_float("budget_s", self.budget_s, min=0, min_exclusive=True)
        check_bool("quick_ceilings", self.quick_ceilings)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype("dtype", self.dtype)


# --------------------------------------------------------------------------- what runs here
def support_matrix(table: pd.DataFrame) -> pd.DataFrame:
    """``A.path_table`` as path x (layout, mask, direction): "yes" where the path runs here."""
    return table.assign(ok=table.supported.map({True: "yes", False: "-"})).pivot_table(
        index="path", columns=["layout", "mask", "direction"], values="ok", aggfunc="first", sort=False
    )


def unsupported_reasons(table: pd.DataFrame) -> pd.DataFrame:
    """One row per distinct reason a combination does not run here."""
    return table[~table.supported].drop_duplicates("why_not")[["path", "layout", "mask", "direction", "why_not"]]


# --------------------------------------------------------------------------- masks
def mask_census(names, L: int, *, block_size: int, head_dim: int = 64) -> pd.DataFrame:
    """Density, tile census and mask-aware forward FLOPs per head of each named mask at length L."""
    rows = []
    for name in names:
        m = M.make_mask(name, L)
        bs = M.block_stats(m, L, L, block_size=block_size)
        fl = M.attention_flops(m, 1, 1, L, L, head_dim)
        rows.append(
            dict(
                name=name,
                mask=m.name,
                density=bs.density,
                full=bs.full_blocks,
                partial=bs.partial_blocks,
                empty=bs.empty_blocks,
                fwd_flops_per_head=fl.fwd,
            )
        )
    census = pd.DataFrame(rows)
    check_mask_census(census, L, block_size=block_size, head_dim=head_dim)
    return census


def check_mask_census(census: pd.DataFrame, L: int, *, block_size: int, head_dim: int) -> None:
    """Each row recounted pair by pair (the mask asked one (q, k) at a time, the tiles walked
    in Python), the forward FLOPs by hand (QK^T and PV: 2 + 2 FLOPs per pair and head dim),
    and the closed forms of full (L^2) and causal (L(L+1)/2) pairs; raises when one differs."""
    bad = []
    for r in census.itertuples():
        m = M.make_mask(r.name, L)
        z = torch.zeros((), dtype=torch.long)
        allowed = [[bool(m.mask_mod(z, z, z + q, z + k)) for k in range(L)] for q in range(L)]
        pairs = sum(map(sum, allowed))
        tiles = [0, 0, 0]  # empty, partial, full
        for q0 in range(0, L, block_size):
            for k0 in range(0, L, block_size):
                t = [a for row in allowed[q0 : q0 + block_size] for a in row[k0 : k0 + block_size]]
                tiles[(sum(t) > 0) + (sum(t) == len(t))] += 1
        closed = {"full": L * L, "causal": L * (L + 1) // 2}.get(r.name, pairs)
        got = (r.density * L * L, r.empty, r.partial, r.full, r.fwd_flops_per_head)
        want = (pairs, *tiles, 4 * head_dim * pairs)
        if pairs != closed or any(abs(g - w) > 1e-6 * max(1, w) for g, w in zip(got, want, strict=True)):
            bad.append(f"{r.name}: (pairs, empty, partial, full tiles, FLOPs) {got} != recount {want}")
    if bad:
        raise AssertionError("mask census off its direct count: " + "; ".join(bad))


def print_mask_census(census: pd.DataFrame) -> None:
    for r in census.itertuples():
        print(
            f"{r.name:15s} {r.mask:38s} density {r.density:6.1%}  tiles full/partial/empty "
            f"{r.full:3d}/{r.partial:3d}/{r.empty:3d}  fwd FLOPs/head {r.fwd_flops_per_head:.4g}"
        )


def mask_picture(mask: M.Mask, L: int, *, block_size: int = 16, b: int = 0):
    """Dense mask and block states side by side (holoviews Images, query rows down)."""
    d = M.dense_mask(mask, b + 1, 1, L, L)[b, 0]
    st = M.block_states(d, block_size, block_size).float()
    dense = hv.Image(d.float().flip(0).numpy(), bounds=(0, 0, L, L), kdims=["key", "query"], vdims=["allowed"]).opts(
        cmap="Blues",
        title=f"{mask.name}: dense ({float(d.float().mean()):.0%} allowed)",
        width=330,
        height=330,
        invert_yaxis=False,
        tools=["hover"],
        colorbar=False,
    )
    n = st.shape[0]
    blocks = hv.Image(
        st.flip(0).numpy(), bounds=(0, 0, st.shape[1], n), kdims=["key block", "query block"], vdims=["state"]
    ).opts(
        cmap=["white", "orange", "steelblue"],
        clim=(0, 2),
        width=330,
        height=330,
        tools=["hover"],
        title=f"blocks {block_size}x{block_size}: full {int((st == 2).sum())} partial {int((st == 1).sum())} "
        f"empty {int((st == 0).sum())}",
    )
    return dense + blocks


def mask_holomap(names, L: int, *, block_size: int = 16):
    """HoloMap over mask names of :func:`mask_picture` (every frame embedded)."""
    return hv.HoloMap(
        {n: mask_picture(M.make_mask(n, L), L, block_size=block_size) for n in names}, kdims=["mask"]
    ).collate()


# --------------------------------------------------------------------------- correctness
def correctness_table(paths, inputs: dict, *, mask=None, backward: bool = True) -> pd.DataFrame:
    """Each path vs the float64 reference (out, dq, dk, dv) on one problem: ``inputs`` from
    :func:`lab_utils.attention.attend.random_qkv` (fixed seed)."""
    rows = []
    for path in paths:
        for r in A.check_path(path, inputs, mask=mask, backward=backward):
            rows.append(
                dict(
                    path=r.path,
                    tensor=r.tensor,
                    verdict="skipped" if r.ok is None else ("ok" if r.ok else "FAIL"),
                    max_abs_err=r.max_abs,
                    atol=r.atol,
                    rtol=r.rtol,
                    bound=r.bound,
                    note=(r.note.splitlines()[0] if r.note else ""),
                )
            )
    return pd.DataFrame(rows)


@dataclass
class Correctness:
    """The lab's three correctness problems: (label, layout tag, table) each."""

    problems: list[tuple[str, str, pd.DataFrame]]

    def table(self, layout: str) -> pd.DataFrame:
        return next(df for _, tag, df in self.problems if tag == layout)

    def tables(self) -> pd.DataFrame:
        return pd.concat({tag: df for _, tag, df in self.problems}, names=["problem"])

    def failures(self) -> pd.DataFrame:
        return self.tables().query("verdict == 'FAIL'")

    def print_verdicts(self) -> None:
        for label, _, df in self.problems:
            print(label)
            for path, g in df.groupby("path", sort=False):
                print(f"  {path:11s} " + "  ".join(f"{t}:{v}" for t, v in zip(g.tensor, g.verdict)))

    def assert_ok(self) -> None:
        """Raise when any path disagrees with the float64 reference (a lab must fail then)."""
        bad = self.failures()
        if len(bad):
            lines = [
                f"{p}/{r.path}:{r.tensor} max_abs_err {r.max_abs_err:.3g} > atol {r.atol:.3g}"
                for p, r in zip(bad.index.get_level_values(0), bad.itertuples())
            ]
            raise AssertionError("attention paths disagree with the float64 reference:\n  " + "\n  ".join(lines))


def check_paths(cfg: AttentionLabConfig, device, rec: Recorder | None = None) -> Correctness:
    """Every ``cfg.check_paths`` against float64 on three fixed-seed problems: the lab's mask
    (dense), causal (dense) and causal packed varlen; every row recorded."""
    dt = cfg.torch_dtype
    check_mask = M.make_mask(cfg.mask, cfg.check_len)

    def qkv(seed: int, L: int = 97, lengths=None) -> dict:  # batch 1, 2 heads
        return A.random_qkv(1, 2, L, cfg.check_head_dim, dtype=dt, device=device, seed=seed, lengths=lengths)

    problems = [
        (
            f"dense L={cfg.check_len}, mask {check_mask.name}",
            "dense",
            correctness_table(cfg.check_paths, qkv(0, cfg.check_len), mask=check_mask),
        ),
        (
            f"dense L={cfg.check_len}, causal",
            "dense_causal",
            correctness_table(cfg.check_paths, qkv(2, cfg.check_len), mask="causal"),
        ),
        (
            f"packed lengths {list(cfg.check_lengths)}, causal",
            "packed",
            correctness_table(cfg.check_paths, qkv(1, lengths=list(cfg.check_lengths)), mask="causal"),
        ),
    ]
    if rec is not None:
        for _, tag, df in problems:
            for r in df.itertuples():
                rec.add(
                    "correctness",
                    r.path,
                    "max_abs_err",
                    r.max_abs_err,
                    "",
                    dtype=dt,
                    tensor=r.tensor,
                    layout=tag,
                    verdict=r.verdict,
                    atol=r.atol,
                    tolerance=r.bound,  # the figure passes its check while <= this (the gate judges it so)
                )
    return Correctness(problems)


# --------------------------------------------------------------------------- speed
def run_sweep(cfg: AttentionLabConfig, session: Session) -> pd.DataFrame:
    """The timing sweep of :func:`lab_utils.attention.attend.sweep` at the lab's parameters (one row per case)."""
    return pd.DataFrame(
        A.sweep(
            A.SweepGrid(
                paths=tuple(cfg.paths),
                masks=tuple(cfg.masks),
                seq_lens=tuple(cfg.seq_lens),
                head_dims=tuple(cfg.head_dims),
                directions=tuple(cfg.directions),
                batch=cfg.batch,
                heads=cfg.heads,
                dtype=cfg.torch_dtype,
            ),
            session,
            A.SweepOptions(reps=cfg.reps, budget_s=cfg.budget_s),
            progress=lambda cases: tqdm(cases, desc="attention sweep (seq_len, head_dim, mask)"),
        )
    )


def not_run(sweep_df: pd.DataFrame) -> pd.DataFrame:
    """The cases the sweep could not time, one row per distinct reason."""
    d = sweep_df[sweep_df.time_ms.isna()]
    return d[["seq_len", "mask", "path", "direction", "note"]].drop_duplicates(["mask", "path", "direction", "note"])


def _sweep_rows(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    d = df[(df.experiment == "sweep") & (df.metric == metric) & (df.statistic == "median")].copy()
    ex = d.extra.map(json.loads)
    for k in ("mask", "direction", "seq_len", "head_dim"):
        d[k] = ex.map(lambda e, k=k: e.get(k))
    return d


def sweep_plot(df: pd.DataFrame, metric: str = "time", *, title: str = ""):
    """HoloMap over masks of ``metric`` (median) vs sequence length; one curve per path and
    direction (and head dim when several; dashed = forward+backward).  ``df``: Recorder
    rows of experiment "sweep".  Few frames on purpose: every frame is embedded in HTML."""
    d = _sweep_rows(df, metric)
    if d.empty:
        return hv.Div(f"<p>no {metric} rows to plot</p>")
    unit = d.unit.iloc[0]
    several_d = d.head_dim.nunique() > 1
    frames = {}
    for m, g in d.groupby("mask", sort=False):
        curves = []
        for (p, direction, hd), gg in g.groupby(["variant", "direction", "head_dim"], sort=False):
            label = f"{p} {direction}" + (f" Dh{hd}" if several_d else "")
            curves.append(
                hv.Curve(gg.sort_values("seq_len"), "seq_len", ("value", f"{metric} ({unit})"), label=label).opts(
                    line_dash="dashed" if direction == "fwd+bwd" else "solid"
                )
            )
        frames[m] = hv.Overlay(curves).opts(
            hv.opts.Curve(tools=["hover"], line_width=2),
            hv.opts.Overlay(
                logx=True, logy=metric == "time", legend_position="top_left", title=title or f"{metric} ({unit})"
            ),
        )
    return hv.HoloMap(frames, kdims=["mask"])


def sweep_table(df: pd.DataFrame, metric: str = "pct_of_matmul") -> pd.DataFrame:
    """Median ``metric`` of the sweep as a (mask, direction, head_dim, seq_len) x path table."""
    d = _sweep_rows(df, metric)
    return d.pivot_table(
        index=["mask", "direction", "head_dim", "seq_len"], columns="variant", values="value", sort=False
    ).round(3)


def block_mask_cost(sweep_df: pd.DataFrame) -> pd.DataFrame:
    """Block-mask build time beside each path's forward time, per (seq_len, head_dim, mask)."""
    keys = ["seq_len", "head_dim", "mask"]
    build = sweep_df[sweep_df.path == "block_mask_build"][[*keys, "time_ms"]].rename(
        columns={"time_ms": "block_mask_build_ms"}
    )
    attn = (
        sweep_df[(sweep_df.path != "block_mask_build") & (sweep_df.direction == "fwd")]
        .pivot_table(index=keys, columns="path", values="time_ms")
        .add_suffix("_fwd_ms")
        .reset_index()
    )
    return build.merge(attn, on=keys, how="left")


# --------------------------------------------------------------------------- padding vs packing
def varlen_batch(cfg: AttentionLabConfig) -> V.VarlenBatch:
    return V.bucket_batch(
        cfg.varlen_batch,
        buckets=cfg.varlen_buckets,
        txt_len=tuple(cfg.txt_len),
        pixels_per_token=cfg.pixels_per_token,
        seed=0,
    )


def print_pad_pack_costs(vb: V.VarlenBatch, cfg: AttentionLabConfig) -> None:
    """The batch and the computed (not measured) cost of each layout."""
    print("buckets:", [f"{h}x{w}" for h, w in vb.buckets])
    print("lengths:", list(vb.lengths), " Lmax", vb.max_len, " T", vb.total)
    costs = V.pad_pack_costs(vb, cfg.varlen_heads, max(cfg.head_dims), cfg.torch_dtype)
    check_pad_pack(costs, vb.lengths, cfg.varlen_heads, max(cfg.head_dims))
    for c in costs:
        print(
            f"{c.layout:6s} tokens {c.tokens:6d}  pairs {c.pairs:9d}  fwd FLOPs {c.fwd_flops:.4g}  useful "
            f"{c.useful_fraction:6.1%}  q/k/v/o {c.activation_bytes / 2**20:.3g} MiB  "
            f"scores {c.score_bytes / 2**20:.3g} MiB"
        )


def check_pad_pack(costs, lengths, heads: int, head_dim: int) -> None:
    """Tokens, pairs, forward FLOPs and useful fraction of each layout against a direct count:
    the padded layout's (B, Lmax, Lmax) grid of computed pairs, the packed layout's
    block-diagonal mask (its allowed pairs are the useful ones); raises when one differs."""
    lengths = [int(n) for n in lengths]
    packed = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool) for n in lengths])
    padded = torch.ones(len(lengths), max(lengths), max(lengths), dtype=torch.bool)
    useful = heads * int(packed.sum())
    want = {
        "padded": (padded.shape[0] * padded.shape[1], heads * padded.numel()),
        "packed": (packed.shape[0], useful),
    }
    for c in costs:
        tokens, pairs = want[c.layout]
        got, exp = (
            (c.tokens, c.pairs, c.fwd_flops, c.useful_fraction),
            (tokens, pairs, 4 * head_dim * pairs, useful / pairs),
        )
        if any(abs(g - e) > 1e-9 * max(1, e) for g, e in zip(got, exp, strict=True)):
            raise AssertionError(f"{c.layout}: (tokens, pairs, fwd FLOPs, useful) {got} != direct count {exp}")


def run_pad_vs_pack(cfg: AttentionLabConfig, vb: V.VarlenBatch, session: Session) -> pd.DataFrame:
    """Time the timed paths (and Triton, which says why it is not timed on CPU) on both layouts."""
    rows = V.time_padding_vs_packing(
        vb,
        cfg.varlen_heads,
        max(cfg.head_dims),
        paths=[*cfg.paths, *(["triton"] if "triton" not in cfg.paths else [])],
        dtype=cfg.torch_dtype,
        session=session,
        bench=BenchOptions(reps=cfg.reps, budget_s=cfg.budget_s),
    )
    cols = ["path", "layout", "tokens", "useful_fraction", "time_ms", "useful_tflops", "note"]
    df = pd.DataFrame(rows)
    return df[[c for c in cols if c in df.columns]]


def pad_pack_plot(pp: pd.DataFrame):
    d = pp[pp.time_ms.map(lambda t: isinstance(t, float) and math.isfinite(t))]
    if d.empty:
        return hv.Div("<p>no padding/packing timings on this device</p>")
    return hv.Bars(d, ["path", "layout"], "time_ms").opts(title="padding vs packing: forward time (ms)", xrotation=30)


# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


@register("03_attention")
def headline(df: pd.DataFrame) -> list[Figure]:
    """The attention path closest to and the one farthest from its ceiling (stable timings only)."""
    figs = []
    pc = rows(df, metric="pct_of_ceiling", statistic="median")
    pc = pc[pc.stable != False]  # noqa: E712 - True/False/None column
    if len(pc):
        b, w = pc.loc[pc.value.idxmax()], pc.loc[pc.value.idxmin()]
        figs.append(Figure("best path vs ceiling", f"{b.variant} {fmt(b.value, '%')}", f"{b.experiment} {b['shape']}"))
        figs.append(Figure("worst path vs ceiling", f"{w.variant} {fmt(w.value, '%')}", f"{w.experiment} {w['shape']}"))
    err = rows(df, experiment="correctness", metric="max_abs_err")
    if len(err):
        figs.append(Figure("largest error vs float64", fmt(err.value.max()), f"{len(err)} checks"))
    return figs
