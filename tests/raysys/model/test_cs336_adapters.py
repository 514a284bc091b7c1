"""raysys.model.cs336_adapters: every hook the course's `tests/adapters.py` names resolves, has the course's signature,
and does the course's job cheaply on the CPU: both FlashAttention-2 classes against plain attention (the Triton
one under TRITON_INTERPRET=1), and DDP, FSDP and the sharded optimizer on 2 gloo ranks against single-process
training."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raysys.model import cs336_adapters as adapters
from tests.parallel.dist_utils import run_ranks

# The hooks of stanford-cs336/assignment2-systems tests/adapters.py and their parameters, in order.
COURSE_HOOKS = {
    "get_flashattention_autograd_function_pytorch": [],
    "get_flashattention_autograd_function_triton": [],
    "get_ddp": ["module"],
    "ddp_on_after_backward": ["ddp_model", "optimizer"],
    "get_fsdp": ["module", "compute_dtype"],
    "fsdp_on_after_backward": ["fsdp_model", "optimizer"],
    "fsdp_gather_full_params": ["fsdp_model"],
    "get_sharded_optimizer": ["params", "optimizer_cls", "kwargs"],
}


def test_every_course_hook_resolves_with_the_course_signature():
    assert sorted(adapters.__all__) == sorted(COURSE_HOOKS)
    namespace: dict = {}
    exec("from raysys.model.cs336_adapters import *", namespace)     # what the course's adapters.py would re-export
    for name, params in COURSE_HOOKS.items():
        hook = namespace[name]
        assert callable(hook), name
        assert list(inspect.signature(hook).parameters) == params, name
    assert inspect.signature(adapters.get_fsdp).parameters["compute_dtype"].default is None
    kinds = inspect.signature(adapters.get_sharded_optimizer).parameters
    assert kinds["kwargs"].kind is inspect.Parameter.VAR_KEYWORD


def test_a_missing_feature_is_named():
    with pytest.raises(NotImplementedError, match=r"widget \(math.no_such_name\) is not available"):
        adapters._load("math", "no_such_name", "widget")


def _attention(q, k, v, is_causal):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), -1e6)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("hook", ["get_flashattention_autograd_function_pytorch",
                                  pytest.param("get_flashattention_autograd_function_triton",
                                               marks=pytest.mark.interpret)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_attention_classes_do_the_courses_job(hook, is_causal):
    """As the course's test_attention.py calls them: `.apply(q, k, v, is_causal)` on (batch, seq, d) fp32 inputs;
    L is the one saved tensor of shape (batch, n_queries); gradients match plain attention's."""
    cls = getattr(adapters, hook)()
    assert isinstance(cls, type) and issubclass(cls, torch.autograd.Function)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 32, 16, generator=g, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 32, 16, generator=g)
    out = cls.apply(q, k, v, is_causal)
    lse = [t for t in out.grad_fn.saved_tensors if t.shape == (q.shape[0], q.shape[1])]
    assert len(lse) == 1
    ref_out, ref_lse = _attention(q, k, v, is_causal)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse[0], ref_lse, rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------------- 2 gloo ranks
class _Toy(nn.Module):
    """Embedding and torch Linear layers (odd sizes: shards need padding on 2 ranks)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(23, 10)
        self.up = nn.Linear(10, 13)
        self.down = nn.Linear(13, 23, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.embedding(x))))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 23, (4, 5), generator=g), torch.randint(0, 23, (4, 5), generator=g))
            for _ in range(steps)]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _train(model, optimizer, batches, rank=0, world_size=1, after_backward=None):
    """Each rank trains on its contiguous slice of every batch; `after_backward(model, optimizer)` before the step."""
    for x, y in batches:
        rows = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
        optimizer.zero_grad(set_to_none=True)
        _loss(model, x[rows], y[rows]).backward()
        if after_backward is not None:
            after_backward(model, optimizer)
        optimizer.step()


def _max_diff(params: dict[str, torch.Tensor], reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    assert set(params) == set(ref)
    return max((params[n] - ref[n]).abs().max().item() for n in ref)


def _hooks_on_a_rank(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    base, batches = _Toy(), _batches(3)
    reference = copy.deepcopy(base)
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.5), batches)
    adam_reference = copy.deepcopy(base)
    _train(adam_reference, torch.optim.AdamW(adam_reference.parameters(), lr=0.05), batches)
    out = {}

    ddp = adapters.get_ddp(copy.deepcopy(base))
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.5), batches, rank, world_size, adapters.ddp_on_after_backward)
    out["ddp"] = _max_diff({n.removeprefix("module."): p for n, p in ddp.named_parameters()}, reference)

    fsdp = adapters.get_fsdp(copy.deepcopy(base))
    _train(fsdp, torch.optim.SGD(fsdp.parameters(), lr=0.5), batches, rank, world_size,
           adapters.fsdp_on_after_backward)
    out["fsdp"] = _max_diff(adapters.fsdp_gather_full_params(fsdp), reference)
    out["fsdp_compute_dtype"] = str(adapters.get_fsdp(_Toy(), compute_dtype=torch.bfloat16).compute_dtype)

    sharded_model = adapters.get_ddp(copy.deepcopy(base))
    sharded = adapters.get_sharded_optimizer(sharded_model.parameters(), torch.optim.AdamW, lr=0.05)
    _train(sharded_model, sharded, batches, rank, world_size, adapters.ddp_on_after_backward)
    out["sharded"] = _max_diff({n.removeprefix("module."): p for n, p in sharded_model.named_parameters()},
                               adam_reference)
    dist.barrier()
    return out


@pytest.mark.multiproc
def test_distributed_hooks_match_single_process_training():
    for rank, out in enumerate(run_ranks(_hooks_on_a_rank, 2)):
        assert out["ddp"] < 1e-5, (rank, out)
        assert out["fsdp"] < 1e-5, (rank, out)
        assert out["sharded"] < 1e-5, (rank, out)
        assert out["fsdp_compute_dtype"] == "torch.bfloat16"
