"""Long context with a block mask: forward + backward at S = 131072, causal, a trainable
per-key bias, and each query block's top key blocks by that bias (issue 16's target: runs on
one GPU), against FlexAttention with the same block mask where it runs.

    python3 -m bench.long_context [--seqlen 131072] [--keep-blocks 16] [--out DIR]

Reports the median ms (bench.run.events_median) of the block-mask build (create_block_mask),
of the forward and of the forward + backward, the peak memory of a forward + backward beyond
its inputs (bench.run.peak_mib), and the executed fraction of the dense causal work (visible
blocks over all blocks). Then the same for the token-level causal top-w mask of that bias
(w = keep_blocks x 128) as key_expiry rows (dmattn_cute/topw.py): their build, forward and
forward + backward.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.run import events_median, peak_mib, peer_forward, write_result
from dmattn_cute import create_block_mask, flash_dmattn_func
from dmattn_cute.block_mask import BLOCK
from dmattn_cute.topw import topw_expiry


def flex_runner(q, k, v, bias, block_mask):
    """FlexAttention over the same visible blocks (a BlockMask from their indices: blocks
    below the diagonal full, diagonal ones with the causal mask_mod) with the bias as a
    score_mod."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    heads, group = q.shape[2], q.shape[2] // bias.shape[1]
    m_blocks, n_blocks = block_mask.shape[2], block_mask.shape[3]
    rows = torch.arange(m_blocks, device=q.device)[:, None]
    cols = torch.arange(n_blocks, device=q.device)[None, :]
    visible = block_mask.repeat_interleave(heads // block_mask.shape[1], 1) & (cols <= rows)

    def indices(blocks):  # counts [1, H, Mq] and the listed blocks first, ascending
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return blocks.sum(-1).to(torch.int32), order.to(torch.int32)

    def causal(b, h, q_idx, kv_idx):  # the blocks too: eager flex applies it everywhere
        return visible[0, h, q_idx // BLOCK, kv_idx // BLOCK] & (kv_idx <= q_idx)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[0, h // group, kv_idx]

    blocks = BlockMask.from_kv_blocks(
        *indices(visible & (cols == rows)), *indices(visible & (cols < rows)),
        BLOCK_SIZE=BLOCK, mask_mod=causal,
    )  # fmt: skip
    attend = torch.compile(flex_attention)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return lambda: attend(
        qt, kt, vt, score_mod=score_mod, block_mask=blocks, enable_gqa=True
    ).transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--keep-blocks", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=4)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    torch.manual_seed(0)
    s, h, hkv, d = args.seqlen, args.heads, args.heads_kv, 128
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(1, s, h, d, **kw).requires_grad_()
    k = torch.randn(1, s, hkv, d, **kw).requires_grad_()
    v = torch.randn(1, s, hkv, d, **kw).requires_grad_()
    bias = torch.randn(1, hkv, s, **kw).requires_grad_()
    dout = torch.randn_like(q)

    def build():
        return create_block_mask(bias.detach(), args.keep_blocks, is_causal=True)

    block_mask = build()
    visible = block_mask.float().mean().item() * 2  # causal dense work is half the blocks

    def attention_times(prefix: str, **masks) -> dict:
        """Forward and forward + backward medians, and the latter's peak memory, of the
        attention with these mask keywords."""

        def forward():
            with torch.no_grad():
                flash_dmattn_func(q, k, v, attn_bias=bias, is_causal=True, **masks)

        def forward_backward():
            out = flash_dmattn_func(q, k, v, attn_bias=bias, is_causal=True, **masks)
            torch.autograd.grad(out, (q, k, v, bias), dout)

        return {
            f"{prefix}fwd_ms": events_median(forward),
            f"{prefix}fwdbwd_ms": events_median(forward_backward),
            f"{prefix}fwdbwd_peak_mib": peak_mib(forward_backward),
        }

    result = {
        "gpu": torch.cuda.get_device_name(),
        "seqlen": s,
        "heads": h,
        "heads_kv": hkv,
        "keep_blocks": args.keep_blocks,
        "executed_fraction_of_causal": visible,
        "build_ms": events_median(build),
        **attention_times("", block_mask=block_mask),
    }
    # The token-level causal top-w mask of the same keys (w = keep_blocks x 128), as per-key
    # expiry rows (dmattn_cute/topw.py): its build, then the attention reading it.
    width = args.keep_blocks * BLOCK
    expiry = topw_expiry(bias.detach(), width)

    result |= {
        "topw_w": width,
        "topw_build_ms": events_median(lambda: topw_expiry(bias.detach(), width)),
        **attention_times("topw_", key_expiry=expiry),
    }
    if not args.no_flex:
        with torch.no_grad():
            ours = flash_dmattn_func(q, k, v, attn_bias=bias, is_causal=True, block_mask=block_mask)
        peer_forward(
            result, "flex",
            lambda: flex_runner(q.detach(), k.detach(), v.detach(), bias.detach(), block_mask),
            ours,
        )  # fmt: skip
    write_result(result, args.out, "long_context.json")


if __name__ == "__main__":
    main()
