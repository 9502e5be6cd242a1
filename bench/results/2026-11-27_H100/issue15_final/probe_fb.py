"""fwd+bwd at S4096, key bias, 128-blocks at density 0.25 and 1 (B2 H16 Hkv4 D128 bf16): per
impl the bench's do_bench time, the GPU time of the kernels one call launches (torch.profiler),
the CPU time to enqueue one call; then a cProfile of ours_block_mask's call."""
import cProfile, pstats, sys
import torch
from torch.profiler import ProfilerActivity, profile
from bench import peers
from bench.run import host_ms, make_timer, timed_call
from bench.workloads import Workload, make_inputs

_, timer = make_timer()

def kernel_ms(fn, calls=10):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / calls / 1e3

for density in (0.25, 1.0):
    w = Workload("sparse", 2, 4096, 4096, bias="key", mask="blocks128", density=density)
    x = make_inputs(w, "cuda", grad=True)
    for name in ("ours", "ours_block_mask", "flex"):
        fn, _ = timed_call(next(getattr(peers, name)(x))[1], x, "fwdbwd")
        for _ in range(3): fn()
        print(f"density {density} {name:16s} bench {timer(fn):.3f} ms  kernels {kernel_ms(fn):.3f} ms  host {host_ms(fn):.3f} ms", flush=True)
    if density == 0.25:
        fn, _ = timed_call(next(peers.ours_block_mask(x))[1], x, "fwdbwd")
        torch.cuda.synchronize()
        p = cProfile.Profile(); p.enable()
        for _ in range(50): fn()
        p.disable(); torch.cuda.synchronize()
        pstats.Stats(p, stream=sys.stdout).sort_stats("cumulative").print_stats(45)
        pstats.Stats(p, stream=sys.stdout).sort_stats("tottime").print_stats(30)
    del x; torch.cuda.empty_cache()
