"""Block masks alone (blocks_full) B2 H16 Hkv4 S4096 D128 bf16: graph ms (bench.run.graph_ms)
of densities 1.0 / 0.25 / 0.05 (the sparse suite's binomial) and exactly 8 of 32, key bias and
none; one error check against an fp32 SDPA reference."""

import torch

from bench.run import graph_ms
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
B, S, H, HKV, D, NB = 2, 4096, 16, 4, 128, 32
dev = "cuda"
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
bias = torch.randn(B, HKV, 1, S, device=dev, dtype=torch.bfloat16)
rows = torch.arange(NB, device=dev)


def binomial(d):
    m = torch.rand(B, HKV, NB, NB, device=dev) < (d * NB - 1) / (NB - 1)
    m[:, :, rows, rows] = True
    return m


def exactly(count):
    m = torch.zeros(B, HKV, NB, NB, dtype=torch.bool, device=dev)
    for r in range(NB):
        m[:, :, r, torch.randperm(NB, device=dev)[:count]] = True
    return m


masks = {"1.0": binomial(1.0), "0.25": binomial(0.25), "8 of 32": exactly(8), "0.05": binomial(0.05)}
bm = masks["0.25"]
out = flash_dmattn_func(q, k, v, None, bias, block_mask=bm)
g = H // HKV
em = bm.repeat_interleave(g, 1).repeat_interleave(128, 2).repeat_interleave(128, 3)
ref = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2).float(), k.transpose(1, 2).float().repeat_interleave(g, 1),
    v.transpose(1, 2).float().repeat_interleave(g, 1),
    attn_mask=bias.float().repeat_interleave(g, 1).masked_fill(~em, float("-inf")),
).transpose(1, 2)
print(f"max abs err vs fp32 SDPA (0.25, key bias): {(out.float() - ref).abs().max().item():.4f}")
del em, ref
for name, m in masks.items():
    for b in (bias, None):
        fn = lambda: flash_dmattn_func(q, k, v, None, b, block_mask=m)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        ms = sorted(graph_ms(fn) for _ in range(3))[1]
        print(f"block mask {name:8s} {'key bias' if b is not None else 'no bias ':8s} graph {ms:.4f} ms", flush=True)
