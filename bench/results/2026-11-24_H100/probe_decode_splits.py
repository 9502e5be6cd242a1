"""Probe: the kv-cache decode step from a CUDA graph with the key chunks per row forced to a
given count (kvcache.decode_splits patched), B8 H16 Hkv4 D128, key bias, 64-key blocks at
density 0.25, as bench.run's ours_kvcache_graph times it. Each argument is a key length and
its counts ("auto": the heuristic's); the HBM share is of the visible K/V bytes.

    python3 bench/results/2026-11-24_H100/probe_decode_splits.py \\
        32768:auto,4,16,32,64 131072:auto,16,32,64          # 2026-11-24, H100
    python3 bench/results/2026-11-24_H100/probe_decode_splits.py \\
        32768:auto,12,16,24,32,auto 131072:auto,12,16,24,auto   # 2026-11-26, H200
"""

import sys

import torch

from bench.peers import ours_kvcache_graph
from bench.run import make_timer
from bench.workloads import Workload, make_inputs
from dmattn_cute import kvcache

_, timer = make_timer()
peak = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12  # bytes/s
chosen = kvcache.decode_splits
for arg in sys.argv[1:]:
    seqlen_k, counts = arg.split(":")
    seqlen_k = int(seqlen_k)
    x = make_inputs(
        Workload("decode", 8, 1, seqlen_k, bias="key", mask="blocks", density=0.25), "cuda"
    )
    for count in counts.split(","):
        n = None if count == "auto" else int(count)
        kvcache.decode_splits = chosen if n is None else (lambda *a, n=n: n)
        _, replay = next(ours_kvcache_graph(x))
        ms = timer(replay)
        visible = 8 * 4 * seqlen_k * 0.25 * 128 * 2 * 2
        label = f"auto ({chosen(8, 4, seqlen_k, 132)})" if n is None else str(n)
        print(f"Sk {seqlen_k:6d} splits {label:9s} {ms:.4f} ms  {visible / (ms * 1e-3) / peak:.1%}")
