"""FSDP (parallel/fsdp.py) on 2 gloo ranks against single-process training.

Bitwise invariant (fp32). Rank r computes the gradient g_r of the mean loss over its half of the batch; FSDP
sums the two with one fp32 add inside the reduce-scatter / all-reduce and divides by 2. An fp32 add of two
numbers is commutative and / 2 is exact, so the reference below, which runs the same model on the same two
halves in one process and sets grad = (g_0 + g_1) / 2, must produce bit-identical parameters after every
optimizer step (SGD, the project's AdamW). A reference on the full batch would differ in the last bits: it
sums the per-example contributions in one matmul, in another order.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.fsdp import FSDP, make_fsdp
from parallel.mixed_precision import CastForCompute
from raysys.model.config import ModelConfig
from raysys.model.transformer import AdamW, Embedding, Linear, RMSNorm, TransformerBlock, TransformerLM, cross_entropy
from raysys.measure.timing import dynamo_graphs
from raysys.training.step import compile_blocks
from tests.once import once_per_run
from tests.parallel.dist_utils import run_ranks

WORLD = 2
BATCH, SEQ = 6, 8


class ToyModel(nn.Module):
    """Embedding, RMSNorm, raysys Linear layers, a torch nn.Linear with bias and a final projection.

    Odd sizes (101 vocab rows, 37 hidden rows) make every sharded weight need padding on 2 ranks.
    """

    def __init__(self, vocab_size: int = 101, d_model: int = 24, d_ff: int = 37, spare: bool = False):
        super().__init__()
        self.embedding = Embedding(vocab_size, d_model)
        self.norm1 = RMSNorm(d_model)
        self.up = Linear(d_model, d_ff)
        self.norm2 = RMSNorm(d_ff)
        self.down = nn.Linear(d_ff, d_model, bias=True)
        self.lm_head = Linear(d_model, vocab_size)
        if spare:  # never called: it gets no gradient
            self.spare = Linear(d_ff, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm1(self.embedding(x)))
        return self.lm_head(self.down(self.norm2(torch.relu(h))))


def _build(kind: str, num_layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    if kind.startswith("toy"):
        model = ToyModel(spare=kind == "toy-spare")
        if kind == "toy-frozen":  # its weight is still needed in backward, for the input's gradient
            model.up.weight.requires_grad_(False)
        return model
    return TransformerLM(ModelConfig.from_name("tiny", num_layers=num_layers))


# Units per model kind: None = every sharded module alone; the whole toy model as one unit (padding, a bias, an
# embedding and, for toy-spare, a weight without gradient, all in one all-gather); tiny's blocks.
# `<units>-flat`: the same units with `flat_collectives=True` (one flat all-gather and reduce-scatter per unit).
UNITS = {"layer": None, "model": ("ToyModel",), "block": (TransformerBlock,)}
UNITS.update({f"{name}-flat": spec for name, spec in list(UNITS.items())})


def _data(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets of one step's whole batch (the same on every rank; each rank takes its slice)."""
    vocab = 101 if kind.startswith("toy") else ModelConfig.from_name("tiny").vocab_size
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return x, torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return cross_entropy(model(x).float(), y)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05) if name == "sgd" else AdamW(params, lr=1e-2, weight_decay=0.1)


@contextlib.contextmanager
def _cast_weights(model: nn.Module, dtype: torch.dtype | None):
    """Run Linear/Embedding with weights (and biases) cast to `dtype`; gradients flow back to the fp32 masters."""
    if dtype is None:
        yield
        return
    saved = []
    for mod in model.modules():
        if isinstance(mod, (Linear, Embedding, nn.Linear)):
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    saved.append((mod, name, p))
                    mod._parameters[name] = p.to(dtype)
    try:
        yield
    finally:
        for mod, name, p in saved:
            mod._parameters[name] = p


def _padding_rows(w, rank: int, world_size: int) -> torch.Tensor:
    """The rows of this rank's shard gradient that pad the weight (past its last real row): must stay zero."""
    rows = w.shard.shape[0]
    real = max(0, min(rows, w.shape[0] - rank * rows))
    return w.shard.grad[real:]


