"""Attention against a key/value cache, in FlashAttention's `flash_attn_with_kvcache` convention.

    out = flash_dmattn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                    cache_seqlens=lengths, attn_mask=..., attn_bias=...,
                                    is_causal=True)

Each batch row b of the cache holds `cache_seqlens[b]` valid keys; the new keys and values
`k`, `v` (if given) are written into the cache in place after them, and the queries attend to
the first `cache_seqlens[b] + Snew` keys of their row, with causal and window limits aligned to
that length (the last query sits at the last key). The mask and the bias are indexed by cache
position: their key dim is the cache's length (or 1).

This is the inference API: it runs without autograd. Today it runs the attention kernels over
the whole cache length; unless every row fills the cache (an int cache_seqlens, or the
default), the per-row lengths (and causal/window limits) become a boolean mask
[B, 1, Sq, Sk_cache] combined with the caller's mask, so key blocks past a row's length are
skipped whole. A paged cache (block_table) is read in place by the decode step on SM90 where
its pages hold whole key tiles, else first gathered into a contiguous copy. Per-row lengths
in the kernel (no mask) are the next step (issue 16). Until then the cache slots past a
row's length must hold finite values (a cache made with torch.zeros, or one only ever written
by this function): the key block that holds a row's last keys is read whole, and a masked
key's weight 0 times a NaN value is NaN, in the kernels as in the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.decode import decode_splits, packable, packed_decode, reads_pages
from dmattn_cute.kernels.launch import sm_count
from dmattn_cute.problem import broadcast_view, check_bool, check_broadcast, check_window_size


def flash_dmattn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    attn_mask: Tensor | None = None,
    attn_bias: Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    block_table: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of q against the cache, after appending k, v to it in place.

    q: [B, Sq, H, D]; k_cache, v_cache: [Bc, Sk_cache, Hkv, D] (Bc = B, or any size with
    cache_batch_idx), q's dtype and device; or, paged, [num_pages, page_size, Hkv, D] with
    block_table: integer [B, pages_per_row] (int32 is read as is), row b's key p at page
    block_table[b, p // page_size], slot p % page_size (Sk_cache = pages_per_row * page_size;
    no cache_batch_idx). k, v: [B, Snew, Hkv, D] or None (both or neither). cache_seqlens: the
    valid keys of each row before the append, an int or an integer tensor [B] (default: the
    whole cache, Sk_cache - Snew). cache_batch_idx: integer [B], the cache row of each batch
    row (default: row b). The values of block_table, cache_seqlens and cache_batch_idx are
    checked on every call (a device read each, cache_batch_idx's distinct rows one more)
    except while a CUDA graph is captured: a captured step reads them on the device at each
    replay, so a serving loop may change them in place between replays (and must keep them
    in range).
    attn_mask (bool, True = attend) and attn_bias broadcast as in flash_dmattn_func over
    [B, H, Sq, Sk_cache]. Returns out [B, Sq, H, D] and, with return_lse, lse [B, H, Sq]
    (natural log; -inf for a query that sees no key, whose output is 0).

    A decode step (Sq = 1, packable) on SM90 reads a paged cache where it is when a page holds
    whole key tiles of its kernel (decode.reads_pages; at head dim 128, page_size a multiple
    of 64 with a mask or per-row lengths, of 128 without); otherwise the pages are gathered
    into a contiguous [B, Sk_cache, Hkv, D] copy for the attention. The new keys and values are
    written into their pages in place either way.
    Raises TypeError / ValueError on bad input before anything is written.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = f"{t.dim()}-D" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 4-D tensor, got {got}")
    batch, seqlen_q, _, head_dim = q.shape
    cache_rows, seqlen_cache, heads_kv, _ = k_cache.shape
    pages = None
    if block_table is not None:
        pages = _check_block_table(block_table, cache_batch_idx, batch, cache_rows, q.device)
        seqlen_cache = pages.shape[1] * k_cache.shape[1]  # the rows' logical length
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, "
            f"got {tuple(v_cache.shape)}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(
                f"{name}: expected dtype {q.dtype} on {q.device} like q, got {t.dtype} on "
                f"{t.device}"
            )
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache: expected dim 3 (head_dim) to be D={head_dim} like q, got {k_cache.shape[3]}"
        )
    rows = None if pages is not None else _cache_rows(cache_batch_idx, batch, cache_rows, q.device)
    seqlen_new = _check_new(k, v, batch, heads_kv, head_dim, q)
    lengths, full = _cache_lengths(cache_seqlens, batch, seqlen_cache, seqlen_new, q.device)
    check_bool("is_causal", is_causal)
    check_bool("return_lse", return_lse)
    left, right = check_window_size(window_size)
    heads = q.shape[2]
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None:
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
            check_broadcast(t, name, batch, heads, heads_kv, seqlen_q, seqlen_cache)

    with torch.no_grad():
        if seqlen_new > 0:
            # append: cache row rows[b], positions lengths[b] .. lengths[b] + Snew - 1
            slots = _length_rows(lengths, batch, q.device)[:, None]
            slots = slots + torch.arange(seqlen_new, device=q.device)
            if pages is not None:  # position p: page pages[b, p // page_size], p % page_size
                page_size = k_cache.shape[1]
                cache_index, slots = pages.gather(1, slots // page_size), slots % page_size
            else:
                cache_index = torch.arange(batch, device=q.device) if rows is None else rows
                cache_index = cache_index[:, None]
            k_cache[cache_index, slots] = k
            v_cache[cache_index, slots] = v
        mask = None if attn_mask is None else broadcast_view(attn_mask)
        causal, window = is_causal, (left, right)
        # Every row holds the whole cache (known on the host): the kernels' own bottom-right
        # causal / window limits are the ones asked for, and one query per row limits nothing
        # but a left window. Otherwise the lengths and limits become a mask.
        if not full or (seqlen_q == 1 and left >= 0):
            ends = _length_rows(lengths, batch, q.device) + seqlen_new
            visible = _visible(ends, seqlen_q, seqlen_cache, is_causal, left, right)
            mask = visible if mask is None else visible & mask
            causal, window = False, (-1, -1)
        bias = None if attn_bias is None else broadcast_view(attn_bias)
        splits = decode_splits(batch, heads_kv, seqlen_cache, _sms(q.device))
        if (
            pages is not None
            and packable(q, k_cache, (mask, bias))
            and reads_pages(q, k_cache, pages, mask, bias, softmax_scale, softcap)
        ):
            # one query per row, the pages read where they are
            out, lse = packed_decode(
                q, k_cache, v_cache, mask, bias, softmax_scale, softcap, splits, pages
            )  # fmt: skip
            return (out, lse) if return_lse else out
        # the cache rows of this batch (gathered when cache_batch_idx or pages say where)
        if pages is not None:
            keys = k_cache[pages].flatten(1, 2)  # [B, pages, page_size, ...] -> [B, Sk_cache, ...]
            values = v_cache[pages].flatten(1, 2)
        else:
            keys = k_cache if rows is None else k_cache[rows]
            values = v_cache if rows is None else v_cache[rows]
        if packable(q, keys, (mask, bias)):
            # one query per row: the group's heads packed as rows, the keys split in chunks
            out, lse = packed_decode(q, keys, values, mask, bias, softmax_scale, softcap, splits)
            return (out, lse) if return_lse else out
        return flash_dmattn_func(
            q, keys, values, mask, attn_bias, softmax_scale=softmax_scale, is_causal=causal,
            softcap=softcap, window_size=window, return_lse=return_lse,
        )  # fmt: skip


def _sms(device: torch.device) -> int:
    """SMs of a CUDA device (a CPU run plans as for an H100)."""
    return sm_count(device, "sm_90a")


def _cache_rows(
    cache_batch_idx: Tensor | None, batch: int, cache_rows: int, device: torch.device
) -> Tensor | None:
    """The cache row of each batch row (None: row b for batch row b)."""
    if cache_batch_idx is None:
        if cache_rows != batch:
            raise ValueError(
                f"k_cache: expected dim 0 to be B={batch} like q (or give cache_batch_idx), "
                f"got {cache_rows}"
            )
        return None
    if not isinstance(cache_batch_idx, Tensor) or cache_batch_idx.dtype.is_floating_point:
        raise TypeError("cache_batch_idx: expected an integer tensor [B]")
    if cache_batch_idx.shape != (batch,):
        raise ValueError(
            f"cache_batch_idx: expected shape [{batch}], got {tuple(cache_batch_idx.shape)}"
        )
    rows = cache_batch_idx.to(device=device, dtype=torch.long)
    if _capturing(rows):
        return rows
    low, high = _value_range(rows)
    if low < 0 or high >= cache_rows:
        raise ValueError(
            f"cache_batch_idx: expected values in [0, {cache_rows}), got {low}..{high}"
        )
    if rows.unique().numel() != batch:
        raise ValueError("cache_batch_idx: expected distinct rows (each is written to)")
    return rows


def _check_block_table(
    block_table: object, cache_batch_idx: object, batch: int, num_pages: int, device
) -> Tensor:
    """block_table on q's device as an int32 or int64 tensor [B, pages_per_row] (int32 kept:
    the kernels read it as is) of pages in [0, num_pages); its values are not read while a
    CUDA graph is captured (no device read can be)."""
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: not with block_table (the table says where rows are)")
    if not isinstance(block_table, Tensor) or block_table.dtype.is_floating_point:
        raise TypeError("block_table: expected an integer tensor [B, pages_per_row]")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table: expected shape [B={batch}, pages_per_row >= 1], got "
            f"{tuple(block_table.shape)}"
        )
    pages = block_table.to(device=device)
    if pages.dtype not in (torch.int32, torch.int64):
        pages = pages.long()
    if _capturing(pages):
        return pages
    low, high = _value_range(pages)
    if low < 0 or high >= num_pages:
        raise ValueError(f"block_table: expected pages in [0, {num_pages}), got {low}..{high}")
    return pages


def _check_new(
    k: Tensor | None, v: Tensor | None, batch: int, heads_kv: int, head_dim: int, q: Tensor
) -> int:
    """Snew of the new keys and values (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError("k, v: expected both or neither")
    if k is None:
        return 0
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [B, Snew, Hkv, D]")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name}: expected dtype {q.dtype} on {q.device} like q")
        expected = (batch, k.shape[1], heads_kv, head_dim)
        if tuple(t.shape) != expected:
            raise ValueError(f"{name}: expected shape {list(expected)}, got {list(t.shape)}")
    return k.shape[1]


