"""Probe (PYTHONPATH=.:$PYTHONPATH python3 .lp/probe_sparse_balance.py): B2 H16 Hkv4 S4096 D128 bf16, key bias, 128x128 block mask (block_mask=): random
blocks at 0.25 vs exactly 8 of 32 per query block (staggered), vs all; fwd and fwd+bwd ms."""
import statistics
import torch
from dmattn_cute import flash_dmattn_func

cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
def timed(fn, n=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        cache.sum()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts)

print(torch.cuda.get_device_name())
torch.manual_seed(0)
B, S, H, HKV, D = 2, 4096, 16, 4, 128
kw = dict(device="cuda", dtype=torch.bfloat16)
q = torch.randn(B, S, H, D, **kw, requires_grad=True)
k = torch.randn(B, S, HKV, D, **kw, requires_grad=True)
v = torch.randn(B, S, HKV, D, **kw, requires_grad=True)
bias = torch.randn(B, HKV, 1, S, **kw, requires_grad=True)
nb = S // 128
m = torch.arange(nb, device="cuda").view(1, 1, nb, 1)
n = torch.arange(nb, device="cuda").view(1, 1, 1, nb)
hb = torch.arange(B * HKV, device="cuda").view(B, HKV, 1, 1)
masks = {
    "random 0.25": torch.rand(B, HKV, nb, nb, device="cuda") < 0.25,
    "balanced 0.25": (n + m + hb) % 4 == 0,
    "aligned 0.25": (m + n // 8 + hb) % 4 == 0,
    "cols 0.25": ((n + hb) % 4 == 0).expand(B, HKV, nb, nb),
    "all": torch.ones(B, HKV, nb, nb, dtype=torch.bool, device="cuda"),
}
for name, blocks in masks.items():
    per_row = blocks.sum(-1).float()
    per_col = blocks.sum(-2).float()
    fwd = lambda: flash_dmattn_func(q.detach(), k.detach(), v.detach(), None, bias.detach(), block_mask=blocks)
    def fb():
        out = flash_dmattn_func(q, k, v, None, bias, block_mask=blocks)
        torch.autograd.grad(out, (q, k, v, bias), do)
    do = torch.randn(B, S, H, D, **kw)
    print(f"{name:14s} row max {per_row.max():.0f} col max {per_col.max():.0f}: fwd {timed(fwd):.4f} ms  fwd+bwd {timed(fb):.4f} ms", flush=True)
