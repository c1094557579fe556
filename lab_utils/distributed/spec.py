"""What one distributed run does: :class:`DistConfig`, validated before any process starts.

A strategy is a ``+``-joined set of components applied to the MMDiT on one
:class:`~torch.distributed.device_mesh.DeviceMesh` of shape
``(dp_replicate, dp_shard, cp, tp)``:

* at most one data-parallel wrapper: ``ddp`` (replicate), ``fsdp`` (FSDP2, shard),
  ``hsdp`` (FSDP2 on a 2-D replicate x shard mesh);
* ``tp``: tensor parallelism (QKV / fc1 / linear1 column-wise, out / fc2 / linear2 row-wise);
  ``sp`` adds sequence parallelism for the norms and modulation (with ``tp`` only);
* at most one context-parallel scheme: ``cp_ring`` (ring attention over sequence shards)
  or ``cp_ulysses`` (all-to-all head/sequence exchange).

``single`` is the one-process baseline every strategy is compared with.  Degrees left
at 0 are derived: the only non-data component takes the whole world, otherwise 2.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from lab_utils.core.config import ConfigError, LabConfig, check_bool, check_choice, check_float, check_int
from lab_utils.model import ACTIVATION_CHECKPOINTS, PRESETS, resolve_config

DP_COMPONENTS = ("ddp", "fsdp", "hsdp")
CP_COMPONENTS = ("cp_ring", "cp_ulysses")
COMPONENTS = (*DP_COMPONENTS, "tp", "sp", *CP_COMPONENTS)
BACKENDS = ("auto", "gloo", "nccl")
FAULTS = ("none", "raise", "hang", "kill")  # kill: the rank sends itself SIGKILL (as the OOM killer would)
OPTIMIZERS = ("adamw", "sgd")
#: Strategies the lab runs by default (world size 2 on CPU); any composition of COMPONENTS is accepted.
STRATEGIES = ("single", "ddp", "fsdp", "hsdp", "tp", "tp+sp", "cp_ring", "cp_ulysses", "fsdp+tp", "fsdp+cp_ring")


def components(strategy: str) -> tuple[str, ...]:
    """The components of a strategy name; unknown names are a ConfigError naming ``strategy``."""
    if not isinstance(strategy, str) or not strategy:
        raise ConfigError("strategy", strategy, "a strategy name such as 'fsdp' or 'fsdp+cp_ring'")
    if strategy == "single":
        return ()
    parts = tuple(strategy.split("+"))
    for p in parts:
        if p not in COMPONENTS:
            raise ConfigError(
                "strategy", strategy, f"'single' or '+'-joined components from {', '.join(COMPONENTS)} ({p!r} is not)"
            )
    if len(set(parts)) != len(parts):
        raise ConfigError("strategy", strategy, "each component at most once")
    if sum(p in DP_COMPONENTS for p in parts) > 1:
        raise ConfigError("strategy", strategy, f"at most one of {', '.join(DP_COMPONENTS)}")
    if sum(p in CP_COMPONENTS for p in parts) > 1:
        raise ConfigError("strategy", strategy, f"at most one of {', '.join(CP_COMPONENTS)}")
    if "sp" in parts and "tp" not in parts:
        raise ConfigError("strategy", strategy, "sp together with tp (sequence parallelism shards TP's norms)")
    if "ddp" in parts and "tp" in parts:
        raise ConfigError("strategy", strategy, "tp composed with fsdp or hsdp (DDP does not take DTensor parameters)")
    return parts


@dataclass(frozen=True)
class Mesh:
    """Degrees of the four mesh dimensions; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp(self) -> int:
        """Ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(replicate, shard, cp, tp) index of ``rank`` (tp fastest, as ``init_device_mesh`` lays ranks out)."""
        t = rank % self.tp
        c = (rank // self.tp) % self.cp
        s = (rank // (self.tp * self.cp)) % self.dp_shard
        r = rank // (self.tp * self.cp * self.dp_shard)
        return r, s, c, t


@dataclass(frozen=True)
class DistConfig(LabConfig):
    """One run: strategy x world size x model x steps, plus what is measured and which fault is injected."""

    strategy: str = "fsdp"
    world_size: int = 2
    tp_degree: int = 0  # 0 = derived
    cp_degree: int = 0  # 0 = derived
    replicate_degree: int = 0  # HSDP replicas; 0 = derived (2 when the world is even)
    preset: str = "tiny"
    batch_size: int = 4  # global: split over the data-parallel ranks
    height: int = 64
    width: int = 64
    txt_len: int = 8
    steps: int = 3
    lr: float = 1e-3
    optimizer: str = "adamw"
    dtype: str = "float32"  # parameter storage
    mixed_precision: bool = False  # FSDP2 MixedPrecisionPolicy(bf16 compute, fp32 reduce)
    reshard_after_forward: bool = True
    prefetch: bool = True  # explicit forward/backward prefetch of the next block (FSDP2)
    activation_checkpoint: str = "none"  # the model's activation-checkpointing policy
    profile: bool = True  # profile the last step (communication per rank)
    backend: str = "auto"
    seed: int = 0
    timeout_s: float = 120.0  # the whole run
    hang_timeout_s: float = 30.0  # no rank reports progress for this long = hang (once every rank has started)
    startup_timeout_s: float = 300.0  # every rank's start (Python, torch's import, the process group) within this
    fault: str = "none"
    fault_rank: int = 1
    fault_step: int = 1
    save_step: int = 0  # write a DCP checkpoint after this step (0 = never)
    resume: bool = False  # load the DCP checkpoint from ``ckpt_dir`` and continue after its step
    ckpt_dir: str = ""
    keep_grads: bool = True  # rank 0 writes the full gradients after step 1 (for equality checks)
    comm_sweep: bool = False  # after training, time every collective over message sizes (alpha-beta fit)
    sweep_reps: int = 5

    def __post_init__(self):
        comps = components(self.strategy)
        check_int("world_size", self.world_size, min=1, max=1024)
        if self.strategy == "single" and self.world_size != 1:
            raise ConfigError("world_size", self.world_size, "1 for strategy 'single'")
        check_int("tp_degree", self.tp_degree, min=0)
        check_int("cp_degree", self.cp_degree, min=0)
        check_int("replicate_degree", self.replicate_degree, min=0)
        check_choice("preset", self.preset, PRESETS)
        check_int("batch_size", self.batch_size, min=1)
        check_int("txt_len", self.txt_len, min=1)
        check_int("steps", self.steps, min=1, max=10_000)
        check_float("lr", self.lr, min=0, min_exclusive=True)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        check_int("sweep_reps", self.sweep_reps, min=1, max=1000)
        for name in (
            "mixed_precision",
            "reshard_after_forward",
            "prefetch",
            "profile",
            "resume",
            "keep_grads",
            "comm_sweep",
        ):
            check_bool(name, getattr(self, name))
        check_choice("activation_checkpoint", self.activation_checkpoint, ACTIVATION_CHECKPOINTS)
        check_choice("backend", self.backend, BACKENDS)
        check_int("seed", self.seed, min=0)
        check_float("timeout_s", self.timeout_s, min=0, min_exclusive=True)
        check_float("hang_timeout_s", self.hang_timeout_s, min=0, min_exclusive=True)
        check_float("startup_timeout_s", self.startup_timeout_s, min=0, min_exclusive=True)
        check_choice("fault", self.fault, FAULTS)
        if self.fault != "none":
            check_int("fault_rank", self.fault_rank, min=0, max=self.world_size - 1)
            check_int("fault_step", self.fault_step, min=1, max=self.steps)
        check_int("save_step", self.save_step, min=0, max=self.steps)
        if (self.save_step or self.resume) and not self.ckpt_dir:
            raise ConfigError("ckpt_dir", self.ckpt_dir, "a folder for the DCP checkpoint when save_step or resume")
        if self.mixed_precision and not ({"fsdp", "hsdp"} & set(comps)):
            raise ConfigError("mixed_precision", True, "False unless the strategy has fsdp or hsdp")
        mesh = self.mesh  # raises on a mesh that does not divide the world
        m = resolve_config(self.preset)
        if m.num_heads % mesh.tp:
            raise ConfigError("tp_degree", mesh.tp, f"a divisor of num_heads = {m.num_heads} ({self.preset})")
        if m.mlp_hidden % mesh.tp:
            raise ConfigError("tp_degree", mesh.tp, f"a divisor of the MLP width {m.mlp_hidden} ({self.preset})")
        h, w = m.check_resolution(self.height, self.width, param="height")
        if (h * w) % mesh.cp:
            raise ConfigError("height", self.height, f"an image whose {h * w} tokens split into cp = {mesh.cp} shards")
        if self.txt_len % mesh.cp:
            raise ConfigError("txt_len", self.txt_len, f"a multiple of the context-parallel degree cp = {mesh.cp}")
        if "cp_ulysses" in comps and (m.num_heads // mesh.tp) % mesh.cp:
            raise ConfigError(
                "cp_degree", mesh.cp, f"a divisor of the heads per TP rank ({m.num_heads // mesh.tp}) for Ulysses"
            )
        if "sp" in comps and (h * w + self.txt_len) // mesh.cp % mesh.tp:
            raise ConfigError(
                "txt_len", self.txt_len, f"a joint sequence per CP rank divisible by tp = {mesh.tp} (sequence parallel)"
            )
        if self.batch_size % mesh.dp:
            raise ConfigError("batch_size", self.batch_size, f"a multiple of the data-parallel degree {mesh.dp}")

    @property
    def parts(self) -> tuple[str, ...]:
        return components(self.strategy)

    @property
    def mesh(self) -> Mesh:
        """The mesh degrees; a mesh that does not divide ``world_size`` is a ConfigError."""
        comps, n = self.parts, self.world_size
        has_dp = any(c in DP_COMPONENTS for c in comps)
        non_dp = [c for c in comps if c not in DP_COMPONENTS and c != "sp"]
        derive = n if (len(non_dp) == 1 and not has_dp) else 2
        tp = (self.tp_degree or derive) if "tp" in comps else 1
        cp = (self.cp_degree or derive) if any(c in CP_COMPONENTS for c in comps) else 1
        if self.tp_degree and "tp" not in comps:
            raise ConfigError("tp_degree", self.tp_degree, "0 unless the strategy has tp")
        if self.cp_degree and cp == 1 and not any(c in CP_COMPONENTS for c in comps):
            raise ConfigError("cp_degree", self.cp_degree, "0 unless the strategy has cp_ring or cp_ulysses")
        if n % (tp * cp):
            raise ConfigError(
                "world_size", n, f"a multiple of tp x cp = {tp} x {cp} (the mesh must divide the world size)"
            )
        rest = n // (tp * cp)
        if not has_dp and rest != 1:
            raise ConfigError(
                "world_size", n, f"tp x cp = {tp * cp} for {self.strategy!r} (add ddp/fsdp/hsdp to use more ranks)"
            )
        rep, shard = 1, rest
        if "ddp" in comps:
            rep, shard = rest, 1
        elif "hsdp" in comps:
            rep = self.replicate_degree or (2 if rest % 2 == 0 else 1)
            if rest % rep:
                raise ConfigError("replicate_degree", rep, f"a divisor of world_size / (tp x cp) = {rest}")
            shard = rest // rep
        elif self.replicate_degree:
            raise ConfigError("replicate_degree", self.replicate_degree, "0 unless the strategy is hsdp")
        return Mesh(rep, shard, cp, tp)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DistConfig:
        data: dict[str, Any] = json.loads(text)
        return cls(**data)