def _train_and_compare(rank: int, world_size: int, kind: str, opt_name: str, compute_dtype, steps: int,
                       units: str = "layer") -> dict:
    """Train FSDP and the single-process reference side by side; per step: max |difference|, names not bitwise equal."""
    graphs = dynamo_graphs()
    base = _build(kind.removesuffix("-compiled"))
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    if kind.endswith("-compiled"):   # blocks compiled (the sweeps' --compile); aot_eager: same kernels, no codegen
        compile_blocks(ref, backend="aot_eager")
        compile_blocks(mine, backend="aot_eager")
    fsdp = FSDP(mine, compute_dtype=compute_dtype, units=UNITS[units], flat_collectives=units.endswith("-flat"))
    assert not (fsdp._coalesced_gather or fsdp._coalesced_reduce_scatter) or not units.endswith("-flat")
    ref_opt, fsdp_opt = _optimizer(opt_name, ref.parameters()), _optimizer(opt_name, fsdp.parameters())
    local = BATCH // world_size
    diffs, mismatched, names, gathered_after_backward, padding_zero = [], [], [], [], []
    for step in range(steps):
        x, y = _data(kind, step)
        if compute_dtype is None:
            # Per-slice gradients, averaged exactly as the two-rank reduction does: (g_0 + g_1) / 2.
            grads = []
            for r in range(world_size):
                ref.zero_grad(set_to_none=True)
                _loss(ref, x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]).backward()
                grads.append({n: p.grad for n, p in ref.named_parameters()})
            for n, p in ref.named_parameters():
                p.grad = None if grads[0][n] is None else (grads[0][n] + grads[1][n]) / 2
        else:
            ref.zero_grad(set_to_none=True)
            with _cast_weights(ref, compute_dtype):
                _loss(ref, x, y).backward()
        ref_opt.step()

        fsdp_opt.zero_grad(set_to_none=True)
        _loss(fsdp, x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]).backward()
        gathered_after_backward.append(fsdp.gathered_storage_bytes())
        fsdp.finish_gradient_synchronization()
        fsdp_opt.step()

        padding_zero.append(all(_padding_rows(w, rank, world_size).eq(0).all().item() for unit in fsdp._units
                                for w in unit.weights if w.shard.grad is not None))
        full = fsdp.gather_full_params()
        names = list(full)
        diffs.append(max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
        mismatched.append([n for n, p in ref.named_parameters() if not torch.equal(full[n], p.detach())])
    no_grad = lambda model: sorted(n for n, p in model.named_parameters() if p.grad is None)  # noqa: E731
    return dict(diffs=diffs, mismatched=mismatched, names=names, ref_names=[n for n, _ in ref.named_parameters()],
                graphs=dynamo_graphs() - graphs, padding_zero=padding_zero,
                no_grad=no_grad(fsdp.module), ref_no_grad=no_grad(ref), gathered_after_backward=gathered_after_backward)


TRAINING = [("toy", "sgd", None, 3, "layer"), ("toy", "adamw", None, 3, "layer"),
            ("tiny", "adamw", None, 2, "layer"), ("toy", "sgd", torch.float16, 3, "layer"),
            ("toy", "adamw", None, 3, "model"), ("toy-spare", "adamw", None, 3, "model"),
            ("toy-frozen", "adamw", None, 3, "layer"), ("toy-frozen", "adamw", None, 3, "model"),
            ("tiny", "adamw", None, 2, "block"), ("tiny-compiled", "adamw", None, 2, "block"),
            ("toy", "sgd", torch.float16, 3, "model"), ("tiny", "sgd", torch.float16, 2, "block"),
            ("toy-spare", "adamw", None, 3, "model-flat"), ("tiny", "adamw", None, 2, "block-flat"),
            ("tiny", "sgd", torch.float16, 2, "block-flat")]


def _check_training(rank: int, world_size: int) -> dict:
    with warnings.catch_warnings():
        # Dynamo reads `.grad` of the tensors it traces (a warning for non-leaf ones), not the code under test.
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        return {(kind, opt, str(dtype), units): _train_and_compare(rank, world_size, kind, opt, dtype, steps, units)
                for kind, opt, dtype, steps, units in TRAINING}


DEPTHS = (3, 6)  # blocks: with three, the three units alive at once can all be blocks


def _check_sync_and_memory(rank: int, world_size: int, compute_dtype, units: str = "layer") -> dict:
    """Grad shapes/dtypes, replicated grads across ranks, freed weights, collective counts, 1 vs 4 blocks."""
    out = {}
    for num_layers in DEPTHS:
        fsdp = FSDP(_build("tiny", num_layers), compute_dtype=compute_dtype, units=UNITS[units])
        x, _ = _data("tiny", step=rank)  # different data on each rank
        live_after = []
        for _ in range(2):  # the second step prefetches
            fsdp.zero_grad(set_to_none=True)
            fsdp.stats.reset()
            y = fsdp(x)
            live_after.append(fsdp.gathered_storage_bytes())
            y.float().sum().backward()
            fsdp.finish_gradient_synchronization()
            live_after.append(fsdp.gathered_storage_bytes())
        replicated_equal = {}
        for name, p in fsdp.module.named_parameters():
            if id(p) not in fsdp._weight_of_shard:
                both = [torch.empty_like(p.grad) for _ in range(world_size)]
                dist.all_gather(both, p.grad)
                replicated_equal[name] = torch.equal(both[0], both[1])
        s = fsdp.stats
        out[num_layers] = dict(
            grads={n: (p.grad is not None and p.grad.shape == p.shape, p.grad.dtype if p.grad is not None else None)
                   for n, p in fsdp.module.named_parameters()},
            replicated_equal=replicated_equal, live_after=live_after,
            peak=s.peak_gathered_bytes, max_unit=max(unit.nbytes for unit in fsdp._units),
            multi_weight=any(len(unit.weights) > 1 for unit in fsdp._units), units=fsdp.unit_names,
            coalesced=fsdp._coalesced_gather, coalesced_rs=fsdp._coalesced_reduce_scatter,
            counts=(s.all_gathers, s.reduce_scatters, s.all_reduces),
            expected=(2 * len(fsdp._units) - 1, len(fsdp._units), 1))  # replicated grads: one flat all-reduce
        if num_layers == DEPTHS[0]:
            # Accumulation: two forward/backward passes on the same data, one finish -> exactly twice the gradients.
            once = [p.grad.clone() for p in fsdp.module.parameters()]
            fsdp.zero_grad(set_to_none=True)
            for _ in range(2):
                fsdp(x).float().sum().backward()
            fsdp.finish_gradient_synchronization()
            out["accumulated_equal"] = all(torch.equal(p.grad, 2 * g) for p, g in zip(fsdp.module.parameters(), once))
            # The fallbacks (all-reduce + narrow for gloo builds without reduce-scatter, the flat all-gather for
            # backends without coalesced ones) give the same gradients.
            fallback = FSDP(_build("tiny", num_layers), compute_dtype=compute_dtype, units=UNITS[units])
            fallback._reduce_scatter_ok = fallback._coalesced_reduce_scatter = False
            fallback._coalesced_gather = False  # units of several weights: flat all-gather + copy-out
            fallback(x).float().sum().backward()
            fallback.finish_gradient_synchronization()
            out["fallback_equal"] = all(torch.equal(g, q.grad) for g, q in zip(once, fallback.module.parameters()))
            # NCCL's layout: each weight's gradient reduce-scattered as it lies, one coalesced group per unit (gloo
            # runs it as an all-reduce per weight; here once, for the layout, not as the default).
            coalesced = FSDP(_build("tiny", num_layers), compute_dtype=compute_dtype, units=UNITS[units])
            coalesced._coalesced_reduce_scatter = True
            coalesced(x).float().sum().backward()
            coalesced.finish_gradient_synchronization()
            out["coalesced_rs_equal"] = all(torch.equal(g, q.grad)
                                            for g, q in zip(once, coalesced.module.parameters()))
    return out


def _check_prefetch(rank: int, world_size: int, units: str = "layer") -> list:
    events: list = []
    model = _build("tiny", 2)
    for name, mod in model.named_modules():  # registered before FSDP's hooks, so they run first
        if isinstance(mod, (Linear, Embedding)) if units == "layer" else \
                isinstance(mod, TransformerBlock) or (isinstance(mod, (Linear, Embedding)) and "layers" not in name):
            unit_name = f"{name}.weight" if isinstance(mod, (Linear, Embedding)) else name
            mod.register_forward_hook(lambda m, a, o, name=unit_name: events.append(("forward_done", name, "")))
    fsdp = FSDP(model, event_log=events, units=UNITS[units])
    x, y = _data("tiny", 0)
    for _ in range(2):
        events.append(("step", "", ""))
        _loss(fsdp, x, y).backward()
        fsdp.finish_gradient_synchronization()
    return events


def _hook_count(units: list) -> int:
    """Hooks FSDP put on the model: forward pre/post hooks of the units' roots and sharded modules, grad hooks of
    the full weights."""
    modules = {id(m): m for unit in units for m in [unit.root] + [w.module for w in unit.weights]}
    return (sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in modules.values())
            + sum(len(w.full._post_accumulate_grad_hooks or {}) for unit in units for w in unit.weights))