def _cache_lengths(
    cache_seqlens: int | Tensor | None,
    batch: int,
    seqlen_cache: int,
    seqlen_new: int,
    device: torch.device,
) -> tuple[int | Tensor, bool]:
    """cache_seqlens checked, each length with room for the Snew new keys (a tensor's values
    are read to check them, one device read per call, except while a CUDA graph is captured):
    an int as given, a tensor as a long tensor [B]; and whether every row is known on the host
    to fill the cache once the new keys are in (an int length)."""
    if cache_seqlens is None:
        cache_seqlens = seqlen_cache - seqlen_new
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        low = high = lengths = cache_seqlens  # known on the host: no sync
    elif isinstance(cache_seqlens, Tensor) and not cache_seqlens.dtype.is_floating_point:
        if cache_seqlens.shape != (batch,):
            raise ValueError(
                f"cache_seqlens: expected an int or shape [{batch}], "
                f"got {tuple(cache_seqlens.shape)}"
            )
        lengths = cache_seqlens.to(device=device, dtype=torch.long)
        if _capturing(lengths):
            return lengths, False
        low, high = _value_range(lengths)
    else:
        raise TypeError("cache_seqlens: expected an int or an integer tensor [B]")
    if low < 0 or high + seqlen_new > seqlen_cache:
        raise ValueError(
            f"cache_seqlens: expected lengths in [0, Sk_cache - Snew] = [0, "
            f"{seqlen_cache - seqlen_new}], got {low}..{high}"
        )
    return lengths, isinstance(cache_seqlens, int) and low + seqlen_new == seqlen_cache


