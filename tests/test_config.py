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
