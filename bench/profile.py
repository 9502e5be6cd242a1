"""Two forward + backward calls at the benchmark's shapes, for Nsight Compute.

    ncu --clock-control none -k regex:FlashBwd -c 1 --section SpeedOfLight \\
        python3 -m bench.profile [DENSITY]

Without DENSITY: no mask, no bias. With it: a block-sparse mask of that block density (as
bench.run draws it) and a bias [B, Hkv, 1, S] with its gradient.
"""

from __future__ import annotations

import sys

import torch

from bench.run import BATCH, HEAD_DIM, HEADS, HEADS_KV, SEQLEN, block_sparse_mask
from dmattn_cute.attention import flash_dmattn_func


def main() -> None:
    torch.manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": True}
    q = torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, **kw)
    k, v = (torch.randn(BATCH, SEQLEN, HEADS_KV, HEAD_DIM, **kw) for _ in range(2))
    mask = bias = None
    if len(sys.argv) > 1:
        mask = block_sparse_mask(float(sys.argv[1]), SEQLEN)
        bias = torch.randn(BATCH, HEADS_KV, 1, SEQLEN, **kw)
    for _ in range(2):
        out = flash_dmattn_func(q, k, v, mask, bias)
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
