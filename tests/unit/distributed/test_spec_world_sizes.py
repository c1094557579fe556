"""Lab 06's world sizes: ``auto`` / ``all`` is every visible GPU, resolved when the config is built."""

from pathlib import Path

import pytest
import torch
import yaml

from lab_utils.core.config import ConfigError
from lab_utils.studies.distributed import DistributedLabConfig

GPU_SET = Path(__file__).resolve().parents[3] / "parameterized" / "sets" / "06_distributed" / "gpu.yaml"


def _gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("word", ["auto", "all", "AUTO"])
def test_auto_world_size_is_the_visible_gpu_count(monkeypatch, word):
    _gpus(monkeypatch, 4)
    cfg = DistributedLabConfig(world_sizes=[1, word], strategies=("ddp",), fault_demo=False)
    assert cfg.world_sizes == [1, 4] and cfg.to_dict()["world_sizes"] == [1, 4]
    assert [c.world_size for c in cfg.cases()] == [1, 4]


def test_the_gpu_set_runs_every_local_gpu(monkeypatch):
    params = yaml.safe_load(GPU_SET.read_text())
    assert "auto" in params["world_sizes"]
    _gpus(monkeypatch, 8)
    assert DistributedLabConfig.from_params(params).world_sizes == [1, 8]
    _gpus(monkeypatch, 2)
    assert DistributedLabConfig.from_params(params).world_sizes == [1, 2]


def test_auto_without_a_gpu_is_refused_naming_world_sizes(monkeypatch):
    _gpus(monkeypatch, 0)
    with pytest.raises(ConfigError) as ei:
        DistributedLabConfig(world_sizes=[1, "auto"], strategies=("ddp",))
    assert ei.value.param == "world_sizes" and "none is visible" in str(ei.value)


@pytest.mark.parametrize("bad", [[1, "many"], "auto", [0], [1, 2.5]])
def test_other_world_sizes_are_refused(monkeypatch, bad):
    _gpus(monkeypatch, 4)
    with pytest.raises(ConfigError) as ei:
        DistributedLabConfig(world_sizes=bad, strategies=("ddp",))
    assert ei.value.param == "world_sizes"
