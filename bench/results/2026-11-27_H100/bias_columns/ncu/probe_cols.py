"""ncu probe: the Hopper forward with a key bias [B, Hkv, 1, S], no mask, B2 H16 Hkv4 S4096
D128 bf16; one profiled launch (the tree on PYTHONPATH decides which kernel)."""
import torch
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
b, s, h, hkv, d = 2, 4096, 16, 4, 128
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
bias = torch.randn(b, hkv, 1, s, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    for _ in range(3):
        flash_dmattn_func(q, k, v, None, bias)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    flash_dmattn_func(q, k, v, None, bias)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