def _capturing(t: Tensor) -> bool:
    """Whether t is on a CUDA device whose current stream is capturing a graph: no device read
    can be made, so its values go unchecked (a replay reads whatever they are then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _value_range(t: Tensor) -> tuple[int, int]:
    """The least and greatest values of an integer tensor, in one device read."""
    low, high = torch.stack(torch.aminmax(t)).tolist()
    return low, high


def _length_rows(lengths: int | Tensor, batch: int, device: torch.device) -> Tensor:
    """Cache lengths as a long tensor [B]: an int (one length for all rows) made into one
    where it is needed (a full cache read without new keys needs none: no launch)."""
    if isinstance(lengths, Tensor):
        return lengths
    return torch.full((batch,), lengths, dtype=torch.long, device=device)


def _visible(
    lengths: Tensor, seqlen_q: int, seqlen_cache: int, causal: bool, left: int, right: int
) -> Tensor:
    """bool [B, 1, 1 or Sq, Sk_cache]: key j of row b is one of its first lengths[b] keys and,
    with causal / window limits, in query i's band, aligned so query Sq - 1 sits at key
    lengths[b] - 1."""
    cols = torch.arange(seqlen_cache, device=lengths.device)
    visible = cols[None, :] < lengths[:, None]  # [B, Sk]
    if not (causal or left >= 0 or right >= 0):
        return visible[:, None, None, :]
    # the key position of each query row: i + lengths[b] - Sq
    rows = torch.arange(seqlen_q, device=lengths.device)[None, :] + (lengths[:, None] - seqlen_q)
    rows, cols = rows[:, :, None], cols[None, None, :]  # [B, Sq, 1], [1, 1, Sk]
    band = visible[:, None, :]
    if causal:
        band = band & (cols <= rows)
    if right >= 0:
        band = band & (cols <= rows + right)
    if left >= 0:
        band = band & (cols >= rows - left)
    return band[:, None]


__all__ = ["flash_dmattn_with_kvcache"]
