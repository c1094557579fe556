"""Lab 05's sections that ask for the MMDiT's ``memory_formula`` (and ``fsdp_check``) capability:
the hooks against the analytic formula, bytes per token per block, the presets' accounting by
class, the what-fits projection to large shapes, the FSDP projection and its check on gloo, and on
CUDA the projection confirmed by bisecting a real step to its out-of-memory edge.  On a step that
does not declare them the notebook leaves these cells out (``%%needs``)."""

from __future__ import annotations

import holoviews as hv
import pandas as pd
import torch

from lab_utils import memory as mem
from lab_utils.core.dtypes import parse_dtype
from lab_utils.core.plots import init
from lab_utils.core.records import Recorder
from lab_utils.model import build_model, resolve_config
from lab_utils.step.contract import StepFactory
from lab_utils.studies.memory import GB, MemoryLabConfig, sh_str


def formula_check(cfg: MemoryLabConfig, step: StepFactory) -> pd.DataFrame:
    """The hooks against the analytic model of the step's ``memory_formula`` for every formula
    policy at the lab's step shape, on CPU (where the formula is exact: the lab's own step there,
    else the same MMDiT built on CPU); a mismatch raises.  One row per policy."""
    shape = step.capabilities["memory_formula"]
    mcfg, sh = shape.cfg, mem.step_shape(shape.cfg, shape.batch, shape.height, shape.width, shape.txt_len)
    rows = []
    for pol in mem.FORMULA_POLICIES:
        if step.device.type == "cpu":
            meas = mem.measure_saved(step, pol)
        else:  # CUDA keeps LayerNorm statistics in float32: the formula's exact case is the CPU's
            meas = mem.mmdit_saved(mcfg, sh, shape.dtype, pol, seed=cfg.seed)
        form = mem.saved_bytes_formula(mcfg, sh, shape.dtype, pol)
        if meas.by_region() != form:
            raise AssertionError(f"policy {pol!r}: hooks {meas.by_region()} != formula {form}")
        rows.append(
            dict(policy=pol, saved_tensors=len(meas.tensors), hooks_bytes=meas.total, formula_bytes=sum(form.values()))
        )
    return pd.DataFrame(rows)


