"""Python time of the forward's launch path on this CPU machine (no GPU): flash_fwd with its
kernels replaced by no-ops (as tests/conftest.py's `launches` does) on CPU tensors, sm_90a,
B2 S4096 H16 Hkv4 D128 bf16 with the key bias, without a mask and with a block mask at 0.25;
us per call over 2000 calls, then a profile of the block-mask calls."""

import cProfile
import os
import pstats
import time

import torch

from dmattn_cute.jit import ARCH_ENV
from dmattn_cute.kernels import block_bits_launch, bwd_launch, fwd_launch
from dmattn_cute.kernels.fwd_launch import flash_fwd
from dmattn_cute.problem import make_problem

os.environ[ARCH_ENV] = "sm_90a"
for module in (fwd_launch, bwd_launch, block_bits_launch):
    module.compiled = lambda spec, arch: (lambda *args: None)

B, S, H, HKV, D = 2, 4096, 16, 4, 128
q = torch.randn(B, S, H, D, dtype=torch.bfloat16)
k, v = (torch.randn(B, S, HKV, D, dtype=torch.bfloat16) for _ in range(2))
bias = torch.randn(B, HKV, 1, S, dtype=torch.bfloat16)
block_mask = torch.rand(B, HKV, 32, 32) < 0.25


def run(blocks):
    problem, mask4, bias4 = make_problem(q, k, v, None, bias, None, False, 0.0, (-1, -1), False)
    return flash_fwd(problem, q, k, v, mask4, bias4, block_mask=blocks)


for name, blocks in (("key bias", None), ("block mask", block_mask)):
    for _ in range(20):
        run(blocks)
    start = time.perf_counter()
    for _ in range(2000):
        run(blocks)
    print(f"{name}: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us per call")
profile = cProfile.Profile()
profile.enable()
for _ in range(2000):
    run(block_mask)
profile.disable()
pstats.Stats(profile).sort_stats("cumtime").print_stats(25)
