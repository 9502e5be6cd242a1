"""Probe: decode step (kv-cache API, CUDA graph), B8 H16 Hkv4 D128 key bias, 64-key blocks
at density 0.25: random blocks vs exactly one in four per chunk (balanced), timed with a
dirtying flush (do_bench's zero_), a clean flush (read), and no flush.

    PYTHONPATH=.:$PYTHONPATH python3 .lp/probe_decode_balance.py      # 2026-11-26, H100
"""
import statistics, sys
import torch
from bench.peers import ours_kvcache_graph
from bench.workloads import Workload, make_inputs, block_mask

peak = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12
cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")

def timed(fn, flush):
    for _ in range(10):
        fn()
    ts = []
    for _ in range(200):
        if flush == "zero":
            cache.zero_()
        elif flush == "read":
            cache.sum()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts)

print(torch.cuda.get_device_name())
for sk in (32768, 131072):
    w = Workload("decode", 8, 1, sk, 128, bias="key", mask="blocks", density=0.25)
    x = make_inputs(w, "cuda")
    nk = sk // 64
    rand = x.mask
    idx = torch.arange(nk, device="cuda")
    hb = torch.arange(8 * 4, device="cuda").view(8, 4, 1, 1)
    blocks = ((idx.view(1, 1, 1, nk) + hb) % 4 == 0)
    bal = block_mask(w, "cuda", blocks)
    visible = 8 * 4 * sk * 0.25 * 128 * 2 * 2
    for name, m in (("random", rand), ("balanced", bal)):
        x.mask = m
        _, replay = next(ours_kvcache_graph(x))
        for flush in ("zero", "read", "none"):
            ms = timed(replay, flush)
            print(f"Sk {sk:6d} {name:8s} flush {flush:4s} {ms:.4f} ms {visible / (ms * 1e-3) / peak:.1%}", flush=True)
