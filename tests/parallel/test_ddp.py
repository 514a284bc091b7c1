"""DDP variants against single-process training on the full batch, on 2 gloo ranks.

Each rank function trains every variant in turn (one process spawn per model keeps the file fast) and
returns, per variant and step, the largest parameter difference to a single-process replica trained on the
whole batch, and how many all-reduces the step issued (counted by wrapping the process group's `allreduce` and
`allreduce_coalesced`, which `dist.all_reduce` and the wrappers' direct calls both go through).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.ddp import BucketedDDP, OverlappedDDP, assign_buckets, compiled_regions, make_ddp, ready_together
from raysys.model.config import ModelConfig
from raysys.model.transformer import TransformerLM, cross_entropy
from raysys.measure.timing import dynamo_graphs
from raysys.training.step import compile_blocks
from tests.once import once_per_run
from tests.parallel.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc

WORLD_SIZE = 2
ATOL = 1e-6


class ToyModel(nn.Module):
    """A frozen bias (differs per rank before the broadcast) and a frozen constant parameter."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = nn.Linear(10, 50)
        self.fc2.bias.requires_grad_(False)
        self.fc3 = nn.Linear(50, 5, bias=False)
        self.no_grad_fixed_param = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TiedModel(nn.Module):
    """fc4 reuses fc2's weight: one parameter, two uses, reduced once."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 10, bias=False)
        self.fc4 = nn.Linear(10, 50, bias=False)
        self.fc4.weight = self.fc2.weight
        self.fc5 = nn.Linear(50, 5, bias=False)

    def forward(self, x):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.fc5(torch.relu(self.fc4(torch.relu(self.fc3(h)))))


class BranchModel(nn.Module):
    """`branch` takes part only when asked: its parameters get no gradient in some steps on some ranks."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(10, 10)
        self.branch = nn.Linear(10, 10)
        self.head = nn.Linear(10, 5)

    def forward(self, x, use_branch: bool = True):
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


# Whether each rank uses BranchModel's branch, per step: both, rank 0 only, neither, rank 1 only.
BRANCH_SCHEDULE = [(True, True), (True, False), (False, False), (False, True)]

TOY_VARIANTS = [
    ("naive", {}),
    ("flat", {}),
    ("overlapped", {}),
    ("bucketed", {"bucket_size_mb": 1e-4}),                                # smaller than any parameter
    ("bucketed", {"bucket_size_mb": 0.003}),                               # multi-parameter buckets
    ("bucketed", {"bucket_size_mb": 0.003, "grad_as_bucket_view": False}),  # copy-in / copy-out
    ("bucketed", {"bucket_size_mb": 1000.0}),                              # everything in one bucket
]


def _name(kind: str, kwargs: dict) -> str:
    return kind + "".join(f",{k}={v}" for k, v in sorted(kwargs.items()))


def _build(model_name: str) -> nn.Module:
    if model_name == "transformer":
        return TransformerLM(ModelConfig.from_name("tiny"))
    if model_name == "transformer-compiled":   # the sweeps' --compile; aot_eager: eager's kernels, no codegen
        model = TransformerLM(ModelConfig.from_name("tiny"))
        compile_blocks(model, backend="aot_eager")
        return model
    return {"toy": ToyModel, "tied": TiedModel, "branch": BranchModel}[model_name]()


