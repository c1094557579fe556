"""Memory lab: the analytic model equals the saved-tensor hooks exactly, every AC policy's
gradients equal no checkpointing, FSDP per-rank bytes equal the projection, bad input is
refused before work starts."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from lab_utils import memory as mem
from lab_utils.core.config import ConfigError
from lab_utils.core.timing import BenchFailure
from lab_utils.memory.saved import measure_saved
from lab_utils.model import ACTIVATION_CHECKPOINTS, build_model, resolve_config
from lab_utils.model.checkpointing import block_policy
from lab_utils.step.load import DEFAULT_STEP, load_step
from lab_utils.step.mmdit import synthetic_step
from lab_utils.studies import memory as study
from lab_utils.studies import memory_formula as formula
from lab_utils.studies.memory import MemoryLabConfig

# Irregular step shapes: a 4x5 token grid, odd text length, batch 3 (seeded below).
SHAPES = {"tiny": mem.StepShape(3, 20, 7), "small": mem.StepShape(2, 12, 5)}
#: the lab's step for the table tests (its policies' runs are faked there)
STEP = synthetic_step("tiny", batch_size=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_formula_equals_hooks_every_policy(preset, dtype):
    cfg, sh = resolve_config(preset), SHAPES[preset]
    for policy in mem.FORMULA_POLICIES:
        measured = mem.mmdit_saved(cfg, sh, dtype, policy, seed=0).by_region()
        assert measured == mem.saved_bytes_formula(cfg, sh, dtype, policy), (preset, dtype, policy)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "sh",
    [mem.StepShape(3, 20, 1), mem.StepShape(3, 1, 7), mem.StepShape(2, 1, 1), mem.StepShape(1, 20, 1)],
    ids=["one-text-token", "one-image-token", "one-token-each", "batch1-one-text-token"],
)
def test_formula_counts_a_one_token_stream(sh, dtype):
    """A one-token stream's slice of the joint attention output is a view (batch > 1): it keeps
    the whole output alive, which the formula counts."""
    cfg = resolve_config("tiny")
    for policy in ("none", "every_other"):  # every block kept; kept and recomputed blocks mixed
        measured = mem.mmdit_saved(cfg, sh, dtype, policy, seed=0).by_region()
        assert measured == mem.saved_bytes_formula(cfg, sh, dtype, policy), (sh, dtype, policy)


def test_lab_formula_check_with_one_text_token(monkeypatch):
    """The lab accepts txt_len=1; its formula check (every policy) passes there, measured on the
    lab's own step (on CPU no second MMDiT is built for it)."""
    cfg = MemoryLabConfig(txt_len=1, batch_size=2, resolution=32)
    step = load_step(DEFAULT_STEP, lab=cfg, check=False)
    probed = []
    monkeypatch.setattr(mem, "mmdit_saved", lambda *a, **k: pytest.fail("a second MMDiT built for the check"))
    monkeypatch.setattr(mem, "measure_saved", lambda s, p: probed.append(s) or measure_saved(s, p))
    df = formula.formula_check(cfg, step)
    assert list(df.policy) == list(mem.FORMULA_POLICIES) and (df.hooks_bytes == df.formula_bytes).all()
    assert probed == [step] * len(mem.FORMULA_POLICIES)


@pytest.mark.parametrize("depths", [dict(depth_double=0), dict(depth_single=0), dict(depth_double=1, depth_single=1)])
def test_formula_without_a_block_kind(depths):
    """With no double-stream block the img_in / txt_in outputs are only concatenated, never kept."""
    cfg, sh = resolve_config("tiny", **depths), mem.StepShape(3, 20, 7)
    for policy in mem.FORMULA_POLICIES if cfg.depth_double == 0 else ("none", "full", "offload"):
        measured = mem.mmdit_saved(cfg, sh, "float32", policy, seed=0).by_region()
        assert measured == mem.saved_bytes_formula(cfg, sh, "float32", policy), (depths, policy)
    if cfg.depth_double == 0:
        assert "img_in" not in measured and "txt_in" not in measured


def test_bytes_per_token_flux_dev_pinned():
    """flux-dev, 1024 px (4096 image + 512 text tokens), bf16, CUDA's float32 LayerNorm
    statistics: the figures an independent count gave."""
    flux = resolve_config("flux-dev")
    assert round(mem.bytes_per_token_per_block(flux, "bfloat16", "double"), 1) == 168_264.0
    assert round(mem.bytes_per_token_per_block(flux, "bfloat16", "single"), 1) == 155_950.7
    # the same step, block by block: total saved bytes over 4608 tokens
    sh = mem.StepShape(1, 4096, 512)
    single = mem.single_block_bytes(flux, sh, 2, 4)
    assert mem.bytes_per_token_per_block(flux, "bfloat16", "single") == sum(single.values()) / 4608
    # CPU statistics (bf16) are smaller: 2 LayerNorms x 2 stats x 2 B less per token
    cpu = mem.bytes_per_token_per_block(flux, "bfloat16", "single", device_type="cpu")
    assert mem.bytes_per_token_per_block(flux, "bfloat16", "single") - cpu == 4.0
    with pytest.raises(ConfigError, match="kind"):
        mem.bytes_per_token_per_block(flux, "bfloat16", "triple")


