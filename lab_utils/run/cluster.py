"""Where jobs go: :class:`ClusterOptions` from command-line options and ``perflab.slurm.yaml``,
validated as values (:func:`cluster_options`), then checked against the SLURM site itself and
completed from it (:func:`resolve_site`: the default partition, its GPUs per node, its time limit).
A bad value raises :class:`ConfigError` naming it, before anything is submitted or written."""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ..core.config import ConfigError, check_choice, check_int
from . import slurm

EXECUTORS = ("local", "slurm")
CONFIG_FILE = "perflab.slurm.yaml"
DEFAULT_TIMEOUT_MIN = 60


@dataclass(frozen=True)
class ClusterOptions:
    """Where jobs run.  ``gpus_per_node``: the GPUs one node has (a lab gets one, lab 06 as many
    as its world size asks for, at most these; on SLURM, when not given, the partition's);
    ``nodes``: lab 06's node count; ``site``: the SLURM site it was checked against."""

    executor: str = "local"
    partition: str | None = None
    account: str | None = None
    timeout_min: float | None = None  # None: 60 here; on SLURM the partition's DefaultTime, else min(60, MaxTime)
    gpus_per_node: int | None = None
    nodes: int = 1
    mem_gb: float | None = None
    cpus_per_task: int | None = None
    site: slurm.Site | None = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items() if k != "site" and v not in (None, ""))

    @property
    def gpus(self) -> int:
        return self.gpus_per_node or 0

    def cpus_for(self, gpus: int) -> int | None:
        """CPUs a SLURM job with ``gpus`` GPUs per node asks for: ``cpus_per_task`` when given, else
        its share of a node's CPUs (all of them for a job without GPUs, which times on the CPU)."""
        if self.cpus_per_task is not None or self.site is None:
            return self.cpus_per_task
        p = self.site.partitions[self.partition]
        if gpus and p.node_gpus:
            return max(1, p.node_cpus * min(gpus, p.node_gpus) // p.node_gpus)
        return max(1, p.node_cpus)


USER_KEYS = tuple(f.name for f in fields(ClusterOptions) if f.name not in ("executor", "site"))


def load_cluster_config(path: str | Path) -> dict:
    """``perflab.slurm.yaml``: a mapping of :class:`ClusterOptions` fields; unknown keys are refused."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--cluster-config", str(path), "an existing YAML file (see docs/cluster.md)")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError("--cluster-config", str(path), f"a YAML mapping with keys among {', '.join(USER_KEYS)}")
    for k in data:
        if k not in USER_KEYS:
            raise ConfigError(f"{p.name}: {k}", data[k], f"a key among {', '.join(USER_KEYS)}")
    return data


def cluster_options(executor: str, config: str | Path | None = None, **given: Any) -> ClusterOptions:
    """Options from ``config`` (a YAML file; with SLURM ``./perflab.slurm.yaml`` when it exists and
    none is named), then ``given`` (command-line values; None = not given), validated as values."""
    check_choice("--executor", executor, EXECUTORS)
    if config is None and executor == "slurm" and Path(CONFIG_FILE).is_file():
        config = CONFIG_FILE  # the site's defaults; a local run does not read them
    values = load_cluster_config(config) if config is not None else {}
    values.update({k: v for k, v in given.items() if v is not None})
    values["executor"] = executor
    if executor == "local":
        values.setdefault("timeout_min", DEFAULT_TIMEOUT_MIN)
    opts = ClusterOptions(**values)
    t = opts.timeout_min
    if t is not None and not (isinstance(t, (int, float)) and not isinstance(t, bool)):
        raise ConfigError("--time-limit", t, "a number of minutes")
    if t is not None and executor == "slurm":
        check_int("--time-limit", t, min=1)
    elif t is not None and not t > 0:
        raise ConfigError("--time-limit", t, "a number of minutes > 0")
    if opts.gpus_per_node is not None:
        check_int("--gpus-per-node", opts.gpus_per_node, min=0)
    check_int("--nodes", opts.nodes, min=1)
    if opts.cpus_per_task is not None:
        check_int("cpus_per_task", opts.cpus_per_task, min=1)
    if opts.mem_gb is not None and not (isinstance(opts.mem_gb, (int, float)) and opts.mem_gb > 0):
        raise ConfigError("mem_gb", opts.mem_gb, "a number of GB > 0")
    for name in ("partition", "account"):
        v = getattr(opts, name)
        if v is not None and (not isinstance(v, str) or not v.strip() or any(c.isspace() for c in v)):
            raise ConfigError(f"--{name}", v, "a SLURM name (no spaces)")
        if v is not None and executor != "slurm":
            raise ConfigError(f"--{name}", v, "no value with --executor local (a SLURM setting)")
    if executor == "slurm" and not shutil.which("sbatch"):
        raise ConfigError("--executor", executor, "'local' here: this machine has no SLURM (no sbatch on PATH)")
    return opts


def resolve_site(opts: ClusterOptions, *, gpus: int | None = None, nodes: int | None = None) -> ClusterOptions:
    """SLURM options checked against the site (:func:`.slurm.check_options`) with the partition
    (else the site's default) and its GPUs per node filled in; local options as they are."""
    if opts.executor != "slurm":
        return opts
    try:
        site = slurm.Site.probe()
    except slurm.SlurmError as e:
        raise ConfigError("--executor", "slurm", f"a reachable SLURM controller ({e})") from None
    part = site.partition(opts.partition)
    limit = opts.timeout_min
    if limit is None:  # as sbatch would: the partition's DefaultTime, else an hour within its MaxTime
        limit = part.default_time_min or min(DEFAULT_TIMEOUT_MIN, part.max_time_min or DEFAULT_TIMEOUT_MIN)
        limit = max(1, int(limit))
    opts = replace(opts, timeout_min=limit)
    want = opts.gpus_per_node if gpus is None else gpus
    slurm.check_options(
        replace(opts, partition=part.name),
        site,
        gpus=want or 0,
        nodes=opts.nodes if nodes is None else nodes,
        cpus=opts.cpus_per_task,
        mem_gb=opts.mem_gb,
    )
    per_node = part.node_gpus if opts.gpus_per_node is None else opts.gpus_per_node
    return replace(opts, partition=part.name, gpus_per_node=per_node, timeout_min=limit, site=site)
