"""triton do_bench of the density-0.05 block-mask forward (ours) and Flex in one process:
ours fresh, Flex, ours again; then with gc off; with the host time of one call beside."""
import gc, statistics, time, torch
from triton.testing import do_bench
from bench.workloads import Workload, make_inputs
from bench.peers import flex
from dmattn_cute import flash_dmattn_func
w = Workload("sparse", 2, 4096, 4096, bias="key", mask="blocks128", density=0.05)
x = make_inputs(w, "cuda", grad=False)
ours = torch.no_grad()(lambda: flash_dmattn_func(x.q, x.k, x.v, None, x.bias, block_mask=x.blocks))
def host(fn, n=50):
    fn(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    el = (time.perf_counter() - t) / n * 1e3; torch.cuda.synchronize(); return el
def bench(name, fn):
    r = [do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(3)]
    print(f"{name:28s} do_bench {' '.join(f'{v:.3f}' for v in r)} ms, host {host(fn):.3f} ms, gc counts {gc.get_count()}", flush=True)
for _ in range(5): ours()
bench("ours fresh", ours)
fl = torch.no_grad()(list(flex(x))[0][1])
for _ in range(5): fl()
bench("flex", fl)
bench("ours after flex", ours)
gc.disable()
bench("ours gc off", ours)
bench("flex gc off", fl)
gc.enable()
# the call split: host time to the forward's launch
from dmattn_cute.kernels import fwd_launch