def _check_lifetime(rank: int, world_size: int) -> dict:
    """A dropped wrapper must not be kept alive by its own hooks (a parameter's hook dict is held from C++, invisible
    to the cycle collector): checked with the collector off, so only reference counting frees."""
    module = ToyModel()
    fsdp = FSDP(module)
    optimizer = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    x, y = _data("toy", rank)
    _loss(fsdp, x, y).backward()
    fsdp.finish_gradient_synchronization()
    optimizer.step()
    wrapper, model = weakref.ref(fsdp), weakref.ref(module)
    units = list(fsdp._units)  # kept only to count the hooks left behind
    hooks_while_wrapped = _hook_count(units)
    gc.disable()
    try:
        del fsdp, optimizer
        wrapper_freed = wrapper() is None
        hooks_left = _hook_count(units)
        del module, units
        model_freed = model() is None
    finally:
        gc.enable()
    # remove_hooks(): explicit, idempotent, and the wrapper refuses to train afterwards.
    fsdp = FSDP(ToyModel())
    fsdp.remove_hooks()
    fsdp.remove_hooks()
    try:
        fsdp(x)
        forward_error = ""
    except RuntimeError as exc:
        forward_error = str(exc)
    # With a compute dtype, bias-free modules cast their inputs by a class swapped in (cast_inputs_by_class): their
    # own classes come back with remove_hooks() and when the wrapper is dropped.
    classes = lambda m: [type(mod).__qualname__ + ("*" if hasattr(type(mod), "compute_dtype") else "")  # noqa: E731
                         for mod in m.modules()]
    plain = classes(ToyModel())
    swapped, restored = [], []
    for drop in (False, True):
        model = ToyModel()
        cast = FSDP(model, compute_dtype=torch.bfloat16)
        swapped.append(classes(model))
        if drop:
            del cast
        else:
            cast.remove_hooks()
        restored.append(classes(model) == plain)
    return dict(hooks_while_wrapped=hooks_while_wrapped, wrapper_freed=wrapper_freed, hooks_left=hooks_left,
                model_freed=model_freed, hooks_after_remove=_hook_count(fsdp._units), forward_error=forward_error,
                swapped=swapped, classes_restored=restored)


