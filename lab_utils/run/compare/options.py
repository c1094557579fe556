"""What a comparison may be asked for: thresholds, noise test, rows, gate (``Options``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...config import ConfigError


@dataclass(frozen=True)
class Options:
    threshold: float = 0.05  # performance and memory: relative change that counts
    accuracy_threshold: float = 0.10  # error figures (ratio metrics)
    db_threshold: float = 0.5  # SQNR and other dB figures: absolute change in dB
    confidence: float = 0.99
    method: str = "bootstrap"  # "bootstrap" | "rank"
    bootstrap: int = 2000
    min_samples: int = 3
    statistics: str = "default"  # "default" (no p20/p80) | "all"
    only: str = "all"  # "all" | "performance" | "accuracy" (accuracy + other)
    gate: str = "all"  # which kinds fail the gate: "all" | "performance" | "accuracy" | "none"
    allow_device_mismatch: bool = False
    max_unstable_share: float = 0.25  # a side with more unstable timings than this is not comparable

    def __post_init__(self):
        for name in ("threshold", "accuracy_threshold", "db_threshold"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(name, v, "a finite number >= 0")
        if not (0.5 <= self.confidence < 1):
            raise ConfigError("confidence", self.confidence, "a number in [0.5, 1)")
        if self.method not in ("bootstrap", "rank"):
            raise ConfigError("method", self.method, "'bootstrap' or 'rank'")
        if self.statistics not in ("default", "all"):
            raise ConfigError("statistics", self.statistics, "'default' or 'all'")
        if self.only not in ("all", "performance", "accuracy"):
            raise ConfigError("only", self.only, "'all', 'performance' or 'accuracy'")
        if self.gate not in ("all", "performance", "accuracy", "none"):
            raise ConfigError("gate", self.gate, "'all', 'performance', 'accuracy' or 'none'")
        v = self.max_unstable_share
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 <= v <= 1):
            raise ConfigError("max_unstable_share", v, "a number in [0, 1]")
        if not (isinstance(self.bootstrap, int) and self.bootstrap >= 100):
            raise ConfigError("bootstrap", self.bootstrap, "an integer >= 100")
