"""The Hopper backward's CTA count at block density 0.25 (sparse suite, 128 x 128 blocks,
bias [B, Hkv, 1, S] with its gradient): times forward + backward and the backward alone with
the query heads of a group split over SPLITS CTAs and each key block's query range over
ceil(Sq / ROWS) CTAs, forced, against what bwd_launch picks.

PYTHONPATH=. python3 bench/results/2026-11-26_H100/walk_order/probe_splits.py SPLITS ROWS [DENSITY [MASK]]
(SPLITS 0: bwd_launch.head_splits decides; DENSITY 1.0: the dense mask; MASK blocks128 or blocks)
"""

import sys

import torch
from triton.testing import do_bench

from bench.workloads import Workload, make_inputs
from dmattn_cute import flash_dmattn_func
from dmattn_cute.kernels import bwd_launch

splits, rows = int(sys.argv[1]), int(sys.argv[2])
density = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
if splits:
    bwd_launch.head_splits = lambda *args: splits
bwd_launch.QUERY_SPLIT_ROWS = rows
mask = (sys.argv[4] if len(sys.argv) > 4 else "blocks128") if density < 1 else "dense"
w = Workload("sparse", 2, 4096, 4096, bias="key", mask=mask, density=density)
x = make_inputs(w, "cuda", grad=True)
dout = torch.randn_like(x.q)


def forward():
    return flash_dmattn_func(x.q, x.k, x.v, attn_mask=x.mask, attn_bias=x.bias)


fwdbwd = do_bench(lambda: torch.autograd.grad(forward(), x.leaves, dout), warmup=25, rep=200)
out = forward()
bwd = do_bench(lambda: torch.autograd.grad(out, x.leaves, dout, retain_graph=True),
               warmup=25, rep=200)  # fmt: skip
print(
    f"density {density} splits {splits or 'auto'} rows {rows}: fwd+bwd {fwdbwd:.3f} ms, "
    f"bwd {bwd:.3f} ms"
)