def _check_in_place_gather(rank: int, world_size: int) -> dict:
    """With a compute dtype, each weight's all-gather reads this rank's slot of its own output (in place, as NCCL
    needs for aliasing buffers: any other slot would race with the gather), and the cast landed there: tiny's
    blocks (runs of same-size weights) and the toy model as one unit (padded weights of four sizes)."""
    in_place, cast_ok = [], []
    for fsdp in (FSDP(_build("tiny", 2), compute_dtype=torch.bfloat16, units=UNITS["block"]),
                 FSDP(_build("toy"), compute_dtype=torch.bfloat16, units=UNITS["model"])):
        _gather_each_unit(fsdp, rank, in_place, cast_ok)
    return dict(in_place=in_place, cast_ok=cast_ok)


def _gather_each_unit(fsdp: FSDP, rank: int, in_place: list[bool], cast_ok: list[bool]) -> None:
    for unit in fsdp._units:
        unit.start_gather(fsdp, "forward")
        in_place += [s.data_ptr() == w.padded[rank].data_ptr() for s, w in zip(unit._send, unit.weights)]
        expected = [shard.to(torch.bfloat16) for shard in unit.shard_flat.split(unit.sizes)]
        unit.wait_gather(fsdp)
        cast_ok += [torch.equal(w.padded[rank], e) for w, e in zip(unit.weights, expected)]
        unit.free(fsdp)


def _check_one_in_flight(rank: int, world_size: int) -> list[int]:
    """On gloo the wrapper keeps one collective in flight: per collective issued (two bf16 training steps with
    prefetch, per-block units), how many were in flight with it."""
    fsdp = FSDP(_build("tiny", 3), compute_dtype=torch.bfloat16, units=UNITS["block"])
    optimizer = _optimizer("adamw", fsdp.parameters())
    in_flight = []

    def log(event: str, name: str, phase: str) -> None:
        issued = 1 if event == "reduce_scatter" else 0  # a gather is GATHERING when logged; a reduction not yet pending
        in_flight.append(sum(u.state == "gathering" for u in fsdp._units) + len(fsdp._pending) + issued)

    fsdp._log = log
    for step in range(2):
        x, y = _data("tiny", step)
        optimizer.zero_grad(set_to_none=True)
        _loss(fsdp, x[rank::world_size], y[rank::world_size]).backward()
        fsdp.finish_gradient_synchronization()
        optimizer.step()
    return in_flight


