"""Planning before running: the analytic memory and recompute model (`recompute_model`) and the advisor that picks
a checkpointing plan from it (`advisor`)."""
