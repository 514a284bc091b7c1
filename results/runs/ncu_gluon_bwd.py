"""Launch the Gluon one-pass backward twice at 1x16x16384x128 (bf16, causal) for ncu (issue 16).

Run on the GPU host from the repository root, under ncu (the second launch is the profiled one), e.g.
`ncu --clock-control none -k regex:_gluon_attn_bwd --launch-skip 1 --launch-count 1 --section SpeedOfLight
python3 results/runs/ncu_gluon_bwd.py`; results/runs/README.md lists the sections of the committed run.
"""

import torch, kernels.attention as fa
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(1, 16, 16384, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
for _ in range(2):
    fa.flash_attention(q, k, v, True, path="gluon", bwd="one_pass").backward(do)
torch.cuda.synchronize()
print("ok", fa.last_paths())
