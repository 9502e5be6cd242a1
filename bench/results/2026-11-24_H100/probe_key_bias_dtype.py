"""The forward with a key bias [B, Hkv, 1, S] given in the q/k/v dtype and in fp32, with and
without a random mask (density 0.9), against no bias (NOTES.md, "Key bias in fp32").

    source bench/carried.sh && PYTHONPATH=$PWD python3 bench/results/2026-11-24_H100/probe_key_bias_dtype.py
"""

import torch
from triton.testing import do_bench

from dmattn_cute import flash_dmattn_func

B, S, H, HKV, D = 2, 4096, 16, 4, 128

for dtype in (torch.bfloat16, torch.float16):

    def normal(*shape, dtype=dtype):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    q, k, v = normal(B, S, H, D), normal(B, S, HKV, D), normal(B, S, HKV, D)
    bias = normal(B, HKV, 1, S)
    mask = torch.rand(B, HKV, S, S, device="cuda") < 0.9
    cases = {
        "none": (None, None),
        "key": (None, bias),
        "key32": (None, bias.float()),
        "mask": (mask, None),
        "mask+key": (mask, bias),
        "mask+key32": (mask, bias.float()),
    }
    ms = {}
    for name, (m, b) in cases.items():
        with torch.no_grad():
            ms[name] = do_bench(
                lambda q=q, k=k, v=v, m=m, b=b: flash_dmattn_func(q, k, v, m, b),
                warmup=25, rep=300, return_mode="median",
            )  # fmt: skip
    print(
        dtype, " ".join(f"{n} {t:.3f}" for n, t in ms.items()),
        f"key/none {ms['key'] / ms['none']:.3f} key32/none {ms['key32'] / ms['none']:.3f}",
        f"mk32/mk {ms['mask+key32'] / ms['mask+key']:.3f}",
    )  # fmt: skip
