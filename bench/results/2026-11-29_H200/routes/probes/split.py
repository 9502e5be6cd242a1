"""The routed block-mask call's host time split into its steps (perf_counter_ns, mean of 300)."""
import time, torch
from bench.workloads import Workload, make_inputs
from dmattn_cute import attention, flash_dmattn_func
from dmattn_cute.kernels import fwd_launch as fl
from dmattn_cute.kernels.launch import operand_view
from dmattn_cute.problem import broadcast_view
w = Workload("sparse", 2, 4096, 4096, bias="key", mask="blocks128", density=0.05)
x = make_inputs(w, "cuda", grad=False)
q, k, v, bias, blocks = x.q, x.k, x.v, x.bias, x.blocks
with torch.no_grad():
    for _ in range(5): flash_dmattn_func(q, k, v, None, bias, block_mask=blocks)
    names = ["routing key", "lookup", "broadcast views", "3 outputs", "terms (2 empties + launch)", "mask view + block operands", "forward launch"]
    acc = [0] * len(names)
    n = 300
    for i in range(n + 20):
        t = [time.perf_counter_ns()]
        key = attention._routing_key(q, k, v, None, bias, (None, False, 0.0, (-1, -1), False), blocks, None); t.append(time.perf_counter_ns())
        problem, route = attention._ROUTED[key]; t.append(time.perf_counter_ns())
        mask4, bias4 = broadcast_view(None), broadcast_view(bias); t.append(time.perf_counter_ns())
        out, lse, stats = fl._outputs(problem, q); t.append(time.perf_counter_ns())
        b, moderate = fl._bias_operands(route.plan, bias4, problem); t.append(time.perf_counter_ns())
        view = route.block_mask_view; bits, order = fl._block_operands(route, problem, blocks); t.append(time.perf_counter_ns())
        route.plan.kernel(q, k, v, out, lse, stats, view, b, bits, order, None, moderate, *route.plan.scalars); t.append(time.perf_counter_ns())
        if i >= 20:
            for j in range(len(names)): acc[j] += t[j + 1] - t[j]
    torch.cuda.synchronize()
    for name, a in zip(names, acc): print(f"{name:30s} {a / n / 1e3:6.1f} us")
    print(f"{'total':30s} {sum(acc) / n / 1e3:6.1f} us")
    f = lambda: flash_dmattn_func(q, k, v, None, bias, block_mask=blocks)
    for _ in range(3):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(300): f()
        print("whole call", (time.perf_counter() - t0) / 300 * 1e6, "us")
    e = lambda: torch.empty(2, 16, 4096, dtype=torch.float32, device="cuda")
    t0 = time.perf_counter()
    for _ in range(1000): e()
    print("one empty", (time.perf_counter() - t0) / 1000 * 1e6, "us")
    ng = torch.no_grad()(lambda: None)
    t0 = time.perf_counter()
    for _ in range(1000): ng()
    print("no_grad wrapper", (time.perf_counter() - t0) / 1000 * 1e6, "us")
