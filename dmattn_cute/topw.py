"""Causal top-w masks by a per-key score, in compact form: one int32 per key.

Dynamic-mask models keep, for each query, the w keys of highest score among those it may see
(keys 0..i for query i, causal). Stored as a bool mask that is [B, H, S, S]; but whether key j
is among query i's top w only changes once as i grows: from the row where it appears (i = j)
to the row where w keys of higher score have appeared before it (the `expiry` e_j). So

    mask[i, j] = j <= i < expiry[j]

holds exactly, and expiry [..., Sk] is the mask (`expiry_mask` expands it, e.g. for the
reference). Ties rank by position: of equal scores, the earlier key ranks higher, as a
stable sort orders them.

`topw_expiry` computes it without any [S, S] tensor. With ranks r (0 = highest score):
expiry[j] = min{i : at least w keys of rank below r_j sit at positions <= i}, that is the
first i where h(i) < r_j, h(i) being the w-th smallest rank among positions 0..i (S where
there are fewer than w). h is a running order statistic; it is built in chunks of `chunk`
positions: an inclusive scan (log2(chunks) steps) gives each chunk the w smallest ranks of the
chunks before it, and within a chunk h follows from those and the chunk's own ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmattn_cute.block_mask import and_masks
from dmattn_cute.problem import check_compact_mask

_TEMP_BYTES = 1 << 30


def topw_expiry(scores: Tensor, w: int, chunk: int = 64) -> Tensor:
    """int32 expiry [..., S] of the causal top-`w` mask of `scores` [..., S] (module doc):
    query row i (in key positions; bottom-right aligned when Sq != Sk, see expiry_mask) keeps
    key j iff j <= i < expiry[j]; S where a key never expires."""
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise ValueError(f"w: expected a positive int, got {w!r}")
    if scores.dim() < 1 or not scores.is_floating_point():
        raise ValueError(
            f"scores: expected a float tensor [..., S], got {scores.dtype} {tuple(scores.shape)}"
        )
    lead, seqlen = scores.shape[:-1], scores.shape[-1]
    flat = scores.reshape(-1, seqlen)
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices
    # int32 ranks: half the bytes of every sort and merge below
    ranks = torch.empty(order.shape, dtype=torch.int32, device=flat.device)
    steps = torch.arange(seqlen, dtype=torch.int32, device=flat.device)
    ranks.scatter_(1, order, steps.expand(order.shape))
    # about 5 bytes per (position, candidate) of temporaries: rows in groups of ~1 GiB
    group = max(1, _TEMP_BYTES // (5 * seqlen * (2 * chunk + 1)))
    h = torch.cat([_running_wth_smallest(part, w, chunk) for part in ranks.split(group)])
    # expiry[j] = first i with h(i) < rank[j]; h is non-increasing in i
    expiry = torch.searchsorted(-h.contiguous(), -ranks, right=True)
    return expiry.to(torch.int32).reshape(*lead, seqlen)


def _running_wth_smallest(values: Tensor, w: int, chunk: int) -> Tensor:
    """h[n, p] = the w-th smallest of values[n, :p + 1] (distinct values in [0, S)), or S
    where p + 1 < w."""
    rows, seqlen = values.shape
    none = seqlen  # above every value: "fewer than w so far"
    chunks = -(-seqlen // chunk)
    padded = values.new_full((rows, chunks * chunk), none)
    padded[:, :seqlen] = values
    local = padded.view(rows, chunks, chunk)
    # best[n, c]: the w smallest values of chunks 0..c, ascending (padded with `none`)
    best = torch.sort(local, dim=-1).values
    if chunk < w:
        best = torch.cat([best, best.new_full((rows, chunks, w - chunk), none)], dim=-1)
    best = best[..., :w]
    shift = 1
    while shift < chunks:
        merged = torch.cat([best[:, shift:], best[:, :-shift]], dim=-1)
        best = torch.cat([best[:, :shift], torch.sort(merged, dim=-1).values[..., :w]], dim=1)
        shift *= 2
    before = torch.cat([best.new_full((rows, 1, w), none), best[:, :-1]], dim=1)
    # Within a chunk, h at its u-th position is the w-th smallest of `before` and the chunk's
    # first u + 1 values; with at most `chunk` new values it lies among the last chunk + 1 of
    # `before` (the tail) or the new values. Merge tail and chunk once, then count per u.
    keep = min(chunk + 1, w)
    tail = before[..., w - keep :]
    # the rest of `before` lies below every candidate; count only its real values (where
    # `before` has fewer than w - keep of them, h stays `none` in this chunk anyway)
    below = (before[..., : w - keep] != none).sum(-1, keepdim=True)[..., None]
    merged, source = torch.sort(torch.cat([tail, local], dim=-1), dim=-1)
    from_chunk = source >= keep  # else from the tail
    position = (source - keep).clamp(min=0)  # in the chunk, for values from it
    steps = torch.arange(chunk, device=values.device)
    counted = ~from_chunk[:, :, None, :] | (position[:, :, None, :] <= steps[:, None])
    counted &= merged[:, :, None, :] != none
    reached = counted.cumsum(-1, dtype=torch.int16) + below >= w
    first = (reached & counted).int().argmax(-1, keepdim=True)  # the w-th counted value
    h = torch.gather(merged[:, :, None, :].expand_as(counted), 3, first).squeeze(-1)
    h = torch.where((reached & counted).any(-1), h, torch.full_like(h, none))
    return h.view(rows, chunks * chunk)[:, :seqlen]


def expiry_mask(expiry: Tensor, seqlen_q: int) -> Tensor:
    """The bool mask [..., Sq, Sk] of an expiry [..., Sk]: query i (bottom-right aligned, key
    position i + Sk - Sq) keeps key j iff j <= i + Sk - Sq < expiry[j]."""
    seqlen_k = expiry.shape[-1]
    rows = torch.arange(seqlen_q, device=expiry.device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=expiry.device)[None, :]
    return (cols <= rows) & (rows < expiry[..., None, :])


def check_key_expiry(
    key_expiry: object, batch: int, heads: int, heads_kv: int, seqlen_k: int, device
) -> None:
    """Raise TypeError / ValueError unless key_expiry is an int32 [Be, He, Sk] tensor (or
    int64 key ranges) with Be in {1, B} and He in {1, Hkv, H} on `device`
    (flash_dmattn_func's key_expiry)."""
    ranges = isinstance(key_expiry, Tensor) and key_expiry.dtype == torch.int64
    check_compact_mask(
        "key_expiry", key_expiry, torch.int64 if ranges else torch.int32, device,
        ((1, batch), (1, heads_kv, heads), (seqlen_k,)),
        lambda: f"[Be, He, Sk] with Be in {{1, {batch}}}, He in {{1, {heads_kv}, {heads}}} and "
        f"Sk = {seqlen_k}",
    )  # fmt: skip


def split_ranges(key_expiry: Tensor) -> tuple[Tensor, Tensor | None]:
    """(expiry, first row) of int64 key ranges (first row << 32 | expiry), both int32; or
    (expiry, None) for int32 expiry rows."""
    if key_expiry.dtype == torch.int32:
        return key_expiry, None
    return (key_expiry & 0xFFFFFFFF).to(torch.int32), (key_expiry >> 32).to(torch.int32)


def with_key_expiry(
    attn_mask: Tensor | None, key_expiry: Tensor, seqlen_q: int, group: int
) -> Tensor:
    """attn_mask (3-D or 4-D, or None) and key_expiry [Be, He, Sk] as one materialized element
    mask of their broadcast shape: row i keeps key j where attn_mask does and i + Sk - Sq <
    key_expiry[j] (no causal limit: that stays is_causal's), and for int64 key ranges (first
    row << 32 | expiry) from i + Sk - Sq = first row on. `group` = H / Hkv maps an Hkv head
    dim onto an H one."""
    seqlen_k = key_expiry.shape[-1]
    positions = torch.arange(seqlen_q, device=key_expiry.device) + (seqlen_k - seqlen_q)
    expiry, first = split_ranges(key_expiry)
    keep = positions[:, None] < expiry[:, :, None, :]
    if first is not None:
        keep &= positions[:, None] >= first[:, :, None, :]
    return and_masks(attn_mask, keep, group)


__all__ = [
    "check_key_expiry",
    "expiry_mask",
    "split_ranges",
    "topw_expiry",
    "with_key_expiry",
]