def _all_checks(rank: int, world_size: int) -> dict:
    # One pair of processes for the whole file: spawning and importing torch (dynamo, on the first optimizer)
    # costs more than all the checks together.
    # As the course's test_fsdp.py runs: deterministic kernels, anomaly mode, every warning an error.
    torch.use_deterministic_algorithms(True)
    torch.autograd.set_detect_anomaly(True, check_nan=False)
    warnings.simplefilter("error")
    return dict(training=_check_training(rank, world_size),
                sync={(str(dt), units): _check_sync_and_memory(rank, world_size, dt, units)
                      for dt in (None, torch.bfloat16) for units in ("layer", "block")},
                prefetch={units: _check_prefetch(rank, world_size, units) for units in ("layer", "block")},
                lifetime=_check_lifetime(rank, world_size), in_place=_check_in_place_gather(rank, world_size),
                one_in_flight=_check_one_in_flight(rank, world_size))


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    # every check in one spawn (minutes on a loaded 2-core host), once for all xdist workers
    return once_per_run(tmp_path_factory, "fsdp_per_rank", lambda: run_ranks(_all_checks, WORLD, timeout_s=900))


@pytest.mark.multiproc
def test_one_collective_in_flight_on_gloo(per_rank):
    """gloo ran concurrent collectives of one group into crashes here: the wrapper issues one at a time there."""
    for res in per_rank:
        counts = res["one_in_flight"]
        assert len(counts) > 10 and set(counts) == {1}, counts


@pytest.mark.multiproc
def test_compute_dtype_gathers_run_in_place_in_the_ranks_own_slot(per_rank):
    for res in per_rank:
        assert res["in_place"]["in_place"] and all(res["in_place"]["in_place"])
        assert res["in_place"]["cast_ok"] and all(res["in_place"]["cast_ok"])


@pytest.mark.multiproc
@pytest.mark.parametrize("kind,opt,units", [("toy", "sgd", "layer"), ("toy", "adamw", "layer"),
                                            ("tiny", "adamw", "layer"), ("toy", "adamw", "model"),
                                            ("toy-spare", "adamw", "model"), ("toy-frozen", "adamw", "layer"),
                                            ("toy-frozen", "adamw", "model"), ("tiny", "adamw", "block"),
                                            ("tiny-compiled", "adamw", "block"), ("toy-spare", "adamw", "model-flat"),
                                            ("tiny", "adamw", "block-flat")])
def test_fp32_training_is_bitwise_equal_to_single_process(per_rank, kind, opt, units):
    for res in per_rank:
        r = res["training"][(kind, opt, "None", units)]
        assert r["names"] == r["ref_names"]  # gather_full_params names = the unwrapped model's
        assert r["mismatched"] == [[]] * len(r["diffs"]), f"max |diff| per step {r['diffs']}"
        assert all(r["padding_zero"]), r["padding_zero"]  # padding rows get zero gradient (AdamW leaves them 0)
        assert (r["graphs"] > 0) == kind.endswith("-compiled"), r["graphs"]
        # a weight that got no gradient has none (AdamW would decay it on a zero gradient), as without FSDP
        expected_no_grad = {"toy-spare": ["spare.weight"], "toy-frozen": ["up.weight"]}.get(kind, [])
        assert r["no_grad"] == r["ref_no_grad"] == expected_no_grad, r
        # every unit is freed by its own backward (a frozen one once its input's gradient is done), except a unit
        # with a weight that got no gradient: finish reduces and frees it
        assert all(b == 0 for b in r["gathered_after_backward"]) != (kind == "toy-spare"), r["gathered_after_backward"]


@pytest.mark.multiproc
@pytest.mark.parametrize("kind,units", [("toy", "layer"), ("toy", "model"), ("tiny", "block"), ("tiny", "block-flat")])
def test_fp16_compute_matches_mixed_precision_reference(per_rank, kind, units):
    for res in per_rank:
        diffs = res["training"][(kind, "sgd", str(torch.float16), units)]["diffs"]
        assert max(diffs) < 1e-4, diffs
        assert max(diffs) > 0, diffs  # fp16 is really in use: per-slice fp16 sums differ from the full batch's


