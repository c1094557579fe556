"""Lab 03's explorer: a mask (and its parameters), a path and a sequence length -> the mask
picture, its density, correctness against float64 and the time.

The mask is ``masks.make_mask`` (the lab's named masks; window, document count and valid
text tokens are the controls), its density the mask-aware FLOP count
(``masks.attention_flops``), correctness ``attention.check_path`` (forward and, with a
backward, dq/dk/dv against the float64 reference), the time the lab's one primitive over
``attention.attend``.  A path that cannot honour the problem (a mask it does not support,
a device it does not run on) says why.  Triton on CPU runs in the interpreter: checked,
never timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import holoviews as hv
import pandas as pd
import torch

from lab_utils.attention.attend import PATHS, attend, attention_bytes, check_path, get_path, random_qkv
from lab_utils.attention.masks import MASK_NAMES, attention_flops, dense_mask, make_mask
from lab_utils.core.ceilings import Ceilings
from lab_utils.core.device import pick_device
from lab_utils.core.timing import try_bench
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result, Unavailable, explored_scatter

SEQ_LENS = (64, 127, 256, 512, 1024)
WINDOWS = (8, 32, 128)
DOCS = (2, 3, 5)
TEXT_VALID = ("100%", "75%", "25%")
HEADS, HEAD_DIM = 4, 64
PICTURE_MAX = 128  # the mask picture is max-pooled to at most this many pixels a side
NOT_TIMED = "Triton on CPU runs in the interpreter: correctness only, never timed"


@dataclass
class AttentionExplorer(Explorer):
    """``AttentionExplorer(rec, ceilings=ceilings).show()``."""

    ceilings: Ceilings | None = None
    device: str = "auto"
    reps: int = 8

    lab: ClassVar[str] = "03_attention"
    title: ClassVar[str] = "Explore: one mask on one attention path"
    live_help: ClassVar[str] = (
        "pick mask, its parameters, path and length: picture, density, check against float64, time"
    )
    controls: ClassVar[tuple[Control, ...]] = (
        Control("mask", MASK_NAMES, "sliding_window"),
        Control("window", WINDOWS, 32, "window (sliding_window)"),
        Control("docs", DOCS, 3, "documents (document)"),
        Control("text_valid", TEXT_VALID, "75%", "valid text (mmdit)"),
        Control("path", PATHS, "sdpa"),
        Control("seq_len", SEQ_LENS, 256, "tokens"),
        Control("dtype", ("float32", "bfloat16"), "float32"),
        Control("direction", ("fwd", "fwd+bwd"), "fwd"),
    )

    def __post_init__(self):
        super().__post_init__()
        self.dev = pick_device(self.device)

    def label(self, cfg: dict) -> str:
        m = cfg["mask"]
        detail = {"sliding_window": f" w{cfg['window']}", "document": f" {cfg['docs']} docs"}.get(m, "")
        if m == "mmdit":
            detail = f" text {cfg['text_valid']}"
        return f"{m}{detail} {cfg['path']} L{cfg['seq_len']} {cfg['dtype']} {cfg['direction']}"

    def make(self, cfg: dict):
        L = cfg["seq_len"]
        txt = max(1, L // 8)
        valid = max(1, round(txt * int(cfg["text_valid"].rstrip("%")) / 100))
        return make_mask(cfg["mask"], L, window=cfg["window"], n_docs=cfg["docs"], txt_len=txt, txt_valid=valid)

    def measure(self, cfg: dict, progress: Progress) -> Result:
        L, path, dt = cfg["seq_len"], cfg["path"], getattr(torch, cfg["dtype"])
        backward = cfg["direction"] != "fwd"
        progress(0, 3, f"building the {cfg['mask']} mask")
        mask = self.make(cfg)
        dense = dense_mask(mask, 1, 1, L, L)[0, 0].float()
        pool = max(1, math.ceil(L / PICTURE_MAX))
        picture = torch.nn.functional.max_pool2d(dense[None, None], pool, ceil_mode=True)[0, 0] if pool > 1 else dense
        fl = attention_flops(mask, 1, HEADS, L, L, HEAD_DIM)
        progress(1, 3, f"checking {path} against float64")
        inputs = random_qkv(1, HEADS, L, HEAD_DIM, dtype=dt, device=self.dev, seed=0)
        checks = check_path(path, inputs, mask=mask, backward=backward)
        if all(c.ok is None for c in checks):
            raise Unavailable(checks[0].note)
        bad = [c for c in checks if c.ok is False]
        verdict = "ok" if not bad else f"FAIL: {bad[0].tensor}: {bad[0].note}"
        skipped = [c for c in checks if c.ok is None]
        shape = f"B1xH{HEADS}xL{L}xD{HEAD_DIM}"
        extra = dict(mask=mask.name, seq_len=L, head_dim=HEAD_DIM, direction=cfg["direction"], seed=0)
        self.rec.add("explore", path, "check_ok", float(not bad), "bool", shape=shape, dtype=dt, **extra)
        self.rec.add("explore", path, "density", fl.density, "", shape=shape, dtype=dt, **extra)
        row = dict(
            mask=mask.name,
            path=path,
            seq_len=L,
            dtype=cfg["dtype"],
            direction=cfg["direction"],
            density=fl.density,
            check=verdict + (f" (gradients skipped: {skipped[0].note})" if skipped else ""),
            time_ms=math.nan,
            tflops=math.nan,
            note="",
        )
        if get_path(path).kind == "triton" and self.dev.type == "cpu":
            row["note"] = NOT_TIMED
            return Result(0, cfg, row, data=dict(picture=picture.numpy(), L=L))
        progress(2, 3, f"timing {path}")
        q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
        timed_bwd = backward and not skipped

        if not timed_bwd:  # a forward-only path (flex on CPU) refuses inputs that require grad
            q, k, v = (t.detach() for t in (q, k, v))

        def step():
            if not timed_bwd:
                with torch.no_grad():
                    return attend(q, k, v, path=path, mask=mask)
            return torch.autograd.grad(attend(q, k, v, path=path, mask=mask), (q, k, v), do)

        t = try_bench(step, name=f"attention/{path}", device=self.dev, reps=self.reps, budget_s=10, check_finite=True)
        flops = fl.fwd_bwd if timed_bwd else fl.fwd
        nbytes = attention_bytes(1, HEADS, L, L, HEAD_DIM, dt, backward=timed_bwd)
        self.rec.add_timing(
            "explore", path, t, shape=shape, dtype=dt, bytes=nbytes, flops=flops, ceilings=self.ceilings, **extra
        )
        progress(3, 3, "timed")
        if getattr(t, "ok", False):
            row.update(time_ms=t.median_ms, tflops=flops / (t.median_ms * 1e-3) / 1e12)
            row["note"] = "" if t.stability.stable else "unstable"
        else:
            row["note"] = f"not timed: {t.reason}"
        return Result(0, cfg, row, data=dict(picture=picture.numpy(), L=L))

    def figures(self, results: list[Result]) -> list:
        if results:
            last = results[-1]
            L = last.data["L"]
            img = hv.Image(last.data["picture"][::-1], bounds=(0, 0, L, L), kdims=["key", "query"])
            title = f"Mask #{last.index}: {last.row['mask']} (density {last.row['density']:.3f}; white = attends)"
        else:
            img, title = hv.Image(torch.zeros(2, 2).numpy(), bounds=(0, 0, 1, 1), kdims=["key", "query"]), "Mask"
        img = img.opts(
            cmap="gray", title=title, width=380, height=380, framewise=True, colorbar=False, invert_yaxis=True
        )
        df = pd.DataFrame(
            [
                dict(
                    label=f"#{r.index} {self.label(r.config)}", **{k: r.row[k] for k in ("density", "time_ms", "check")}
                )
                for r in results
                if not math.isnan(r.row["time_ms"])
            ],
            columns=["label", "density", "time_ms", "check"],
        )
        pts = explored_scatter(
            df,
            "density",
            ["time_ms", "label", "check"],
            xlabel="mask density (allowed pairs / L²)",
            ylabel="ms",
            title="Time vs density of the explored cases",
            framewise=True,
            width=480,
        )
        return [img, pts]
