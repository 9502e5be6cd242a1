import sys
import torch
from bench.run import BATCH, HEADS, HEADS_KV, HEAD_DIM, block_sparse_mask
from dmattn_cute.attention import flash_dmattn_func
torch.manual_seed(0)
s = 4096
kw = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": True}
q = torch.randn(BATCH, s, HEADS, HEAD_DIM, **kw); k = torch.randn(BATCH, s, HEADS_KV, HEAD_DIM, **kw); v = torch.randn(BATCH, s, HEADS_KV, HEAD_DIM, **kw)
density = float(sys.argv[1]) if len(sys.argv) > 1 else None
mask = None if density is None else block_sparse_mask(density, s)
bias = None if density is None else torch.randn(BATCH, HEADS_KV, 1, s, **kw)
for _ in range(2):
    out = flash_dmattn_func(q, k, v, mask, bias); out.backward(torch.randn_like(out))
torch.cuda.synchronize()
