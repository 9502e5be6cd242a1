"""One masked, biased forward + backward with a tail (S=1000), for compute-sanitizer.

compute-sanitizer --tool racecheck python3 -m bench.sanitize

The mask has all-False key blocks and rows (skipped tiles), the bias is [1, H, 1, S] (dbias
column sums across the heads of a group), GQA 2/1 and a sliding window; the backward runs
once in default mode (atomics; on Hopper the wgmma backward) and once deterministic (turn
counters). Then a forward and backward with a full [1, H, S, S] bias and softcap (on Hopper:
the bias by TMA in the forward), 7 queries of the first (on Hopper: the short-query forward's
64-key tiles), a causal one without mask or bias, a causal one with a key bias alone, partly
finfo.min (on Hopper: its terms in Q K^T, the bounded and the exact walk), one with a block mask and
one causal (on Hopper: its bits, the CTAs in its launch order), a causal one with top-w
expiry rows (key_expiry) whose backward splits its walks, and decode steps through the kv-cache API (its
chunks' outputs merged by the combine kernel), the last on a paged cache (on Hopper: its pages
read in place).
"""

from __future__ import annotations

import torch

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.reference import attention_ref

GRADIENTS = ("dq", "dk", "dv", "dbias")


def check(label: str, inputs, dout, options: dict, ref_options: dict | None = None) -> None:
    """Ours against the float32 reference, forward and backward on the same `inputs` (q, k, v
    and, if given, the bias: the differentiated tensors), with flash_dmattn_func's keyword
    `options` (the reference's `ref_options` where they differ): prints the largest error of
    out and the relative error of each gradient, and asserts both below 2e-2."""
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    ours = [t.detach().clone().requires_grad_() for t in inputs]
    ref, _ = attention_ref(*leaves[:3], attn_bias=(leaves[3:] or [None])[0],
                           **(options if ref_options is None else ref_options))  # fmt: skip
    ref.backward(dout.float())
    out = flash_dmattn_func(*ours[:3], attn_bias=(ours[3:] or [None])[0], **options)
    out.backward(dout)
    err = (out.float() - ref).abs().max().item()
    grads = {
        name: ((got.grad.float() - want.grad).norm() / want.grad.norm()).item()
        for name, got, want in zip(GRADIENTS, ours, leaves, strict=False)
    }
    print(f"{label}: max abs err out {err:.3e}, rel err "
          + ", ".join(f"{n} {e:.3e}" for n, e in grads.items()))  # fmt: skip
    assert err < 2e-2 and all(e < 2e-2 for e in grads.values())


