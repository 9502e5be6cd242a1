"""do_bench's loop (zero_ flush, start event, call, end event) under torch.profiler: per
iteration, when the CPU launched each kernel and when the GPU ran it (us from the flush's launch)."""
import json, statistics, sys, torch
from bench.workloads import Workload, make_inputs
from bench.peers import flex
from dmattn_cute import flash_dmattn_func
w = Workload("sparse", 2, 4096, 4096, bias="key", mask="blocks128", density=0.05)
x = make_inputs(w, "cuda", grad=False)
calls = {"block": lambda: flash_dmattn_func(x.q, x.k, x.v, None, x.bias, block_mask=x.blocks),
         "flex": list(flex(x))[0][1]}
cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
for name, fn in calls.items():
    with torch.no_grad():
        for _ in range(20): fn()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(30)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for s, e in ev:
                cache.zero_(); s.record(); fn(); e.record()
            torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in ev]
    print(name, "event ms median", statistics.median(ms))
    prof.export_chrome_trace(f"/tmp/trace_{name}.json")
    tr = json.load(open(f"/tmp/trace_{name}.json"))["traceEvents"]
    rows = sorted((e for e in tr if e.get("ph") == "X" and e.get("cat") in ("kernel", "cuda_runtime", "gpu_memset", "cuda_driver")), key=lambda e: e["ts"])
    # iterations start at each zero_ flush (a fill kernel or memset)
    starts = [e for e in rows if e["cat"] in ("kernel", "gpu_memset") and ("fill" in e["name"].lower() or "memset" in e["name"].lower() or "zero" in e["name"].lower())]
    cpu_fill = [e for e in rows if e["cat"] in ("cuda_runtime", "cuda_driver") and ("Memset" in e["name"] or "LaunchKernel" in e["name"])]
    for it in range(10, 14):
        g0 = starts[it]["ts"]
        g1 = starts[it + 1]["ts"] if it + 1 < len(starts) else 1e30
        seg = [e for e in rows if g0 - 400 <= e["ts"] < g1 - 50]
        print(f"-- iteration {it} (us from the flush kernel's start)")
        for e in seg:
            if e["cat"] in ("cuda_runtime", "cuda_driver") and not any(k in e["name"] for k in ("Launch", "Memset", "EventRecord")):
                continue
            print(f"   {e['cat'][:7]:7s} {e['ts'] - g0:8.1f} +{e.get('dur', 0):6.1f}  {e['name'][:70]}")
