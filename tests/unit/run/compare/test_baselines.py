"""Pins of what the comparison treats as comparable, matched or timing-free, on hand-made rows and
contexts.

* A CUDA version on one side only (a CUDA torch against a CPU build) is a software difference;
  a Triton version missing on one side is not (older records lack it).
* Rows sharing a key are told apart by categorical ``extra`` fields (a sequence length), never
  by measured floats or outcome flags: a row whose figure changed must still meet its old self.
* A timing-free baseline keeps accuracy figures and counts, and drops timings and memory.
"""

from __future__ import annotations

import json

import pandas as pd

from lab_utils.run.compare.baselines import timing_free
from lab_utils.run.compare.coverage import context_diff
from lab_utils.run.compare.options import Options
from lab_utils.run.compare.sides import Side, identity_keys


def _side(label: str, **context) -> Side:
    return Side(label=label, source=label, rows=pd.DataFrame(), context=context)


def test_a_cuda_version_on_one_side_only_is_a_software_difference():
    base = _side("base", cuda_version="12.4", torch_version="2.9", triton_version="3.5")
    cand = _side("cand", cuda_version="", torch_version="2.9", triton_version="")
    diff = context_diff(base, cand, Options(), device_differs=False)
    assert diff.software == ["cuda 12.4 -> "]
    # the same pair on different devices: the device difference covers the CUDA stack
    assert context_diff(base, cand, Options(), device_differs=True).software == []


def _rows(extras: list[dict]) -> pd.DataFrame:
    key = dict(lab="03", experiment="attn", variant="triton", shape="", dtype="bf16", metric="time", statistic="median")
    return pd.DataFrame([{**key, "extra": json.dumps(e)} for e in extras])


def test_identity_keys_are_categorical_fields_only():
    df = _rows(
        [
            {"seq": 64, "mask": "causal", "gbs": 1.25, "fused": True, "verdict": "ok"},
            {"seq": 128, "mask": "causal", "gbs": 2.5, "fused": False, "verdict": "slow"},
        ]
    )
    assert identity_keys(df) == ["seq"]


def test_timing_free_keeps_accuracy_and_counts_only():
    rows = pd.DataFrame(
        {
            "metric": ["time", "peak_memory", "rel_error", "sqnr", "flops", "bandwidth"],
            "unit": ["ms", "MiB", "", "dB", "", "GB/s"],
        }
    )
    assert timing_free(rows)["metric"].tolist() == ["rel_error", "sqnr", "flops"]
