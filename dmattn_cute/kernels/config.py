"""Per-architecture tile tables of the forward and backward kernels, and their shared memory.

A kernel's shared memory is described once, buffer by buffer in allocation order
(`fwd_smem_buffers`, `bwd_smem_buffers`, sizes as the DSL allocates them): the tile search
sizes its candidates with it, and a spec's `smem_buffers()` is what its kernel allocates.

Forward: the first candidate that keeps 8 warps resident per SM is chosen (e.g. two 4-warp
CTAs: one CTA's loads and barriers overlap the other's math), else the first that fits.
Backward: the first candidate that fits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

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
    """What a mask or bias tile costs in shared memory: element bytes, broadcast rows, and
    whether it is a TMA box (unpadded, 1024-byte aligned; the Hopper forward's bias)."""

    elem_bytes: int
    row_broadcast: bool
    tma: bool = False


def padded_head_dim(head_dim: int) -> int:
    """The head dim a kernel instance is built for (predicates cover the rest)."""
    for size in (32, 64, 96, 128, 160, 192, 256):
        if head_dim <= size:
            return size
    raise ValueError(f"head_dim: expected at most 256, got {head_dim}")


def tile_row_elems(tile_n: int, elem_bytes: int) -> int:
    """Row pitch (elements) of a mask/bias tile in shared memory."""
    return tile_n + ROW_PAD_BYTES // elem_bytes


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def bias_row_pitch(tile_n: int) -> int:
    """Elements between the smem stages of a 16-bit bias row that TMA writes (its boxes start
    128-byte aligned)."""
    return _round_up(tile_n, 64)


class SmemBuffer(NamedTuple):
    """One shared-memory allocation of a CTA: its name, size and alignment in bytes."""

    name: str
    bytes: int
    align: int


def smem_total(buffers: Iterable[SmemBuffer]) -> int:
    """Bytes of `buffers` allocated one after the other, each at its alignment (as the DSL's
    SmemAllocator places them)."""
    total = 0
    for buffer in buffers:
        total = _round_up(total, buffer.align) + buffer.bytes
    return total


def _operand_tiles_bytes(tile_n: int, rows: int, stages: int, operand: SmemOperand) -> int:
    # `stages` tiles of `rows` padded rows each (tiles.operand_smem_layout); the last row ends
    # at its last element, without the pad.
    pitch = tile_row_elems(tile_n, operand.elem_bytes)
    return ((stages * rows - 1) * pitch + tile_n) * operand.elem_bytes


def _scan_words(num_warps: int) -> SmemBuffer:
    # The mask scan's per-warp (visible, all-True) words (masking.scan_mask_blocks).
    return SmemBuffer("scan_words", 2 * num_warps * 4, 4)


def fwd_smem_buffers(
    tile: FwdTile,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> tuple[SmemBuffer, ...]:
    """The shared memory of one forward CTA in allocation order: Q (one tile), K and V
    (kv_stages tiles each), mask and bias (kv_stages tiles each; one row when broadcast over
    queries) and, with a mask, the scan's per-warp words."""
    kv_bytes = tile.kv_stages * tile.tile_n * head_dim_padded * elem_bytes
    buffers = [
        SmemBuffer("q", tile.tile_m * head_dim_padded * elem_bytes, 1024),
        SmemBuffer("k", kv_bytes, 1024),
        SmemBuffer("v", kv_bytes, 1024),
    ]
    for name, operand in (("mask", mask), ("bias", bias)):
        if operand is not None:
            rows = 1 if operand.row_broadcast else tile.tile_m
            size = _operand_tiles_bytes(tile.tile_n, rows, tile.kv_stages, operand)
            buffers.append(SmemBuffer(name, size, 16))
    if mask is not None:
        buffers.append(_scan_words(tile.num_warps))
    return tuple(buffers)


# The tile tables were tuned against estimates of up to this many bytes above the buffers'
# total; the margin keeps the choices they were tuned for.
_FWD_MARGIN = 128
_BWD_MARGIN = 1536


def fwd_smem_bytes(
    tile: FwdTile,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> int:
    """Shared memory the tile search sets aside for one forward CTA, in bytes: its buffers
    (fwd_smem_buffers) and a margin."""
    buffers = fwd_smem_buffers(tile, head_dim_padded, elem_bytes, mask, bias)
    return smem_total(buffers) + _FWD_MARGIN


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
# Hopper forward (sm_90a): warp-specialized, TMA + wgmma
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sm90FwdTile:
    """Compile-time tiling of one Hopper forward CTA: a producer warpgroup and tile_m / 64
    consumer warpgroups (64 query rows each), `stages` K/V/mask/bias stages."""

    tile_m: int
    tile_n: int
    stages: int
    # A bias row by TMA is converted to fp32 (in log2 units) once per block by a producer warp
    # into stages of its own, where they fit without a narrower tile_n (sm90_fwd_tile).
    row_f32: bool = False
    # A bias row enters Q K^T as one more k-step (kernels/key_bias_terms.py): a key block's
    # (tile_n, 16) terms ride K's stage and barrier, against a (tile_m, 16) tile of ones.
    bias_terms: bool = False

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.consumer_warpgroups)


def sm90_fwd_smem_buffers(
    tile: Sm90FwdTile,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> tuple[SmemBuffer, ...]:
    """The shared memory of one Hopper forward CTA in allocation order: the pipelines'
    mbarriers (full + empty per stage: Q, K, V, cp.async mask/bias, TMA bias, and with
    tile.row_f32 the bias row's fp32 copy), Q (reused for O), K and V stages (1024-byte aligned
    for the 128-byte swizzle of TMA and wgmma), mask and bias stages (`bias_f32`: the fp32
    copy of a bias row; with tile.bias_terms, the bias row's terms stages and `ones`)."""
    kv_bytes = tile.stages * tile.tile_n * head_dim_padded * elem_bytes
    barriers = 2 * (1 + 4 * tile.stages) + (2 * tile.stages if tile.row_f32 else 0)
    buffers = [
        SmemBuffer("mbar", 8 * barriers, 8),
        SmemBuffer("q", tile.tile_m * head_dim_padded * elem_bytes, 1024),
        SmemBuffer("k", kv_bytes, 1024),
        SmemBuffer("v", kv_bytes, 1024),
    ]
    for name, operand in (("mask", mask), ("bias", bias)):
        if name == "bias" and tile.bias_terms:
            buffers.append(SmemBuffer("bias", tile.stages * tile.tile_n * 16 * elem_bytes, 1024))
            buffers.append(SmemBuffer("ones", tile.tile_m * 16 * elem_bytes, 1024))
        elif operand is not None and operand.tma and operand.row_broadcast:
            size = tile.stages * bias_row_pitch(tile.tile_n) * operand.elem_bytes
            buffers.append(SmemBuffer(name, size, 1024))
            if tile.row_f32:
                buffers.append(SmemBuffer(f"{name}_f32", tile.stages * tile.tile_n * 4, 16))
        elif operand is not None and operand.tma:
            size = tile.stages * tile.tile_m * tile.tile_n * operand.elem_bytes
            buffers.append(SmemBuffer(name, size, 1024))
        elif operand is not None:
            rows = 1 if operand.row_broadcast else tile.tile_m
            size = _operand_tiles_bytes(tile.tile_n, rows, tile.stages, operand)
            buffers.append(SmemBuffer(name, size, 16))
    return tuple(buffers)


# Key-block width per padded head dim without mask/bias tiles (FlashAttention 3/4's Hopper
# choices); with them the width drops by 16 until the stages fit.
_SM90_FWD_TILE_N = {32: 128, 64: 128, 96: 128, 128: 128, 160: 112, 192: 112, 256: 80}


# At most this many query rows (decode: one query per row, a group's heads packed as rows) and
# the Hopper forward is bound by reading K and V: with a mask its key tiles are
# SHORT_QUERY_TILE_N wide, so that tile skip works at that grain (64-key blocks at density
# 0.25: 128-key tiles read 1.75x the visible bytes). Measured on an H100 (B8 H16 Hkv4 D128,
# Sk 128k, graph): 64-key blocks 0.417 -> 0.282 ms; 128-key blocks 0.286 -> 0.304 ms.
SHORT_QUERY_ROWS = 64
SHORT_QUERY_TILE_N = 64


def sm90_fwd_tile(
    arch: str,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
    short_queries: bool = False,
    bias_terms: bool = False,
) -> Sm90FwdTile:
    """The Hopper forward tiling: 192 query rows up to head dim 64 without mask/bias, else
    128, and 64 (one consumer) for short queries up to head dim 128; two stages; the widest
    key block that fits (ValueError when none does), at most SHORT_QUERY_TILE_N keys for
    short queries. bias_terms: a bias row may enter Q K^T as terms (Sm90FwdTile.bias_terms),
    where they fit at the key block the row would have had."""
    tile_n = _SM90_FWD_TILE_N[head_dim_padded]
    if short_queries:
        tile_n = min(tile_n, SHORT_QUERY_TILE_N)
    # three consumers for small head dims without mask/bias tiles: their accumulators leave
    # registers to spare (reading mask/bias tiles in the accumulator layout does not)
    tile_m = 192 if head_dim_padded <= 64 and mask is None and bias is None else 128
    # terms of a bias row are read by the GEMM, not in the accumulator layout
    terms_m = 192 if head_dim_padded <= 64 and mask is None else tile_m
    if short_queries and head_dim_padded <= 128:
        # one consumer warpgroup: two CTAs share an SM (sm90/fwd.py); wider heads need more
        # than the 128 registers a thread that leaves at launch
        tile_m = SHORT_QUERY_ROWS

    def fits(tile: Sm90FwdTile) -> bool:
        buffers = sm90_fwd_smem_buffers(tile, head_dim_padded, elem_bytes, mask, bias)
        return smem_total(buffers) <= smem_capacity(arch)

    row = bias is not None and bias.tma and bias.row_broadcast
    while tile_n >= 32:
        tile = Sm90FwdTile(tile_m, tile_n, 2)
        if fits(tile):
            terms = Sm90FwdTile(terms_m, tile_n, 2, bias_terms=True)
            if bias_terms and fits(terms):
                return terms
            converted = Sm90FwdTile(tile_m, tile_n, 2, row_f32=True)
            return converted if row and fits(converted) else tile
        tile_n -= 16
    raise ValueError(
        f"Hopper forward tile: head_dim {head_dim_padded} with mask={mask} bias={bias} does "
        f"not fit the shared memory of {arch}"
    )


@dataclass(frozen=True)
class Sm90BwdTile:
    """Compile-time tiling of one Hopper backward CTA: a producer warpgroup and two MMA
    warpgroups; tile_n keys owned, tile_m query rows per step, `stages` Q/dO stages.

    transposed: the scores are computed as S^T = K Q^T (each warpgroup 64 keys), so P^T and
    dS^T are already the register A operands of dV += P^T dO and dK += dS^T Q; only dS goes
    through smem (for dQ), in one buffer per Q/dO stage. Each query is then a column, and its
    log2 row sum and dpsum (and, with a bias, its row max) come through smem stages too."""

    tile_m: int
    tile_n: int
    stages: int
    transposed: bool = False

    num_threads = 384

    @property
    def dkv_split_keys(self) -> bool:
        """The two MMA warpgroups split dK/dV by keys (64 each); else by head-dim columns."""
        return self.tile_n == 128


def transposed_stats(bias: object | None) -> int:
    """Stats per query row in the transposed backward's smem stages: the log2 row sum and
    dpsum, and with a bias the row max."""
    return 2 if bias is None else 3


def sm90_bwd_smem_buffers(
    tile: Sm90BwdTile,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None = None,
    bias: SmemOperand | None = None,
) -> tuple[SmemBuffer, ...]:
    """The shared memory of one Hopper backward CTA in allocation order: the pipelines'
    mbarriers (full + empty: K/V once; Q, dO and the mask/bias tiles per stage), K and V
    (reused for dK and dV), Q and dO stages, P and dS (one tile each), the fp32 dQ tile of the
    bulk reduce, mask and bias stages, and with a bias the dbias column sums of the four warps
    along the query rows. K and V share one buffer: with 16-bit elements it holds an fp32
    (tile_n, D) tile, the dK or dV partial sum of a CTA that has only some heads of its
    group."""
    tm, tn, dp = tile.tile_m, tile.tile_n, head_dim_padded
    qdo_bytes = tile.stages * tm * dp * elem_bytes
    buffers = [
        SmemBuffer("mbar", 8 * 2 * (1 + 3 * tile.stages), 8),
        SmemBuffer("kv", 2 * tn * dp * elem_bytes, 1024),
        SmemBuffer("q", qdo_bytes, 1024),
        SmemBuffer("do", qdo_bytes, 1024),
    ]
    if tile.transposed:  # P stays in registers; dS in one buffer per stage
        buffers.append(SmemBuffer("ds", tile.stages * tm * tn * elem_bytes, 1024))
        # the log2 row sums, dpsums and (with a bias) row maxima of each stage's query rows
        stats = transposed_stats(bias)
        buffers.append(SmemBuffer("stats", tile.stages * stats * tm * 4, 16))
    else:
        buffers.append(SmemBuffer("p", tm * tn * elem_bytes, 1024))
        buffers.append(SmemBuffer("ds", tm * tn * elem_bytes, 1024))
    buffers.append(SmemBuffer("dq", tm * dp * 4, 1024))
    for name, operand in (("mask", mask), ("bias", bias)):
        if operand is not None:
            rows = 1 if operand.row_broadcast else tm
            size = _operand_tiles_bytes(tn, rows, tile.stages, operand)
            buffers.append(SmemBuffer(name, size, 16))
    if bias is not None and not tile.transposed:  # (transposed: a key's sum is in one quad)
        buffers.append(SmemBuffer("colsum", 4 * tn * 4, 16))
    return tuple(buffers)


def sm90_bwd_tile(
    arch: str,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None = None,
    bias: SmemOperand | None = None,
    transposable: bool = False,
) -> Sm90BwdTile:
    """The Hopper backward tiling: 128 query rows per step up to head dim 64 without mask or
    bias tiles (reading those in the accumulator layout needs the registers), else 64; 128
    keys up to head dim 128, else 64 (dK and dV then split by columns); two Q/dO/mask/bias
    stages when they fit, else one (ValueError when that does not fit either). Transposed
    scores (S^T, see Sm90BwdTile) for 64 x 128 tiles of two stages where the variant is
    `transposable` (Sm90BwdSpec.build says which)."""
    untiled = mask is None and bias is None
    tile_m = 128 if head_dim_padded <= 64 and untiled and not transposable else 64
    tile_n = 128 if head_dim_padded <= 128 else 64
    for stages in (2, 1):
        transposed = transposable and (tile_m, tile_n, stages) == (64, 128, 2)
        tile = Sm90BwdTile(tile_m, tile_n, stages, transposed)
        buffers = sm90_bwd_smem_buffers(tile, head_dim_padded, elem_bytes, mask, bias)
        if smem_total(buffers) <= smem_capacity(arch):
            return tile
    raise ValueError(
        f"Hopper backward tile: head_dim {head_dim_padded} with mask={mask} bias={bias} does "
        f"not fit the shared memory of {arch}"
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

    @property
    def sdp_grid(self) -> tuple[int, int]:
        """Warps along (query rows, keys) of the S = Q K^T and dP = dO V^T GEMMs."""
        return warp_grid(self.tile_m, self.tile_n, self.num_warps, 2)


# Scan windows whose bitmaps are kept for the other heads of a group (Sq up to 64 * 31 blocks).
CACHED_WINDOWS = 64
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


def bwd_smem_buffers(
    tile: BwdTile,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> tuple[SmemBuffer, ...]:
    """The shared memory of one backward CTA in allocation order: K, V (one tile each), Q, dO
    (per stage), P over the mask tile and dS over the bias tile (per stage, see
    bwd_region_bytes), the dbias column sums of each row of warps, the mask scan's per-warp
    words and the scan bitmaps kept for the other heads of a group."""
    kv_bytes = tile.tile_n * head_dim_padded * elem_bytes
    q_bytes = tile.stages * tile.tile_m * head_dim_padded * elem_bytes
    return (
        SmemBuffer("k", kv_bytes, 1024),
        SmemBuffer("v", kv_bytes, 1024),
        SmemBuffer("q", q_bytes, 1024),
        SmemBuffer("do", q_bytes, 1024),
        SmemBuffer("p", tile.stages * bwd_region_bytes(tile, elem_bytes, mask), _STAGE_ALIGN),
        SmemBuffer("ds", tile.stages * bwd_region_bytes(tile, elem_bytes, bias), _STAGE_ALIGN),
        SmemBuffer("colsum", tile.sdp_grid[0] * tile.tile_n * 4, 16),
        _scan_words(tile.num_warps),
        SmemBuffer("scan_bits", 2 * CACHED_WINDOWS * 4, 4),
    )


def bwd_smem_bytes(
    tile: BwdTile,
    head_dim_padded: int,
    elem_bytes: int,
    mask: SmemOperand | None,
    bias: SmemOperand | None,
) -> int:
    """Shared memory the tile search sets aside for one backward CTA, in bytes: its buffers
    (bwd_smem_buffers) and a margin."""
    buffers = bwd_smem_buffers(tile, head_dim_padded, elem_bytes, mask, bias)
    return smem_total(buffers) + _BWD_MARGIN


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
