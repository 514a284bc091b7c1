"""raysys: a Ray-orchestrated multi-GPU experiment runner for LLM training systems (CS336 assignment 2)."""

__version__ = "0.1.0"