def _batch(model_name: str, step: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    if model_name.startswith("transformer"):
        tokens = torch.randint(0, 256, (n, 17), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(n, 10, generator=g), torch.randn(n, 5, generator=g)


def _loss(model_name: str, model: nn.Module, x, y, use_branch: bool = True) -> torch.Tensor:
    if model_name.startswith("transformer"):
        return cross_entropy(model(x), y)
    out = model(x, use_branch) if model_name == "branch" else model(x)
    return nn.functional.mse_loss(out, y)


def _optimizer(model_name: str, params):
    if model_name.startswith("transformer"):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if model_name == "branch":   # no momentum: a zero gradient and no gradient are then the same update
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@contextlib.contextmanager
def _count_all_reduces():
    """Counts all-reduce calls on process groups (one per collective, a coalesced one included): the variants look
    the methods up at call time."""
    calls: list[int] = []
    # The class's own entries (pybind's instancemethod descriptors), put back as they were: getattr would give
    # the bare builtin, which no longer binds `self` once set on the class.
    originals = {name: vars(dist.ProcessGroup)[name] for name in ("allreduce", "allreduce_coalesced")}

    def counting(original):
        method = original.__func__
        def call(self, tensors, *args, **kwargs):
            calls.append(sum(t.numel() for t in tensors))
            return method(self, tensors, *args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(dist.ProcessGroup, name, counting(original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist.ProcessGroup, name, original)


def _train_variants(rank: int, world_size: int, model_name: str, variants: list, num_steps: int) -> dict:
    results = {}
    for kind, kwargs in variants:
        torch.manual_seed(0)
        reference = _build(model_name)
        torch.manual_seed(rank)              # every rank starts different: the wrapper must broadcast rank 0's
        ddp = make_ddp(kind, _build(model_name), **kwargs)
        init_diff = max((a - b).abs().max().item() for a, b in zip(reference.state_dict().values(),
                                                                   ddp.module.state_dict().values()))
        ref_opt = _optimizer(model_name, reference.parameters())
        ddp_opt = _optimizer(model_name, ddp.parameters())
        step_diffs, step_calls, grads_kept = [], [], []
        for step in range(num_steps):
            x, y = _batch(model_name, step)
            half = x.shape[0] // world_size
            lo, hi = rank * half, (rank + 1) * half
            use = BRANCH_SCHEDULE[step % len(BRANCH_SCHEDULE)]

            ref_opt.zero_grad()
            ref_loss = sum(_loss(model_name, reference, x[r * half:(r + 1) * half], y[r * half:(r + 1) * half],
                                 use[r]) for r in range(world_size)) / world_size
            ref_loss.backward()
            ref_opt.step()

            ddp_opt.zero_grad()
            with _count_all_reduces() as calls:
                _loss(model_name, ddp, x[lo:hi], y[lo:hi], use[rank]).backward()
                before = _grad_storages(ddp)
                ddp.finish_gradient_synchronization()
            ddp_opt.step()
            step_calls.append(len(calls))
            grads_kept.append(all(b is None or b == a for b, a in zip(before, _grad_storages(ddp))))
            step_diffs.append(max((a - b).abs().max().item() for a, b in zip(reference.parameters(),
                                                                            ddp.module.parameters())))
        trainable = [p for p in ddp.module.parameters() if p.requires_grad]
        results[_name(kind, kwargs)] = dict(
            init_diff=init_diff, step_diffs=step_diffs, step_calls=step_calls, num_trainable=len(trainable),
            num_buckets=getattr(ddp, "num_buckets", None), grads_kept=grads_kept,
            bucket_sizes=[len(b.params) for b in ddp.buckets] if hasattr(ddp, "buckets") else None,
            copy_buffers=sum(b.buffer is not None for b in ddp.buckets) if isinstance(ddp, BucketedDDP) else None,
            multi_param_buckets=sum(len(b.params) > 1 for b in ddp.buckets) if isinstance(ddp, BucketedDDP) else None)
    return results


def _grad_storages(ddp: nn.Module) -> list[int | None]:
    """Where each parameter's .grad lies: finish must reduce the gradients backward made in place, never replace
    them (a parameter without one gets zeros)."""
    return [None if p.grad is None else p.grad.data_ptr() for p in ddp.module.parameters()]


def _expected_calls(kind: str, result: dict) -> int:
    return {"naive": result["num_trainable"], "flat": 1, "overlapped": result["num_buckets"],
            "bucketed": result["num_buckets"]}[kind]


def _check(results_by_rank: list[dict], variants: list, num_steps: int) -> None:
    for kind, kwargs in variants:
        name = _name(kind, kwargs)
        for rank, results in enumerate(results_by_rank):
            r = results[name]
            assert r["init_diff"] == 0.0, f"{name} rank {rank}: replica differs from rank 0's initial state"
            assert max(r["step_diffs"]) <= ATOL, f"{name} rank {rank}: parameter diffs per step {r['step_diffs']}"
            if kind != "torch":   # torch's reducer calls its process group directly, not dist.all_reduce
                assert r["step_calls"] == [_expected_calls(kind, r)] * num_steps, f"{name}: {r['step_calls']}"
            if kind == "bucketed":
                size = kwargs["bucket_size_mb"]
                if size < 1e-3:
                    assert r["num_buckets"] == r["num_trainable"], f"{name}: tiny buckets hold one parameter each"
                if size >= 1000:
                    assert r["num_buckets"] == 1, f"{name}: a huge bucket holds everything"
                if 1e-3 < size < 1000:
                    assert r["num_buckets"] < r["num_trainable"], f"{name}: no bucket holds several parameters"
                # In place: no buffer at all; the textbook variant: one per bucket of several parameters.
                assert r["copy_buffers"] == (0 if kwargs.get("grad_as_bucket_view", True)
                                             else r["multi_param_buckets"]), name
            if kind in ("overlapped", "bucketed"):
                assert all(r["grads_kept"]), f"{name}: finish replaced .grad tensors: {r['grads_kept']}"


TOY_STEPS = 4


def _toy_checks(rank: int, world_size: int) -> dict:
    """Everything the toy-model tests below assert on, computed in one spawn of the ranks (spawns are slow)."""
    return {"train": {name: _train_variants(rank, world_size, name, TOY_VARIANTS, TOY_STEPS)
                      for name in ("toy", "tied", "branch")},
            "no_sync": {kind: _no_sync_accumulation(rank, world_size, kind)
                        for kind in ("naive", "flat", "overlapped", "bucketed")},
            "misuse": _misuse(rank, world_size),
            "lifetime": _lifetime(rank, world_size),
            "torch": _train_variants(rank, world_size, "toy", [("torch", {})], TOY_STEPS)}


@pytest.fixture(scope="module")
def toy_checks(tmp_path_factory) -> list[dict]:
    return once_per_run(tmp_path_factory, "ddp_toy_checks", lambda: run_ranks(_toy_checks, WORLD_SIZE))


@pytest.mark.parametrize("model_name", ["toy", "tied", "branch"])
def test_variants_match_single_process_training(toy_checks, model_name):
    results = [r["train"][model_name] for r in toy_checks]
    _check(results, TOY_VARIANTS, TOY_STEPS)
    if model_name == "toy":   # 3 trainable tensors: fc1.weight, fc2.weight, fc3.weight (fc2.bias is frozen)
        assert results[0]["naive"]["num_trainable"] == 3
    if model_name == "tied":  # the shared weight counts once: fc1, fc2 (= fc4), fc3, fc5
        assert results[0]["naive"]["num_trainable"] == 4


def test_torch_ddp_adapter_matches_too(toy_checks):
    _check([r["torch"] for r in toy_checks], [("torch", {})], TOY_STEPS)


def test_assign_buckets_reverse_order_cap_and_dtype():
    p = {name: nn.Parameter(torch.zeros(n, dtype=dtype)) for name, n, dtype in [
        ("a", 100, torch.float32), ("b", 300, torch.float32), ("c", 200, torch.float32),
        ("d", 50, torch.float32), ("e", 10, torch.bfloat16), ("f", 2000, torch.float32)]}
    names = {id(t): n for n, t in p.items()}
    partition = lambda mb: [[names[id(t)] for t in bucket] for bucket in assign_buckets(list(p.values()), mb)]
    # 2000 B cap: f (8000 B) alone; e is another dtype; d + c (1000 B) fit, b (1200 B) would not; then b + a.
    assert partition(2000 / 2**20) == [["f"], ["e"], ["d", "c"], ["b", "a"]]
    assert partition(0) == [["f"], ["e"], ["d"], ["c"], ["b"], ["a"]]
    assert partition(1.0) == [["f"], ["e"], ["d", "c", "b", "a"]]


TRANSFORMER_VARIANTS = [
    ("naive", {}),
    ("flat", {}),
    ("overlapped", {}),
    ("bucketed", {"bucket_size_mb": 0.05}),
    ("bucketed", {"bucket_size_mb": 0.05, "grad_as_bucket_view": False}),
    ("bucketed", {"bucket_size_mb": 1000.0}),
]


@pytest.mark.slow
def test_variants_match_single_process_training_transformer():
    num_steps = 3
    results = run_ranks(_train_variants, WORLD_SIZE, "transformer", TRANSFORMER_VARIANTS, num_steps)
    _check(results, TRANSFORMER_VARIANTS, num_steps)


WORLD_OF_ONE = [("naive", {}), ("flat", {}), ("overlapped", {}), ("bucketed", {"bucket_size_mb": 0.05}),
                ("bucketed", {"bucket_size_mb": 0.05, "grad_as_bucket_view": False}), ("bucketed", {"bucket_size_mb": 1000.0})]
# The same wrappers told to run the collective path of a larger group (what a one-GPU measurement of its cost needs).
ALONE = [(kind, {**kwargs, "collectives_alone": True}) for kind, kwargs in WORLD_OF_ONE]


def _world_of_one(rank: int, world_size: int) -> dict:
    """Every variant on a group of one against plain training of the same model on the same batch (what the sweeps'
    `--world-size 1` times): per step, the parameters not bitwise equal, and the collectives issued."""
    out = {}
    for kind, kwargs in WORLD_OF_ONE + ALONE:
        torch.manual_seed(0)
        reference = _build("transformer")
        torch.manual_seed(0)
        ddp = make_ddp(kind, _build("transformer"), **kwargs)
        ref_opt, ddp_opt = _optimizer("transformer", reference.parameters()), _optimizer("transformer", ddp.parameters())
        mismatched, calls_per_step = [], []
        for step in range(2):
            x, y = _batch("transformer", step)
            ref_opt.zero_grad(set_to_none=True)
            _loss("transformer", reference, x, y).backward()
            ref_opt.step()
            ddp_opt.zero_grad(set_to_none=True)
            with _count_all_reduces() as calls:
                _loss("transformer", ddp, x, y).backward()
                ddp.finish_gradient_synchronization()
            ddp_opt.step()
            calls_per_step.append(len(calls))
            mismatched.append([n for (n, p), q in zip(reference.named_parameters(), ddp.module.parameters())
                               if not torch.equal(p, q)])
        out[_name(kind, kwargs)] = dict(mismatched=mismatched, calls=calls_per_step, expected=ddp.num_collectives)
    return out


def _world_of_one_unused(rank: int, world_size: int) -> dict:
    """BranchModel on a group of one, its branch unused in the second step: which parameters end each step without
    a gradient, per variant and for the plain model (a group of one adds no zeros: it is the identity)."""
    out = {}
    for kind, kwargs in [("plain", {})] + WORLD_OF_ONE:
        torch.manual_seed(0)
        model = _build("branch") if kind == "plain" else make_ddp(kind, _build("branch"), **kwargs)
        no_grad = []
        for step, use in enumerate((True, False)):
            model.zero_grad(set_to_none=True)
            x, y = _batch("branch", step)
            _loss("branch", model, x, y, use).backward()
            getattr(model, "finish_gradient_synchronization", lambda: None)()
            no_grad.append(sorted(n.removeprefix("module.") for n, p in model.named_parameters() if p.grad is None))
        out[_name(kind, kwargs)] = no_grad
    return out


def _world_of_one_all(rank: int, world_size: int) -> tuple[dict, dict]:
    return _world_of_one(rank, world_size), _world_of_one_unused(rank, world_size)


def test_group_of_one_trains_bitwise_like_one_process():
    """A group of one is the identity: bitwise the plain model's training, no collective at all (the hooks and
    bucket bookkeeping still run), and an unused parameter keeps no gradient, as without a wrapper. With
    `collectives_alone` it issues every collective a larger group does, one per bucket, and is still bitwise equal."""
    [(results, unused)] = run_ranks(_world_of_one_all, 1)
    assert len(results) == len(WORLD_OF_ONE + ALONE)
    for name, r in results.items():
        assert r["mismatched"] == [[], []], f"{name}: {r['mismatched']}"
        if "collectives_alone" in name:
            assert r["expected"] > 0 and r["calls"] == [r["expected"]] * 2, f"{name}: {r}"
        else:
            assert r["calls"] == [0, 0] and r["expected"] == 0, f"{name}: a group of one issued collectives: {r}"
    plain = unused.pop("plain")
    assert plain[0] == [] and plain[1] and all("branch" in n for n in plain[1]), plain
    for name, no_grad in unused.items():
        assert no_grad == plain, f"{name}: {no_grad} != {plain}"


def _train_compiled(rank: int, world_size: int, variants: list, num_steps: int) -> tuple[dict, int]:
    graphs = dynamo_graphs()
    return _train_variants(rank, world_size, "transformer-compiled", variants, num_steps), dynamo_graphs() - graphs


def test_variants_match_single_process_training_with_compiled_blocks():
    """Gradient hooks fire after each compiled block's backward; the reductions are unchanged. `overlapped` issues a
    block's gradients, ready at once, in one call (one per other parameter); with group_compiled=False one each."""
    variants = [("overlapped", {}), ("overlapped", {"group_compiled": False}), ("bucketed", {"bucket_size_mb": 0.1}),
                ("bucketed", {"bucket_size_mb": 1000.0})]
    results = run_ranks(_train_compiled, WORLD_SIZE, variants, 2)
    _check([r for r, _ in results], variants, 2)
    assert all(graphs > 0 for _, graphs in results), results   # the blocks did run compiled
    model = _build("transformer-compiled")
    per_block = len(list(model.layers[0].parameters()))
    outside = sum(1 for n, _ in model.named_parameters() if not n.startswith("layers."))
    for r, _ in results:
        grouped, each = r["overlapped"], r["overlapped,group_compiled=False"]
        assert each["bucket_sizes"] == [1] * each["num_trainable"], each["bucket_sizes"]
        # Reverse order: the final norm and the LM head alone, each block's parameters together, the embedding alone.
        assert sorted(grouped["bucket_sizes"]) == [1] * outside + [per_block] * len(model.layers), grouped
        assert grouped["num_buckets"] == outside + len(model.layers), grouped


def _model_with_tied_and_compiled_parts() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4),
                          nn.Linear(4, 4))
    model[1].forward = torch.compile(model[1].forward, backend="eager")
    model[3].compile(backend="eager")
    return model


def test_ready_together_groups_each_compiled_region_and_keeps_shared_parameters_alone():
    model = _model_with_tied_and_compiled_parts()
    assert compiled_regions(model) == [model[1], model[3]]
    params = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g] for g in ready_together(model, params)]
    assert groups == [["3.bias", "3.weight"], ["2.bias"], ["2.weight"], ["1.1.bias", "1.1.weight", "1.0.bias",
                                                                        "1.0.weight"], ["0.bias"], ["0.weight"]]
    model[2].weight = model[1][1].weight      # tied: also registered outside the region, so it stays alone
    params = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g] for g in ready_together(model, params)]
    assert groups == [["3.bias", "3.weight"], ["2.bias"], ["1.1.bias"], ["1.1.weight"], ["1.0.bias", "1.0.weight"],
                      ["0.bias"], ["0.weight"]], groups
    assert compiled_regions(torch.compile(model, backend="eager"))[0] is not None
    with pytest.raises(ValueError, match="group_compiled"):
        OverlappedDDP(model, group_compiled=1)


