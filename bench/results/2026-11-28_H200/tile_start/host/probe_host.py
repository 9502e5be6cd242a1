"""Host time per forward call (bench.run.host_ms, 200 calls after 20) of block masks alone and
of no mask, B2 H16 Hkv4 D128 bf16 with the key bias; and do_bench of a host-bound size."""

import torch
from triton.testing import do_bench

from bench.run import host_ms
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
dev = "cuda"


def case(S, density):
    B, H, HKV, D, NB = 2, 16, 4, 128, S // 128
    q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    bias = torch.randn(B, HKV, 1, S, device=dev, dtype=torch.bfloat16)
    bm = None
    if density is not None:
        bm = torch.rand(B, HKV, NB, NB, device=dev) < density
        bm[:, :, torch.arange(NB), torch.arange(NB)] = True
    return lambda: flash_dmattn_func(q, k, v, None, bias, block_mask=bm)


for S, density in ((4096, None), (4096, 0.25), (4096, 1.0), (1024, 0.25)):
    fn = case(S, density)
    fn()
    torch.cuda.synchronize()
    hosts = sorted(host_ms(fn, calls=200, warmup=20) for _ in range(5))
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    name = "no mask" if density is None else f"block mask {density}"
    print(f"S{S} {name:16s} host {hosts[2] * 1e3:.1f} us  do_bench {ms:.4f} ms", flush=True)
