"""Packed variable-length sequences against the padded batch of the same sequences (issue 16's
target: varlen forward + backward within 1.1x of the padded batch's time), and FlexAttention
over the packed tokens with a document mask.

    python3 -m bench.varlen [--max-len 4096] [--count 8] [--unaligned] [--no-causal] [--no-flex]
        [--out DIR]

The lengths run evenly from max_len down to about max_len / 2, all different (so the varlen
path's runs of equal lengths are single sequences). Both layouts carry a per-key bias and take
its gradient: [N, Hkv, 1, S] on the padded batch, whose key-padding mask [N, 1, 1, S] hides
the padding keys, and [Hkv, total] on the packed tokens. Reports the median ms
(bench.run.events_median) of the forward and of the forward + backward of each layout, the
varlen / padded ratios, and the relative difference of the real rows' outputs.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from dmattn_cute import flash_dmattn_func, flash_dmattn_varlen_func


def sequence_lengths(max_len: int, count: int, unaligned: bool = False) -> list[int]:
    """`count` different lengths from max_len down by max_len // (2 * count) each; unaligned:
    sequence i also 37 * (i + 1) shorter, so that the packed sequences start off the 128-row tiles
    (more tiles straddle two sequences)."""
    step = max(1, max_len // (2 * count))
    return [max_len - i * step - (37 * (i + 1) if unaligned else 0) for i in range(count)]


@dataclass
class Layouts:
    """The same sequences padded ([N, S, ...], leaves q, k, v, bias; `valid` [N, S] marks the
    real tokens) and packed ([total, ...], leaves of their own)."""

    lengths: list[int]
    valid: Tensor
    padded: tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # q, k, v, key mask, bias
    packed: tuple[Tensor, Tensor, Tensor, Tensor]  # q, k, v, bias [Hkv, total]
    cu_seqlens: Tensor

    def padded_call(self, causal: bool) -> Tensor:
        q, k, v, mask, bias = self.padded
        return flash_dmattn_func(q, k, v, mask, bias, is_causal=causal)

    def packed_call(self, causal: bool) -> Tensor:
        q, k, v, bias = self.packed
        longest = max(self.lengths)
        return flash_dmattn_varlen_func(
            q, k, v, self.cu_seqlens, self.cu_seqlens, longest, longest, attn_bias=bias,
            is_causal=causal,
        )  # fmt: skip


def make_layouts(
    lengths: list[int], heads: int, heads_kv: int, head_dim: int, device, dtype
) -> Layouts:
    torch.manual_seed(0)
    n, s = len(lengths), max(lengths)
    kw = {"device": device, "dtype": dtype}
    q = torch.randn(n, s, heads, head_dim, **kw)
    k, v = (torch.randn(n, s, heads_kv, head_dim, **kw) for _ in range(2))
    bias = torch.randn(n, heads_kv, 1, s, **kw)
    valid = torch.arange(s, device=device) < torch.tensor(lengths, device=device)[:, None]
    packed = [t[valid] for t in (q, k, v)] + [bias[:, :, 0].transpose(0, 1)[:, valid]]
    cu_seqlens = torch.zeros(n + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.tensor(lengths, device=device).cumsum(0)
    padded = [t.requires_grad_() for t in (q, k, v)] + [valid[:, None, None, :]]
    return Layouts(
        lengths,
        valid,
        (*padded, bias.requires_grad_()),
        tuple(t.contiguous().requires_grad_() for t in packed),
        cu_seqlens,
    )


def flex_runner(layouts: Layouts, causal: bool):
    """FlexAttention over the packed tokens as one sequence: a document mask (and the causal
    one) as mask_mod and its BlockMask (built here, outside the timing), the per-key bias as
    score_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, bias = (t.detach() for t in layouts.packed)
    total, heads = q.shape[0], q.shape[1]
    group = heads // k.shape[1]
    lengths = torch.tensor(layouts.lengths, device=q.device)
    document = torch.repeat_interleave(torch.arange(len(layouts.lengths), device=q.device), lengths)

    def mask_mod(b, h, q_idx, kv_idx):
        same = document[q_idx] == document[kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h // group, kv_idx]

    blocks = create_block_mask(mask_mod, 1, None, total, total, device=q.device.type)
    attend = torch.compile(flex_attention)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    return lambda: attend(qt, kt, vt, score_mod=score_mod, block_mask=blocks, enable_gqa=True)[
        0
    ].transpose(0, 1)


def main() -> None:
    from bench.run import events_median, peer_forward, write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--unaligned", action="store_true")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    causal = not args.no_causal
    lengths = sequence_lengths(args.max_len, args.count, args.unaligned)
    lay = make_layouts(lengths, args.heads, args.heads_kv, args.head_dim, "cuda", torch.bfloat16)
    padded_leaves = [lay.padded[i] for i in (0, 1, 2, 4)]
    dout_padded = torch.randn_like(lay.padded[0])
    dout_packed = dout_padded[lay.valid]

    def times(call, leaves, dout) -> dict:
        def forward():
            with torch.no_grad():
                call(causal)

        def forward_backward():
            torch.autograd.grad(call(causal), leaves, dout)

        return {"fwd_ms": events_median(forward), "fwdbwd_ms": events_median(forward_backward)}

    with torch.no_grad():
        want = lay.padded_call(causal)[lay.valid].float()
        got = lay.packed_call(causal).float()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "lengths": lengths,
        "tokens": sum(lengths),
        "padded_tokens": len(lengths) * max(lengths),
        "causal": causal,
        "heads": args.heads,
        "heads_kv": args.heads_kv,
        "head_dim": args.head_dim,
        "varlen_rel_diff": ((got - want).norm() / want.norm()).item(),
        "padded": times(lay.padded_call, padded_leaves, dout_padded),
        "varlen": times(lay.packed_call, list(lay.packed), dout_packed),
    }
    for mode in ("fwd_ms", "fwdbwd_ms"):
        result[f"varlen_over_padded_{mode[:-3]}"] = result["varlen"][mode] / result["padded"][mode]
    if not args.no_flex:
        peer_forward(result, "flex", lambda: flex_runner(lay, causal), got)
    write_result(result, args.out, "varlen.json")


if __name__ == "__main__":
    main()
