"""Layer 1, the measurement core: configs and their checks, the device and its datasheet peaks,
the one dtype table, CPU thread policy, FLOP and byte conventions, the one timing primitive,
measured ceilings, the roofline, tidy records, shared plots and known library noise."""
