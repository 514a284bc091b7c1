"""Issue 19: does Dynamo's cache lookup per compiled block depend on weights that are views of one storage (as FSDP's
full weights are) or on modules whose `_parameters` are swapped? A tiny TransformerBlock compiled with backend="eager",
the lookup's mean host time from torch.profiler over 200 forward calls per case. CPU only:

    PYTHONPATH=$PWD python results/runs/dynamo_guard_check.py > dynamo_guard_check.txt
"""
import torch
from torch.profiler import profile, ProfilerActivity
from raysys.config import ModelConfig
from raysys.model import TransformerLM
torch.manual_seed(0)
mc = ModelConfig(vocab_size=64, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32, name="t")
m = TransformerLM(mc)
blk = m.layers[0]
blk.forward = torch.compile(blk.forward, backend="eager")
x = torch.randn(1, 8, 16)
lin = [mod for mod in blk.modules() if type(mod).__name__ == "Linear"]
origs = [l.weight for l in lin]
flat = torch.cat([w.detach().reshape(-1) for w in origs])
offs = [0]
for w in origs: offs.append(offs[-1] + w.numel())
views = [torch.nn.Parameter(flat[a:b].view(w.shape)) for w, a, b in zip(origs, offs, offs[1:])]
separate = [torch.nn.Parameter(w.detach().clone()) for w in origs]
def run(ws, n=200, grad=True):
    for l, w in zip(lin, ws): l._parameters["weight"] = w
    for _ in range(3): blk(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            with torch.set_grad_enabled(grad):
                blk(x)
    ev = [e for e in prof.key_averages() if "Cache Lookup" in e.key]
    return round(ev[0].cpu_time_total / ev[0].count, 1)
print("original params", run(origs))
print("separate clones", run(separate))
print("views of one storage", run(views))
print("separate clones", run(separate))
