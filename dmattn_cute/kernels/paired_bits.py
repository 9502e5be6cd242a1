"""One block-bits pre-pass for a forward and the backward that follows it (the eager path with
a mask and a gradient): the Hopper backward's query tiles divide the Hopper forward's and their
key tiles are equal, so the pre-pass runs once at the backward's tiles and also writes the
forward's bits, those ORed (VISIBLE) and ANDed (FULL) over each forward tile's rows of tiles
(BlockBitsSpec.coarse_rows); the mask is read once instead of twice, in one launch."""

from __future__ import annotations

import torch

from ..jit.arch import hopper_kernels
from ..memo import remember
from .block_bits import BlockBitsSpec
from .block_bits_launch import (
    kernel_bits_view,
    launch_block_bits,
    launch_paired_bits,
    remembered_bits,
)
from .bwd_launch import backward_spec_of
from .fwd_launch import forward_spec_of
from .launch import kernel_layout, operand_view
from .sm90.bwd import Sm90BwdSpec
from .sm90.fwd import Sm90FwdSpec


def _pairing(problem, mask, bias, bias_grad: bool, arch: str, device):
    """(pre-pass spec, forward tile_m, backward tile_m) when the two kernels pair, else None."""
    fwd = forward_spec_of(problem, mask, bias, arch)
    bwd = backward_spec_of(problem, mask, bias, bias_grad, arch, device)
    if not (isinstance(fwd, Sm90FwdSpec) and isinstance(bwd, Sm90BwdSpec)):
        return None
    (fwd_m, fwd_n), (bwd_m, bwd_n) = ((s.tile.tile_m, s.tile.tile_n) for s in (fwd, bwd))
    if fwd_n != bwd_n or fwd_m % bwd_m:
        return None
    rows = 1 if bwd.mask.row_broadcast else fwd_m // bwd_m
    return BlockBitsSpec(bwd.mask, bwd_m, bwd_n, rows), fwd_m, bwd_m


# _pairing by (problem, arch, kernel family, device, mask/bias layouts, dbias request).
_PAIRINGS: dict[tuple, tuple | None] = {}


def paired_bits_spec(
    problem, mask: torch.Tensor, bias: torch.Tensor | None, bias_grad: bool, arch: str, device
) -> BlockBitsSpec | None:
    """The one pre-pass of a paired forward and backward (None where they do not pair)."""
    pairing = _pairing(problem, mask, bias, bias_grad, arch, device)
    return None if pairing is None else pairing[0]


def paired_bits(
    problem, mask: torch.Tensor, bias: torch.Tensor | None, bias_grad: bool, arch: str, device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the forward's bits as its pre-pass writes them, the backward's as its kernel reads
    them) from one pre-pass, or None where the two kernels do not pair (not both Hopper, or
    tiles that do not nest): each then runs its own. mask/bias: 4-D views. Remembered with
    the mask (block_bits_launch.remembered_bits): the layers of a step that share it share one
    pre-pass."""
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
    spec, _, bwd_m = pairing
    seqlens = (problem.seqlen_q, problem.seqlen_k)
    if spec.coarse_rows == 1:  # equal tiles, or one row of tiles for every query block
        bits = forward = remembered_bits(
            mask, seqlens, spec, lambda: launch_block_bits(view, spec, *seqlens, arch)
        )
    else:
        bits, forward = remembered_bits(
            mask, seqlens, spec, lambda: launch_paired_bits(view, spec, *seqlens, arch)
        )
    return forward, kernel_bits_view(bits, -(-problem.seqlen_q // bwd_m))


__all__ = ["paired_bits", "paired_bits_spec"]