def test_lab_per_token_table_says_what_it_computes():
    cfg = MemoryLabConfig(account_presets=("flux-dev",), account_dtypes=("bfloat16",))
    rec = study.recorder(cfg)
    df = formula.per_token_table(cfg, rec)
    assert df.bytes_per_token.tolist() == [168_264.0, 155_950.7]
    extra = [json.loads(x) for x in rec.frame().extra]
    assert {(x["tokens"], x["layernorm_stats"]) for x in extra} == {("4096+512", "float32 (CUDA)")}


def test_a_policy_on_the_mmdits_step_runs_through_its_seam_and_is_undone():
    """measure_saved applies a policy through the step's own seam (the MMDiT's block runners) for
    the one forward it measures, and leaves the step's model as it was."""
    cfg, sh = resolve_config("tiny"), mem.StepShape(1, 4, 2)
    step = synthetic_step(cfg, batch_size=1, height=32, width=32, txt_len=2)
    own = mem.measure_saved(step, "none").by_region()
    assert own == mem.saved_bytes_formula(cfg, sh, "float32", "none")
    got = mem.measure_saved(step, "full").by_region()
    assert got == mem.saved_bytes_formula(cfg, sh, "float32", "full") != own
    assert step.model.activation_checkpoint.name == "none" and not step.model.block_runners
    assert mem.policies_of(step) == tuple(ACTIVATION_CHECKPOINTS)  # its own seam: double, single too
    with pytest.raises(ConfigError, match="activation_checkpoint"):
        mem.measure_saved(step, "sometimes")


def test_offload_on_cpu_is_labelled_as_device_bytes(monkeypatch):
    """On a CPU save_on_cpu moves nothing: the offload row says its saved bytes are what it
    would keep on a GPU, not memory freed here (the lab's table and its records)."""
    failed = BenchFailure("step", "budget", "not timed in this test")
    fake = [mem.PolicyResult(p, 4, 100, 200, 1.0, failed, True, mem.acts_on(p, "cpu")) for p in ("none", "offload")]
    monkeypatch.setattr(mem, "compare_policies", lambda *a, **k: fake)  # the policies' runs: not under test
    cfg = MemoryLabConfig(activation_checkpoints=("none", "offload"), device="cpu")
    rec = study.recorder(cfg)
    df = study.compare(cfg, STEP, rec).set_index("policy")
    assert not df.loc["offload", "acts_here"] and df.loc["none", "acts_here"]
    assert "moves nothing" in df.loc["offload", "saved_bytes_are"]
    assert "moves nothing" not in df.loc["none", "saved_bytes_are"]
    f = rec.frame()
    extra = json.loads(f[(f.variant == "offload") & (f.metric == "saved_bytes")].extra.item())
    assert "would keep on a GPU" in extra["method"]
    assert "on the device" in study.saved_means("offload", torch.device("cuda"))


def test_views_share_storage_and_parameters_are_not_activations():
    model = build_model("tiny")
    x = torch.randn(5, 64, requires_grad=True)  # made outside the probe: region "input"
    with mem.saved_tensor_probe(model) as rep:
        y = model.img_in.weight[:, :4].sum() + (x[1:] * x[:-1]).sum()  # views of x saved twice
    del y
    keys = [t for t in rep.tensors if t.region == "input"]
    assert len(keys) == 1 and keys[0].nbytes == 5 * 64 * 4  # one storage, counted once; weight skipped


def test_formula_extrapolates_on_meta():
    """flux-dev-width blocks measured on meta (no memory): the block terms the formula and
    hooks share; meta runs attention through the math path, so full checkpointing is compared."""
    cfg = resolve_config("flux-dev", depth_double=1, depth_single=1)
    sh = mem.StepShape(1, 64, 16)
    got = mem.mmdit_saved(cfg, sh, "bfloat16", "full", device="meta").by_region()
    want = mem.saved_bytes_formula(cfg, sh, "bfloat16", "full", device_type="cuda")
    assert got == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_policy_gradients_equal_no_checkpointing(dtype):
    seed = 1234
    print("seed", seed)
    cfg, sh = resolve_config("tiny"), SHAPES["tiny"]
    h, w = mem.pixels_of(cfg, sh)
    step = synthetic_step(cfg, batch_size=sh.batch, height=h, width=w, txt_len=sh.txt_tokens, dtype=dtype, seed=seed)
    ref = mem.grads_of(step, "none")
    for policy in mem.FORMULA_POLICIES:
        assert not mem.grad_mismatch(ref, mem.grads_of(step, policy), dtype), policy


