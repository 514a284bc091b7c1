"""The deterministic two-pass Gluon backward (`kernels/attention/gluon/backward_two_pass.py`): config rules, sm_90
builds without spills or wgmma serialisation, its dQ loop's exp2s under dP (SASS), and bitwise equal runs (GPU)."""

from __future__ import annotations

import pytest
import torch

import kernels.attention.gluon.backward as fgo
import kernels.attention.gluon.backward_two_pass as fgb
import kernels.attention.gluon.forward as fg
from kernels.attention import dispatch
from kernels.attention.gluon import runtime
from tests.kernels.attention.gluon.sm90_builds import sm90_build
from tests.kernels.attention.gluon.support import (
    cpu,
    needs_gluon,
    needs_sm90,
    over_tritons,
)


def test_bwd2_config_rules():
    with pytest.raises(ValueError, match="dkdv_block_m"):
        fgb.GluonBwd2Config(dkdv_block_m=128)
    with pytest.raises(ValueError, match="dq_stages"):
        fgb.GluonBwd2Config(dq_stages=0)
    config = fgb.GluonBwd2Config(dkdv_block_m=64, dkdv_stages=2, dq_block_n=64, dq_stages=3)
    # dK/dV: K, V of two consumers (4 x 64 x 128) and the Q/dO ring (2 x 2 x 64 x 128); dQ: Q, dO of two consumers
    # (4 x 64 x 128) and the K/V ring (2 x 3 x 64 x 128); bf16.
    assert config.shared_bytes(128) == (2 * 128 * (4 * 64 + 4 * 64), 2 * 128 * (4 * 64 + 6 * 64))
    assert config.registers() == fg.GluonConfig(num_consumers=2).registers()
    assert config.name != fgb.GluonBwd2Config().name


def test_bwd_refuses_a_config_of_the_other_backward(monkeypatch):
    """Each backward's checked entry takes its own config only (a one-pass config is no two-pass one)."""
    monkeypatch.setattr(fgo, "unsupported_reason", lambda q, k, v: "")
    q = cpu((1, 2, 64, 128))
    with pytest.raises(ValueError, match="gluon_attention_bwd2: config .* is not a GluonBwd2Config"):
        fgb.gluon_attention_bwd2(q, q, q, q, torch.zeros(1, 2, 64), q, True, fgo.GluonBwdConfig())
    with pytest.raises(ValueError, match="gluon_attention_bwd: config .* is not a GluonBwdConfig"):
        fgo.gluon_attention_bwd(q, q, q, q, torch.zeros(1, 2, 64), q, True, fgb.GluonBwd2Config())


def _compile_sm90_bwd2(config: fgb.GluonBwd2Config, head_dim: int, dtype: torch.dtype, causal: bool, release=None):
    """(dK/dV kernel, dQ kernel), built for sm_90 from the launcher's own arguments."""
    return tuple(sm90_build("bwd2", config, head_dim, dtype, causal, triton=release))


@pytest.mark.slow
@needs_gluon
@over_tritons
@pytest.mark.parametrize("head_dim, causal, dtype", [(64, True, torch.bfloat16), (128, True, torch.bfloat16),
                                                     (128, False, torch.float16)])
def test_bwd2_compiles_for_sm90_without_spills(head_dim, causal, dtype, release):
    config = fgb.DEFAULT_BWD2_CONFIGS[head_dim]
    for compiled, shared in zip(_compile_sm90_bwd2(config, head_dim, dtype, causal, release),
                                config.shared_bytes(head_dim)):
        ptx = compiled.ptx
        assert compiled.cubin and compiled.shared >= shared
        # Two products in flight (S and dP), no atomics (dQ deterministic), the consumer/producer register split.
        assert "wgmma.wait_group.sync.aligned 1;" in ptx
        assert "atom.global" not in ptx and "red.global" not in ptx
        assert f"setmaxnreg.inc.sync.aligned.u32 \t{config.registers()[1]};" in ptx
        assert f"setmaxnreg.dec.sync.aligned.u32 \t{runtime.LOADER_REGS};" in ptx
        # No spills, and no wgmma serialisation (C7512: what an accumulator carried in flight across the loop gives).
        log = compiled.ptxas_log
        assert " 0 bytes spill stores, 0 bytes spill loads" in log and "C7512" not in log, log


@pytest.mark.slow
@needs_gluon
@over_tritons
def test_bwd2_dq_exp2s_run_under_dp_sm90(release):
    """SASS of the dQ loop: the dP wait (DEPBAR <= 0) comes after the exp2s of P, which follow the S wait."""
    import re

    _, dq = _compile_sm90_bwd2(fgb.DEFAULT_BWD2_CONFIGS[128], 128, torch.bfloat16, True, release)
    ops = re.findall(r"(HGMMA|WARPGROUP\.DEPBAR\.LE gsb0, 0x[01]|MUFU\.EX2)", dq.sass)
    first = ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert ops[first - 1] == "HGMMA" and ops[first + 1] == "MUFU.EX2"
    assert ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", first) > first + 8


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd2_is_deterministic(head_dim):
    """Two two-pass backwards of the same inputs give bitwise equal dQ, dK, dV (no atomics anywhere)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn((2, 3, 1537, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
                   for _ in range(4))
    out, lse = fg.gluon_attention_fwd(q, k, v, True, dispatch.gluon_fwd_config(q, k))
    first = fgb.gluon_attention_bwd2(q, k, v, out, lse, do, True)
    for _ in range(2):
        again = fgb.gluon_attention_bwd2(q, k, v, out, lse, do, True)
        for name, a, b in zip("qkv", first, again):
            assert torch.equal(a, b), name
