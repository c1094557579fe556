"""Layer 4, numerical stability of training: telemetry and the NaN/Inf locator (`telemetry`), the
stability-aware optimizer, spike policies and training loop (`training`), where two runs'
telemetry part (`numdiff`)."""
