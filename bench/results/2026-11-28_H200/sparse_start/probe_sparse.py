"""Where the sparse forward's per-CTA extra goes: B2 H16 Hkv4 S4096 D128 bf16, block masks
[B, Hkv, 32, 32] of 128 x 128 blocks given as block_mask=, with and without the key bias
[B, Hkv, 1, S]; forward do_bench medians (ms), one process."""

import torch
from triton.testing import do_bench

from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
B, S, H, HKV, D, NB = 2, 4096, 16, 4, 128, 32
dev = "cuda"
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
bias = torch.randn(B, HKV, 1, S, device=dev, dtype=torch.bfloat16)
rows = torch.arange(NB, device=dev)


def binomial():  # the sparse suite's random_blocks at 0.25: diagonal kept, others w.p. (0.25*32-1)/31
    m = torch.rand(B, HKV, NB, NB, device=dev) < (0.25 * NB - 1) / (NB - 1)
    m[:, :, rows, rows] = True
    return m


def exactly(count, contiguous):  # every query block: `count` visible key blocks
    m = torch.zeros(B, HKV, NB, NB, dtype=torch.bool, device=dev)
    for r in range(NB):
        if contiguous:
            start = min(r, NB - count)
            m[:, :, r, start:start + count] = True
        else:
            pick = torch.randperm(NB, device=dev)[:count]
            m[:, :, r, pick] = True
    return m


masks = {
    "full (1.0)": torch.ones(B, HKV, NB, NB, dtype=torch.bool, device=dev),
    "binomial 0.25": binomial(),
    "exactly 8, random": exactly(8, False),
    "exactly 8, contiguous": exactly(8, True),
    "exactly 1, diagonal": exactly(1, True),
}
for name, bm in masks.items():
    for with_bias in (True, False):
        b = bias if with_bias else None
        fn = lambda: flash_dmattn_func(q, k, v, None, b, block_mask=bm)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        print(f"{name:24s} {'key bias' if with_bias else 'no bias ':8s} visible {bm.float().mean().item():.3f}  {ms:.4f} ms", flush=True)
for with_bias in (True, False):
    fn = lambda: flash_dmattn_func(q, k, v, None, bias if with_bias else None)  # noqa: E731
    fn()
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    print(f"no mask B2 S4096 {'key bias' if with_bias else 'no bias'}  {ms:.4f} ms", flush=True)
q1 = torch.randn(16, 1024, H, D, device=dev, dtype=torch.bfloat16)
k1, v1 = (torch.randn(16, 1024, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
b1 = torch.randn(16, HKV, 1, 1024, device=dev, dtype=torch.bfloat16)
for with_bias in (True, False):
    fn = lambda: flash_dmattn_func(q1, k1, v1, None, b1 if with_bias else None)  # noqa: E731
    fn()
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    print(f"dense B16 S1024 (2048 CTAs x 8 blocks) {'key bias' if with_bias else 'no bias'}  {ms:.4f} ms", flush=True)
