"""Per-CTA start cost of the sparse walk: 1024 CTAs (B2 H16 Hkv4, 32 query blocks) of 1 or 8
visible key blocks each, D128 bf16, through the unmasked kernel, the masked kernel's dense
walk (a block mask of all-True blocks) and its sparse walk (blocks picked from 32); forward
time by do_bench and by CUDA-graph replay (bench.run.graph_ms), ms."""

import torch
from triton.testing import do_bench

from bench.run import graph_ms
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
B, S, H, HKV, D, NB = 2, 4096, 16, 4, 128, 32
dev = "cuda"
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)


def keys(sk):
    k, v = (torch.randn(B, sk, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    return k, v, torch.randn(B, HKV, 1, sk, device=dev, dtype=torch.bfloat16)


def picked(count, nk=NB):  # every query block: `count` contiguous key blocks from nk
    m = torch.zeros(B, HKV, NB, nk, dtype=torch.bool, device=dev)
    for r in range(NB):
        start = min(r, nk - count)
        m[:, :, r, start:start + count] = True
    return m


cases = []
for count in (8,):
    kv = keys(128 * count)
    cases.append((f"{count} block(s), no mask, Sk={128 * count}", kv, None))
    cases.append((f"{count} block(s), all-True block mask, Sk={128 * count}", kv, picked(count, count)))
    cases.append((f"{count} block(s) of 32, block mask, Sk=4096", keys(4096), picked(count)))
for name, (k, v, bias), bm in cases:
    for b in (bias,):
        fn = lambda: flash_dmattn_func(q, k, v, None, b, block_mask=bm)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        ms = float("nan")
        g = graph_ms(fn)
        print(f"{name:44s} {'key bias' if b is not None else 'no bias ':8s} do_bench {ms:.4f}  graph {g:.4f} ms", flush=True)
