"""Decoding (one query per row) composed from the forward kernel: the query heads of a group
packed as rows (PackGQA: K and V are read once per kv head, not once per query head) and the
keys split into chunks run side by side (split-KV: enough CTAs to read the cache at the
GPU's bandwidth), their partial outputs merged by their log-sum-exps.

Used by flash_dmattn_with_kvcache for Sq = 1. On eager CUDA the chunks run as one forward
launch that reads q, k, v and the mask/bias rows in place, each chunk a range of a row's key
blocks (of as many visible blocks as the others where the row is short enough;
fwd_launch.flash_fwd's key_chunks), and the merge is one more (kernels/combine.py).
Elsewhere (torch.compile, CPU) the chunks are equal key ranges: one forward over views where
the keys divide evenly (chunk_operands), else one forward each. A paged cache is read in place
by that one launch where its pages hold whole key tiles (reads_pages), else gathered first by
the caller."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from dmattn_cute.jit.arch import target_arch
from dmattn_cute.kernels.bwd_launch import sm_count
from dmattn_cute.kernels.combine_launch import combine_splits
from dmattn_cute.kernels.fwd_launch import flash_fwd, paged_tile_n
from dmattn_cute.ops import attention_fwd, eager_cuda
from dmattn_cute.problem import Problem, broadcast_view, make_problem

# An eager decode step with fewer keys runs as one plain forward launch: the packed, split
# path's extra host work (chunk operands, a second launch for the merge; about 55 us a call)
# outweighs what it saves on the GPU. H100, B8 H16 Hkv4 D128, 64-key blocks at density 0.25:
# the one launch takes 0.18 ms at Sk 32k (packed: 0.24 ms, host-bound) and 0.67 ms at 128k
# (packed: 0.26 ms). A step captured into a CUDA graph pays no host time: always packed.
PLAIN_DECODE_MIN_KEYS = 1 << 16


def decode_splits(batch: int, heads_kv: int, seqlen_k: int, sms: int) -> int:
    """Key chunks per (row, kv head): up to enough for two CTAs per SM, each chunk at least
    512 keys; the largest such count that divides the keys (off eager CUDA its chunks then
    fold into one forward by views; the kernels split any count), else that upper count."""
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


def decode_step(
    problem: Problem,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    attn_bias: Tensor | None,
) -> tuple[Tensor, Tensor] | None:
    """out, lse of flash_dmattn_func's decode step (one query per row, nothing for autograd to
    record) run as the kv-cache API runs it, the group's heads packed as rows and the keys
    split in chunks, where that computes the same thing and the chunks run as one forward;
    else None (the call runs as any other; so do eager calls with fewer keys than
    PLAIN_DECODE_MIN_KEYS). Causal limits nothing for the last query; a left window would, and
    is left to the kernels."""
    if problem.seqlen_q != 1 or 0 <= problem.window_left < problem.seqlen_k - 1:
        return None
    capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
    if problem.seqlen_k < PLAIN_DECODE_MIN_KEYS and not capturing:
        return None
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_bias)
    ):
        return None
    mask, bias = broadcast_view(attn_mask), broadcast_view(attn_bias)
    if not packable(query, key, (mask, bias)):
        return None
    splits = decode_splits(
        problem.batch, problem.num_heads_kv, problem.seqlen_k, sm_count(query.device, "sm_90a")
    )
    group = problem.num_heads // problem.num_heads_kv
    one_forward = eager_cuda(query) or chunk_fold(key, value, splits) is not None
    if not one_forward and not (splits == 1 and group > 1):
        return None  # one forward per chunk: host-bound at short lengths; or nothing gained
    return packed_decode(
        query, key, value, mask, bias, problem.softmax_scale, problem.softcap, splits
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
    block_table: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """out [B, 1, H, D] and lse [B, H, 1] of one query per row (see packable), the keys in
    `splits` chunks. With block_table (where reads_pages): k, v are page pools [pages,
    page_size, Hkv, D] and row b's key p is slot p % page_size of page block_table[b, p //
    page_size].

    Each chunk runs the forward on q viewed as [B, group, Hkv, D] (a view: the group's heads
    as its query rows), its mask/bias sliced alike: all chunks in one forward on eager CUDA
    (_forward_chunks) or where chunk_fold finds a way, else one forward each. The chunks'
    outputs are merged with the weights exp(lse_chunk - lse), lse the log-sum-exp of theirs
    (a row with no visible key anywhere: out 0, lse -inf)."""
    batch, _, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads // heads_kv
    if (splits > 1 and eager_cuda(q)) or block_table is not None:
        # chunk s of row b: batch entry b * splits + s
        out, lse = _forward_chunks(
            q, k, v, mask, bias, splits, softmax_scale, softcap, block_table
        )  # fmt: skip
        outs = out.view(batch, splits, group, heads_kv, head_dim)
        lses = lse.view(batch, splits, heads_kv, group)
    elif (fold := chunk_fold(k, v, splits)) is not None:
        operands = chunk_operands(q, k, v, mask, bias, splits, fold)
        out, lse = _forward(*operands, softmax_scale, softcap)
        if fold == "batch":  # chunk s of row b: batch entry b * splits + s
            outs = out.view(batch, splits, group, heads_kv, head_dim)
            lses = lse.view(batch, splits, heads_kv, group)
        else:  # chunk s of kv head h: head h * splits + s
            outs = out.view(batch, group, heads_kv, splits, head_dim).permute(0, 3, 1, 2, 4)
            lses = lse.view(batch, heads_kv, splits, group).transpose(1, 2)
    else:
        packed = _packed_queries(q, heads_kv)
        chunk = -(-seqlen_k // splits)
        outs, lses = [], []
        for start in range(0, seqlen_k, chunk):
            keys = slice(start, min(seqlen_k, start + chunk))
            parts = [t if t is None or t.shape[-1] == 1 else t[..., keys] for t in (mask, bias)]
            out, lse = _forward(packed, k[:, keys], v[:, keys], *parts, softmax_scale, softcap)
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


def _forward_chunks(
    q, k, v, mask, bias, splits: int, softmax_scale, softcap, block_table=None
) -> tuple[Tensor, Tensor]:
    """out [B * splits, group, Hkv, D], lse [B * splits, Hkv, group] of the one forward that
    runs every chunk of every row: the kernels read the packed queries, k, v (or their pages)
    and the mask/bias rows in place and split each row's key blocks themselves
    (fwd_launch.flash_fwd's key_chunks and block_table)."""
    # stride 0 on size-1 dims, as make_problem views the operands (e.g. the kv-cache API's
    # lengths rows [B, 1, 1, Sk] come from indexing with None)
    mask, bias = broadcast_view(mask), broadcast_view(bias)
    queries = _packed_queries(q, k.shape[2])
    problem = _packed_problem(queries, k, softmax_scale, softcap, block_table)
    problem = dataclasses.replace(problem, batch=problem.batch * splits)
    table = block_table
    if block_table is not None and block_table.dtype != torch.int32:
        table = block_table.to(torch.int32)
    out, lse, _ = flash_fwd(
        problem, queries, k, v, mask, bias, key_chunks=splits, block_table=table
    )  # fmt: skip
    return out, lse


def _packed_problem(queries, k, softmax_scale, softcap, block_table=None) -> Problem:
    """The problem of packed queries against k [B, Sk, Hkv, D], or against a page pool k
    [pages, page_size, Hkv, D] with block_table [B, pages per row] (its rows' keys, viewed
    without memory as [B, Sk, Hkv, D])."""
    if block_table is not None:
        rows, per_row = block_table.shape
        k = k[:1, :1].expand(rows, per_row * k.shape[1], *k.shape[2:])
    problem, _, _ = make_problem(
        queries, k, k, None, None, softmax_scale, False, softcap, (-1, -1), False
    )
    return problem


def reads_pages(
    q: Tensor, k: Tensor, block_table: Tensor, mask, bias, softmax_scale, softcap
) -> bool:
    """Whether packed_decode reads a paged cache (k: its page pool) in place: on eager CUDA,
    with a kernel that reads pages (Hopper) whose key tile divides the page size."""
    if not eager_cuda(q):
        return False
    queries = _packed_queries(q, k.shape[2])
    problem = _packed_problem(queries, k, softmax_scale, softcap, block_table)
    mask, bias = broadcast_view(mask), broadcast_view(bias)
    tile_n = paged_tile_n(problem, mask, bias, target_arch(q.device))
    return tile_n is not None and k.shape[1] % tile_n == 0


def _forward(q, k, v, mask, bias, softmax_scale, softcap) -> tuple[Tensor, Tensor]:
    """out, lse of one forward over chunks: eager CUDA tensors go to the kernels directly (a
    chunk with one query per row must not take flash_dmattn_func's decode route again),
    others to the op (torch.compile; the reference on CPU)."""
    problem, mask4, bias4 = make_problem(
        q, k, v, mask, bias, softmax_scale, False, softcap, (-1, -1), False
    )
    if eager_cuda(q):
        out, lse, _ = flash_fwd(problem, q, k, v, mask4, bias4)
    else:
        out, lse, _ = attention_fwd(
            q, k, v, mask, bias, problem.softmax_scale, False, problem.softcap, -1, -1, False
        )
    return out, lse


def _packed_queries(q: Tensor, heads_kv: int) -> Tensor:
    """q [B, 1, H, D] viewed as [B, group, Hkv, D]: a group's heads as its query rows."""
    batch, _, heads, head_dim = q.shape
    return q[:, 0].view(batch, heads_kv, heads // heads_kv, head_dim).transpose(1, 2)


def chunk_fold(k: Tensor, v: Tensor, splits: int) -> str | None:
    """How `splits` chunks of the keys run as one forward, by views of k and v (no copies):
    "batch" for contiguous [B, Sk, Hkv, D] (chunk s of row b as batch entry b * splits + s),
    "heads" for the transposed storage of [B, Hkv, Sk, D] (as transformers' caches hold it:
    chunk s of kv head h as head h * splits + s); None when splits is 1 or does not divide Sk,
    or for other layouts."""
    seqlen_k = k.shape[1]
    if splits == 1 or seqlen_k % splits != 0:
        return None
    if k.is_contiguous() and v.is_contiguous():
        return "batch"
    if all(
        t.stride(3) == 1 and t.stride(1) == t.shape[3] and t.stride(2) == seqlen_k * t.stride(1)
        for t in (k, v)
    ):
        return "heads"
    return None


def chunk_operands(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    splits: int,
    fold: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """q, k, v, mask, bias of the one forward that runs every chunk, folded as chunk_fold
    says: k, v as views ([B * splits, chunk, Hkv, D] or [B, chunk, Hkv * splits, D]); the
    packed queries (tiny) and the mask/bias rows (the size of one key row per batch and head)
    in that order, copied where a view cannot say it. Also what precompile plans decode
    variants on."""
    batch, seqlen_k, heads_kv, head_dim = k.shape
    packed = _packed_queries(q, heads_kv)
    group, chunk = packed.shape[1], seqlen_k // splits
    if fold == "batch":
        keys, values = (t.view(batch * splits, chunk, heads_kv, head_dim) for t in (k, v))
        queries = packed.unsqueeze(1).expand(batch, splits, group, heads_kv, head_dim)
        queries = queries.reshape(batch * splits, group, heads_kv, head_dim)
    else:
        keys, values = (
            t.as_strided(
                (batch, chunk, heads_kv * splits, head_dim),
                (t.stride(0), t.stride(1), chunk * t.stride(1), 1),
                t.storage_offset(),
            )
            for t in (k, v)
        )
        queries = packed.unsqueeze(3).expand(batch, group, heads_kv, splits, head_dim)
        queries = queries.reshape(batch, group, heads_kv * splits, head_dim)

    def rows(t):  # [Bm, Hm, 1, Sk] -> [B * splits, Hm, 1, chunk] or [B, Hm', 1, chunk]
        if t is None:
            return None
        t = t.expand(batch, *t.shape[1:])
        if fold == "batch":
            if t.shape[-1] == 1:
                return t.repeat_interleave(splits, dim=0)
            return t.unflatten(-1, (splits, chunk)).movedim(3, 1).flatten(0, 1)
        if t.shape[-1] == 1:  # a key-broadcast row: the same for every chunk
            return t if t.shape[1] == 1 else t.repeat_interleave(splits, dim=1)
        t = t.expand(batch, heads_kv, 1, seqlen_k)
        return t.unflatten(-1, (splits, chunk)).movedim(3, 2).flatten(1, 2)

    return queries, keys, values, rows(mask), rows(bias)


__all__ = [
    "chunk_fold",
    "chunk_operands",
    "decode_splits",
    "decode_step",
    "packable",
    "packed_decode",
    "reads_pages",
]