@pytest.mark.multiproc
@pytest.mark.parametrize("units", ["layer", "block"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_synchronised_and_gathered_weights_freed(per_rank, dtype, units):
    for res in per_rank:
        r = res["sync"][(str(dtype), units)]
        for num_layers in DEPTHS:
            got = r[num_layers]
            assert len(got["units"]) == (2 + (7 if units == "layer" else 1) * num_layers), got["units"]
            assert all(ok and dt == torch.float32 for ok, dt in got["grads"].values()), got["grads"]
            assert all(got["replicated_equal"].values()), got["replicated_equal"]
            assert got["live_after"] == [0] * 4  # after each forward and each backward: nothing gathered
            # forward gathers every unit; backward every unit but the embedding (its backward never reads it)
            assert got["counts"] == got["expected"]
            assert got["coalesced"]  # gloo has coalesced all-gathers: the units gather in place
            assert not got["coalesced_rs"]  # gloo: one reduce-scatter of a rank-major buffer per unit (see FSDP)
            # at most three units' full weights alive at once
            assert got["peak"] <= 3 * got["max_unit"]
        assert r[DEPTHS[1]]["peak"] == r[DEPTHS[0]]["peak"]  # gathered memory does not grow with depth
        assert r["fallback_equal"] and r["coalesced_rs_equal"] and r["accumulated_equal"]


@pytest.mark.multiproc
@pytest.mark.parametrize("units", ["layer", "block"])
def test_forward_prefetch_starts_after_the_unit_two_before(per_rank, units):
    events = per_rank[0]["prefetch"][units]
    steps = [i for i, e in enumerate(events) if e[0] == "step"]
    for first, step_events in ((True, events[steps[0]:steps[1]]), (False, events[steps[1]:])):
        forward = [e for e in step_events if e[2] in ("forward", "")]
        order = [name for kind, name, _ in forward if kind == "forward_done"]
        # embedding, 7 linears per block (or the block), lm_head
        assert order == (["token_embeddings.weight"] + [f"layers.{i}" for i in range(2)] + ["lm_head.weight"]
                         if units == "block" else order) and len(order) == 2 * (7 if units == "layer" else 1) + 2
        where = {(kind, name): i for i, (kind, name, _) in enumerate(forward) if kind != "step"}
        for i, name in enumerate(order):
            assert [n for _, n, _ in forward].count(name) == 2  # one gather, one forward
            gather = where[("all_gather", name)]
            if i >= 2:  # the rule: gather(i) only after unit i-2 finished its forward pass
                assert gather > where[("forward_done", order[i - 2])], name
            if not first and i >= 1:  # and, once the order is known, before unit i-1 finished (overlapping it)
                assert gather < where[("forward_done", order[i - 1])], name
        backward = [e for e in step_events if e[2] == "backward"]
        for name in order[1:]:  # every unit is gathered again before its gradient is reduce-scattered
            gathered = backward.index(("all_gather", name, "backward"))
            assert gathered < backward.index(("reduce_scatter", name, "backward"))
        assert ("all_gather", order[0], "backward") not in backward
        # Backward prefetch: the next unit's gather is issued before the current unit's gradient is done.
        gathers = [name for kind, name, _ in backward if kind == "all_gather"]
        for current, nxt in zip(gathers, gathers[1:]):
            assert backward.index(("all_gather", nxt, "backward")) < backward.index(("reduce_scatter", current,
                                                                                     "backward")), nxt


@pytest.mark.multiproc
def test_wrapper_and_model_are_freed_with_their_hooks(per_rank):
    for res in per_rank:
        r = res["lifetime"]
        assert r["hooks_while_wrapped"] == 4 * 3, r  # embedding, up, down, lm_head: 2 forward hooks + 1 grad hook each
        assert r["wrapper_freed"] and r["hooks_left"] == 0, f"the dropped wrapper is still alive: {r}"
        assert r["model_freed"], f"the model outlived its last reference: {r}"
        assert r["hooks_after_remove"] == 0 and "remove_hooks" in r["forward_error"], r
        assert all(sum(name.endswith("*") for name in names) >= 2 for names in r["swapped"]), r["swapped"]
        assert r["classes_restored"] == [True, True], r


WORLD_OF_ONE = [("fsdp", None, None), ("fsdp", (TransformerBlock,), None), ("fsdp", (TransformerBlock,), torch.bfloat16),
                ("fsdp2", (TransformerBlock,), None)]
# FSDP told to run a larger group's collectives on its group of one (what a one-GPU measurement of its cost needs).
ALONE = [("fsdp-alone", None, None), ("fsdp-alone", (TransformerBlock,), torch.bfloat16)]


def _world_of_one(rank: int, world_size: int) -> dict:
    """`make_fsdp` on a group of one (the sweeps' `--world-size 1`, where the reduce-scatter runs in place) against
    one process training the same model on the same batch, through `CastForCompute` for a compute dtype: per step,
    the parameters not bitwise equal."""
    out = {}
    for kind, units, dtype in WORLD_OF_ONE + ALONE:
        base = _build("tiny")
        ref = copy.deepcopy(base) if dtype is None else CastForCompute(copy.deepcopy(base), dtype)
        alone = {"collectives_alone": True} if kind == "fsdp-alone" else {}
        mine = make_fsdp(kind.removesuffix("-alone"), copy.deepcopy(base), compute_dtype=dtype, units=units, **alone)
        ref_opt, opt = _optimizer("adamw", ref.parameters()), _optimizer("adamw", mine.parameters())
        mismatched = []
        for step in range(2):
            x, y = _data("tiny", step)
            for model, optimizer in ((ref, ref_opt), (mine, opt)):
                optimizer.zero_grad(set_to_none=True)
                _loss(model, x, y).backward()
                getattr(model, "finish_gradient_synchronization", lambda: None)()
                optimizer.step()
            full = (mine.gather_full_params() if kind != "fsdp2"
                    else {n: p.full_tensor() for n, p in mine.named_parameters()})
            ref_params = ref.module.named_parameters() if dtype is not None else ref.named_parameters()
            mismatched.append([n for n, p in ref_params if not torch.equal(full[n], p.detach())])
        out[(kind, str(units), str(dtype))] = mismatched
        if kind != "fsdp2":  # collectives issued; nothing gathered left over; two passes before a finish add up
            s = mine.stats
            out[("counts", kind, str(units), str(dtype))] = (s.all_gathers, s.reduce_scatters, s.all_reduces,
                                                               mine.gathered_storage_bytes())
            x, y = _data("tiny", 0)
            opt.zero_grad(set_to_none=True)
            _loss(mine, x, y).backward()
            mine.finish_gradient_synchronization()
            once = [p.grad.clone() for p in mine.parameters()]
            opt.zero_grad(set_to_none=True)
            for _ in range(2):
                _loss(mine, x, y).backward()
            mine.finish_gradient_synchronization()
            out[("accumulated", kind, str(units), str(dtype))] = all(torch.equal(p.grad, 2 * g)
                                                                for p, g in zip(mine.parameters(), once))
    return out


@pytest.mark.multiproc
def test_group_of_one_trains_bitwise_like_one_process():
    """A group of one is the identity: bitwise one process's training, no collective, no gathered weights left
    after a step (fp32: the full weights are the shards), gradient accumulation over two backward passes. With
    `collectives_alone` it issues a larger group's all-gathers and reduce-scatters (and the all-reduce of the
    replicated norms) and is still bitwise equal."""
    [results] = run_ranks(_world_of_one, 1)
    for case, value in results.items():
        if case[0] == "counts" and case[1] == "fsdp":
            assert value == (0, 0, 0, 0), f"{case}: (all-gathers, reduce-scatters, all-reduces, gathered bytes)"
        elif case[0] == "counts":
            gathers, reduce_scatters, all_reduces, gathered = value
            assert gathers > 0 and reduce_scatters > 0 and all_reduces > 0 and gathered == 0, f"{case}: {value}"
        elif case[0] == "accumulated":
            assert value, f"{case}: two backward passes did not add up"
        else:
            assert value == [[], []], f"{case}: {value}"
    assert sum(case[0] == "counts" for case in results) == 5


def test_make_fsdp_rejects_an_unknown_kind_and_bad_units():
    with pytest.raises(ValueError, match="'zero3'"):
        make_fsdp("zero3", ToyModel())
    with pytest.raises(ValueError, match="no module of those classes"):
        make_fsdp("fsdp2", ToyModel(), units=("TransformerBlock",))


def test_invalid_arguments_raise_before_any_communication():
    with pytest.raises(ValueError, match="compute_dtype"):
        FSDP(nn.Linear(2, 2), compute_dtype=torch.int32)
    with pytest.raises(ValueError, match="max_inflight_reductions"):
        FSDP(nn.Linear(2, 2), max_inflight_reductions=0)
    with pytest.raises(ValueError, match="units"):
        FSDP(nn.Linear(2, 2), units=(42,))
    with pytest.raises(ValueError, match="no module of those classes"):
        FSDP(ToyModel(), units=("TransformerBlock",))
    mixed = ToyModel()
    mixed.up.half()
    with pytest.raises(ValueError, match="share one"):
        FSDP(mixed, units=(ToyModel,))
    with pytest.raises(ValueError, match=r"flat_reduce_scatter \('yes'\) must be a bool"):
        FSDP(nn.Linear(2, 2), flat_reduce_scatter="yes")
    with pytest.raises(ValueError, match="process group"):
        FSDP(nn.Linear(2, 2))


def test_cast_for_compute_is_the_single_process_compute_policy():
    # CastForCompute (the sweep's `single_cast` reference) computes what the test's own weight-casting does.
    ref, model = _build("toy"), CastForCompute(_build("toy"), torch.float16)
    x, y = _data("toy", 0)
    with _cast_weights(ref, torch.float16):
        out_ref = ref(x)
    out = model(x)
    assert out.dtype == torch.float16 and torch.equal(out, out_ref)
    out_ref.float().sum().backward()
    out.float().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), model.module.parameters()):
        assert q.dtype == torch.float32 and q.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name
    with pytest.raises(ValueError, match="compute_dtype"):
        CastForCompute(ref, torch.int8)