def test_block_policy_choices():
    assert [block_policy("every_other", "single", i) for i in range(4)] == [True, False, True, False]
    assert block_policy("double", "double", 3) and not block_policy("double", "single", 0)
    with pytest.raises(ConfigError, match="checkpoint"):
        block_policy("sometimes", "double", 0)
    with pytest.raises(ConfigError, match="checkpoint"):
        resolve_config("tiny", activation_checkpoint="sometimes")


def test_fsdp_projection_shards_rows():
    model = build_model("tiny", device="meta")
    whole = mem.fsdp_rank_state(model, 1)
    parts = [mem.fsdp_rank_state(model, 3, r) for r in range(3)]  # 3 does not divide every row count
    assert sum(p["optimizer"] for p in parts) == whole["optimizer"]  # moments: the rows held
    for k in ("parameters", "gradients"):  # padded shards: every rank allocates rank 0's size
        assert parts[0][k] == parts[2][k] and 3 * parts[0][k] > whole[k]
    assert whole == {k: v for k, v in mem.state_totals(resolve_config("tiny"), "float32").items()}


def test_what_fits_and_gpus_needed():
    cfg = resolve_config("medium")
    rows = mem.what_fits(cfg, "bfloat16", "full", mem.H200_BYTES, (512, 1024))
    assert rows[0]["max_batch"] >= rows[1]["max_batch"] > 0
    flux = resolve_config("flux-dev")
    sh = mem.step_shape(flux, 1, 1024, 1024, 512)
    assert mem.gpus_needed(flux, sh, "bfloat16", "full", mem.H200_BYTES) > 1  # AdamW state alone exceeds 141 GB
    with pytest.raises(ConfigError, match="device_memory_gb"):
        mem.what_fits(cfg, "bfloat16", "full", 0)


@pytest.mark.parametrize(
    "bad, param",
    [
        (dict(activation_checkpoints=["none", "often"]), "activation_checkpoints"),
        (dict(inspect_block="single_blocks.9"), "inspect_block"),
        (dict(device_memory_gb=-1.0), "device_memory_gb"),
        (dict(dtype="int8"), "dtype"),
        (dict(resolution=100), "resolution"),
    ],
)
def test_bad_input_names_the_parameter(bad, param):
    with pytest.raises(ConfigError) as e:
        MemoryLabConfig(**bad)
    assert e.value.param == param


def test_downsample_keeps_the_peak():
    df = pd.DataFrame({"time_ms": range(10_000), "activations": [i % 977 for i in range(10_000)]})
    df.loc[4321, "activations"] = 10**6
    d = mem.downsample(df, 100)
    assert len(d) <= 100 and d.activations.max() == 10**6


def test_cuda_trace_categories():
    """The snapshot categorizer on a hand-made trace: an activation freed in the backward, a
    temporary, a gradient allocated at an address an activation used before."""
    ev = lambda action, addr, size, t: dict(action=action, addr=addr, size=size, time_us=t)  # noqa: E731
    snap = {
        "device_traces": [
            [
                ev("alloc", 100, 64, 0),  # activation
                ev("alloc", 200, 32, 1),  # activation, freed in the backward, address reused by a gradient
                ev("alloc", 999, 512, 2),  # the end-of-forward marker
                ev("free_completed", 200, 32, 3),
                ev("alloc", 300, 16, 4),  # temporary
                ev("alloc", 200, 32, 5),  # gradient
                ev("free_completed", 300, 16, 6),
            ]
        ]
    }
    df = mem.categorize_trace(snap, {200: "gradients"}, marker=999, param_bytes=1000)
    assert df.parameters.eq(1000).all()
    assert df.activations.tolist() == [64, 96, 96, 64, 64, 64, 64]
    assert df.temporaries.tolist() == [0, 0, 512, 512, 528, 528, 512]
    assert df.gradients.tolist() == [0, 0, 0, 0, 0, 32, 32]


PARETO_ROWS = pd.DataFrame(
    [
        # policy, time, peak, stable: on CPU, offload moves nothing and is the fastest
        dict(policy="none", time_ms=10.0, peak_bytes=900, stable=True, device="cpu"),
        dict(policy="full", time_ms=14.0, peak_bytes=300, stable=True, device="cpu"),
        dict(policy="selective", time_ms=12.0, peak_bytes=950, stable=True, device="cpu"),  # behind none
        dict(policy="double", time_ms=11.0, peak_bytes=200, stable=False, device="cpu"),  # would dominate
        dict(policy="single", time_ms=float("nan"), peak_bytes=100, stable=False, device="cpu"),  # failed
        dict(policy="offload", time_ms=5.0, peak_bytes=900, stable=True, device="cpu"),
    ]
)