def test_a_compiled_blocks_gradients_are_accumulated_back_to_back():
    """What `ready_together` relies on: between the first and the last post-accumulate-grad hook of a compiled
    block's parameters, autograd runs no other node (every node's pre-hook records that it started)."""
    torch.manual_seed(0)
    model = _build("transformer-compiled")
    block_of = {id(p): i for i, block in enumerate(model.layers) for p in block.parameters()}
    events: list = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: events.append(("param", block_of.get(id(p)))))
               for p in model.parameters()]
    x, y = _batch("transformer", 0)
    loss = _loss("transformer", model, x, y)
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            handles.append(node.register_prehook(lambda grads, name=type(node).__name__: events.append(("node", name))))
        stack.extend(n for n, _ in node.next_functions)
    loss.backward()
    for h in handles:
        h.remove()
    assert any(name == "CompiledFunctionBackward" for kind, name in events if kind == "node"), events
    for i in range(len(model.layers)):
        at = [j for j, e in enumerate(events) if e == ("param", i)]
        assert len(at) == len(list(model.layers[i].parameters())), (i, events)
        assert at == list(range(at[0], at[-1] + 1)), f"block {i}: another node ran between its hooks: {events}"


def _no_sync_accumulation(rank: int, world_size: int, kind: str) -> dict:
    """Two micro-batches per rank, the first under no_sync(), against one full-batch step."""
    torch.manual_seed(0)
    reference = ToyModel()
    torch.manual_seed(rank)
    ddp = make_ddp(kind, ToyModel(), **({"bucket_size_mb": 0.003} if kind == "bucketed" else {}))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    diffs, calls_in_no_sync, calls_total = [], [], []
    for step in range(3):
        x, y = _batch("toy", step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()

        ddp_opt.zero_grad(set_to_none=step % 2 == 0)   # both zero_grad modes
        local_x, local_y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        micro = list(zip(local_x.chunk(2), local_y.chunk(2)))
        with _count_all_reduces() as calls:
            with ddp.no_sync():
                (nn.functional.mse_loss(ddp(micro[0][0]), micro[0][1]) / 2).backward()
                ddp.finish_gradient_synchronization()   # a no-op inside no_sync
            calls_in_no_sync.append(len(calls))
            (nn.functional.mse_loss(ddp(micro[1][0]), micro[1][1]) / 2).backward()
            ddp.finish_gradient_synchronization()
        calls_total.append(len(calls))
        ddp_opt.step()
        diffs.append(max((a - b).abs().max().item() for a, b in zip(reference.parameters(), ddp.module.parameters())))
    return dict(diffs=diffs, calls_in_no_sync=calls_in_no_sync, calls_total=calls_total)


def _misuse(rank: int, world_size: int) -> dict:
    errors = {}
    ddp = make_ddp("bucketed", ToyModel(), bucket_size_mb=0.003)
    x, y = _batch("toy", 0)
    nn.functional.mse_loss(ddp(x), y).backward()
    try:
        ddp(x)          # the previous backward's reductions were never finished
    except RuntimeError as exc:
        errors["forward_before_finish"] = str(exc)
    ddp.finish_gradient_synchronization()
    for key, build in [("negative_bucket", lambda: make_ddp("bucketed", ToyModel(), bucket_size_mb=-1.0)),
                       ("unknown_kind", lambda: make_ddp("ring", ToyModel())),
                       ("structure", lambda: make_ddp("naive", nn.Linear(4, 4 + rank)))]:
        try:
            build()
        except ValueError as exc:
            errors[key] = str(exc)
    return errors


def _lifetime(rank: int, world_size: int) -> dict:
    """Hook-driven wrappers must not be kept alive by their own hooks (a parameter's hook dict is held from C++,
    invisible to the cycle collector): checked with the collector off, so only reference counting frees."""
    out = {}
    for kind, kwargs in (("overlapped", {}), ("bucketed", {"bucket_size_mb": 0.003})):
        module = ToyModel()
        ddp = make_ddp(kind, module, **kwargs)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x, y = _batch("toy", 0)
        nn.functional.mse_loss(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        wrapper, model = weakref.ref(ddp), weakref.ref(module)
        params = list(module.parameters())
        hooks_while_wrapped = sum(len(p._post_accumulate_grad_hooks or {}) for p in params)
        gc.disable()
        try:
            del ddp, optimizer
            wrapper_freed = wrapper() is None
            hooks_left = sum(len(p._post_accumulate_grad_hooks or {}) for p in params)
            del module, params
            model_freed = model() is None
        finally:
            gc.enable()
        # remove_hooks(): explicit, idempotent, and the wrapper refuses to train afterwards.
        ddp = make_ddp(kind, ToyModel(), **kwargs)
        ddp.remove_hooks()
        ddp.remove_hooks()
        hooks_after_remove = sum(len(p._post_accumulate_grad_hooks or {}) for p in ddp.module.parameters())
        try:
            ddp(x)
            forward_error = ""
        except RuntimeError as exc:
            forward_error = str(exc)
        out[kind] = dict(hooks_while_wrapped=hooks_while_wrapped, wrapper_freed=wrapper_freed, hooks_left=hooks_left,
                         model_freed=model_freed, hooks_after_remove=hooks_after_remove, forward_error=forward_error)
    return out


def test_wrappers_are_freed_with_their_hooks(toy_checks):
    for checks in toy_checks:
        for kind, r in checks["lifetime"].items():
            assert r["hooks_while_wrapped"] == 3, kind              # fc1, fc2, fc3 weights (fc2.bias is frozen)
            assert r["wrapper_freed"] and r["hooks_left"] == 0, f"{kind}: the dropped wrapper is still alive: {r}"
            assert r["model_freed"], f"{kind}: the model outlived its last reference: {r}"
            assert r["hooks_after_remove"] == 0 and "remove_hooks" in r["forward_error"], kind


def test_no_sync_accumulates_locally_then_reduces_once(toy_checks):
    for rank, checks in enumerate(toy_checks):
        for kind, r in checks["no_sync"].items():
            assert max(r["diffs"]) <= ATOL, f"{kind} rank {rank}: {r['diffs']}"
            assert r["calls_in_no_sync"] == [0, 0, 0], f"{kind}: no_sync must not communicate"
            assert min(r["calls_total"]) > 0


def test_misuse_is_reported(toy_checks):
    for checks in toy_checks:
        errors = checks["misuse"]
        assert "finish_gradient_synchronization" in errors["forward_before_finish"]
        assert "bucket_size_mb (-1.0)" in errors["negative_bucket"]
        assert "'ring'" in errors["unknown_kind"]
        assert "module structure differs across ranks" in errors["structure"]


def test_wrapper_without_process_group_is_a_value_error():
    with pytest.raises(ValueError, match="process group"):
        make_ddp("naive", nn.Linear(2, 2))
