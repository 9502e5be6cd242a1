"""Per-architecture tile table of the forward kernel and its shared-memory budget.

The forward keeps Q (one tile) and K, V, mask and bias (`kv_stages` tiles each) in shared
memory. The first candidate that keeps 8 warps resident per SM is chosen (e.g. two 4-warp
CTAs: one CTA's loads and barriers overlap the other's math), else the first that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.arch import smem_capacity

# Rows of the mask and bias tiles are padded by 16 bytes: conflict-free reads in the MMA
# accumulator layout and 16-byte aligned cp.async destinations.
ROW_PAD_BYTES = 16


@dataclass(frozen=True)
class FwdTile:
    """Compile-time tiling of one forward CTA."""

    tile_m: int
    tile_n: int
    num_warps: int
    kv_stages: int

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32


@dataclass(frozen=True)
class SmemOperand:
    """What a mask or bias tile costs in shared memory: element bytes and broadcast rows."""

    elem_bytes: int
    row_broadcast: bool


def padded_head_dim(head_dim: int) -> int:
    """The head dim a kernel instance is built for (predicates cover the rest)."""
    for size in (32, 64, 96, 128, 160, 192, 256):
        if head_dim <= size:
            return size
    raise ValueError(f"head_dim: expected at most 256, got {head_dim}")


def tile_row_elems(tile_n: int, elem_bytes: int) -> int:
    """Row pitch (elements) of a mask/bias tile in shared memory."""
    return tile_n + ROW_PAD_BYTES // elem_bytes


def fwd_smem_bytes(
    tile: FwdTile,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> int:
    """Shared memory of one forward CTA, in bytes."""
    total = tile.tile_m * head_dim_padded * elem_bytes
    total += 2 * tile.kv_stages * tile.tile_n * head_dim_padded * elem_bytes
    for operand in (mask, bias):
        if operand is not None:
            rows = 1 if operand.row_broadcast else tile.tile_m
            pitch = tile_row_elems(tile.tile_n, operand.elem_bytes)
            total += tile.kv_stages * rows * pitch * operand.elem_bytes
    return total + 128  # the mask scan's per-warp words and alignment slack


# Candidates in order of preference per padded head dim. Larger tiles amortize the online
# softmax; two K/V stages overlap the next block's loads with this block's math; a single stage
# halves K/V's shared memory so that a second CTA fits on the SM instead.
_CANDIDATES: dict[int, tuple[FwdTile, ...]] = {
    64: (
        FwdTile(128, 128, 4, 2),
        FwdTile(128, 64, 4, 2),
        FwdTile(128, 64, 4, 1),
        FwdTile(64, 64, 4, 2),
        FwdTile(64, 32, 4, 2),
    ),
    128: (
        FwdTile(128, 64, 4, 2),
        FwdTile(128, 64, 4, 1),
        FwdTile(64, 64, 4, 2),
        FwdTile(64, 32, 4, 2),
        FwdTile(64, 32, 4, 1),
    ),
    256: (
        FwdTile(128, 64, 8, 2),
        FwdTile(64, 64, 4, 2),
        FwdTile(64, 32, 4, 2),
        FwdTile(64, 32, 4, 1),
    ),
}
# Warps resident per SM that hide the latency of loads and barriers (FlashAttention-2 runs
# 4-warp CTAs two to an SM).
_WANTED_WARPS_PER_SM = 8
# Shared memory the hardware reserves for each resident CTA.
_RESERVED_PER_CTA = 1024


def ctas_per_sm(arch: str, smem_bytes: int) -> int:
    """How many CTAs of `smem_bytes` shared memory fit on one SM of `arch`."""
    return (smem_capacity(arch) + _RESERVED_PER_CTA) // (smem_bytes + _RESERVED_PER_CTA)


def fwd_tile(
    arch: str,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> FwdTile:
    """The forward tiling for `arch`: the first candidate that keeps _WANTED_WARPS_PER_SM
    resident, else the first that fits; ValueError when nothing fits its shared memory."""
    bucket = min(size for size in _CANDIDATES if head_dim_padded <= size)
    fitting = [
        (tile, ctas_per_sm(arch, fwd_smem_bytes(tile, head_dim_padded, elem_bytes, mask, bias)))
        for tile in _CANDIDATES[bucket]
    ]
    fitting = [(tile, ctas) for tile, ctas in fitting if ctas >= 1]
    for tile, ctas in fitting:
        if ctas * tile.num_warps >= _WANTED_WARPS_PER_SM:
            return tile
    if fitting:
        return fitting[0][0]
    smallest = _CANDIDATES[bucket][-1]
    need = fwd_smem_bytes(smallest, head_dim_padded, elem_bytes, mask, bias)
    raise ValueError(
        f"forward tile: head_dim {head_dim_padded} with mask={mask} bias={bias} needs "
        f"{need} bytes of shared memory, {arch} has {smem_capacity(arch)}"
    )


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BwdTile:
    """Compile-time tiling of one backward CTA: tile_m query rows per step, tile_n keys owned,
    `stages` smem buffers for Q, dO, mask and bias (2 overlaps the next step's loads)."""

    tile_m: int
    tile_n: int
    num_warps: int
    stages: int

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


# The swizzled P/dS stages sit at 1 KiB multiples so the swizzle pattern repeats per stage.
_STAGE_ALIGN = 1024


def bwd_region_bytes(tile: BwdTile, elem_bytes: int, operand: SmemOperand | None) -> int:
    """One stage of the buffer shared by P (or dS) and the mask (or bias) tile it replaces."""
    size = tile.tile_m * tile.tile_n * elem_bytes
    if operand is not None:
        rows = 1 if operand.row_broadcast else tile.tile_m
        size = max(
            size, rows * tile_row_elems(tile.tile_n, operand.elem_bytes) * operand.elem_bytes
        )
    return _round_up(size, _STAGE_ALIGN)


def bwd_smem_bytes(
    tile: BwdTile,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> int:
    """Shared memory of one backward CTA, in bytes: K, V (one tile each), Q, dO (per stage),
    P over the mask and dS over the bias (per stage), dbias column sums and scan words."""
    total = 2 * tile.tile_n * head_dim_padded * elem_bytes
    total += 2 * tile.stages * tile.tile_m * head_dim_padded * elem_bytes
    total += tile.stages * bwd_region_bytes(tile, elem_bytes, mask)
    total += tile.stages * bwd_region_bytes(tile, elem_bytes, bias)
    total += tile.num_warps * tile.tile_n * 4  # per-warp dbias column sums
    return total + 1024  # scan words and alignment slack


_BWD_CANDIDATES: dict[int, tuple[BwdTile, ...]] = {
    64: (BwdTile(64, 128, 8, 2), BwdTile(64, 128, 8, 1), BwdTile(64, 64, 4, 1)),
    128: (
        BwdTile(64, 128, 8, 2),
        BwdTile(64, 128, 8, 1),
        BwdTile(64, 64, 4, 2),
        BwdTile(64, 64, 4, 1),
    ),
    256: (
        BwdTile(64, 64, 8, 2),
        BwdTile(64, 64, 8, 1),
        BwdTile(64, 32, 4, 1),
        BwdTile(32, 32, 4, 1),
    ),
}


def bwd_tile(
    arch: str,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> BwdTile:
    """The first backward candidate that fits `arch`'s shared memory (ValueError if none).

    One CTA per SM suffices: the backward's 8-warp CTAs hold dK and dV in registers, so a
    second CTA would not fit the register file anyway."""
    bucket = min(size for size in _BWD_CANDIDATES if head_dim_padded <= size)
    for tile in _BWD_CANDIDATES[bucket]:
        need = bwd_smem_bytes(tile, head_dim_padded, elem_bytes, mask, bias)
        if ctas_per_sm(arch, need) >= 1:
            return tile
    need = bwd_smem_bytes(_BWD_CANDIDATES[bucket][-1], head_dim_padded, elem_bytes, mask, bias)
    raise ValueError(
        f"backward tile: head_dim {head_dim_padded} with mask={mask} bias={bias} needs "
        f"{need} bytes of shared memory, {arch} has {smem_capacity(arch)}"
    )


def warp_grid(rows: int, cols: int, num_warps: int, prefer: int) -> tuple[int, int]:
    """(warps along rows, warps along cols) for an mma.sync tile of (rows, cols): each warp
    covers 16-row by 16-column atoms, so both must divide; `prefer` rows-warps when possible."""
    options = [prefer] + [w for w in (1, 2, 4, 8) if w != prefer]
    for wm in options:
        wn = num_warps // wm
        if wm * wn == num_warps and rows % (wm * 16) == 0 and cols % (wn * 16) == 0:
            return wm, wn
    raise ValueError(f"no warp grid of {num_warps} warps tiles ({rows}, {cols})")
