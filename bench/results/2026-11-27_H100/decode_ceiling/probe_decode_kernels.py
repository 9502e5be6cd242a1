"""Probe: the kernels of one decode step (kv-cache API from a CUDA graph, B8 H16 Hkv4 D128 bf16,
key bias, 64-key blocks at density 0.25, Sk 32k), their GPU times and the gaps between them
(torch.profiler over 50 replays, each after a clean 256 MB read flush).

    PYTHONPATH=.:$PYTHONPATH python3 probe_decode_kernels.py
"""
import collections
import statistics
import torch
from torch.profiler import ProfilerActivity, profile
from bench.peers import ours_kvcache_graph
from bench.workloads import Workload, make_inputs

cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
print(torch.cuda.get_device_name())
for sk in (32768, 131072):
    w = Workload("decode", 8, 1, sk, 128, bias="key", mask="blocks", density=0.25)
    x = make_inputs(w, "cuda")
    _, replay = next(ours_kvcache_graph(x))
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            cache.sum()
            replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    steps, current = [], []
    for e in kernels:
        if "reduce" in e.name.lower() and "sum" in e.name.lower() or "reduce_kernel" in e.name:
            if current:
                steps.append(current)
            current = []
        else:
            current.append(e)
    if current:
        steps.append(current)
    durations = collections.defaultdict(list)
    spans, gaps = [], collections.defaultdict(list)
    for step in steps[5:]:
        spans.append(step[-1].time_range.end - step[0].time_range.start)
        for i, e in enumerate(step):
            durations[(i, e.name[:90])].append(e.time_range.end - e.time_range.start)
            if i:
                gaps[i].append(e.time_range.start - step[i - 1].time_range.end)
    print(f"Sk {sk}: {len(steps)} steps, span first start -> last end median {statistics.median(spans):.1f} us")
    for (i, name), ds in sorted(durations.items()):
        gap = statistics.median(gaps[i]) if i else 0.0
        print(f"  {i}: {statistics.median(ds):7.1f} us (gap before {gap:5.1f} us)  {name}")
    del x
