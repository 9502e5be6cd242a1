"""Host side of top-w expiry rows (dmattn_cute/topw.py) for the Hopper kernels.

The kernels read an expiry [Be, He, Sk] int32 as their mask operand: a one-row (query-
broadcast) tile per key block, kept where the score's row + Sk - Sq is below the key's expiry
(Scores.mask_expiry); int64 key ranges (first row << 32 | expiry) also need the row at or
past the key's first row. Its block bits come from each key block's largest and smallest expiry:
a tile is visible where some key outlives the tile's first row, full where every key outlives
its last row (never on the tail tiles of Sq or Sk). Everywhere else (the mma.sync kernels,
with attn_mask or a block mask, torch.compile, CPU) the expiry becomes an element mask
(`element_mask`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..memo import remember_for
from ..problem import Problem, broadcast_view
from ..topw import split_ranges, with_key_expiry
from .block_bits_launch import kernel_bits_view
from .masking import FULL, VISIBLE

_NEVER = torch.iinfo(torch.int32).max
# Expiry rows (int32) and key ranges (int64: first row << 32 | expiry, topw.key_ranges)
EXPIRY_DTYPES = (torch.int32, torch.int64)


# Bits of recent expiries (memo.remember_for): one expiry usually serves every layer's forward
# and backward of a step, and its bits take about ten small launches to build.
_BITS: dict[tuple, tuple] = {}


def expiry_bits(
    key_expiry: torch.Tensor, problem: Problem, tile_m: int, tile_n: int
) -> torch.Tensor:
    """The bits of (tile_m, tile_n) tiles as the kernels index them (kernel_bits_view), from
    key_expiry [Be, He, Sk]; memoized per expiry tensor, the result shared and not to be
    written."""
    key = (problem.seqlen_q, problem.seqlen_k, tile_m, tile_n)
    return remember_for(
        _BITS,
        key_expiry,
        key,
        lambda: _expiry_bits(key_expiry, problem, tile_m, tile_n),
        graphs=True,
    )


def _expiry_bits(
    key_expiry: torch.Tensor, problem: Problem, tile_m: int, tile_n: int
) -> torch.Tensor:
    seqlen_q, seqlen_k = problem.seqlen_q, problem.seqlen_k
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    expiry, born = split_ranges(key_expiry)
    pad = n_blocks * tile_n - seqlen_k
    blocks = (*expiry.shape[:2], n_blocks, tile_n)
    longest = F.pad(expiry, (0, pad), value=0).reshape(blocks).amax(-1)
    shortest = F.pad(expiry, (0, pad), value=_NEVER).reshape(blocks).amin(-1)
    first = torch.arange(m_blocks, device=key_expiry.device) * tile_m
    last = torch.clamp(first + tile_m, max=seqlen_q) - 1
    shift = seqlen_k - seqlen_q  # rows in key positions (bottom-right aligned)
    visible = longest[:, :, None, :] > (first + shift)[:, None]
    full = visible & (shortest[:, :, None, :] > (last + shift)[:, None])
    if born is not None:  # a tile some key's range reaches; full where every range covers it
        earliest = F.pad(born, (0, pad), value=_NEVER).reshape(blocks).amin(-1)
        latest = F.pad(born, (0, pad), value=0).reshape(blocks).amax(-1)
        visible &= earliest[:, :, None, :] <= (last + shift)[:, None]
        full &= visible & (latest[:, :, None, :] <= (first + shift)[:, None])
    if seqlen_k % tile_n:
        full[..., -1] = False
    if seqlen_q % tile_m:
        full[..., -1, :] = False
    bits = visible.to(torch.uint8) * VISIBLE | full.to(torch.uint8) * FULL
    return kernel_bits_view(bits, m_blocks)


def element_mask(mask: torch.Tensor | None, expiry: torch.Tensor, problem: Problem) -> torch.Tensor:
    """attn_mask (a 4-D view, or None) and the expiry [Be, He, Sk] as one materialized 4-D
    element mask view (topw.with_key_expiry)."""
    group = problem.num_heads // problem.num_heads_kv
    return broadcast_view(with_key_expiry(mask, expiry, problem.seqlen_q, group))


__all__ = ["EXPIRY_DTYPES", "element_mask", "expiry_bits"]
