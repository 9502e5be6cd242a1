"""Probe: the host time of eager decode steps (flash_dmattn_func, one query per row, no grad),
B8 H16 Hkv4 D128, key bias, 64-key blocks at density 0.25: wall time per step over runs of
1000 steps (host-bound: the GPU needs ~0.16 ms a step at Sk 128k on an H200), median of 7.

    PYTHONPATH=TREE python3 bench/results/2026-11-26_H200/probe_decode_host.py
"""

import statistics
import time

import torch

from bench.workloads import Workload, make_inputs
from dmattn_cute import flash_dmattn_func

for seqlen_k in (131072, 524288):
    x = make_inputs(
        Workload("decode", 8, 1, seqlen_k, bias="key", mask="blocks", density=0.25), "cuda"
    )
    runs = []
    with torch.no_grad():
        for _ in range(8):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(1000):
                flash_dmattn_func(x.q, x.k, x.v, x.mask, x.bias)
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - start) / 1000 * 1e3)
    print(f"Sk {seqlen_k:6d}: {statistics.median(runs[1:]):.4f} ms a step (runs {runs[1:]})")
