"""CPU time per eager call (un-synchronized loop at S256, so the GPU keeps up): ours with the
block mask and with the bool mask, fwd+bwd and fwd; then the same after FlexAttention has
compiled a forward + backward in the process; then a cProfile of the block-mask fwd+bwd."""
import cProfile, pstats, statistics, sys, time
import torch
from bench import peers
from bench.workloads import Workload, make_inputs

w = Workload("sparse", 2, 256, 256, bias="key", mask="blocks128", density=0.5)
x = make_inputs(w, "cuda", grad=True)
dout = torch.randn_like(x.q)
leaves = [x.q, x.k, x.v, x.bias]
calls = {"block": next(peers.ours_block_mask(x))[1], "bool": next(peers.ours(x))[1]}

def fwdbwd(fn):
    return lambda: torch.autograd.grad(fn(), leaves, dout)

def per_call(fn, n=200, reps=7):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n): fn()
        times.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)

def table(tag):
    for name, fn in calls.items():
        print(f"{tag:12s} {name:6s} fwd+bwd {per_call(fwdbwd(fn)):7.1f} us", flush=True)
        with torch.no_grad():
            print(f"{tag:12s} {name:6s} fwd     {per_call(fn):7.1f} us", flush=True)

table("fresh")
flex = next(peers.flex(x))[1]
torch.autograd.grad(flex(), leaves, dout); torch.cuda.synchronize()
table("after flex")
p = cProfile.Profile(); fn = fwdbwd(calls["block"]); p.enable()
for _ in range(200): fn()
p.disable(); torch.cuda.synchronize()
pstats.Stats(p).sort_stats("tottime").print_stats(30)
