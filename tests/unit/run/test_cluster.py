"""Where jobs go (``cluster``): options validated as values, read from ``perflab.slurm.yaml``, a job's
share of a node's CPUs, and the time limit and partition completed from the site (a site of fixed
partitions here: no SLURM)."""

from __future__ import annotations

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.run import cluster, slurm
from lab_utils.run.cluster import ClusterOptions, cluster_options, resolve_site


def _part(**kw) -> slurm.Partition:
    base = dict(name="gpu", default=True, state="UP", max_time_min=None, default_time_min=None, max_nodes=None,
                total_nodes=4, allow_accounts=None, deny_accounts=(), node_cpus=64, node_mem_mb=512000,
                node_gpus=8, gres="gpu:8")  # fmt: skip
    return slurm.Partition(**{**base, **kw})


def _on(part: slurm.Partition, **opts) -> ClusterOptions:
    site = slurm.Site({part.name: part}, False)
    return ClusterOptions(executor="slurm", partition=part.name, site=site, **opts)


def test_a_job_asks_for_its_gpus_share_of_a_nodes_cpus():
    """64 CPUs and 8 GPUs a node: 8 CPUs a GPU; a job without GPUs (timing on the CPU) takes them all."""
    assert [_on(_part()).cpus_for(g) for g in (0, 1, 3, 8, 16)] == [64, 8, 24, 64, 64]
    assert [_on(_part(node_cpus=10, node_gpus=4)).cpus_for(g) for g in (1, 2, 3)] == [2, 5, 7]  # rounded down
    assert _on(_part(node_cpus=2, node_gpus=8)).cpus_for(1) == 1  # at least one
    assert _on(_part(node_gpus=0)).cpus_for(2) == 64  # no GPUs on the node: the whole node
    assert _on(_part(), cpus_per_task=3).cpus_for(1) == 3  # asked for: as asked
    assert ClusterOptions().cpus_for(1) is None  # no site: sbatch's default


def test_local_options_are_validated_at_each_bound():
    opts = cluster_options("local")
    assert (opts.executor, opts.timeout_min, opts.nodes) == ("local", cluster.DEFAULT_TIMEOUT_MIN, 1)
    assert cluster_options("local", timeout_min=0.5, mem_gb=0.5, cpus_per_task=1, gpus_per_node=0).mem_gb == 0.5
    for kw, msg in [
        (dict(timeout_min=0), "'--time-limit' = 0 .* a number of minutes > 0"),
        (dict(timeout_min="ten"), "'--time-limit' = 'ten' .* a number of minutes"),
        (dict(timeout_min=True), "'--time-limit' = True"),
        (dict(mem_gb=0), "'mem_gb' = 0 .* a number of GB > 0"),
        (dict(cpus_per_task=0), "'cpus_per_task' = 0 .* an integer >= 1"),
        (dict(gpus_per_node=-1), "'--gpus-per-node' = -1 .* an integer >= 0"),
        (dict(nodes=0), "'--nodes' = 0 .* an integer >= 1"),
        (dict(partition="gpu"), "'--partition' = 'gpu' .* no value with --executor local"),
        (dict(account="a b"), "'--account' = 'a b' .* a SLURM name"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            cluster_options("local", **kw)
    with pytest.raises(ConfigError, match="'--executor' = 'pbs' .* one of 'local', 'slurm'"):
        cluster_options("pbs")


def test_the_cluster_file_is_read_and_its_unknown_keys_refused(tmp_path):
    f = tmp_path / "site.yaml"
    f.write_text("timeout_min: 30\nmem_gb: 8\n")
    assert cluster.load_cluster_config(f) == {"timeout_min": 30, "mem_gb": 8}
    assert cluster_options("local", f, mem_gb=4).mem_gb == 4  # the command line wins
    assert cluster_options("local", f).timeout_min == 30
    with pytest.raises(ConfigError, match="'--cluster-config' = .*missing.yaml.* an existing YAML file"):
        cluster.load_cluster_config(tmp_path / "missing.yaml")
    f.write_text("gpus: 2\n")
    with pytest.raises(ConfigError, match="'site.yaml: gpus' = 2 .* a key among partition, account"):
        cluster.load_cluster_config(f)
    f.write_text("- a\n")
    with pytest.raises(ConfigError, match="a YAML mapping"):
        cluster.load_cluster_config(f)


def _resolve(monkeypatch, part: slurm.Partition, **opts) -> ClusterOptions:
    monkeypatch.setattr(slurm.Site, "probe", classmethod(lambda cls: slurm.Site({part.name: part}, False)))
    return resolve_site(ClusterOptions(executor="slurm", **opts))


def test_the_time_limit_and_gpus_come_from_the_partition_when_not_given(monkeypatch):
    """As sbatch would: the partition's DefaultTime, else an hour within its MaxTime, whole minutes, at least 1."""
    got = _resolve(monkeypatch, _part(default_time_min=30.0, max_time_min=120.0))
    assert (got.partition, got.timeout_min, got.gpus_per_node, got.site is not None) == ("gpu", 30, 8, True)
    assert _resolve(monkeypatch, _part(max_time_min=120.0)).timeout_min == 60
    assert _resolve(monkeypatch, _part(max_time_min=20.0)).timeout_min == 20
    assert _resolve(monkeypatch, _part(default_time_min=0.5)).timeout_min == 1
    assert _resolve(monkeypatch, _part(default_time_min=30.0), timeout_min=90, gpus_per_node=2).timeout_min == 90
    assert _resolve(monkeypatch, _part(), gpus_per_node=2).gpus_per_node == 2
    with pytest.raises(ConfigError, match="'--time-limit' = 90 .* at most 60 minutes"):
        _resolve(monkeypatch, _part(max_time_min=60.0), timeout_min=90)
    with pytest.raises(ConfigError, match="'--gpus-per-node' = 9"):
        _resolve(monkeypatch, _part(), gpus_per_node=9)
    local = ClusterOptions()
    assert resolve_site(local) is local


def test_the_sites_file_in_the_working_folder_is_read_for_slurm_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / cluster.CONFIG_FILE).write_text("partition: gpu\ntimeout_min: 5\n")
    local = cluster_options("local")
    assert (local.partition, local.timeout_min) == (None, cluster.DEFAULT_TIMEOUT_MIN)
    monkeypatch.setattr(cluster.shutil, "which", lambda name: f"/usr/bin/{name}")
    on_slurm = cluster_options("slurm")
    assert (on_slurm.partition, on_slurm.timeout_min) == ("gpu", 5)
    assert cluster_options("slurm", timeout_min=7).timeout_min == 7
    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="'--executor' = 'slurm' .* this machine has no SLURM"):
        cluster_options("slurm")
