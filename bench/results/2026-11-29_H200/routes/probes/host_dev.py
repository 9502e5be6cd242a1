"""Host time per call of the sparse forward on the GPU machine, split: kernel calls, empties."""
import statistics, sys, time
import torch
print("torch", torch.__version__, "dlpack attrs:",
      hasattr(torch.Tensor, "__dlpack_c_exchange_api__"), hasattr(torch.Tensor, "__c_dlpack_exchange_api__"))
import tvm_ffi, tvm_ffi._optional_torch_c_dlpack as o
print("tvm_ffi", tvm_ffi.__version__ if hasattr(tvm_ffi, "__version__") else "?", "c_dlpack lib:", o._LIB)
from bench.workloads import Workload, make_inputs
from dmattn_cute import flash_dmattn_func
from dmattn_cute.kernels import fwd_launch, block_bits_launch
acc = {"ns": 0, "n": 0}
orig = fwd_launch.compiled
def timed(spec, arch):
    f = orig(spec, arch)
    def call(*a):
        t = time.perf_counter_ns(); r = f(*a); acc["ns"] += time.perf_counter_ns() - t; acc["n"] += 1
        return r
    return call
fwd_launch.compiled = timed
w = Workload("sparse", 2, 4096, 4096, bias="key", mask="blocks128", density=0.05)
x = make_inputs(w, "cuda", grad=False)
calls = {
    "nobias": lambda: flash_dmattn_func(x.q, x.k, x.v),
    "key": lambda: flash_dmattn_func(x.q, x.k, x.v, None, x.bias),
    "block": lambda: flash_dmattn_func(x.q, x.k, x.v, None, x.bias, block_mask=x.blocks),
    "bool": lambda: flash_dmattn_func(x.q, x.k, x.v, x.mask, x.bias),
}
def host_us(f, n=100):
    res = []
    for _ in range(7):
        torch.cuda.synchronize(); acc["ns"] = acc["n"] = 0
        t = time.perf_counter(); [f() for _ in range(n)]; el = time.perf_counter() - t
        res.append((el / n * 1e6, acc["ns"] / n / 1e3, acc["n"] / n))
    torch.cuda.synchronize()
    return sorted(res)[3]
with torch.no_grad():
    for name, f in calls.items():
        for _ in range(10): f()
        tot, kern, nk = host_us(f)
        print(f"{name:7s} host {tot:6.1f} us/call, kernel calls {kern:6.1f} us ({nk:.0f} per call)")
    def empties():
        torch.empty(2, 4096, 16, 128, dtype=torch.bfloat16, device="cuda")
        torch.empty(2, 16, 4096, dtype=torch.float32, device="cuda")
        torch.empty(2, 16, 2, 4096, dtype=torch.float32, device="cuda")
        torch.empty(2, 16, 4096, 16, dtype=torch.bfloat16, device="cuda")
        torch.empty(2, 16, 128, dtype=torch.uint8, device="cuda")
    print("5 empties", host_us(empties, 1000)[0], "us")
    view = lambda: x.q.view(torch.bfloat16)
    print("1 view", host_us(view, 1000)[0], "us")
    from bench.peers import flex
    fl = list(flex(x))[0][1]
    for _ in range(5): fl()
    print("flex host", host_us(fl)[0], "us")
