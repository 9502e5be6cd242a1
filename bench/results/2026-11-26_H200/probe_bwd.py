"""Dense backward calls for Nsight Compute: B4 H16 Hkv4 S4096 D128 bf16 (the dense suite's
row), forward then backward, twice.

ncu -k regex:FlashBwdSm90 python3 bench/results/2026-11-26_H200/probe_bwd.py [--causal]
(from the repo root, PYTHONPATH=.)
"""

import sys

import torch

from dmattn_cute.attention import flash_dmattn_func

causal = "--causal" in sys.argv
torch.manual_seed(0)
q = torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(4, 4096, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn_like(k, requires_grad=True)
dout = torch.randn_like(q)
for _ in range(2):
    out = flash_dmattn_func(q, k, v, is_causal=causal)
    out.backward(dout)
torch.cuda.synchronize()
