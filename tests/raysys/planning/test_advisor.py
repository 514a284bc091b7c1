"""The checkpointing advisor: none when everything fits, escalation as memory shrinks, CLI and errors."""

import json

import pytest
import torch

from parallel.checkpointing import apply_activation_checkpointing
from raysys import cli
from raysys.model.config import ModelConfig
from raysys.model.transformer import TransformerLM, cross_entropy
from raysys.planning.advisor import advise, parse_bytes
from raysys.planning.recompute_model import GiB, Workload, predict_peak

XL = ModelConfig.from_name("xl", context_length=2048)


def advise_main(argv):
    """`raysys advise ARGV`'s exit status."""
    return cli.main(["advise", *argv])


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("8.5e10") == 85 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    for bad in ("lots", "-3GB", "10XB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_picks_none_when_everything_fits():
    plan = advise(ModelConfig.from_name("small"), 4, parse_bytes("80GiB"))
    assert plan.fits and set(plan.layers) == {"none"} and plan.overhead == 0
    assert "without recomputation" in plan.reason


def test_escalates_as_memory_shrinks():
    """Less memory -> more recomputation: overhead never falls, the predicted peak always fits."""
    plans = [advise(XL, 4, parse_bytes(f"{gib}GiB")) for gib in (400, 200, 120, 90, 75)]
    assert all(p.fits and p.predicted_peak_bytes <= p.usable_bytes for p in plans)
    assert set(plans[0].layers) == {"none"}
    assert [p.overhead for p in plans] == sorted(p.overhead for p in plans)
    assert "selective" in plans[1].layers and "full" not in plans[1].layers  # cheapest escalation first
    assert plans[-1].layers.count("full") > plans[-2].layers.count("full") > 0
    # the plan's layers, re-scored through the policy object, give the same prediction
    w = Workload(config=XL, batch_size=4)
    assert predict_peak(w, plans[-1].policy.regions(32)).peak_bytes == plans[-1].predicted_peak_bytes


def test_nothing_fits_is_reported():
    plan = advise(XL, 4, parse_bytes("40GiB"))
    assert not plan.fits and plan.predicted_peak_bytes > plan.usable_bytes
    assert "nothing fits" in plan.reason


def test_fused_attention_never_chooses_selective():
    plan = advise(XL, 4, parse_bytes("80GiB"), attention="sdpa")
    assert plan.fits and "selective" not in plan.layers and "full" in plan.layers


def test_offload_wins_only_with_fast_links():
    slow = advise(XL, 4, parse_bytes("80GiB"), pcie_gbps=25)
    fast = advise(XL, 4, parse_bytes("80GiB"), pcie_gbps=5000)
    assert "offload" not in slow.layers and "offload" in fast.layers and fast.overhead < slow.overhead
    capped = advise(XL, 4, parse_bytes("80GiB"), pcie_gbps=5000, host_memory_bytes=parse_bytes("40GiB"))
    assert capped.layers.count("offload") * 8.35 <= 40  # 8.35 GiB per offloaded block


def test_plan_policy_applies_to_a_model():
    cfg = ModelConfig(vocab_size=32, context_length=256, d_model=64, num_layers=4, num_heads=4, d_ff=128)
    w = Workload(config=cfg, batch_size=4)
    none = predict_peak(w, advise(cfg, 4, 10 * GiB).policy.regions(4))
    usable = none.peak_bytes - none.activation_peak_bytes // 2  # half the activations must go
    plan = advise(cfg, 4, int(usable / 0.95) + GiB // 2)
    assert plan.fits and set(plan.layers) != {"none"}
    model = TransformerLM(cfg)
    handle = apply_activation_checkpointing(model, plan.policy)
    assert [r.kind for r in handle.regions] == [r.kind for r in plan.policy.regions(4)]
    x = torch.randint(0, 32, (1, 16))
    cross_entropy(model(x), x).backward()


def test_cli_json_and_exit_codes(capsys):
    assert advise_main(["--size", "xl", "--context-length", "2048", "--batch-size", "4", "--gpu-memory", "80GiB",
                        "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["predicted_peak_bytes"] <= out["usable_bytes"] and len(out["layers"]) == 32
    assert advise_main(["--size", "xl", "--context-length", "2048", "--gpu-memory", "30GiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert advise_main(["--size", "small", "--gpu-memory", "lots"]) == 2
    assert "memory size" in capsys.readouterr().err
    assert advise_main(["--size", "small", "--attention", "nope"]) == 2
    assert advise_main(["--size", "small", "--dtype", "bf16", "--attention", "flash_triton"]) == 0
    text = capsys.readouterr().out
    assert "policy spec:" in text and "bf16" in text


def test_ffn_blocks_are_chosen_when_cheaper_per_byte():
    """With fused attention an ffn block frees the norm's and SwiGLU's tensors for two matmuls: the advisor
    prefers it to rerunning whole blocks, never does worse than without it, and keeps to the kinds it is given."""
    with_ffn = advise(XL, 4, parse_bytes("80GiB"), attention="sdpa")
    without = advise(XL, 4, parse_bytes("80GiB"), attention="sdpa", kinds=("none", "full", "offload"))
    assert with_ffn.fits and "ffn" in with_ffn.layers and with_ffn.overhead <= without.overhead
    only = advise(XL, 4, parse_bytes("120GiB"), attention="sdpa", kinds=("none", "ffn"))
    assert only.fits and set(only.layers) <= {"none", "ffn"} and "ffn" in only.layers
    assert "ffn" in only.reason
