"""Shared test set-up.  Importing lab_kernels first sets TRITON_INTERPRET on CPU-only machines."""

import pytest
import torch

import lab_kernels  # noqa: F401


@pytest.fixture
def gen():
    """A fresh, differently seeded generator per test: inputs are random every run."""
    g = torch.Generator()
    g.seed()
    return g


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
