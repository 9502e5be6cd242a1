"""A persistent Hopper forward (block mask alone) whose CTAs walk many items in turn, for
compute-sanitizer: the launch told there are 3 SMs, B1 H4 Hkv2 S1000 D128 bf16 (8 query
tiles, 32 items: ~11 per CTA), rows with no, some and every key block visible, no bias and a
key bias; the output checked against an fp32 SDPA reference."""

import torch

from dmattn_cute import flash_dmattn_func
from dmattn_cute.kernels import fwd_launch

fwd_launch.sm_count = lambda device, arch: 3
torch.manual_seed(0)
B, S, H, HKV, D = 1, 1000, 4, 2, 128
dev = "cuda"
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
nb = -(-S // 128)
block_mask = torch.rand(B, HKV, nb, nb, device=dev) < 0.5
block_mask[0, 0, 1] = False
block_mask[0, 1, 2:4] = True
g = H // HKV
cells = torch.arange(S, device=dev) // 128
element = block_mask[:, :, cells][:, :, :, cells].repeat_interleave(g, 1)
for bias in (None, torch.randn(B, HKV, 1, S, device=dev, dtype=torch.bfloat16)):
    out = flash_dmattn_func(q, k, v, None, bias, block_mask=block_mask)
    add = (
        torch.zeros(B, H, S, S, device=dev)
        if bias is None
        else bias.float().repeat_interleave(g, 1)
    )
    ref = (
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(),
            k.transpose(1, 2).float().repeat_interleave(g, 1),
            v.transpose(1, 2).float().repeat_interleave(g, 1),
            attn_mask=add.masked_fill(~element, float("-inf")),
        )
        .transpose(1, 2)
        .nan_to_num(0.0)
    )
    err = (out.float() - ref).abs().max().item()
    print(f"bias {'key' if bias is not None else 'none'}: max abs err {err:.4f}", flush=True)
    assert err < 0.03
