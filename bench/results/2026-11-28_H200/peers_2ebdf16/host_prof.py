"""Host time of one forward call per row (no sync in the loop) and a cProfile of each."""
import cProfile
import io
import pstats
import sys
import time

import torch

from bench.peers import ours, ours_block_mask
from bench.workloads import Workload, make_inputs

ROWS = [
    ("no bias", Workload("bias", 2, 4096, 4096, 128), ours),
    ("key bias", Workload("bias", 2, 4096, 4096, 128, bias="key"), ours),
    ("key bias + dense mask", Workload("bias", 2, 4096, 4096, 128, bias="key", mask="dense"), ours),
    ("blocks128 0.25 bool", Workload("sparse", 2, 4096, 4096, 128, bias="key", mask="blocks128", density=0.25), ours),
    ("blocks128 0.25 block", Workload("sparse", 2, 4096, 4096, 128, bias="key", mask="blocks128", density=0.25), ours_block_mask),
]


def host(fn, calls=40):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    e = time.perf_counter() - t
    torch.cuda.synchronize()
    return e / calls * 1e6


for name, w, impl in ROWS:
    x = make_inputs(w, "cuda")
    fn = next(impl(x))[1]
    for _ in range(10):
        fn()
    times = sorted(host(fn) for _ in range(7))
    print(f"{name:24s} host us: median {times[3]:.1f} min {times[0]:.1f}", flush=True)
    if "-p" in sys.argv:
        pr = cProfile.Profile()
        torch.cuda.synchronize()
        pr.enable()
        for _ in range(200):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print("\n".join(s.getvalue().splitlines()[:45]))
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
        print("\n".join(s.getvalue().splitlines()[:50]))
