"""Probe: a decode step through flash_dmattn_with_kvcache on a paged cache (pages shuffled in
a pool) against the contiguous cache, B8 H16 Hkv4 D128 bf16, key bias, 64-key blocks at
density 0.25 (the bench's decode rows). Page sizes 64 and 256 are read in place; 32 splits
the 64-key tile, so that step gathers the rows first (as every paged step did before).
CUDA graph replays and eager calls; CUDA events, median of 100, after a 256 MB read (clean
L2) or do_bench's zero_ (dirty L2)."""
import os
import statistics

import torch
from bench.workloads import Workload, make_inputs
from dmattn_cute import flash_dmattn_with_kvcache

print(torch.cuda.get_device_name(), torch.__version__)
cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")


def events(fn, reps=100, flush="read"):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        cache.zero_() if flush == "zero" else cache.sum()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts)


def graphed(call):
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    return g.replay


for sk in (32768, 131072):
    w = Workload("decode", 8, 1, sk, 128, bias="key", mask="blocks", density=0.25)
    x = make_inputs(w, "cuda")
    B, _, Hkv, D = x.k.shape

    def contiguous():
        return flash_dmattn_with_kvcache(x.q, x.k, x.v, attn_mask=x.mask, attn_bias=x.bias)

    ref = contiguous()
    rows = {"contiguous": contiguous}
    for page in [int(p) for p in os.environ.get("PAGES", "64 256 32").split()]:
        per_row = sk // page
        order = torch.randperm(B * per_row, device="cuda")
        table = order.view(B, per_row).to(torch.int32)
        kp = torch.empty(B * per_row, page, Hkv, D, device="cuda", dtype=x.k.dtype)
        vp = torch.empty_like(kp)
        kp[table.long()] = x.k.view(B, per_row, page, Hkv, D)
        vp[table.long()] = x.v.view(B, per_row, page, Hkv, D)

        def paged(kp=kp, vp=vp, table=table):
            return flash_dmattn_with_kvcache(
                x.q, kp, vp, attn_mask=x.mask, attn_bias=x.bias, block_table=table
            )

        assert torch.equal(paged(), ref), page
        rows[f"paged {page}"] = paged
    for name, fn in rows.items():
        replay = graphed(fn)
        print(f"Sk {sk:6d} {name:12s} graph clean {events(replay):.4f} ms  dirty "
              f"{events(replay, flush='zero'):.4f} ms  eager clean {events(fn):.4f} ms", flush=True)
    del x, rows