def accounting(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Per preset x dtype x policy: bytes per class at ``account_resolution`` (state from the
    model on meta, activations from the formula, transient from its model), batch 1."""
    rows = []
    for preset in cfg.account_presets:
        mcfg = resolve_config(preset)
        sh = mem.step_shape(mcfg, 1, cfg.account_resolution, cfg.account_resolution, cfg.account_txt_len)
        for dt in cfg.account_dtypes:
            st = mem.state_totals(mcfg, dt)
            for pol in mem.FORMULA_POLICIES:
                peak = mem.predicted_peak(mcfg, sh, dt, pol, state=st)
                row = dict(
                    preset=preset, dtype=dt, policy=pol, **{k: peak[k] for k in mem.CLASSES}, total=peak["total"]
                )
                rows.append(row)
                for k in (*mem.CLASSES, "total"):
                    rec.add("accounting", pol, f"{k}_bytes", peak[k], "B", shape=sh_str(sh), dtype=dt, preset=preset)
    return pd.DataFrame(rows)


def per_token_table(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Bytes per token per block at ``account_resolution`` (image tokens) + ``account_txt_len``
    (text tokens), batch 1, no checkpointing, CUDA's float32 LayerNorm statistics."""
    rows = []
    for preset in cfg.account_presets:
        mcfg = resolve_config(preset)
        sh = mem.step_shape(mcfg, 1, cfg.account_resolution, cfg.account_resolution, cfg.account_txt_len)
        for dt in cfg.account_dtypes:
            for kind in ("double", "single"):
                v = mem.bytes_per_token_per_block(mcfg, dt, kind, sh.img_tokens, sh.txt_tokens, device_type="cuda")
                rows.append(dict(preset=preset, dtype=dt, block=kind, bytes_per_token=round(v, 1)))
                rec.add(
                    "per_token",
                    kind,
                    "bytes_per_token_per_block",
                    v,
                    "B/token",
                    dtype=dt,
                    preset=preset,
                    tokens=f"{sh.img_tokens}+{sh.txt_tokens}",
                    layernorm_stats="float32 (CUDA)",
                )
    return pd.DataFrame(rows)


def block_state_table(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Parameter/gradient/optimizer bytes per region of the lab's preset (built on meta)."""
    model = build_model(cfg.preset, device="meta", dtype=parse_dtype("dtype", cfg.dtype))
    df = pd.DataFrame([dict(region=k, **v) for k, v in mem.state_bytes(model).items()])
    for r in df.itertuples():
        rec.add("state", r.region, "parameters_bytes", r.parameters, "B", dtype=cfg.dtype, preset=cfg.preset)
    return df


def class_bars(df: pd.DataFrame, dtype: str = "bfloat16"):
    """Stacked bytes per class for each preset x policy (GB), one frame per preset."""
    init()
    frames = {}
    for preset, g in df[df.dtype == dtype].groupby("preset", sort=False):
        long = g.melt(id_vars=["policy"], value_vars=list(mem.CLASSES), var_name="class", value_name="bytes")
        long["GB"] = long.bytes / GB
        frames[preset] = hv.Bars(long, ["policy", "class"], "GB").opts(
            stacked=True,
            xrotation=45,
            title=f"{preset} · {dtype} · batch 1: bytes per class",
            tools=["hover"],
            legend_position="right",  # beside the axes: inside, it covered the tallest stacks
            width=760,
        )
    return hv.HoloMap(frames, kdims=["preset"])


def formula_fits(cfg: MemoryLabConfig, rec: Recorder, presets=("medium", "flux-dev"), dtype="bfloat16") -> pd.DataFrame:
    """Largest batch per square resolution that the predicted peak fits in ``device_bytes``."""
    rows = []
    for preset in presets:
        mcfg = resolve_config(preset)
        for pol in mem.FORMULA_POLICIES:
            for r in mem.what_fits(mcfg, dtype, pol, cfg.device_bytes, cfg.fit_resolutions, cfg.account_txt_len):
                rows.append(r)
                rec.add(
                    "what_fits",
                    pol,
                    "max_batch",
                    r["max_batch"],
                    "samples",
                    shape=f"{r['resolution']}px",
                    dtype=dtype,
                    preset=preset,
                    device_bytes=cfg.device_bytes,
                )
    return pd.DataFrame(rows)


def fits_table(df: pd.DataFrame) -> pd.DataFrame:
    return df.pivot_table(index=["preset", "policy"], columns="resolution", values="max_batch").astype(int)


def fsdp_projection(cfg: MemoryLabConfig, rec: Recorder, preset: str = "flux-dev", dtype: str = "bfloat16"):
    """Per-rank predicted peak at 1024 px, batch 1, for N GPUs (state sharded as ``fully_shard``
    allocates it on the fullest rank, padding included; activations not sharded), and the
    fewest GPUs each policy needs."""
    mcfg = resolve_config(preset)
    sh = mem.step_shape(mcfg, 1, cfg.account_resolution, cfg.account_resolution, cfg.account_txt_len)
    rows = []
    for pol in mem.FORMULA_POLICIES:
        need = mem.gpus_needed(mcfg, sh, dtype, pol, cfg.device_bytes)
        row = dict(policy=pol, gpus_needed=need)
        for n in cfg.fsdp_gpus:
            row[f"{n} GPUs (GB)"] = round(mem.predicted_peak(mcfg, sh, dtype, pol, shards=n)["total"] / GB, 1)
        rows.append(row)
        rec.add(
            "fsdp",
            pol,
            "gpus_needed",
            need if need else float("nan"),
            "GPUs",
            shape=sh_str(sh),
            dtype=dtype,
            preset=preset,
            device_bytes=cfg.device_bytes,
        )
    return pd.DataFrame(rows)


def fsdp_check(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Real fully_shard AdamW steps on gloo at every world size (one spawn): per-rank bytes
    fully_shard allocates (padded parameter and gradient shards), the bytes each rank holds,
    and every parameter's shard against the projection (a mismatch raises)."""
    rows = mem.run_fsdp(cfg.fsdp_preset, cfg.fsdp_world_sizes)
    for r in rows:
        ws = r["world_size"]
        bad = mem.fsdp_mismatches(r)
        if bad:
            raise AssertionError(f"world_size={ws} rank {r['rank']}: " + "; ".join(bad[:5]))
        for k in mem.FSDP_FIGURES:
            rec.add("fsdp_check", f"ws{ws}-rank{r['rank']}", f"{k}_bytes", r[k], "B", preset=cfg.fsdp_preset)
    return pd.DataFrame(rows).drop(columns=["params", "projected_params"])


def confirm_fits(cfg: MemoryLabConfig, rec: Recorder, preset: str = "medium", resolution: int = 1024) -> pd.DataFrame:
    """On CUDA: bisect the batch of a real step to the OOM edge per policy (an OOM is caught,
    recorded, and the search goes on); beside it the prediction.  The step holds the state the
    prediction counts (bf16 weights and gradients, fp32 master weights and AdamW moments:
    ``state_bytes``, equal to the predicted state).  Empty on CPU."""
    if not (cfg.confirm_fit and torch.cuda.is_available()):
        return pd.DataFrame()
    rows = []
    mcfg = resolve_config(preset)
    for pol in ("none", "full", "selective"):
        pred = mem.what_fits(mcfg, "bfloat16", pol, cfg.device_bytes, (resolution,), cfg.account_txt_len)[0]
        fit = mem.bisect_fit(mcfg, pol, resolution, cfg.account_txt_len, hi=max(2 * pred["max_batch"], 2))
        rows.append(
            dict(
                policy=pol,
                predicted=pred["max_batch"],
                measured=fit.edge,
                ooms=fit.ooms,
                state_bytes=sum(fit.state.values()),
                predicted_state_bytes=sum(mem.state_totals(mcfg, "bfloat16").values()),
            )
        )
        rec.add(
            "what_fits",
            pol,
            "max_batch_measured",
            fit.edge,
            "samples",
            shape=f"{resolution}px",
            preset=preset,
            ooms=fit.ooms,
            optimizer="AdamW, fp32 master weights and moments (MasterAdamW)",
        )
    return pd.DataFrame(rows)
