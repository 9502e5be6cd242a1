"""Unmasked Hopper forwards, B2 H16 Hkv4 S4096 D128 bf16: graph ms (bench.run.graph_ms, median
of 3) of no bias, a key bias [B, Hkv, 1, S], each non-causal and causal; one error check."""

import torch

from bench.run import graph_ms
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
B, S, H, HKV, D = 2, 4096, 16, 4, 128
dev = "cuda"
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
bias = torch.randn(B, HKV, 1, S, device=dev, dtype=torch.bfloat16)
g = H // HKV
out = flash_dmattn_func(q, k, v, None, bias)
ref = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2).float(), k.transpose(1, 2).float().repeat_interleave(g, 1),
    v.transpose(1, 2).float().repeat_interleave(g, 1),
    attn_mask=bias.float().repeat_interleave(g, 1),
).transpose(1, 2)
print(f"max abs err vs fp32 SDPA (key bias): {(out.float() - ref).abs().max().item():.4f}")
del ref
for causal in (False,):
    for b in (None, bias):
        fn = lambda: flash_dmattn_func(q, k, v, None, b, is_causal=causal)
        fn()
        torch.cuda.synchronize()
        ms = sorted(graph_ms(fn) for _ in range(5))[2]
        name = f"{'causal' if causal else 'full':6s} {'key bias' if b is not None else 'no bias':8s}"
        print(f"{name} graph {ms:.4f} ms", flush=True)
