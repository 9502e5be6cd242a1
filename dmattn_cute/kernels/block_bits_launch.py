"""Host side of the mask block-bits pre-pass (kernels/block_bits.py): its variant for a mask,
the shape of its output, and the launch on torch tensors (through the compile cache and
TVM-FFI, on the current torch stream)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..jit.arch import target_arch
from ..jit.cache import compiled
from ..memo import capturing, remember_for
from ..problem import broadcast_view
from .block_bits import BlockBitsSpec
from .launch import operand_spec, operand_view
from .spec import OperandSpec

Bits = TypeVar("Bits")

# Bits of live masks (memo.remember_for, on the tensor a kernel's mask view views): one
# attn_mask usually serves every layer's forward and backward of a step, and each pre-pass
# reads all of it (134 MB at B2 Hkv4 S4096).
_REMEMBERED: dict[tuple, tuple] = {}


def remembered_bits(
    mask: torch.Tensor, lengths: tuple[int, int], spec: BlockBitsSpec, make: Callable[[], Bits]
) -> Bits:
    """make()'s block bits of a 4-D mask view (problem.broadcast_view of the caller's mask;
    not its kernel view, a dtype view that keeps the version but not the tensor it views) at
    these (Sq, Sk) by this pre-pass variant, remembered while the tensor it views is
    unchanged; the result is shared and must not be written. Not while a CUDA graph is
    captured: its replays must read the mask they find."""
    if capturing():
        return make()
    base = mask if mask._base is None else mask._base
    where = (mask.storage_offset(), tuple(mask.shape), mask.stride(), mask.dtype)
    return remember_for(_REMEMBERED, base, (where, lengths, spec), make)


def mask_view(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """The uint8 kernel view (launch.operand_view) of a bool or uint8 mask [Bm, Hm, Km] or
    [Bm, Hm, Qm, Km] with Qm in {1, Sq}, Km in {1, Sk}; stride 0 on its size-1 dims."""
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"mask: expected dtype torch.bool or torch.uint8, got {mask.dtype}")
    if mask.dim() not in (3, 4):
        raise ValueError(
            f"mask: expected a 3-D [Bm, Hm, Km] or 4-D [Bm, Hm, Qm, Km] tensor, got "
            f"{mask.dim()}-D of shape {tuple(mask.shape)}"
        )
    view = broadcast_view(mask)
    for dim, label, length in ((2, "Sq", seqlen_q), (3, "Sk", seqlen_k)):
        if view.shape[dim] not in (1, length):
            raise ValueError(
                f"mask: expected dim {dim} to be 1 or {label}={length}, got {view.shape[dim]}"
            )
    return operand_view(view)


def block_bits_spec(view: torch.Tensor, seqlen_k: int, tile_m: int, tile_n: int) -> BlockBitsSpec:
    """The variant for a kernel view (mask_view; may be on the meta device)."""
    return BlockBitsSpec(operand_spec(view, seqlen_k), tile_m, tile_n)


def block_bits_shape(
    view: torch.Tensor, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int
) -> tuple[int, int, int, int]:
    """[Bm', Hm', n_m_blocks, n_n_blocks] of the bits of a kernel view (mask_view): 1 on its
    stride-0 batch/head dims, one row of blocks for a query-broadcast mask."""
    batch, heads = ((1 if view.stride(d) == 0 else view.shape[d]) for d in (0, 1))
    m_blocks = 1 if view.stride(2) == 0 else -(-seqlen_q // tile_m)
    return batch, heads, m_blocks, -(-seqlen_k // tile_n)


def block_bits(
    mask: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
    tile_m: int,
    tile_n: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per (tile_m, tile_n) tile of a CUDA mask, one byte: masking.VISIBLE if the tile has a
    True element inside [0, Sq) x [0, Sk), masking.VISIBLE | masking.FULL if all its elements
    are True and it lies wholly inside (see kernels/block_bits.py).

    mask: bool or uint8, [Bm, Hm, Km] or [Bm, Hm, Qm, Km] (broadcast as attn_mask is; read
    in place). Returns uint8 [Bm', Hm', n_m_blocks, n_n_blocks] (block_bits_shape); `out`, if
    given, must have that shape and is written in place.
    """
    view = mask_view(mask, seqlen_q, seqlen_k)
    shape = block_bits_shape(view, seqlen_q, seqlen_k, tile_m, tile_n)
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.uint8):
        raise ValueError(
            f"out: expected a uint8 tensor of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    spec = block_bits_spec(view, seqlen_k, tile_m, tile_n)
    return launch_block_bits(view, spec, seqlen_q, seqlen_k, target_arch(view.device), out)


def launch_block_bits(
    view: torch.Tensor,
    spec: BlockBitsSpec,
    seqlen_q: int,
    seqlen_k: int,
    arch: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """block_bits on a kernel view (mask_view) whose variant the caller already knows (the
    forward launch: its mask view and operand spec are the forward's own)."""
    if spec.coarse_rows != 1:
        raise ValueError("launch_block_bits: a variant with coarse bits takes launch_paired_bits")
    if out is None:
        shape = block_bits_shape(view, seqlen_q, seqlen_k, spec.tile_m, spec.tile_n)
        out = torch.empty(shape, dtype=torch.uint8, device=view.device)
    compiled(spec, arch)(view, out, None, seqlen_q, seqlen_k)
    return out


def launch_paired_bits(
    view: torch.Tensor,
    spec: BlockBitsSpec,
    seqlen_q: int,
    seqlen_k: int,
    arch: str,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits, coarse bits) of a kernel view from one pass, for a variant with coarse_rows > 1:
    the coarse ones are those of (coarse_rows * tile_m, tile_n) tiles. `out`: the two
    tensors to write, of those shapes (uint8)."""
    shape = block_bits_shape(view, seqlen_q, seqlen_k, spec.tile_m, spec.tile_n)
    coarse_shape = (*shape[:2], -(-shape[2] // spec.coarse_rows), shape[3])
    if out is None:
        out = tuple(
            torch.empty(s, dtype=torch.uint8, device=view.device) for s in (shape, coarse_shape)
        )
    for tensor, want in zip(out, (shape, coarse_shape), strict=True):
        if tuple(tensor.shape) != want or tensor.dtype != torch.uint8:
            raise ValueError(
                f"out: expected uint8 {want}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
    compiled(spec, arch)(view, *out, seqlen_q, seqlen_k)
    return out


def kernel_bits_view(bits: torch.Tensor, m_blocks: int) -> torch.Tensor:
    """Block bits [Bm', Hm', 1 or m_blocks, n_blocks] as the Hopper kernels index them, by
    (batch, head // mask_head_div, query block, key block): [Bm', Hm', m_blocks, n_blocks]
    with stride 0 on each size-1 batch, head or query-block dim."""
    shape = (*bits.shape[:2], m_blocks, bits.shape[3])
    strides = [0 if bits.shape[d] == 1 else bits.stride(d) for d in range(3)]
    if bits.shape == shape and strides == [bits.stride(d) for d in range(3)]:
        return bits  # already so: no view op per call
    return bits.as_strided(shape, (*strides, bits.stride(3)))


def mask_block_bits(
    mask: torch.Tensor, view: torch.Tensor, mask_spec: OperandSpec, seqlen_q: int, seqlen_k: int,
    tile: tuple[int, int], arch: str,
) -> torch.Tensor:  # fmt: skip
    """The block bits of a 4-D mask view and its kernel view `view`, whose operand spec the
    kernel's variant was picked by, for its (tile_m, tile_n) tiles, as the kernel indexes them
    (kernel_bits_view); remembered with the mask (remembered_bits)."""
    spec = BlockBitsSpec(mask_spec, *tile)
    bits = remembered_bits(
        mask, (seqlen_q, seqlen_k), spec,
        lambda: launch_block_bits(view, spec, seqlen_q, seqlen_k, arch),
    )  # fmt: skip
    return kernel_bits_view(bits, -(-seqlen_q // tile[0]))


__all__ = [
    "block_bits",
    "block_bits_shape",
    "block_bits_spec",
    "kernel_bits_view",
    "launch_block_bits",
    "launch_paired_bits",
    "mask_block_bits",
    "mask_view",
    "remembered_bits",
]
