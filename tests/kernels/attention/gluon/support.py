"""What the Gluon kernel tests share: skip marks, the Tritons the sm_90 compile tests build under, CPU stand-ins and
fp32 attention with the Gluon kernels' -inf mask (the GPU tests' reference)."""

from __future__ import annotations

import math

import pytest
import torch
import triton

from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from tests.kernels.attention.gluon.sm90_builds import extra_tritons

needs_gluon = pytest.mark.skipif(not HAS_GLUON_HOPPER, reason=f"Triton {triton.__version__} has no Gluon Hopper API")
TRITONS = [None, *extra_tritons()]
"""The Tritons the sm_90 compile tests build under: the installed one (None) and RAYSYS_EXTRA_TRITONS' releases."""
over_tritons = pytest.mark.parametrize("release", TRITONS, ids=lambda r: f"triton-{r or triton.__version__}")
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                                or not HAS_GLUON_HOPPER, reason="needs an sm_90 GPU and Gluon's Hopper API")


def cpu(shape, dtype=torch.bfloat16):
    """Zeros on the CPU (the rules the host checks, and the sm_90 builds, read only shapes and dtypes)."""
    return torch.zeros(shape, dtype=dtype)


def fp32_attention(q, k, v, causal):
    """(O, L) of (B, H, N, d) attention in fp32, masked scores -inf."""
    qf, kf, vf = (t.float() for t in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:  # top-left aligned: query i sees keys j <= i
        scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
                                    .triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ vf, torch.logsumexp(scores, -1)
