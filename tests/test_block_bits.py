"""The mask block-bits pre-pass on the host: its output shape, variants, thread split and
argument checks (no GPU; the kernel itself is in test_block_bits_gpu.py and test_compile.py)."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.kernels.block_bits import NUM_THREADS, BlockBitsSpec
from dmattn_cute.kernels.block_bits_launch import (
    block_bits,
    block_bits_shape,
    block_bits_spec,
    mask_view,
)
from dmattn_cute.kernels.spec import OperandSpec
from dmattn_cute.kernels.tiles import copy_threads


def meta_mask(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bool, device="meta")


@pytest.mark.parametrize(
    ("mask", "shape", "strides"),
    [
        (meta_mask(2, 4, 300, 512), (2, 4, 3, 4), ("d", "d", "d", "1")),
        (meta_mask(1, 4, 300, 512), (1, 4, 3, 4), ("0", "d", "d", "1")),
        (meta_mask(2, 1, 300, 512), (2, 1, 3, 4), ("d", "0", "d", "1")),
        (meta_mask(2, 1, 300, 512).expand(2, 8, 300, 512), (2, 1, 3, 4), ("d", "0", "d", "1")),
        (meta_mask(2, 4, 1, 512), (2, 4, 1, 4), ("d", "d", "0", "1")),
        (meta_mask(2, 4, 512), (2, 4, 1, 4), ("d", "d", "0", "1")),
        (meta_mask(2, 4, 300, 1), (2, 4, 3, 4), ("d", "d", "1", "0")),
        (meta_mask(1, 1, 1, 1).expand(2, 4, 300, 512), (1, 1, 1, 4), ("0", "0", "0", "0")),
    ],
    ids=["full", "batch-bcast", "head-bcast", "expanded", "query-bcast", "3d", "key-bcast",
         "scalar"],
)  # fmt: skip
def test_bits_shape_of_broadcast_masks(mask, shape, strides) -> None:
    view = mask_view(mask, 300, 512)
    assert view.dtype == torch.uint8
    assert block_bits_shape(view, 300, 512, 128, 128) == shape
    assert block_bits_spec(view, 512, 128, 128).mask.strides == strides


@pytest.mark.parametrize(
    ("strides", "vec", "tile_m", "tile_n", "per_tile", "per_cta"),
    [
        (("d", "d", "d", "1"), 16, 128, 128, 128, 1),
        (("d", "d", "0", "1"), 16, 128, 128, 8, 16),
        (("d", "d", "0", "1"), 1, 64, 64, 64, 2),
        (("d", "d", "d", "1"), 16, 128, 176, 88, 1),
        (("d", "d", "0", "1"), 16, 128, 176, 11, 1),
    ],
)
def test_threads_per_tile(strides, vec, tile_m, tile_n, per_tile, per_cta) -> None:
    spec = BlockBitsSpec(OperandSpec("u8", strides, vec), tile_m, tile_n)
    assert (spec.threads_per_tile, spec.tiles_per_cta) == (per_tile, per_cta)


@pytest.mark.parametrize("rows", [1, 16, 64, 128, 176, 256])
@pytest.mark.parametrize("per_row", [1, 2, 4, 7, 8, 11, 16, 44, 64, 128, 176, 256])
def test_copy_threads_divide_the_tile(rows: int, per_row: int) -> None:
    thread_rows, threads_per_row = copy_threads(rows, per_row, NUM_THREADS)
    assert rows % thread_rows == 0 and per_row % threads_per_row == 0
    assert thread_rows * threads_per_row <= NUM_THREADS
    if per_row <= NUM_THREADS and rows & (rows - 1) == 0 and per_row & (per_row - 1) == 0:
        # the split the kernels used before odd sizes were allowed
        used = min(NUM_THREADS, rows * per_row)
        assert (thread_rows, threads_per_row) == (used // per_row, per_row)


@pytest.mark.parametrize(("tile_m", "tile_n"), [(100, 128), (128, 0), (128, 272), (8, 128)])
def test_spec_rejects_tiles(tile_m: int, tile_n: int) -> None:
    with pytest.raises(ValueError, match="tile_"):
        BlockBitsSpec(OperandSpec("u8", ("d", "d", "d", "1"), 16), tile_m, tile_n)


def test_spec_rejects_a_non_mask() -> None:
    with pytest.raises(ValueError, match="mask: expected the uint8 view"):
        BlockBitsSpec(OperandSpec("bf16", ("d", "d", "d", "1"), 8), 128, 128)


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (torch.empty(2, 4, 300, 512, device="meta"), TypeError, "mask: expected dtype"),
        (meta_mask(300, 512), ValueError, "mask: expected a 3-D"),
        (meta_mask(2, 4, 299, 512), ValueError, "dim 2 to be 1 or Sq=300, got 299"),
        (meta_mask(2, 4, 300, 500), ValueError, "dim 3 to be 1 or Sk=512, got 500"),
    ],
    ids=["float", "2d", "queries", "keys"],
)
def test_bad_masks_raise(mask, error, match) -> None:
    with pytest.raises(error, match=match):
        block_bits(mask, 300, 512, 128, 128)


def test_bad_out_raises() -> None:
    out = torch.empty(2, 4, 3, 5, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=r"out: expected a uint8 tensor of shape \(2, 4, 3, 4\)"):
        block_bits(meta_mask(2, 4, 300, 512), 300, 512, 128, 128, out=out)


def test_spec_rejects_coarse_rows_of_a_one_row_mask() -> None:
    """A query-broadcast mask has one row of tiles for every query block: nothing to stack."""
    rows = OperandSpec("u8", ("d", "d", "0", "1"), 16)
    with pytest.raises(ValueError, match="coarse_rows"):
        BlockBitsSpec(rows, 64, 128, coarse_rows=2)
    with pytest.raises(ValueError, match="coarse_rows"):
        BlockBitsSpec(OperandSpec("u8", ("d", "d", "d", "1"), 16), 64, 128, coarse_rows=0)
    assert BlockBitsSpec(rows, 64, 128).rounds == 1
    assert BlockBitsSpec(OperandSpec("u8", ("d", "d", "d", "1"), 16), 64, 128, 2).rounds == 3
