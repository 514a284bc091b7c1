"""Probes and one-off profilers that a GPU phase, a test or a doc still runs, and the GPU phases themselves
(`python -m tools.gpu`). Run each from the repository root as `python -m tools.<name>`. Tools import only the
public names of kernels/, parallel/, raysys/ and sweeps/; their measured runs are described in docs/runs.md and
their rows live in results/.
"""
