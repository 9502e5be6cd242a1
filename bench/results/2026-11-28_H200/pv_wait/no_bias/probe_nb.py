"""Forward GPU time (CUDA graph after an L2 flush, bench.run.graph_ms, ms) of the Hopper
forward's variants without a bias, and a key-bias control, bf16 H16 Hkv4."""

import torch

from bench.run import graph_ms
from dmattn_cute import flash_dmattn_func

torch.manual_seed(0)
H, HKV = 16, 4


def case(b, s, d, causal=False, mask=None, bias=False):
    q = torch.randn(b, s, H, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, HKV, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    m = None
    if mask == "dense":
        m = torch.ones(b, HKV, s, s, dtype=torch.bool, device="cuda")
    elif mask == "blocks":
        nb = s // 128
        blocks = torch.rand(b, HKV, nb, nb, device="cuda") < 0.25
        m = blocks.repeat_interleave(128, 2).repeat_interleave(128, 3)
    bb = torch.randn(b, HKV, 1, s, device="cuda", dtype=torch.bfloat16) if bias else None
    return lambda: flash_dmattn_func(q, k, v, m, bb, is_causal=causal)


cases = {
    "B4 S4096 D64": case(4, 4096, 64),
    "B4 S4096 D128": case(4, 4096, 128),
    "B4 S4096 D256": case(4, 4096, 256),
    "B4 S4096 D128 causal": case(4, 4096, 128, causal=True),
    "B16 S1024 D128": case(16, 1024, 128),
    "B2 S4096 D128 bool mask all True": case(2, 4096, 128, mask="dense"),
    "B2 S4096 D128 bool mask blocks 0.25": case(2, 4096, 128, mask="blocks"),
    "B2 S4096 D128 key bias (control)": case(2, 4096, 128, bias=True),
}
for name, fn in cases.items():
    fn()
    torch.cuda.synchronize()
    print(f"{name:40s} {graph_ms(fn):.4f} ms", flush=True)
