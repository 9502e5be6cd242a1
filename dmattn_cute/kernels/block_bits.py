"""Mask block bits: one byte per (query block, key block) tile of the boolean mask, from one
bandwidth-bound pass over it, so that the kernels walking its tiles (and every head of a GQA
group, every batch of a broadcast mask) read a byte per tile instead of the tile.

bits[bm, hm, m_block, n_block] (uint8 [Bm', Hm', n_m_blocks, n_n_blocks]; Bm', Hm' are 1 on
the mask's stride-0 dims): masking.VISIBLE when the tile has a True element inside
[0, Sq) x [0, Sk), plus masking.FULL when every element of the tile is True and the tile lies
wholly inside (tail tiles are never FULL), as masking.scan_mask_blocks decides both. A
query-broadcast mask (Qm = 1) has one row of (1, tile_n) tiles, n_m_blocks = 1: its bits hold
for every query block.

With coarse_rows > 1 the pass also writes the bits of (coarse_rows * tile_m, tile_n) tiles,
coarse[bm, hm, m_block // coarse_rows, n_block]: VISIBLE where any of its rows of tiles is,
FULL where all are (a row of tiles past Sq is not FULL), the definition above at the wider
tile. The Hopper forward's tiles are the backward's stacked 2 high, so one pass (one read of
the mask) serves a training step's forward and backward (kernels/paired_bits.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute

from ..jit.arch import compile_options, dependent_launch
from . import masking, operands, tiles
from .config import SmemBuffer
from .spec import OperandSpec, env_stream, fake_tensor

NUM_THREADS = 128
_NUM_WARPS = NUM_THREADS // 32
# Tile sizes the pre-pass takes: those of the attention kernels (MMA granularity), so a vector
# of up to 16 mask bytes never straddles two tiles.
TILE_MULTIPLE = 16
MAX_TILE = 256


@dataclass(frozen=True)
class BlockBitsSpec:
    """One block-bits kernel variant (the compile-cache key): the mask's stride pattern and
    vector width, the tile it summarizes (tile_m query rows by tile_n keys), and how many of
    its rows of tiles make one of the coarse bits also written (1: none)."""

    mask: OperandSpec
    tile_m: int
    tile_n: int
    coarse_rows: int = 1

    def __post_init__(self) -> None:
        if self.mask.dtype != "u8":
            raise ValueError(f"mask: expected the uint8 view of a bool mask, got {self.mask.dtype}")
        for name, size in (("tile_m", self.tile_m), ("tile_n", self.tile_n)):
            if size % TILE_MULTIPLE != 0 or not 0 < size <= MAX_TILE:
                raise ValueError(
                    f"{name}: expected a multiple of {TILE_MULTIPLE} in [{TILE_MULTIPLE}, "
                    f"{MAX_TILE}], got {size}"
                )
        if self.coarse_rows < 1 or (self.coarse_rows > 1 and self.mask.row_broadcast):
            raise ValueError(
                f"coarse_rows: expected 1, or more for a mask with rows, got {self.coarse_rows}"
            )

    @property
    def threads_per_tile(self) -> int:
        """Threads that read one tile (tiles.copy_threads of its vectors)."""
        rows = 1 if self.mask.row_broadcast else self.tile_m
        thread_rows, per_row = tiles.copy_threads(rows, self.tile_n // self.mask.vec, NUM_THREADS)
        return thread_rows * per_row

    @property
    def tiles_per_cta(self) -> int:
        """Key blocks one CTA summarizes: its threads split into groups of threads_per_tile,
        when that is a power of two (a group is then lanes of one warp, or whole warps)."""
        used = self.threads_per_tile
        return NUM_THREADS // used if used & (used - 1) == 0 else 1

    @property
    def rounds(self) -> int:
        """Bytes each tile's group of threads writes: one per row of tiles, plus the coarse
        one."""
        return 1 if self.coarse_rows == 1 else self.coarse_rows + 1

    def smem_buffers(self) -> tuple[SmemBuffer, ...]:
        """The per-warp ballots of a tile read by more than one warp (none otherwise)."""
        if self.threads_per_tile <= 32:
            return ()
        return (SmemBuffer("warp_ballots", 2 * _NUM_WARPS * self.rounds * 4, 4),)

    def example_args(self) -> list:
        """BlockBits's arguments for an offline compile: the mask as launch.operand_spec found
        it, the contiguous bits (and coarse bits), placeholder lengths and the stream."""
        bits = fake_tensor("u8", ("d", "d", "d", "1"), 1)
        coarse = fake_tensor("u8", ("d", "d", "d", "1"), 1) if self.coarse_rows > 1 else None
        return [self.mask.fake(), bits, coarse, 1, 1, env_stream()]

    def compile(self, arch: str, extra_options: str = ""):
        """cute.compile of this variant for `arch` (no GPU needed)."""
        return cute.compile(
            BlockBits(self, dependent_launch(arch)), *self.example_args(),
            options=compile_options(arch, extra_options),
        )  # fmt: skip


class BlockBits:
    """One CTA per (tiles_per_cta key blocks, coarse_rows query blocks, mask batch x head):
    each group of threads_per_tile threads loads its tiles once (gmem -> rmem, predicated
    vectors of up to 16 bytes as 32-bit words, the partition of the forward's mask scan), ORs
    and ANDs each per thread (and across them, for the coarse tile), combines the group by
    warp ballots and writes one byte per tile (rmem -> gmem). On Hopper
    (`dependent`) the forward after it may launch at once: it waits for these bits in
    griddepcontrol before reading them."""

    def __init__(self, spec: BlockBitsSpec, dependent: bool) -> None:
        self.spec = spec
        self.dependent = dependent

    @cute.jit
    def __call__(
        self,
        mMask: cute.Tensor,  # [Bm, Hm, Qm, Km] uint8 view of the bool mask
        mBits: cute.Tensor,  # [Bm', Hm', n_m_blocks, n_n_blocks] uint8
        mCoarse: cute.Tensor | None,  # [Bm', Hm', ceil(n_m_blocks / coarse_rows), n_n_blocks]
        seqlen_q: cutlass.Int32,
        seqlen_k: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        grid = (
            cute.ceil_div(mBits.shape[3], self.spec.tiles_per_cta),
            cute.ceil_div(mBits.shape[2], self.spec.coarse_rows),
            mBits.shape[0] * mBits.shape[1],
        )
        self.kernel(mMask, mBits, mCoarse, seqlen_q, seqlen_k).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mMask: cute.Tensor,
        mBits: cute.Tensor,
        mCoarse: cute.Tensor | None,
        seqlen_q: cutlass.Int32,
        seqlen_k: cutlass.Int32,
    ):
        if cutlass.const_expr(self.dependent):
            cute.arch.griddepcontrol_launch_dependents()
        spec = self.spec
        used, per_cta, rows = spec.threads_per_tile, spec.tiles_per_cta, spec.coarse_rows
        tidx, _, _ = cute.arch.thread_idx()
        n_group, m_group, bh = cute.arch.block_idx()
        b, h = bh // mBits.shape[1], bh % mBits.shape[1]
        slot = tidx // used
        n_block = n_group * per_cta + slot
        limits = masking.BlockLimits(
            seqlen_q, seqlen_k, cutlass.Int32(0), cutlass.Int32(0), spec.tile_m, spec.tile_n,
            False,
        )  # fmt: skip
        has_tile = (slot < per_cta) & (n_block < mBits.shape[3])
        s_ballots = None  # (seen / every, warp, round): a group of whole warps meets here
        if cutlass.const_expr(used > 32):
            smem = tiles.allocate_smem(spec.smem_buffers())
            s_ballots = tiles.smem_tensor(
                smem["warp_ballots"],
                cutlass.Int32,
                cute.make_layout(
                    (2, _NUM_WARPS, spec.rounds), stride=(_NUM_WARPS, 1, 2 * _NUM_WARPS)
                ),
            )

        # per round, a row of tiles; with coarse bits, a last round for their stack
        outputs = []  # (bits, query block, whether the group's byte exists) per round
        seen_all = cutlass.Boolean(False)
        every_all = cutlass.Boolean(True)
        scans = []
        for r in cutlass.range_constexpr(rows):
            scans.append(
                operands.mask_scan(
                    spec.mask, mMask, b, h, limits, m_group * rows + r, None, used,
                    NUM_THREADS, tidx,
                )
            )  # fmt: skip
        # gmem -> rmem: this thread's share of every round's tile, bytes past Sq/Sk
        # zero-filled (False: a row of tiles past Sq is seen as neither VISIBLE nor FULL),
        # all issued before any is reduced, so that they are in flight together
        if has_tile:
            for r in cutlass.range_constexpr(rows):
                masking.load_tile(scans[r], n_block)
        for r in cutlass.range_constexpr(rows):
            m_block = m_group * rows + r
            seen = cutlass.Boolean(False)
            every = cutlass.Boolean(True)  # threads holding no share do not veto
            if has_tile:
                seen, every = masking.tile_any_all(scans[r].frag, scans[r].words)
            seen_all = seen_all | seen
            every_all = every_all & every
            self.ballots(s_ballots, r, seen, every, mBits, b, h, m_block, n_block,
                         has_tile & (m_block < mBits.shape[2]))  # fmt: skip
            outputs.append((mBits, m_block, has_tile & (m_block < mBits.shape[2])))
        if cutlass.const_expr(mCoarse is not None):
            self.ballots(s_ballots, rows, seen_all, every_all, mCoarse, b, h, m_group, n_block,
                         has_tile)  # fmt: skip
            outputs.append((mCoarse, m_group, has_tile))

        if cutlass.const_expr(used > 32):
            # The group is whole warps (lanes past `used` hold no share): their ballots meet
            # in shared memory.
            warps = _NUM_WARPS // per_cta
            cute.arch.sync_threads()  # every warp's ballots of every round are in smem
            if tidx % used == 0:
                for r in cutlass.range_constexpr(len(outputs)):
                    bits, m_block, exists = outputs[r]
                    seen_any = cutlass.Int32(0)
                    every_warp = cutlass.Int32(-1)
                    for w in cutlass.range_constexpr(warps):
                        seen_any = seen_any | s_ballots[0, slot * warps + w, r]
                        every_warp = every_warp & s_ballots[1, slot * warps + w, r]
                    if exists:
                        self.store(bits, b, h, m_block, n_block, seen_any != 0, every_warp == -1)

    @cute.jit
    def ballots(self, s_ballots, r, seen, every, bits, b, h, m_block, n_block, exists):
        """Round r's (seen, every) of the group's threads: a group within one warp combines
        its lanes and its first lane stores the byte; a group of whole warps leaves its
        warps' ballots in s_ballots for after the barrier."""
        used = self.spec.threads_per_tile
        tidx, _, _ = cute.arch.thread_idx()
        seen_lanes = cute.arch.vote_ballot_sync(seen)
        every_lanes = cute.arch.vote_ballot_sync(every)
        if cutlass.const_expr(used <= 32):
            # The group is `used` adjacent lanes of one warp, from its first lane up.
            lanes = (1 << used) - 1 if used < 32 else -1
            lane = tidx % 32
            if exists & (tidx % used == 0):
                self.store(
                    bits, b, h, m_block, n_block,
                    ((seen_lanes >> lane) & lanes) != 0,
                    ((~every_lanes >> lane) & lanes) == 0,
                )  # fmt: skip
        else:
            if tidx % 32 == 0:
                s_ballots[0, tidx // 32, r] = seen_lanes
                s_ballots[1, tidx // 32, r] = every_lanes

    @cute.jit
    def store(self, mBits: cute.Tensor, b, h, m_block, n_block, visible, full):
        """The byte of tile (m_block, n_block): VISIBLE, and FULL with it."""
        value = cutlass.Int32(0)
        if visible:
            value = cutlass.Int32(masking.VISIBLE)
            if full:
                value = cutlass.Int32(masking.VISIBLE | masking.FULL)
        mBits[b, h, m_block, n_block] = value.to(cutlass.Uint8)
