"""Decoding (one query per row) composed from the forward kernel: the query heads of a group
packed as rows (PackGQA: K and V are read once per kv head, not once per query head) and the
keys split into chunks run side by side (split-KV: enough CTAs to read the cache at the
GPU's bandwidth), their partial outputs merged by their log-sum-exps.

Used by flash_dmattn_with_kvcache for Sq = 1. On CUDA the chunks run as one forward launch
where the keys divide evenly (else one per chunk), and the merge is one more
(kernels/combine.py). The forward reading its chunk of the keys itself (no copies of the
mask/bias rows, any Sk) is the next step (issue 16)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.kernels.combine_launch import combine_splits


def decode_splits(batch: int, heads_kv: int, seqlen_k: int, sms: int) -> int:
    """Key chunks per (row, kv head): up to enough for two CTAs per SM, each chunk at least
    512 keys; the largest such count that divides the keys (its chunks then run in one
    launch), else that upper count."""
    wanted = max(1, min(math.ceil(2 * sms / (batch * heads_kv)), math.ceil(seqlen_k / 512)))
    divisors = [n for n in range(2, wanted + 1) if seqlen_k % n == 0]
    return divisors[-1] if divisors else wanted


def packable(q: Tensor, k: Tensor, operands: tuple[Tensor | None, ...]) -> bool:
    """Whether a call can run packed: one query per row, q's heads adjacent in memory, and each
    mask/bias ([Bm, Hm, 1, Km], 4-D) shared by the query heads of a group (Hm in 1, Hkv)."""
    heads, heads_kv = q.shape[2], k.shape[2]
    return (
        q.shape[1] == 1
        and q.stride(2) == q.shape[3]
        and all(t is None or (t.dim() == 4 and t.shape[1] in (1, heads_kv)) for t in operands)
        and heads % heads_kv == 0
    )


def packed_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    softmax_scale: float | None,
    softcap: float,
    splits: int,
) -> tuple[Tensor, Tensor]:
    """out [B, 1, H, D] and lse [B, H, 1] of one query per row (see packable), the keys in
    `splits` chunks.

    Each chunk runs the forward on q viewed as [B, group, Hkv, D] (a view: the group's heads
    as its query rows), its mask/bias sliced alike; the chunks' outputs are merged with the
    weights exp(lse_chunk - lse), lse the log-sum-exp of theirs (a row with no visible key
    anywhere: out 0, lse -inf)."""
    batch, _, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads // heads_kv
    if splits > 1 and seqlen_k % splits == 0 and k.is_contiguous() and v.is_contiguous():
        # one launch: chunk s of row b is batch entry b * splits + s
        out, lse = flash_dmattn_func(
            *chunk_operands(q, k, v, mask, bias, splits), softmax_scale=softmax_scale,
            softcap=softcap, return_lse=True,
        )  # fmt: skip
        outs = out.view(batch, splits, group, heads_kv, head_dim)
        lses = lse.view(batch, splits, heads_kv, group)
    else:
        packed = _packed_queries(q, heads_kv)
        chunk = -(-seqlen_k // splits)
        outs, lses = [], []
        for start in range(0, seqlen_k, chunk):
            keys = slice(start, min(seqlen_k, start + chunk))
            parts = [t if t is None or t.shape[-1] == 1 else t[..., keys] for t in (mask, bias)]
            out, lse = flash_dmattn_func(
                packed, k[:, keys], v[:, keys], *parts, softmax_scale=softmax_scale,
                softcap=softcap, return_lse=True,
            )  # fmt: skip
            outs.append(out)
            lses.append(lse)
        outs, lses = torch.stack(outs, dim=1), torch.stack(lses, dim=1)
    # outs [B, splits, group, Hkv, D], lses [B, splits, Hkv, group]
    if outs.is_cuda:
        out, lse = combine_splits(outs, lses)  # one launch: [B, Hkv, group, D], [B, Hkv, group]
        return out.view(batch, 1, heads, head_dim), lse.view(batch, heads, 1)
    # the reference path (CPU): the same merge in whole-tensor ops
    lse = torch.logsumexp(lses, dim=1)
    # -inf - -inf: a chunk and the whole row without a visible key weigh 0
    weights = torch.exp(lses - lse[:, None]).nan_to_num_(0.0)
    out = (weights.transpose(2, 3)[..., None] * outs).sum(dim=1)  # fp32 [B, group, Hkv, D]
    out = out.transpose(1, 2).reshape(batch, 1, heads, head_dim).to(q.dtype)
    return out, lse.reshape(batch, heads, 1)


def _packed_queries(q: Tensor, heads_kv: int) -> Tensor:
    """q [B, 1, H, D] viewed as [B, group, Hkv, D]: a group's heads as its query rows."""
    batch, _, heads, head_dim = q.shape
    return q[:, 0].view(batch, heads_kv, heads // heads_kv, head_dim).transpose(1, 2)


def chunk_operands(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, splits: int
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """q, k, v, mask, bias of the one forward over B * splits batch entries that runs every
    chunk (contiguous k, v; splits divides Sk): k, v viewed as [B * splits, Sk / splits, Hkv,
    D]; the packed queries (tiny) and the mask/bias rows (the size of one key row per batch
    and head) copied into that batch order. Also what precompile plans decode variants on."""
    batch, seqlen_k, heads_kv, head_dim = k.shape
    packed = _packed_queries(q, heads_kv)
    group, chunk = packed.shape[1], seqlen_k // splits
    keys = k.view(batch * splits, chunk, heads_kv, head_dim)
    values = v.view(batch * splits, chunk, heads_kv, head_dim)
    queries = packed.unsqueeze(1).expand(batch, splits, group, heads_kv, head_dim)
    queries = queries.reshape(batch * splits, group, heads_kv, head_dim)

    def rows(t):  # [Bm, Hm, 1, Sk] -> [B * splits, Hm, 1, chunk] (a key-broadcast one as is)
        if t is None or t.shape[-1] == 1:
            return (
                None
                if t is None
                else t.expand(batch, *t.shape[1:]).repeat_interleave(splits, dim=0)
            )
        t = t.expand(batch, *t.shape[1:])
        return t.unflatten(-1, (splits, chunk)).movedim(3, 1).flatten(0, 1)

    return queries, keys, values, rows(mask), rows(bias)


__all__ = ["chunk_operands", "decode_splits", "packable", "packed_decode"]