def test_pareto_front_leaves_out_unstable_timings_and_policies_that_do_not_act():
    d = study.pareto_front(PARETO_ROWS).set_index("policy")
    assert set(d.index[d.mark == study.FRONT]) == {"none", "full"}
    assert d.loc["selective", "mark"] == study.BEHIND
    assert d.loc["double", "mark"] == d.loc["single", "mark"] == study.UNSTABLE
    assert d.loc["offload", "mark"] == "does not act on cpu"
    on_gpu = study.pareto_front(PARETO_ROWS.assign(device="cuda")).set_index("policy")
    assert set(on_gpu.index[on_gpu.mark == study.FRONT]) == {"offload", "full"}, "offload acts on a GPU"
    noise = study.pareto_front(PARETO_ROWS.assign(stable=False))
    assert set(noise.mark) == {study.UNSTABLE, "does not act on cpu"}, "no stable point: an empty front"
    other = study.pareto_front(PARETO_ROWS.assign(shape=["a", "b", "a", "a", "a", "a"]), step="a")
    assert other.set_index("policy").loc["full", "mark"] == "another step shape"


def _layers(plot):
    return {el.label: el for el in plot if el.label}, plot.opts.get().kwargs["title"]


def test_pareto_plot_marks_the_points_and_draws_no_front_through_noise():
    import holoviews as hv

    layers, title = _layers(study.pareto_plot(PARETO_ROWS))
    assert set(layers) == {study.FRONT, study.BEHIND, study.UNSTABLE, "does not act on cpu"}
    assert isinstance(layers[study.FRONT], hv.Curve) and list(layers[study.FRONT].data.policy) == ["none", "full"]
    unstable = layers[study.UNSTABLE]
    assert isinstance(unstable, hv.Scatter)
    assert sorted(unstable.data.policy) == ["double", "single"]
    assert unstable.opts.get().kwargs["marker"] != "circle"
    assert "dashed: Pareto front of the stable timings" in title
    layers, title = _layers(study.pareto_plot(PARETO_ROWS.assign(stable=False)))
    assert not any(isinstance(el, hv.Curve) for el in layers.values()) and "no Pareto front drawn" in title
    hv.renderer("bokeh").get_plot(study.pareto_plot(PARETO_ROWS))


def test_lab_table_carries_stability_and_device(monkeypatch):
    failed = BenchFailure("step", "budget", "not timed in this test")
    fake = [mem.PolicyResult(p, 4, 100, 200, 1.0, failed, True, mem.acts_on(p, "cpu")) for p in ("none", "offload")]
    monkeypatch.setattr(mem, "compare_policies", lambda *a, **k: fake)
    cfg = MemoryLabConfig(activation_checkpoints=("none", "offload"), device="cpu")
    df = study.compare(cfg, STEP, study.recorder(cfg))
    assert list(df.stable) == [False, False] and set(df.device) == {"cpu"}
    assert (study.pareto_front(df).mark != study.FRONT).all()


def test_gpu_set_is_read_from_the_lab_yaml():
    g = study.gpu_set()
    assert g["device"] == "cuda" and g["resolution"] == 1024 and g["preset"] == "medium"


def test_the_takeaway_reads_lab_05s_own_records():
    """The headline from records alone: the peak without checkpointing, the lowest peak of a policy
    that acts here (offload on a CPU, whose saved bytes move nothing, is not it), what fits the
    device named in the row, the extrapolated batch with its thousands separated."""
    mib = 2**20
    offload = json.dumps({"method": "save_on_cpu moves nothing on a CPU: bytes it would keep on a GPU"})
    df = pd.DataFrame(
        [
            dict(experiment="policies", variant="none", metric="peak_bytes", value=3 * mib, extra=""),
            dict(experiment="policies", variant="full", metric="peak_bytes", value=1.5 * mib, extra=""),
            dict(experiment="policies", variant="offload", metric="peak_bytes", value=1.0 * mib, extra=""),
            dict(experiment="policies", variant="offload", metric="saved_bytes", value=4096, extra=offload),
            dict(experiment="step_fits", variant="b16", metric="max_batch", value=16,
                 extra=json.dumps({"device": "an H200, 141 GB"})),
            dict(experiment="step_fits", variant="b16", metric="max_batch_extrapolated", value=149619, extra=""),
        ]
    )  # fmt: skip
    got = [str(f) for f in study.headline(df)]
    assert got == [
        "peak memory, no checkpointing: 3 MiB (measured)",
        "lowest peak: full 1.5 MiB",
        "what fits an H200, 141 GB: batch 16 (about 149,619 extrapolated) (measured on real steps)",
    ], got
