"""One block-bits pre-pass for a forward and the backward that follows it (the eager path with
a mask and a gradient): the Hopper backward's query tiles divide the Hopper forward's and their
key tiles are equal, so the pre-pass runs once at the backward's tiles and the forward's bits
are those ORed (VISIBLE) and ANDed (FULL) over each forward tile's rows; the mask is read once
instead of twice."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..jit.arch import hopper_kernels
from ..memo import remember
from .block_bits import BlockBitsSpec
from .block_bits_launch import kernel_bits_view, launch_block_bits
from .bwd_launch import backward_spec_of
from .fwd_launch import forward_spec_of
from .launch import kernel_layout, operand_view
from .masking import FULL, VISIBLE
from .sm90.bwd import Sm90BwdSpec
from .sm90.fwd import Sm90FwdSpec


def coarsen_bits(
    bits: torch.Tensor, ratio: int, m_blocks: int, rows_shared: bool = False
) -> torch.Tensor:
    """Bits [B', H', R, N] of (tile_m, tile_n) tiles as those of (ratio * tile_m, tile_n)
    tiles, m_blocks of them: VISIBLE where any of a tile's rows of tiles is, FULL where all are.
    A row past the last one (past Sq) counts as not FULL: the tile is a tail tile. The one row
    of a query-broadcast mask (rows_shared) stays as it is."""
    if rows_shared or ratio == 1:
        return bits
    rows = F.pad(bits, (0, 0, 0, m_blocks * ratio - bits.shape[2])).unflatten(2, (m_blocks, ratio))
    return (rows & VISIBLE).amax(3) | (rows & FULL).amin(3)


def _pairing(problem, mask, bias, bias_grad: bool, arch: str, device):
    """(pre-pass spec, forward tile_m, backward tile_m) when the two kernels pair, else None."""
    fwd = forward_spec_of(problem, mask, bias, arch)
    bwd = backward_spec_of(problem, mask, bias, bias_grad, arch, device)
    if not (isinstance(fwd, Sm90FwdSpec) and isinstance(bwd, Sm90BwdSpec)):
        return None
    (fwd_m, fwd_n), (bwd_m, bwd_n) = ((s.tile.tile_m, s.tile.tile_n) for s in (fwd, bwd))
    if fwd_n != bwd_n or fwd_m % bwd_m:
        return None
    return BlockBitsSpec(bwd.mask, bwd_m, bwd_n), fwd_m, bwd_m


# _pairing by (problem, arch, kernel family, device, mask/bias layouts, dbias request).
_PAIRINGS: dict[tuple, tuple | None] = {}


def paired_bits(
    problem, mask: torch.Tensor, bias: torch.Tensor | None, bias_grad: bool, arch: str, device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the forward's bits as its pre-pass writes them, the backward's as its kernel reads
    them) from one pre-pass, or None where the two kernels do not pair (not both Hopper, or
    tiles that do not nest): each then runs its own. mask/bias: 4-D views."""
    view = operand_view(mask)
    key = (
        problem,
        arch,
        hopper_kernels(arch),
        device,
        kernel_layout(view),
        kernel_layout(bias),
        bias_grad,
    )
    pairing = remember(
        _PAIRINGS, key, lambda: _pairing(problem, mask, bias, bias_grad, arch, device)
    )
    if pairing is None:
        return None
    spec, fwd_m, bwd_m = pairing
    bits = launch_block_bits(view, spec, problem.seqlen_q, problem.seqlen_k, arch)
    m_blocks = -(-problem.seqlen_q // fwd_m)
    forward = coarsen_bits(bits, fwd_m // bwd_m, m_blocks, spec.mask.row_broadcast)
    return forward, kernel_bits_view(bits, -(-problem.seqlen_q // bwd_m))


__all__ = ["coarsen_bits", "paired_bits"]
