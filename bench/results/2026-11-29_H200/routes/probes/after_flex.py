"""Host cost of torch ops and of our call, before and after a compiled FlexAttention ran."""
import time, torch
from bench.workloads import Workload, make_inputs
from dmattn_cute import flash_dmattn_func
w = Workload("sparse", 2, 4096, 4096, bias="key", mask="blocks128", density=0.05)
x = make_inputs(w, "cuda", grad=False)
q, k, v, bias, blocks = x.q, x.k, x.v, x.bias, x.blocks
def us(f, n=2000):
    best = []
    for _ in range(3):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n): f()
        best.append((time.perf_counter() - t) / n * 1e6)
    torch.cuda.synchronize(); return min(best)
def report(tag):
    with torch.no_grad():
        r = {
            "empty": us(lambda: torch.empty(2, 16, 4096, dtype=torch.float32, device="cuda")),
            "as_strided": us(lambda: bias.as_strided((2, 4, 1, 4096), (16384, 4096, 0, 1))),
            "view": us(lambda: q.view(torch.bfloat16)),
            "stride+shape": us(lambda: (q.shape, q.stride())),
            "call": us(lambda: flash_dmattn_func(q, k, v, None, bias, block_mask=blocks), 300),
        }
    print(tag, "  ".join(f"{a} {b:.2f}" for a, b in r.items()), flush=True)
for _ in range(5): flash_dmattn_func(q, k, v, None, bias, block_mask=blocks)
report("fresh          ")
import torch._dynamo  # noqa
report("dynamo imported")
from bench.peers import flex
fl = list(flex(x))[0][1]
for _ in range(5): fl()
report("flex ran       ")
torch._dynamo.reset()
report("dynamo reset   ")
