"""Unit pins of lab_utils/run/parallel.py: the job options read from the CLI, the CPU thread
environment and lab 06's multinode spec, without running a job."""

from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.run import parallel
from lab_utils.run.parallel import job_options, multinode_spec, parse_devices, thread_env

NONE = dict(
    executor=None,
    parallel=None,
    devices=None,
    partition=None,
    account=None,
    time_limit=None,
    gpus_per_node=None,
    nodes=None,
    cluster_config=None,
)


def test_job_options_none_when_no_job_option_given():
    assert job_options(Namespace(**NONE)) is None


@pytest.mark.parametrize("name,value", [(k, 2) for k in NONE])
def test_job_options_any_single_option_gives_the_jobs_argument(name, value):
    got = job_options(Namespace(**{**NONE, name: value}))
    assert got is not None
    flat = {**{k: v for k, v in got.items() if k != "cluster"}, **got["cluster"]}
    assert value in flat.values()
    assert sorted(got) == ["cluster", "devices", "executor", "parallel"]


def test_thread_env_is_empty_without_a_per_lab_share():
    plan = SimpleNamespace(threads_per_lab=None, thread_budget=None, parallel=1)
    assert thread_env(plan, [object()]) == {}


class _Lab:
    strategies = ("ddp", "fsdp")
    seen: list = []

    @classmethod
    def from_params(cls, params):
        lab = cls()
        lab.params = params
        return lab

    def dist_config(self, strategy, world):
        _Lab.seen.append((strategy, world, self.params["world_sizes"]))
        return SimpleNamespace(mesh=(world,), world=world)


@pytest.mark.parametrize("nodes,per_node", [(1, 1), (2, 4), (3, 8)])
def test_multinode_spec_spans_nodes_times_ranks_per_node(nodes, per_node):
    _Lab.seen.clear()
    p = SimpleNamespace(entry=SimpleNamespace(notebook=Path("labs/06_x.ipynb")), resolved={"world_sizes": [8]})
    cfg = multinode_spec(p, nodes, per_node, lambda nb: _Lab)
    assert cfg is not None and cfg.world == nodes * per_node
    assert _Lab.seen == [("ddp", nodes * per_node, [1])]


@pytest.mark.parametrize(
    "text,want",
    [(None, None), ("0", (0,)), ("0,1,3", (0, 1, 3)), ("3,1", (3, 1)), (" 2 , 0 ", (2, 0)), ("0,", (0,))],
)
def test_parse_devices_reads_distinct_indices(text, want):
    assert parse_devices(text) == want


@pytest.mark.parametrize("text", ["", ",", "a", "1,1", "-1", "2,-1", "0,0,1"])
def test_parse_devices_rejects_naming_the_option(text):
    with pytest.raises(ConfigError, match="--devices"):
        parse_devices(text)


@pytest.mark.parametrize("devices,ok", [("0,1", True), ("1", True), ("2", False), ("0,2", False), ("1,0,3", False)])
def test_prepare_accepts_only_indices_below_the_visible_gpu_count(monkeypatch, devices, ok):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 2)
    if ok:
        assert parallel.prepare(devices=devices).devices == parse_devices(devices)
    else:
        with pytest.raises(ConfigError, match="indices below 2"):
            parallel.prepare(devices=devices)


def test_prepare_without_devices_takes_every_visible_gpu(monkeypatch):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 3)
    assert tuple(parallel.prepare().devices) == (0, 1, 2)


def _planned(stem, **resolved):
    return SimpleNamespace(entry=SimpleNamespace(stem=stem, notebook=Path(f"labs/{stem}.ipynb")), resolved=resolved)


@pytest.mark.parametrize("parallel_n,labs", [(1, 3), (2, 3), (4, 2), (3, 3)])
def test_plan_jobs_splits_the_thread_budget_over_the_labs_running_at_once(monkeypatch, parallel_n, labs):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 0)
    planned = [_planned(f"0{i}_x") for i in range(labs)]
    plan = parallel.plan_jobs(planned, None, parallel.prepare(parallel=parallel_n), timing_threads=12)
    at_once = min(parallel_n, labs)
    assert plan.thread_budget == 12
    assert plan.threads_per_lab == 12 // at_once
