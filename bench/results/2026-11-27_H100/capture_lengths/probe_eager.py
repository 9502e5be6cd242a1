"""Eager kv-cache decode steps with tensor lengths (contiguous, and paged 64-key pages): host
wall time per call (each call synchronized), median of 200; B8 H16 Hkv4 D128 bf16, key bias."""
import statistics, time
import torch
from dmattn_cute import flash_dmattn_with_kvcache

torch.manual_seed(0)
B, H, HKV, D, SK, PAGE = 8, 16, 4, 128, 32768, 64
kw = {"device": "cuda", "dtype": torch.bfloat16}
q = torch.randn(B, 1, H, D, **kw)
k, v = (torch.randn(B, SK, HKV, D, **kw) for _ in range(2))
bias = torch.randn(B, HKV, 1, SK, **kw)
lengths = torch.full((B,), SK - 100, dtype=torch.int32, device="cuda")
table = torch.randperm(B * SK // PAGE, device="cuda").int().view(B, -1)
kp, vp = (t.view(-1, PAGE, HKV, D) for t in (k, v))
for name, call in (
    ("contiguous", lambda: flash_dmattn_with_kvcache(q, k, v, cache_seqlens=lengths, attn_bias=bias)),
    ("paged", lambda: flash_dmattn_with_kvcache(q, kp, vp, cache_seqlens=lengths, attn_bias=bias, block_table=table)),
):
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    ts = []
    for _ in range(200):
        t0 = time.perf_counter(); call(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    print(f"{name:10s} {statistics.median(ts) * 1e3:.4f} ms per synchronized eager call", flush=True)
