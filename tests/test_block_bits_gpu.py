"""The mask block-bits pre-pass against the bits computed by plain torch from their definition.

Every launch writes into an output poisoned with 0xAA (neither 0, VISIBLE nor VISIBLE | FULL),
so a tile the kernel fails to write shows up as a failure.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmattn_cute.jit import compile_count, load_count
from dmattn_cute.jit.arch import target_arch
from dmattn_cute.kernels.block_bits_launch import (
    block_bits,
    block_bits_shape,
    block_bits_spec,
    launch_paired_bits,
    mask_view,
)
from dmattn_cute.kernels.masking import FULL, VISIBLE

pytestmark = pytest.mark.gpu
POISON = 0xAA
TILES = [(64, 128), (128, 128), (128, 176), (128, 80), (128, 64)]
# Odd lengths and tile edges, decode (Sq = 1), Sk = 1, and key lengths whose rows allow 16-, 8-,
# 4- and 1-byte vectors.
SEQLENS = [
    (1, 1), (1, 4095), (63, 65), (65, 63), (127, 200), (200, 127), (4095, 1), (4095, 4095),
    (65, 256), (1000, 4096), (127, 4092),
]  # fmt: skip
CONTENTS = ["false", "true", "sparse", "tiles"]


def bits_ref(
    mask: torch.Tensor, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int
) -> torch.Tensor:
    """The bits by definition: per tile of the mask's own (un-broadcast) batch/head extents,
    VISIBLE if an element inside [0, Sq) x [0, Sk) is True, FULL if the tile lies wholly
    inside and all its elements are True. A query-broadcast mask has (1, tile_n) tiles."""
    view = mask.unsqueeze(2) if mask.dim() == 3 else mask
    batch, heads, q_bcast = view.shape[0], view.shape[1], view.shape[2] == 1
    if view.stride(0) == 0:
        batch = 1
    if view.stride(1) == 0:
        heads = 1
    q_bcast = q_bcast or view.stride(2) == 0
    rows, tile_rows = (1, 1) if q_bcast else (seqlen_q, tile_m)
    dense = view[:batch, :heads, :rows].bool().expand(batch, heads, rows, seqlen_k)
    m_blocks, n_blocks = -(-rows // tile_rows), -(-seqlen_k // tile_n)
    padded = torch.zeros(
        batch, heads, m_blocks * tile_rows, n_blocks * tile_n, dtype=torch.bool, device=view.device
    )
    padded[:, :, :rows, :seqlen_k] = dense
    tiles = padded.view(batch, heads, m_blocks, tile_rows, n_blocks, tile_n)
    visible = tiles.any(dim=5).any(dim=3)
    full = tiles.all(dim=5).all(dim=3)
    return visible.to(torch.uint8) * VISIBLE | full.to(torch.uint8) * FULL


def mask_values(content: str, shape, tile_m: int, tile_n: int) -> torch.Tensor:
    """A bool mask of `shape` [..., rows, cols] on CUDA. "tiles": each (tile_m, tile_n) tile
    (tile_n-wide when rows = 1) is, at random, all False, all True, one True element, one
    False element or random."""
    if content == "false":
        return torch.zeros(shape, dtype=torch.bool, device="cuda")
    if content == "true":
        return torch.ones(shape, dtype=torch.bool, device="cuda")
    if content == "sparse":
        return torch.rand(shape, device="cuda") < 0.002
    *lead, rows, cols = shape
    tile_m = 1 if rows == 1 else tile_m
    m_blocks, n_blocks = -(-rows // tile_m), -(-cols // tile_n)
    blocks = (*lead, m_blocks, 1, n_blocks, 1)
    kind = torch.randint(0, 5, blocks, device="cuda")
    row = torch.arange(tile_m, device="cuda").view(tile_m, 1, 1)
    col = torch.arange(tile_n, device="cuda")
    one = (row == torch.randint(0, tile_m, blocks, device="cuda")) & (
        col == torch.randint(0, tile_n, blocks, device="cuda")
    )
    noise = torch.rand(*lead, m_blocks, tile_m, n_blocks, tile_n, device="cuda") < 0.5
    values = torch.where(kind == 0, False, kind == 1)
    values = torch.where(kind == 2, one, torch.where(kind == 3, ~one, values))
    values = torch.where(kind == 4, noise, values)
    return values.reshape(*lead, m_blocks * tile_m, n_blocks * tile_n)[..., :rows, :cols]


def make_mask(layout: str, content: str, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n):
    """The mask of `layout`: its own shape, broadcast dims, strides and alignment."""

    def values(*shape):
        return mask_values(content, shape, tile_m, tile_n)

    full = (batch, heads, seqlen_q, seqlen_k)
    if layout == "full":
        return values(*full)
    if layout == "batch-bcast":
        return values(1, heads, seqlen_q, seqlen_k)
    if layout == "head-bcast":
        return values(batch, 1, seqlen_q, seqlen_k)
    if layout == "expanded":  # stride 0 on batch and heads, at full size
        return values(1, 1, seqlen_q, seqlen_k).expand(full)
    if layout == "query-bcast":
        return values(batch, heads, 1, seqlen_k)
    if layout == "3d":
        return values(batch, heads, 1, seqlen_k)[:, :, 0]
    if layout == "query-expanded":
        return values(batch, heads, 1, seqlen_k).expand(full)
    if layout == "key-bcast":
        return values(batch, heads, seqlen_q, 1)
    if layout == "offset":  # rows start one byte past an aligned address
        storage = torch.zeros(batch, heads, seqlen_q, seqlen_k + 1, dtype=torch.bool, device="cuda")
        storage[..., 1:] = values(*full)
        return storage[..., 1:]
    if layout == "pitch":  # rows of a wider buffer
        storage = torch.zeros(batch, heads, seqlen_q, seqlen_k + 8, dtype=torch.bool, device="cuda")
        storage[..., :seqlen_k] = values(*full)
        return storage[..., :seqlen_k]
    if layout == "transposed":  # unit stride along the queries
        return values(*full).transpose(2, 3).contiguous().transpose(2, 3)
    raise ValueError(layout)


def check_bits(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int):
    shape = block_bits_shape(
        mask_view(mask, seqlen_q, seqlen_k), seqlen_q, seqlen_k, tile_m, tile_n
    )
    out = torch.full(shape, POISON, dtype=torch.uint8, device="cuda")
    bits = block_bits(mask, seqlen_q, seqlen_k, tile_m, tile_n, out=out)
    torch.cuda.synchronize()
    assert bits is out
    expected = bits_ref(mask, seqlen_q, seqlen_k, tile_m, tile_n)
    assert bits.shape == expected.shape
    wrong = (bits != expected).nonzero()
    assert wrong.numel() == 0, (
        f"{len(wrong)} of {bits.numel()} tiles wrong, first at {wrong[0].tolist()}: "
        f"got {bits[tuple(wrong[0])].item()}, expected {expected[tuple(wrong[0])].item()}"
    )


@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("tile_m,tile_n", TILES)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_bits_match_reference(seqlen_q, seqlen_k, tile_m, tile_n, content):
    mask = make_mask("full", content, 2, 2, seqlen_q, seqlen_k, tile_m, tile_n)
    check_bits(mask, seqlen_q, seqlen_k, tile_m, tile_n)


LAYOUTS = [
    "full", "batch-bcast", "head-bcast", "expanded", "query-bcast", "3d", "query-expanded",
    "key-bcast", "offset", "pitch", "transposed",
]  # fmt: skip


@pytest.mark.parametrize("tile_m,tile_n", TILES)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(127, 200), (65, 256), (1, 4095)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(layout, seqlen_q, seqlen_k, tile_m, tile_n):
    mask = make_mask(layout, "tiles", 2, 3, seqlen_q, seqlen_k, tile_m, tile_n)
    check_bits(mask, seqlen_q, seqlen_k, tile_m, tile_n)


def test_broadcast_dims_are_computed_once():
    mask = make_mask("expanded", "tiles", 4, 8, 300, 512, 128, 128)
    shape = block_bits_shape(mask_view(mask, 300, 512), 300, 512, 128, 128)
    assert shape == (1, 1, 3, 4)
    check_bits(mask, 300, 512, 128, 128)


def test_one_compile_serves_all_lengths():
    """Lengths are runtime values: one variant per mask layout serves every Sq and Sk. Loads
    from the disk cache count too, since under xdist another worker may have compiled first."""
    check_bits(make_mask("full", "tiles", 2, 3, 100, 512, 128, 128), 100, 512, 128, 128)
    before = compile_count() + load_count()
    for seqlen_q, seqlen_k in [(2, 16), (4097, 4096), (129, 1024)]:
        mask = make_mask("full", "tiles", 2, 3, seqlen_q, seqlen_k, 128, 128)
        check_bits(mask, seqlen_q, seqlen_k, 128, 128)
    assert compile_count() + load_count() == before


@pytest.mark.parametrize("content", ["tiles", "true"])
@pytest.mark.parametrize("tile_m,tile_n,rows", [(64, 128, 2), (64, 64, 3), (128, 80, 2)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(2, 300), (65, 256), (129, 200), (300, 4095)])
@pytest.mark.parametrize("layout", ["full", "head-bcast", "expanded", "key-bcast", "offset",
                                    "transposed"])  # fmt: skip
def test_paired_bits_match_reference(layout, seqlen_q, seqlen_k, tile_m, tile_n, rows, content):
    """One pass writes the bits of (tile_m, tile_n) tiles and of (rows * tile_m, tile_n)
    ones (the forward's, from the backward's pre-pass), each as defined at its own tile: a
    stack of tiles with rows past Sq is never FULL."""
    mask = make_mask(layout, content, 2, 3, seqlen_q, seqlen_k, tile_m, tile_n)
    view = mask_view(mask, seqlen_q, seqlen_k)
    spec = dataclasses.replace(block_bits_spec(view, seqlen_k, tile_m, tile_n), coarse_rows=rows)
    fine = block_bits_shape(view, seqlen_q, seqlen_k, tile_m, tile_n)
    coarse = block_bits_shape(view, seqlen_q, seqlen_k, rows * tile_m, tile_n)
    out = tuple(torch.full(s, POISON, dtype=torch.uint8, device="cuda") for s in (fine, coarse))
    got = launch_paired_bits(view, spec, seqlen_q, seqlen_k, target_arch(view.device), out)
    torch.cuda.synchronize()
    for bits, m in zip(got, (tile_m, rows * tile_m), strict=True):
        expected = bits_ref(mask, seqlen_q, seqlen_k, m, tile_n)
        wrong = (bits != expected).nonzero()
        assert wrong.numel() == 0, (
            f"tile_m {m}: {len(wrong)} of {bits.numel()} tiles wrong, first at "
            f"{wrong[0].tolist()}: got {bits[tuple(wrong[0])].item()}, expected "
            f"{expected[tuple(wrong[0])].item()}"
        )
    if content == "true" and seqlen_q >= rows * tile_m:
        assert (got[1] & FULL).any()  # FULL stacks exist to be found