def main() -> None:
    torch.manual_seed(0)
    b, s, h, hkv, d = 1, 1000, 2, 1, 64
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(b, s, h, d, **kw)
    k = torch.randn(b, s, hkv, d, **kw)
    v = torch.randn(b, s, hkv, d, **kw)
    mask = torch.rand(b, hkv, s, s, device="cuda") < 0.5
    mask[..., 256:512] = False  # whole key blocks skipped
    mask[..., 600:700, :] = False  # whole query blocks skipped
    bias = torch.randn(b, h, 1, s, **kw)
    dout = torch.randn_like(q)
    window = {"attn_mask": mask, "window_size": (700, 300)}
    for deterministic in (False, True):
        check(f"deterministic={deterministic}", (q, k, v, bias), dout,
              {**window, "deterministic": deterministic}, window)  # fmt: skip
    # A full 16-bit bias with 16-byte aligned rows: the Hopper forward loads it by TMA; its
    # gradient is stored from dS (one contribution per element), after the softcap.
    full = torch.randn(b, h, s, s, **kw)
    check("full bias, softcap", (q, k, v, full), dout, {"attn_mask": mask, "softcap": 30.0})
    # At most 64 queries with a mask: the Hopper forward walks 64-key tiles.
    rows = slice(590, 597)  # straddles the fully masked query rows from 600 on
    check("7 queries, mask", (q[:, rows], k, v, bias), dout[:, rows],
          {"attn_mask": mask[:, :, rows]})  # fmt: skip
    # No mask or bias: the Hopper backward's dense walk (every query block, no tile loads).
    ours = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_dmattn_func(*ours, is_causal=True).backward(dout)
    assert all(t.grad.isfinite().all() for t in ours)
    # A key bias alone, causal: on Hopper the row as terms of Q K^T (kernels/key_bias_terms.py),
    # head 1's last keys finfo.min padding: its last query blocks walk with the exact softmax,
    # the rest with the bounded one (the terms' moderate flags).
    padded = bias.clone()
    padded[:, 1, :, 950:] = torch.finfo(padded.dtype).min
    check("key bias, causal", (q, k, v, padded), dout, {"is_causal": True})
    # A block mask: the Hopper kernels read it as block bits and take their CTAs' items from
    # its launch order (kernels/launch_order.py); all-False block rows leave rows masked.
    from dmattn_cute.block_mask import expand_block_mask

    blocks = torch.rand(b, hkv, 8, 8, device="cuda") < 0.4
    for causal in (False, True):
        check(f"block mask, causal={causal}", (q, k, v, bias), dout,
              {"is_causal": causal, "block_mask": blocks},
              {"is_causal": causal, "attn_mask": expand_block_mask(blocks, s, s)})  # fmt: skip
    # Top-w expiry rows as the kernels' mask, with the backward's query range split every
    # 128 rows (split CTAs, some with empty shares, adding fp32 partial sums).
    from dmattn_cute.kernels import bwd_launch
    from dmattn_cute.topw import expiry_mask, topw_expiry

    bwd_launch.QUERY_SPLIT_ROWS = 128
    expiry = topw_expiry(bias[:, :, 0].float()[:, :1], 200)
    check("top-w expiry, split walks", (q, k, v), dout,
          {"is_causal": True, "key_expiry": expiry},
          {"is_causal": True, "attn_mask": expiry_mask(expiry, s)})  # fmt: skip
    # Decode: heads packed, keys split into chunks (one launch where they divide the cache,
    # else one per chunk), merged by the combine kernel.
    from dmattn_cute import flash_dmattn_with_kvcache

    for seqlen_cache in (s, s + 1):
        cache = [torch.randn(2, seqlen_cache, hkv, d, **kw) for _ in range(2)]
        step = torch.randn(2, 1, h, d, **kw)
        row_mask = torch.rand(2, hkv, 1, seqlen_cache, device="cuda") < 0.3
        row_bias = torch.randn(2, hkv, 1, seqlen_cache, **kw)
        out, lse = flash_dmattn_with_kvcache(
            step, *cache, attn_mask=row_mask, attn_bias=row_bias, return_lse=True
        )
        ref_step, _ = attention_ref(step, *cache, row_mask, row_bias)
        err = (out.float() - ref_step.float()).abs().max().item()
        print(f"decode, cache {seqlen_cache}: max abs err out {err:.3e}")
        assert err < 2e-2 and lse.isfinite().all()
    # a cache of 1024 keys in pages of 64, shuffled in a pool
    n = 1024
    pages = torch.randperm(2 * n // 64, device="cuda", dtype=torch.int32).view(2, n // 64)
    pool = [torch.empty(2 * n // 64, 64, hkv, d, **kw) for _ in range(2)]
    for part in pool:
        part[pages.long()] = torch.randn(2, n // 64, 64, hkv, d, **kw)
    row_mask = torch.rand(2, hkv, 1, n, device="cuda") < 0.3
    out = flash_dmattn_with_kvcache(step, *pool, attn_mask=row_mask, block_table=pages)
    keys, values = (part[pages.long()].flatten(1, 2) for part in pool)
    ref_step, _ = attention_ref(step, keys, values, row_mask, None)
    err = (out.float() - ref_step.float()).abs().max().item()
    print(f"decode, paged cache {n}: max abs err out {err:.3e}")
    assert err < 2e-2


if __name__ == "__main__":
    main()
