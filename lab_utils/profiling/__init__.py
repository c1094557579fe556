"""Layer 4, profiling a training step: torch.profiler runs, FLOPs and MFU (`profiler`) and
reading the Chrome traces they write (`traces`)."""