def test_cast_for_compute_is_freed_with_its_hooks():
    module = _build("toy")
    model = CastForCompute(module, torch.float16)
    x, _ = _data("toy", 0)
    model(x).float().sum().backward()
    num_hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())
    assert num_hooks() == 2 * 4  # embedding, up, down, lm_head: a pre and a post hook each
    wrapper, wrapped = weakref.ref(model), weakref.ref(module)
    gc.disable()  # reference counting alone must free them
    try:
        del model
        assert wrapper() is None and num_hooks() == 0
        del module
        assert wrapped() is None
    finally:
        gc.enable()
    model = CastForCompute(_build("toy"), torch.float16)
    model.remove_hooks()
    model.remove_hooks()
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.module.modules()) == 0
    with pytest.raises(RuntimeError, match="remove_hooks"):
        model(x)


def _block_guards(rank: int, world_size: int) -> tuple[str, str]:
    """The guards Dynamo installed for a compiled block of an FSDP model (a group of one), as logged: with compute
    dtype bf16, and with none (fp32)."""
    from raysys.measure.profiling import dynamo_guard_log

    logs = []
    for compute_dtype in (torch.bfloat16, None):
        torch._dynamo.reset()
        model = _build("tiny", 1)
        compile_blocks(model, backend="eager")
        fsdp = FSDP(model, compute_dtype=compute_dtype, units=UNITS["block"])
        x, y = _data("tiny", 0)
        with dynamo_guard_log() as log:
            _loss(fsdp, x, y).backward()
        logs.append(log.getvalue())
    return tuple(logs)


