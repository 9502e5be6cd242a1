"""Probe: the kv-cache decode step from a CUDA graph with the key chunks per row forced to a
given count (kvcache.decode_splits patched), B8 H16 Hkv4 D128, key bias, 64-key blocks at
density 0.25, as bench.run's ours_kvcache_graph times it.

    python3 bench/results/2026-11-26_H200/probe_decode_splits.py
"""

import torch

from bench.peers import ours_kvcache_graph
from bench.run import make_timer
from bench.workloads import Workload, make_inputs
from dmattn_cute import kvcache

_, timer = make_timer()
PEAK = 4800 if "H200" in torch.cuda.get_device_name() else 3350  # GB/s
chosen = kvcache.decode_splits
for seqlen_k, splits in ((32768, (None, 12, 16, 24, 32, None)), (131072, (None, 12, 16, 24, None))):
    x = make_inputs(
        Workload("decode", 8, 1, seqlen_k, bias="key", mask="blocks", density=0.25), "cuda"
    )
    for n in splits:
        kvcache.decode_splits = chosen if n is None else (lambda *a, n=n: n)
        _, replay = next(ours_kvcache_graph(x))
        ms = timer(replay)
        visible = 8 * 4 * seqlen_k * 0.25 * 128 * 2 * 2
        label = f"auto ({chosen(8, 4, seqlen_k, 132)})" if n is None else str(n)
        print(f"Sk {seqlen_k:6d} splits {label:9s} {ms:.4f} ms  {visible / ms / 1e6 / PEAK:.1%}")
