"""Cold-L2 cost of a masked forward's metadata reads: CUDA-graph GPU time with an L2 flush
before each replay (bench.run.graph_ms) and without one, B2 H16 Hkv4 S4096 D128 bf16, key
bias [B, Hkv, 1, S]; no mask, an all-True bool mask [B, Hkv, S, S], block masks."""

import statistics

import torch

from bench.run import graph_ms
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
B, S, H, HKV, D, NB = 2, 4096, 16, 4, 128, 32
dev = "cuda"
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
bias = torch.randn(B, HKV, 1, S, device=dev, dtype=torch.bfloat16)
dense = torch.ones(B, HKV, S, S, dtype=torch.bool, device=dev)
full_blocks = torch.ones(B, HKV, NB, NB, dtype=torch.bool, device=dev)
eight = torch.zeros(B, HKV, NB, NB, dtype=torch.bool, device=dev)
idx = torch.rand(B, HKV, NB, NB, device=dev).argsort(-1)[..., :8]
eight.scatter_(-1, idx, True)


def warm_ms(fn, reps=60):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


cases = {
    "no mask": lambda: flash_dmattn_func(q, k, v, None, bias),
    "bool mask all True": lambda: flash_dmattn_func(q, k, v, dense, bias),
    "block mask all True": lambda: flash_dmattn_func(q, k, v, None, bias, block_mask=full_blocks),
    "block mask 8 of 32": lambda: flash_dmattn_func(q, k, v, None, bias, block_mask=eight),
}
for r in range(2):
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        cold, warm = graph_ms(fn), warm_ms(fn)
        print(
            f"r{r} {name:22s} cold L2 {cold:.4f}  warm L2 {warm:.4f}  diff {cold - warm:.4f} ms",
            flush=True,
        )
