"""Measurement: the one step timer (`timing`, seconds), memory (`memory`), torch.profiler summaries (`profiling`),
and the device, dtype and synchronisation helpers every measurement uses (`device`)."""
