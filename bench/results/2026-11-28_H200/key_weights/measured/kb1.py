"""One key-bias forward (B2 H16 Hkv4 S4096 D128 bf16), called 4 times: for ncu."""
import torch
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
B, S, H, HKV, D = 2, 4096, 16, 4, 128
q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
bias = torch.randn(B, HKV, 1, S, device="cuda", dtype=torch.bfloat16)
for _ in range(4):
    flash_dmattn_func(q, k, v, None, bias)
torch.cuda.synchronize()