@pytest.mark.multiproc
def test_compute_dtype_casts_traced_into_a_compiled_block_add_few_guards():
    """The per-Linear input casts run inside a compiled block; Dynamo guards on what they touch and checks those
    guards at every call of the block. By the modules' class (`cast_inputs_by_class`) they add a few guards to the
    fp32 block's; as forward pre-hooks they added a guard set per module (a 4-block model's block: 224 against 149,
    results/runs/dynamo_guard_check_fsdp_e88b4e2.parquet), and holding the wrapper, guards on it too (its weak
    reference, its attributes)."""
    from raysys.measure.profiling import guard_kinds

    [(bf16, fp32)] = run_ranks(_block_guards, 1)
    assert "compute_dtype" in bf16 or "cast_inputs" in bf16, bf16[:2000]  # the casts were traced
    owner_lines = [line for line in bf16.splitlines() if "owner" in line]
    assert ".owner" not in bf16 and "FSDP" not in bf16, owner_lines[:5]
    assert "_forward_pre_hooks'][" not in bf16
    count = lambda log: sum(guard_kinds(log).values())  # noqa: E731
    assert count(bf16) <= count(fp32) + 12, (count(bf16), count(fp32))


def test_cast_inputs_by_class_casts_and_its_handle_puts_the_class_back():
    """The swapped-in class keeps the module's name and is a subclass of its class; its forward casts floating
    positional inputs (integer ones pass); the handle's remove() restores the class, once."""
    from parallel.mixed_precision import cast_inputs_by_class, casting_class

    lin = torch.nn.Linear(3, 2, bias=False).to(torch.float16)
    handle = cast_inputs_by_class(lin, torch.float16)
    assert type(lin) is casting_class(torch.nn.Linear, torch.float16) and type(lin).__name__ == "Linear"
    assert isinstance(lin, torch.nn.Linear) and type(lin).compute_dtype == torch.float16
    out = lin(torch.ones(4, 3))  # fp32 input: cast, else the fp16 matmul raises
    assert out.dtype == torch.float16
    emb = torch.nn.Embedding(5, 2)
    emb_handle = cast_inputs_by_class(emb, torch.float16)
    assert emb(torch.tensor([1, 4])).dtype == torch.float32  # integer inputs pass unchanged
    handle.remove()
    handle.remove()
    emb_handle.remove()
    assert type(lin) is torch.nn.Linear and type(emb) is torch.nn.Embedding
    with pytest.raises(ValueError, match=r"dtype \(torch.int32\) must be a floating-point torch.dtype"):
        cast_inputs_by_class(lin, torch.int32)
    with pytest.raises(ValueError, match="module must be a torch.nn.Module, got Tensor"):
        cast_inputs_by_class(torch.ones(1), torch.float16)
