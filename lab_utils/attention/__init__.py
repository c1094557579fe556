"""Layer 2, attention below the model: the paths and their capability checks (`paths`), the
input checks of `attend()` (`inputs`), mask_mods and block masks (`masks`), every path behind
`attend()` with its float64 checks and timing sweep (`attend`), and variable-length batches
(`varlen`: bucketing, padding vs packing)."""
