"""Host side of block masks (dmattn_cute/block_mask.py): what a launch gives a kernel for one.

The Hopper kernels take a block mask as their block bits. Each kernel tile lies in one BLOCK x
BLOCK block when its sizes divide BLOCK: a False block's tiles are skipped (bits 0), a True
block's tiles need no mask tile (VISIBLE | FULL) unless attn_mask's own bits say otherwise
(the two are ANDed) or they hold the tail of Sq or Sk (VISIBLE: the kernel reads the mask tile,
which limits the tail). The kernel then reads a mask view next to the bits: attn_mask, or a
key mask of Sk True bytes, widened by stride 0 to the block mask's batch and heads so that
one head divisor indexes both. Everything else runs on the element mask (with_block_mask).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..block_mask import BLOCK, with_block_mask
from ..memo import remember, remember_for
from ..problem import Problem, broadcast_view
from .masking import FULL, VISIBLE


def tiles_nest(tile_m: int, tile_n: int) -> bool:
    """Whether every (tile_m, tile_n) tile lies in one block."""
    return BLOCK % tile_m == 0 and BLOCK % tile_n == 0


def read_as_bits(
    problem: Problem,
    mask: torch.Tensor | None,
    block_mask: torch.Tensor | None,
    tile_of: Callable[[torch.Tensor], tuple[int, int] | None],
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """How a kernel reads a block mask next to attn_mask `mask` (a 4-D view or None): (the 4-D
    mask view it reads, the block mask where it reads that as its bits, whether attn_mask is
    ANDed into them); without a block mask (mask, None, False). tile_of(view): the (tile_m,
    tile_n) of the Hopper variant that would run on a mask view, or None for one that reads no
    bits; where the joint mask has no such variant or its tiles straddle blocks, the view is
    the element mask and no block mask is read (None, False)."""
    if block_mask is None:
        return mask, None, False
    joint = joint_mask(mask, block_mask, problem)
    tile = None if joint is None else tile_of(joint)
    if tile is not None and tiles_nest(*tile):
        return joint, block_mask, mask is not None
    return element_mask(mask, block_mask, problem), None, False


def joint_mask(
    mask: torch.Tensor | None, block_mask: torch.Tensor, problem: Problem
) -> torch.Tensor | None:
    """The 4-D mask view a Hopper kernel reads next to a block mask's bits (see the module);
    None when attn_mask is per kv head and the block mask per query head (a group's heads
    would need bits of their own under one mask head)."""
    if mask is None:  # Sk True bytes, one view for every call of a block mask's shape
        seqlen_k, device = problem.seqlen_k, block_mask.device

        def make() -> torch.Tensor:
            keys = torch.ones((1, 1, 1, seqlen_k), dtype=torch.bool, device=device)
            return _widened(keys, block_mask)

        key = (seqlen_k, device, *block_mask.shape[:2])
        return remember(_ALL_TRUE, key, make, _MEMO_MAX, graphs=True)
    return _widened(mask, block_mask)


def _widened(mask: torch.Tensor, block_mask: torch.Tensor) -> torch.Tensor | None:
    """mask widened by stride 0 to the block mask's batch and heads (joint_mask)."""
    heads = max(mask.shape[1], block_mask.shape[1])
    if 1 < mask.shape[1] < heads:
        return None
    batch = max(mask.shape[0], block_mask.shape[0])
    return broadcast_view(mask.expand(batch, heads, *mask.shape[2:]))


# Key masks of Sk True bytes, as 4-D views widened to a block mask's batch and heads, by (Sk,
# device, batch, heads): read-only, never written by a kernel.
_ALL_TRUE: dict[tuple, torch.Tensor] = {}
# Bits of live block masks (memo.remember_for): one block mask usually serves every layer's
# forward and backward of a step, and its bits take ten small launches to build.
_BITS: dict[tuple, tuple] = {}
_MEMO_MAX = 16


def block_bits(
    block_mask: torch.Tensor, problem: Problem, tile_m: int, tile_n: int, heads: int
) -> torch.Tensor:
    """uint8 [Bm, heads or 1, m_blocks or 1, n_blocks] bits of (tile_m, tile_n) tiles (which
    nest in blocks, tiles_nest) from a block mask, its head dim widened to `heads` (the joint
    mask's); one row for a query-broadcast block mask unless Sq has a tail tile. Memoized per
    block mask; the result is shared and must not be written."""
    key = (problem.seqlen_q, problem.seqlen_k, tile_m, tile_n, heads)
    return remember_for(
        _BITS,
        block_mask,
        key,
        lambda: _block_bits(block_mask, problem, tile_m, tile_n, heads),
        graphs=True,
    )


def joint_block_bits(
    block_mask: torch.Tensor,
    bits: torch.Tensor | None,
    mask_given: bool,
    problem: Problem,
    tile_m: int,
    tile_n: int,
    heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block mask's own bits, as block_bits; the bits a kernel reads): with an attn_mask
    too (mask_given), the tiles both leave visible, its `bits` and'ed in; else the block
    mask's alone."""
    from_blocks = block_bits(block_mask, problem, tile_m, tile_n, heads)
    return from_blocks, (from_blocks & bits if mask_given else from_blocks)


def _block_bits(
    block_mask: torch.Tensor, problem: Problem, tile_m: int, tile_n: int, heads: int
) -> torch.Tensor:
    seqlen_q, seqlen_k = problem.seqlen_q, problem.seqlen_k
    m_tiles, n_tiles = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    device = block_mask.device
    rows = block_mask
    q_tail = seqlen_q % tile_m != 0
    if rows.shape[2] > 1 or q_tail:
        index = torch.arange(m_tiles, device=device) * tile_m // BLOCK
        rows = (
            rows.index_select(2, index) if rows.shape[2] > 1 else rows.expand(-1, -1, m_tiles, -1)
        )
    cols = rows.index_select(3, torch.arange(n_tiles, device=device) * tile_n // BLOCK)
    if 1 < cols.shape[1] < heads:
        cols = cols.repeat_interleave(heads // cols.shape[1], 1)
    bits = cols.to(torch.uint8) * (VISIBLE | FULL)
    # a tail tile is never FULL: the kernel reads its mask tile, whose loads stop at Sq x Sk
    if seqlen_k % tile_n:
        bits[..., -1] &= VISIBLE
    if q_tail:
        bits[..., -1, :] &= VISIBLE
    return bits


def element_mask(
    mask: torch.Tensor | None, block_mask: torch.Tensor, problem: Problem
) -> torch.Tensor:
    """attn_mask and the block mask as one materialized 4-D element mask view."""
    group = problem.num_heads // problem.num_heads_kv
    return broadcast_view(
        with_block_mask(mask, block_mask, problem.seqlen_q, problem.seqlen_k, group)
    )


__all__ = ["block_bits", "element_mask", "joint_mask", "read_as_bits", "tiles_nest"]
