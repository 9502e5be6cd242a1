"""Probe: the backward preprocess (B2 S4096 H16 D128 bf16) at several CTA tiles, with its
grid as main has it and with heads as the fastest grid dim ("heads-fastest": .lp/bwd_pre_swapped.py
was kernels/bwd_pre.py with the grid's first two dims swapped, by sed); then the zero fill of
the fp32 accumulators (dq and the GQA split's dk / dv sums) and the fp32 -> bf16 casts, us
(CUDA events, median of 100, each after a read-only 256 MB L2 flush).

    PYTHONPATH=.:$PYTHONPATH python3 .lp/probe_pre.py                 # 2026-11-26, H100
"""
import statistics, sys, importlib.util
import torch
sys.path.insert(0, ".lp")
import bwd_pre_swapped as sw
from dmattn_cute.kernels import bwd_pre as pre
from dmattn_cute.jit.arch import target_arch

cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
def timed(fn):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(100):
        cache.sum()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts) * 1e3

print(torch.cuda.get_device_name())
arch = target_arch(torch.device("cuda"))
B, S, H, D = 2, 4096, 16, 128
o, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ref = (o.float() * do.float()).sum(-1).transpose(1, 2)
for mod, name in ((pre, "main"), (sw, "heads-fastest")):
    for tile_m, threads in ((64, 128), (128, 128), (128, 256), (32, 128), (16, 128)):
        spec = mod.BwdPreprocessSpec("bf16", 128, tile_m=tile_m, num_threads=threads)
        k = spec.compile(arch)
        dpsum = torch.full((B, H, S), float("nan"), device="cuda")
        k(o, do, dpsum)
        err = (dpsum - ref).abs().max().item()
        us = timed(lambda: k(o, do, dpsum))
        print(f"{name:14s} tile_m {tile_m:3d} threads {threads:3d}: {us:6.1f} us  err {err:.2e}", flush=True)
n = B * S * H * D
acc = torch.empty(n + 2 * B * S * 4 * D, device="cuda")
print(f"zero fill {acc.numel()*4/1e6:.0f} MB: {timed(lambda: acc.zero_()):.1f} us")
dq = acc[:n]
print(f"dq cast: {timed(lambda: dq.to(torch.bfloat16)):.1f} us")
print(f"dq+dk+dv cast as one: {timed(lambda: acc.to(torch.bfloat16)):.1f} us")
kv = acc[n:].view(2, -1)
print(f"dk, dv casts: {timed(lambda: (kv[0].to(torch.bfloat16), kv[1].to(torch.bfloat16))):.1f} us")
