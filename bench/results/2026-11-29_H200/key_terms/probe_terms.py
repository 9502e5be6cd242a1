"""Hopper forwards, B2 H16 Hkv4 S4096 bf16, non-causal: graph ms (median of 5) without a bias
and with a key bias [B, Hkv, 1, S] at head dims 64, 128, 256, and with the key bias and a
dense (all-True) mask at 128; one error check per head dim."""

import torch

from bench.run import graph_ms
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
B, S, H, HKV = 2, 4096, 16, 4
dev = "cuda"
g = H // HKV
for D in (128, 64, 256):
    q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    bias = torch.randn(B, HKV, 1, S, device=dev, dtype=torch.bfloat16)
    out = flash_dmattn_func(q, k, v, None, bias)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float().repeat_interleave(g, 1),
        v.transpose(1, 2).float().repeat_interleave(g, 1),
        attn_mask=bias.float().repeat_interleave(g, 1),
    ).transpose(1, 2)
    print(f"D{D} max abs err vs fp32 SDPA (key bias): {(out.float() - ref).abs().max().item():.4f}")
    del ref
    mask = torch.ones(B, HKV, S, S, device=dev, dtype=torch.bool)
    rows = [("no bias", None, None), ("key bias", None, bias)]
    if D == 128:
        rows.append(("key bias + dense mask", mask, bias))
    for name, m, b in rows:
        fn = lambda: flash_dmattn_func(q, k, v, m, b)
        fn()
        torch.cuda.synchronize()
        ms = sorted(graph_ms(fn) for _ in range(5))[2]
        print(f"D{D:<3d} {name:22s} graph {ms:.4f} ms", flush=True)
    del mask
