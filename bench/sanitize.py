"""One masked, biased forward with a tail (S=1000), for compute-sanitizer racecheck/memcheck.

compute-sanitizer --tool racecheck python3 -m bench.sanitize
"""

from __future__ import annotations

import torch

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.reference import attention_ref


def main() -> None:
    torch.manual_seed(0)
    b, s, h, hkv, d = 1, 1000, 2, 1, 64
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(b, hkv, s, s, device="cuda") < 0.5
    mask[..., 256:512] = False  # whole key blocks skipped
    bias = torch.randn(b, h, 1, s, device="cuda", dtype=torch.bfloat16)
    out = flash_dmattn_func(q, k, v, mask, bias, window_size=(700, 300))
    ref, _ = attention_ref(q, k, v, mask, bias, window_size=(700, 300))
    err = (out.float() - ref).abs().max().item()
    print(f"max abs err vs reference: {err:.3e}")
    assert err < 5e-2


if __name__ == "__main__":
    main()
