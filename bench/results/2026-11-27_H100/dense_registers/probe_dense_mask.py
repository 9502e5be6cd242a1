"""Probe: the key-bias forward with and without an all-True bool mask [B, Hkv, S, S]
(bench's "bias key" and "bias key mask dense" rows, B2 H16 Hkv4 S4096 D128 bf16): do_bench
wall time, and the kernels each call launches with their GPU times (torch.profiler).

    PYTHONPATH=.:$PYTHONPATH python3 probe_dense_mask.py
"""
import collections
import statistics
import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
b, s, h, hkv, d = 2, 4096, 16, 4, 128
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
bias = torch.randn(b, hkv, 1, s, device="cuda", dtype=torch.bfloat16)
mask = torch.ones(b, hkv, s, s, device="cuda", dtype=torch.bool)
rows = {
    "no bias": lambda: flash_dmattn_func(q, k, v, None, None),
    "key bias": lambda: flash_dmattn_func(q, k, v, None, bias),
    "key bias + all-True mask": lambda: flash_dmattn_func(q, k, v, mask, bias),
}
print(torch.cuda.get_device_name())
with torch.no_grad():
    for rnd in range(2):
        for name, fn in rows.items():
            print(f"r{rnd + 1} {name:26s} do_bench {do_bench(fn, warmup=50, rep=300):.4f} ms", flush=True)
    for name, fn in rows.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(30):
                fn()
            torch.cuda.synchronize()
        times = collections.defaultdict(list)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name[:80]].append(e.time_range.end - e.time_range.start)
        for kname, ts in times.items():
            print(f"  {name:26s} {len(ts):3d} x {statistics.median(ts):8.1f} us  {kname}")
