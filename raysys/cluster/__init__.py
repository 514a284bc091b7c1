"""The cluster layer: gangs of ranks on Ray (`gang`) or local processes (`mp_gang`) behind one rank interface
(`rank`), sweeps on a gang (`sweep`), telemetry, job submission (`submit`), signals, and what studies share
(`studies`)."""
