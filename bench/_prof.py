import torch
from dmattn_cute.attention import flash_dmattn_func
torch.manual_seed(0)
kw = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": True}
q = torch.randn(2, 4096, 16, 128, **kw); k = torch.randn(2, 4096, 4, 128, **kw); v = torch.randn(2, 4096, 4, 128, **kw)
for _ in range(2):
    out = flash_dmattn_func(q, k, v); out.backward(torch.randn_like(out))
torch.cuda.synchronize()
