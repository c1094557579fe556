"""Layer 4, fused ops on the model's shapes: one problem size and seeded inputs (`inputs`), checks
and benchmarking of every fused-op variant (`ops`), whole-block comparisons (`blocks`)."""
