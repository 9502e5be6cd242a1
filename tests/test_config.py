"""The per-architecture tile tables and their shared-memory accounting."""

import pytest

from dmattn_cute.jit import SUPPORTED_ARCHS
from dmattn_cute.jit.arch import smem_capacity
from dmattn_cute.kernels import config
from dmattn_cute.kernels.config import (
    SmemBuffer,
    SmemOperand,
    fwd_smem_bytes,
    fwd_tile,
    padded_head_dim,
    smem_total,
)
from dmattn_cute.kernels.spec import OperandSpec

OPERANDS = [
    (None, None),
    (SmemOperand(1, False), SmemOperand(2, False)),
    (SmemOperand(1, True), SmemOperand(4, False)),
]


@pytest.mark.parametrize(
    ("head_dim", "padded"),
    [(8, 32), (40, 64), (80, 96), (128, 128), (136, 160), (192, 192), (256, 256)],
)
def test_padded_head_dim(head_dim: int, padded: int) -> None:
    assert padded_head_dim(head_dim) == padded


@pytest.mark.parametrize(("mask", "bias"), OPERANDS)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_every_supported_variant_fits(arch, head_dim, mask, bias) -> None:
    tile = fwd_tile(arch, head_dim, 2, mask, bias)
    assert fwd_smem_bytes(tile, head_dim, 2, mask, bias) <= smem_capacity(arch)
    assert tile.tile_m % (16 * tile.num_warps) == 0


def test_large_smem_gets_the_large_tile() -> None:
    assert fwd_tile("sm_90a", 128, 2, None, None).tile_m == 128
    small = fwd_tile("sm_86", 256, 2, SmemOperand(1, False), SmemOperand(4, False))
    assert small.kv_stages == 1


def test_impossible_combination_is_a_spec_time_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "smem_capacity", lambda arch: 48 * 1024)
    with pytest.raises(ValueError, match="shared memory"):
        fwd_tile("sm_86", 256, 2, SmemOperand(1, False), SmemOperand(4, False))


def test_buffers_are_placed_at_their_alignment() -> None:
    buffers = [SmemBuffer("a", 10, 4), SmemBuffer("b", 8, 16), SmemBuffer("c", 4, 4)]
    assert smem_total(buffers) == 16 + 8 + 4


SM90_OPERANDS = [
    *OPERANDS,
    (SmemOperand(1, False), SmemOperand(2, False, tma=True)),
    (None, SmemOperand(2, False, tma=True)),
]


@pytest.mark.parametrize(("mask", "bias"), SM90_OPERANDS)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 256])
def test_every_hopper_forward_variant_fits(head_dim, mask, bias) -> None:
    tile = config.sm90_fwd_tile("sm_90a", head_dim, 2, mask, bias)
    buffers = config.sm90_fwd_smem_buffers(tile, head_dim, 2, mask, bias)
    assert smem_total(buffers) <= smem_capacity("sm_90a")
    # wgmma: 64 rows per consumer warpgroup; the key block is the P V GEMM's k (16s)
    assert tile.tile_m % 64 == 0 and tile.tile_n % 16 == 0
    assert tile.num_threads == 128 * (1 + tile.tile_m // 64)
    # TMA and the 128-byte swizzle need 1024-byte aligned tiles
    assert all(b.align == 1024 for b in buffers if b.name in ("q", "k", "v"))
    if bias is not None and bias.tma:
        assert next(b for b in buffers if b.name == "bias").align == 1024


def test_hopper_forward_tiles() -> None:
    tile = config.sm90_fwd_tile
    assert tile("sm_90a", 128, 2, None, None) == config.Sm90FwdTile(128, 128, 2)
    # three consumers at small head dims, unless mask/bias tiles take their registers
    assert tile("sm_90a", 64, 2, None, None).tile_m == 192
    assert tile("sm_90a", 64, 2, SmemOperand(1, False), None).tile_m == 128
    # mask and bias stages narrow the key block until they fit
    assert tile("sm_90a", 128, 2, SmemOperand(1, False), SmemOperand(2, False)).tile_n < 128
    assert tile("sm_90a", 256, 2, None, None).tile_n == 80
    # short queries (decode): key tiles of at most 64; one consumer up to head dim 128
    for head_dim in (64, 128, 256):
        short = tile("sm_90a", head_dim, 2, SmemOperand(1, False), None, True)
        assert (short.tile_n, short.tile_m) == (64, 64 if head_dim <= 128 else 128)


def test_hopper_bias_row_fp32_copy_only_where_it_fits() -> None:
    """A TMA bias row gets fp32 stages (a producer warp converts it: row_f32) unless they
    would narrow the key block: D256 with a key mask keeps its 80 keys without them."""
    tile = config.sm90_fwd_tile
    row = SmemOperand(2, True, tma=True)
    for head_dim in (64, 128, 256):
        assert tile("sm_90a", head_dim, 2, None, row).row_f32
    assert not tile("sm_90a", 128, 2, None, SmemOperand(2, False, tma=True)).row_f32
    assert not tile("sm_90a", 128, 2, None, None).row_f32
    key_mask = SmemOperand(1, True)
    narrow = tile("sm_90a", 256, 2, key_mask, row)
    assert (narrow.tile_n, narrow.row_f32) == (80, False)
    buffers = config.sm90_fwd_smem_buffers(tile("sm_90a", 128, 2, None, row), 128, 2, None, row)
    (copy,) = [b for b in buffers if b.name == "bias_f32"]
    assert copy.bytes == 2 * 128 * 4


def test_hopper_tile_search_fails_at_spec_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "smem_capacity", lambda arch: 64 * 1024)
    with pytest.raises(ValueError, match="shared memory"):
        config.sm90_fwd_tile("sm_90a", 256, 2, SmemOperand(1, False), SmemOperand(4, False))


@pytest.mark.parametrize(
    ("operand", "tma"),
    [
        (OperandSpec("bf16", ("d", "d", "d", "1"), 8), True),
        (OperandSpec("fp16", ("0", "d", "d", "1"), 8), True),  # broadcast dims drop out
        (OperandSpec("bf16", ("d", "d", "d", "1"), 4), False),  # rows 8-byte aligned only
        (OperandSpec("bf16", ("d", "d", "0", "1"), 8), True),  # one row for all queries
        (OperandSpec("bf16", ("d", "d", "0", "1"), 2), False),  # that row 4-byte aligned
        (OperandSpec("fp32", ("d", "d", "d", "1"), 4), False),  # 32-bit: no room for 2 stages
        (OperandSpec("bf16", ("d", "d", "1", "d"), 1), False),  # queries contiguous
    ],
)
def test_bias_tiles_by_tma(operand, tma) -> None:
    assert operand.tma_tiles == tma
