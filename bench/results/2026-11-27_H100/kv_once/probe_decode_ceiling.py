"""Probe: the decode step's share of HBM against the device's measured copy bandwidth (METHOD.md:
a large device-to-device copy, bytes read plus written) and against the datasheet, in one
process. B8 H16 Hkv4 D128 bf16, key bias, 64-key blocks at density 0.25 (the bench's decode
rows), kv-cache API replayed from a CUDA graph (bench's ours_kvcache_graph). CUDA events,
median of 200, each step after do_bench's dirtying flush (zero_ of 256 MB), after a read of
256 MB (clean lines), or with no flush.

    PYTHONPATH=.:$PYTHONPATH python3 probe_decode_ceiling.py
"""
import statistics
import torch
from bench.peers import ours_kvcache_graph
from bench.workloads import Workload, make_inputs

name = torch.cuda.get_device_name()
datasheet = 4.8e12 if "H200" in name else 3.35e12
cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")


def events(fn, reps, flush="none"):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        if flush == "zero":
            cache.zero_()
        elif flush == "read":
            cache.sum()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts) * 1e-3


print(name, torch.__version__)
copy_bw = {}
for gib in (1, 2, 4):
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = events(lambda: dst.copy_(src), 30)
    copy_bw[gib] = 2 * src.numel() / t
    print(f"copy {gib} GiB: {t * 1e3:.3f} ms, {copy_bw[gib] / 1e12:.3f} TB/s (read + written)", flush=True)
    del src, dst
measured = max(copy_bw.values())
print(f"ceiling: measured {measured / 1e12:.3f} TB/s, datasheet {datasheet / 1e12:.2f} TB/s")
for sk in (32768, 131072, 524288):
    w = Workload("decode", 8, 1, sk, 128, bias="key", mask="blocks", density=0.25)
    x = make_inputs(w, "cuda")
    visible = 8 * 4 * sk * 0.25 * 128 * 2 * 2  # K and V bytes of the visible blocks
    _, replay = next(ours_kvcache_graph(x))
    for flush in ("zero", "read", "none"):
        t = events(replay, 200, flush)
        rate = visible / t
        print(f"Sk {sk:6d} flush {flush:4s} {t * 1e3:.4f} ms  {rate / 1e12:.3f} TB/s  "
              f"{rate / measured:.1%} of measured  {rate / datasheet:.1%} of datasheet", flush=True)
    del x
