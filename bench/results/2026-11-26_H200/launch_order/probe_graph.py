"""GPU time of the sparse suite's block-mask rows by CUDA graph replay (no host in the timing),
each replay after a clean L2 flush (a read), median of REPS; forward alone and forward +
backward (autograd.grad of q, k, v, bias).
    PYTHONPATH=.:$PYTHONPATH python3 .lp/probe_graph.py TAG"""
import statistics
import sys

import torch

from bench.workloads import Workload, make_inputs
from dmattn_cute import flash_dmattn_func

REPS = 60
flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def graph_ms(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        flush_buf.sum(dtype=torch.int32)  # clean lines: nothing written back during the call
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


tag = sys.argv[1]
for causal in (False, True):
    for density in (1.0, 0.25, 0.05):
        w = Workload("sparse", 2, 4096, 4096, 128, causal=causal, bias="key", mask="blocks128",
                     density=density)
        x = make_inputs(w, "cuda", grad=True)

        def fwd():
            return flash_dmattn_func(x.q, x.k, x.v, None, x.bias, is_causal=causal,
                                     block_mask=x.blocks)

        dout = torch.randn_like(x.q)

        def fwdbwd():
            out = fwd()
            return torch.autograd.grad(out, x.leaves, dout)

        with torch.no_grad():
            f = graph_ms(fwd)
        fb = graph_ms(fwdbwd)
        print(f"{tag:8s} blocks128 {density:4} {'causal' if causal else '      '} "
              f"fwd {f:.4f} fwdbwd {fb:.4f} ms", flush=True)
