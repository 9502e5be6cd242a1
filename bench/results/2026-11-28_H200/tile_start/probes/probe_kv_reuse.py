"""Block masks alone, exactly 8 visible blocks of 32 in every query block, B2 H16 Hkv4 S4096
D128 bf16, key bias: the same 8 blocks for every row (each K/V block read by all 32 query
blocks of its heads) against 8 per row at random or on a band (each block read by ~8 rows);
CUDA-graph ms (median of 3), and the unmasked 8-block analog (Sk = 1024)."""

import torch

from bench.run import graph_ms
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
B, S, H, HKV, D, NB = 2, 4096, 16, 4, 128, 32
dev = "cuda"
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
bias = torch.randn(B, HKV, 1, S, device=dev, dtype=torch.bfloat16)


def rows(pick):
    m = torch.zeros(B, HKV, NB, NB, dtype=torch.bool, device=dev)
    for r in range(NB):
        m[:, :, r, pick(r)] = True
    return m


masks = {
    "same 8 (0-7)": rows(lambda r: slice(0, 8)),
    "same 8 (24-31)": rows(lambda r: slice(24, 32)),
    "same 8 (every 4th)": rows(lambda r: slice(0, 32, 4)),
    "band of 8": rows(lambda r: slice(min(r, 24), min(r, 24) + 8)),
    "random 8": rows(lambda r: torch.randperm(NB, device=dev)[:8]),
}
for name, m in masks.items():
    fn = lambda: flash_dmattn_func(q, k, v, None, bias, block_mask=m)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    ms = sorted(graph_ms(fn) for _ in range(3))[1]
    print(f"block mask {name:20s} graph {ms:.4f} ms", flush=True)
k1, v1 = k[:, :1024].contiguous(), v[:, :1024].contiguous()
b1 = bias[..., :1024].contiguous()
fn = lambda: flash_dmattn_func(q, k1, v1, None, b1)  # noqa: E731
fn()
ms = sorted(graph_ms(fn) for _ in range(3))[1]
print(f"no mask, Sk 1024 (8 blocks) graph {ms:.4f} ms", flush=True)
m1 = torch.ones(B, HKV, NB, 8, dtype=torch.bool, device=dev)
fn = lambda: flash_dmattn_func(q, k1, v1, None, b1, block_mask=m1)  # noqa: E731
fn()
ms = sorted(graph_ms(fn) for _ in range(3))[1]
print(f"all-True block mask, Sk 1024 graph {ms:.4f} ms", flush=True)
