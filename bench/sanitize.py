"""One masked, biased forward + backward with a tail (S=1000), for compute-sanitizer.

compute-sanitizer --tool racecheck python3 -m bench.sanitize

The mask has all-False key blocks and rows (skipped tiles), the bias is [1, H, 1, S] (dbias
column sums across the heads of a group), GQA 2/1 and a sliding window; the backward runs
once in default mode (atomics; on Hopper the wgmma backward) and once deterministic (turn
counters). Then a forward and backward with a full [1, H, S, S] bias and softcap (on Hopper:
the bias by TMA in the forward), 7 queries of the first (on Hopper: the short-query forward's
64-key tiles), a causal one without mask or bias, a causal one with top-w expiry rows
(key_expiry) whose backward splits its walks, and decode steps through the kv-cache API (its
chunks' outputs merged by the combine kernel).
"""

from __future__ import annotations

import torch

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.reference import attention_ref


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
    window = (700, 300)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, bias)]
    ref, _ = attention_ref(*leaves[:3], mask, leaves[3], window_size=window)
    ref.backward(dout.float())
    for deterministic in (False, True):
        ours = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        out = flash_dmattn_func(
            *ours[:3], mask, ours[3], window_size=window, deterministic=deterministic
        )
        out.backward(dout)
        errs = {"out": (out.float() - ref).abs().max().item()}
        for name, got, want in zip(("dq", "dk", "dv", "dbias"), ours, leaves, strict=True):
            errs[name] = ((got.grad.float() - want.grad).norm() / want.grad.norm()).item()
        print(f"deterministic={deterministic}: max abs err out {errs.pop('out'):.3e}, rel err "
              + ", ".join(f"{n} {e:.3e}" for n, e in errs.items()))  # fmt: skip
        assert all(e < 2e-2 for e in errs.values())
    # A full 16-bit bias with 16-byte aligned rows: the Hopper forward loads it by TMA; its
    # gradient is stored from dS (one contribution per element), after the softcap.
    full = torch.randn(b, h, s, s, **kw)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, full)]
    ref_full, _ = attention_ref(*leaves[:3], mask, leaves[3], softcap=30.0)
    ref_full.backward(dout.float())
    ours = [t.detach().clone().requires_grad_() for t in (q, k, v, full)]
    out = flash_dmattn_func(*ours[:3], mask, ours[3], softcap=30.0)
    out.backward(dout)
    err = (out.float() - ref_full).abs().max().item()
    grads = {
        name: ((got.grad.float() - want.grad).norm() / want.grad.norm()).item()
        for name, got, want in zip(("dq", "dk", "dv", "dbias"), ours, leaves, strict=True)
    }
    print(f"full bias, softcap: max abs err out {err:.3e}, rel err "
          + ", ".join(f"{n} {e:.3e}" for n, e in grads.items()))  # fmt: skip
    assert err < 2e-2 and all(e < 2e-2 for e in grads.values())
    # At most 64 queries with a mask: the Hopper forward walks 64-key tiles.
    rows = slice(590, 597)  # straddles the fully masked query rows from 600 on
    leaves = [q[:, rows].detach().float().requires_grad_()]
    leaves += [t.detach().float().requires_grad_() for t in (k, v, bias)]
    short_mask = mask[:, :, rows]
    ref_short, _ = attention_ref(*leaves[:3], short_mask, leaves[3])
    ref_short.backward(dout[:, rows].float())
    ours = [q[:, rows].detach().clone().requires_grad_()]
    ours += [t.detach().clone().requires_grad_() for t in (k, v, bias)]
    out = flash_dmattn_func(*ours[:3], short_mask, ours[3])
    out.backward(dout[:, rows])
    err = (out.float() - ref_short).abs().max().item()
    grads = {
        name: ((got.grad.float() - want.grad).norm() / want.grad.norm()).item()
        for name, got, want in zip(("dq", "dk", "dv", "dbias"), ours, leaves, strict=True)
    }
    print(f"7 queries, mask: max abs err out {err:.3e}, rel err "
          + ", ".join(f"{n} {e:.3e}" for n, e in grads.items()))  # fmt: skip
    assert err < 2e-2 and all(e < 2e-2 for e in grads.values())
    # No mask or bias: the Hopper backward's dense walk (every query block, no tile loads).
    ours = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_dmattn_func(*ours, is_causal=True).backward(dout)
    assert all(t.grad.isfinite().all() for t in ours)
    # Top-w expiry rows as the kernels' mask, with the backward's query range split every
    # 128 rows (split CTAs, some with empty shares, adding fp32 partial sums).
    from dmattn_cute.kernels import bwd_launch
    from dmattn_cute.topw import expiry_mask, topw_expiry

    bwd_launch.QUERY_SPLIT_ROWS = 128
    expiry = topw_expiry(bias[:, :, 0].float()[:, :1], 200)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_topw, _ = attention_ref(*leaves, expiry_mask(expiry, s), is_causal=True)
    ref_topw.backward(dout.float())
    ours = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_dmattn_func(*ours, is_causal=True, key_expiry=expiry)
    out.backward(dout)
    err = (out.float() - ref_topw).abs().max().item()
    grads = {
        name: ((got.grad.float() - want.grad).norm() / want.grad.norm()).item()
        for name, got, want in zip(("dq", "dk", "dv"), ours, leaves, strict=True)
    }
    print(f"top-w expiry, split walks: max abs err out {err:.3e}, rel err "
          + ", ".join(f"{n} {e:.3e}" for n, e in grads.items()))  # fmt: skip
    assert err < 2e-2 and all(e < 2e-2 for e in grads.values())
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


if __name__ == "__main__":
    main()
