"""Which key blocks a query block visits: causal/window ranges, per-element limits, and the
bitmap of key blocks whose mask tile has a True byte (all-False tiles are skipped).

Causal is the window (left=inf, right=0), bottom-right aligned: query row i sees key j when
i + Sk - Sq - left <= j <= i + Sk - Sq + right. The host passes unbounded sides as a large
finite value so the arithmetic here needs no special case.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
from cutlass import cute

from . import tiles
from .utils import acc_mn_view, wgmma_column

# Key blocks per mask scan: one 32-bit word per scan, leaving the sign bit unused so that
# shifts stay logical.
SCAN_BLOCKS = 31

# Bits of one (query block, key block) entry of the block-bits pre-pass.
VISIBLE = 1  # the block's mask tile has a True element
FULL = 2  # every element of the tile is True (and inside Sq x Sk): no mask tile needed


class ScanState:
    """Slots of the Int32 register array a kernel's walk over blocks keeps between steps."""

    VISIBLE = 0  # bit j: block j of the current scan window has a True mask byte (or no mask)
    STAGE = 1  # the smem stage the next load fills
    FULL = 2  # bit j: block j's mask tile is all True (no mask tile load, no masking)
    LOADED = 3  # backward: the query block whose tiles the last load already holds
    SLOTS = 4


@dataclass(frozen=True)
class BlockLimits:
    """The causal/window and length limits of one launch, per block and per element.

    Sequence lengths and window sides are run-time values, tile sizes and whether a window
    exists compile-time ones (the model is FlashAttention 4's block_info.py; frozen, so the
    DSL passes it into run-time loops as it is).
    """

    seqlen_q: cutlass.Int32
    seqlen_k: cutlass.Int32
    window_left: cutlass.Int32
    window_right: cutlass.Int32
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    has_window: cutlass.Constexpr[bool]

    @cute.jit
    def key_block_range(self, m_block: cutlass.Int32):
        """[n_block_min, n_block_max) of the key blocks query block `m_block` can see."""
        n_block_min = cutlass.Int32(0)
        n_block_max = cute.ceil_div(self.seqlen_k, self.tile_n)
        if cutlass.const_expr(self.has_window):
            diag = self.seqlen_k - self.seqlen_q
            row_first = m_block * self.tile_m
            row_last = cutlass.min(row_first + self.tile_m, self.seqlen_q) - 1
            col_hi = cutlass.max(row_last + diag + self.window_right + 1, 0)
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(col_hi, self.tile_n))
            n_block_min = cutlass.max(row_first + diag - self.window_left, 0) // self.tile_n
        return n_block_min, n_block_max

    @cute.jit
    def query_block_range(self, n_block: cutlass.Int32):
        """[m_block_min, m_block_max) of the query blocks that can see a key of block
        `n_block` (the backward's view of key_block_range)."""
        m_block_min = cutlass.Int32(0)
        m_block_max = cute.ceil_div(self.seqlen_q, self.tile_m)
        if cutlass.const_expr(self.has_window):
            diag = self.seqlen_k - self.seqlen_q
            # row i sees key j when i + diag - left <= j <= i + diag + right
            row_lo = n_block * self.tile_n - diag - self.window_right
            row_hi = (n_block + 1) * self.tile_n - 1 - diag + self.window_left
            m_block_min = cutlass.max(row_lo, 0) // self.tile_m
            m_block_max = cutlass.min(
                m_block_max, cute.ceil_div(cutlass.max(row_hi + 1, 0), self.tile_m)
            )
        return m_block_min, m_block_max

    @cute.jit
    def apply(
        self, acc_s: cute.Tensor, t_coord: cute.Tensor, m_block, n_block,
        transposed: cutlass.Constexpr[bool] = False,
    ):  # fmt: skip
        """Scores of block (m_block, n_block) past Sk or outside the window become -inf
        (t_coord: (row, col) of each element of acc_s; transposed: acc_s holds S^T, rows are
        keys and t_coord (key, query)); blocks wholly inside are left alone."""
        needs = (n_block + 1) * self.tile_n > self.seqlen_k
        if cutlass.const_expr(self.has_window):
            diag = self.seqlen_k - self.seqlen_q
            row_first = m_block * self.tile_m
            row_last = row_first + self.tile_m - 1
            needs = needs | ((n_block + 1) * self.tile_n - 1 > row_first + diag + self.window_right)
            needs = needs | (n_block * self.tile_n < row_last + diag - self.window_left)
        if needs and cutlass.const_expr(transposed):
            acc_mn = acc_mn_view(acc_s)
            coord_mn = acc_mn_view(t_coord)
            # column c's query from the first one (wgmma_column), not read from t_coord per
            # column (those are kept in registers, or spilled)
            first = coord_mn[0, 0][1]
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                key_end = self.seqlen_k
                key_begin = cutlass.Int32(0)
                if cutlass.const_expr(self.has_window):
                    query = first + wgmma_column(c)
                    diag_key = query + self.seqlen_k - self.seqlen_q
                    key_end = cutlass.min(key_end, diag_key + self.window_right + 1)
                    key_begin = diag_key - self.window_left
                for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                    key = coord_mn[r, 0][0]
                    if key >= key_end or key < key_begin:
                        acc_mn[r, c] = -cutlass.Float32.inf
        elif needs:
            acc_mn = acc_mn_view(acc_s)
            coord_mn = acc_mn_view(t_coord)
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                col_end = self.seqlen_k
                col_begin = cutlass.Int32(0)
                if cutlass.const_expr(self.has_window):
                    diag_col = coord_mn[r, 0][0] + self.seqlen_k - self.seqlen_q
                    col_end = cutlass.min(col_end, diag_col + self.window_right + 1)
                    col_begin = diag_col - self.window_left
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    col = coord_mn[0, c][1]
                    if col >= col_end or col < col_begin:
                        acc_mn[r, c] = -cutlass.Float32.inf


@cute.jit
def range_bits(first: cutlass.Int32, lo: cutlass.Int32, hi: cutlass.Int32) -> cutlass.Int32:
    """Bit j set for the SCAN_BLOCKS blocks first + j that lie in [lo, hi)."""
    begin = cutlass.max(lo - first, 0)
    end = cutlass.min(hi - first, SCAN_BLOCKS)
    bits = cutlass.Int32(0)
    if end > begin:
        bits = ((cutlass.Int32(1) << end) - 1) & ~((cutlass.Int32(1) << begin) - 1)
    return bits


@cute.jit
def tile_any_all(frag: cute.Tensor, words: cutlass.Constexpr):
    """(any byte set, every byte set) of this thread's share of a mask tile (bytes are 0/1),
    held as 32-bit words of 4 mask bytes (words=True) or as single bytes."""
    if cutlass.const_expr(words):
        acc_or = cutlass.Int32(0)
        acc_and = cutlass.Int32(-1)
        if cutlass.const_expr(cute.size(frag) < tiles.COMPILER_UNROLLED_VECTORS):
            for i in cutlass.range_constexpr(cute.size(frag)):
                acc_or = acc_or | frag[i]
                acc_and = acc_and & frag[i]
        else:
            for i in cutlass.range(cute.size(frag), unroll_full=True):
                acc_or = acc_or | frag[i]
                acc_and = acc_and & frag[i]
        return acc_or != 0, acc_and == 0x01010101
    else:
        total = frag.load().to(cutlass.Int32).reduce(cute.ReductionOp.ADD, 0, 0)
        return total != 0, total == cute.size(frag)


@cute.jit
def load_tile(scan, tile):
    """This thread's share of mask tile `tile` of a scan partition (operands.mask_scan) into
    scan.frag: gmem -> rmem, bytes past Sq/Sk zero-filled."""
    tiles.copy_tile(
        scan.copy,
        scan.tXgX[None, None, None, tile],
        scan.frag,
        scan.tXcX[None, None, None, tile],
        scan.row_end,
        scan.col_end,
        True,
        True,
    )


@cute.jit
def scan_tile(scan, tile):
    """(any True, all True) of this thread's share of mask tile `tile`: load_tile, then
    tile_any_all."""
    load_tile(scan, tile)
    return tile_any_all(scan.frag, scan.words)


@cute.jit
def scan_mask_blocks(
    scan,
    n_first: cutlass.Int32,
    n_end: cutlass.Int32,
    s_words: cute.Tensor,
    tidx: cutlass.Int32,
    num_warps: cutlass.Constexpr,
):
    """CTA-uniform bitmaps of the next SCAN_BLOCKS key blocks (n_first + j < n_end):
    `visible` bit j when the block's mask tile has a True byte in this CTA's query rows, `full`
    bit j when every byte of the tile is True (no per-element masking needed; bytes past Sq/Sk
    read as False, so tail tiles are never full).

    Each thread reads its share of every tile (gmem -> rmem, the same partition the smem loads
    use); warps combine by shuffles, then the CTA through two shared words per warp.
    scan: the partition operands.mask_scan builds.
    """
    visible = cutlass.Int32(0)
    full = cutlass.Int32((1 << SCAN_BLOCKS) - 1)  # threads holding no share do not veto
    for j in cutlass.range(SCAN_BLOCKS, unroll=4):
        n_block = n_first + j
        # A query-broadcast mask (backward) has one tile for every query block.
        tile = 0 if cutlass.const_expr(scan.same_tile) else n_block
        if n_block < n_end and tidx < scan.used:
            seen, every = scan_tile(scan, tile)
            if seen:
                visible = visible | (cutlass.Int32(1) << j)
            if not every:
                full = full & ~(cutlass.Int32(1) << j)
    for i in cutlass.range_constexpr(5):
        visible = visible | cute.arch.shuffle_sync_bfly(visible, offset=16 >> i)
        full = full & cute.arch.shuffle_sync_bfly(full, offset=16 >> i)
    if tidx % 32 == 0:
        s_words[0, tidx // 32] = visible
        s_words[1, tidx // 32] = full
    cute.arch.sync_threads()  # every warp's words are in shared memory
    for w in cutlass.range_constexpr(num_warps):
        visible = visible | s_words[0, w]
        full = full & s_words[1, w]
    cute.arch.sync_threads()  # every thread has read the words before the next scan rewrites them
    return visible, full & visible


@cute.jit
def next_set_bit(word: cutlass.Int32, j: cutlass.Int32) -> cutlass.Int32:
    """Index of the lowest set bit of `word` above bit j (j in [-1, SCAN_BLOCKS - 1]), or
    SCAN_BLOCKS if there is none."""
    above = word >> (j + 1)
    lowest = above & (-above)
    return SCAN_BLOCKS if above == 0 else j + 1 + cutlass.Int32(cute.arch.popc(lowest - 1))


# Split-KV chunks: block-bit loads a lane of the balancing scan keeps in flight, and the
# longest range of key blocks that is balanced. The scan costs a few L2 round trips per 512
# blocks before a CTA's first load; measured on an H200 (decode, B8 Hkv4, 64-key tiles, mask
# density 0.25, from a CUDA graph) it paid at 512 blocks (Sk 32k: 0.061 -> 0.057 ms) and cost
# more than it saved at 2048 (Sk 128k: 0.157 -> 0.162 ms) and 8192 (Sk 512k: 0.544 -> 0.606).
CHUNK_SCAN_UNROLL = 16
CHUNK_BALANCE_MAX_BLOCKS = 1024


@cute.jit
def chunk_block_range(
    bits: cute.Tensor | None,
    n_block_min: cutlass.Int32,
    n_block_max: cutlass.Int32,
    chunk: cutlass.Int32,
    chunks: cutlass.Int32,
):
    """[lo, hi) of chunk `chunk` of `chunks` that split [n_block_min, n_block_max) for a
    split-KV forward (fwd_launch.flash_fwd's key_chunks): as many blocks each, or, with the
    block bits of the query block (bits[n_block], a byte per key block) and at most
    CHUNK_BALANCE_MAX_BLOCKS blocks, as many visible blocks each (within one). A row's CTAs
    then read about the same K/V bytes, where equal key ranges of a random mask give the
    busiest one ~1.7x the mean at 16 visible blocks each. Every lane of the calling warp
    computes the same range (no shared memory, no barrier: each warp of a CTA calls it)."""
    lo, hi = n_block_min, n_block_max
    if chunks > 1:
        n = n_block_max - n_block_min
        lo = n_block_min + n * chunk // chunks
        hi = n_block_min + n * (chunk + 1) // chunks
        if cutlass.const_expr(bits is not None):
            if n <= CHUNK_BALANCE_MAX_BLOCKS:
                lo, hi = _balanced_range(bits, n_block_min, n_block_max, chunk, chunks)
    return lo, hi


@cute.jit
def _balanced_range(bits, n_block_min, n_block_max, chunk, chunks):
    """chunk_block_range's chunk of as many visible blocks. Each lane counts the visible
    blocks of its own `seg` consecutive blocks; an inclusive prefix sum over the lanes gives
    every lane the ranks its blocks hold. The chunk runs from the block of rank total * chunk
    / chunks to the one of rank total * (chunk + 1) / chunks (rank `total`: n_block_max), each
    found by the lane whose blocks hold it."""
    lane = cute.arch.lane_idx()
    seg = cute.ceil_div(n_block_max - n_block_min, 32)
    first = n_block_min + lane * seg
    own = cutlass.Int32(0)
    for j in cutlass.range(seg, unroll=CHUNK_SCAN_UNROLL):
        own += _visible(bits, first + j, n_block_max)
    upto = own
    for i in cutlass.range_constexpr(5):
        below = cute.arch.shuffle_sync_up(upto, offset=1 << i)
        if lane >= (1 << i):
            upto += below
    total = cute.arch.shuffle_sync(upto, 31)
    lo, hi = n_block_max, n_block_max
    rank_lo = total * chunk // chunks
    rank_hi = total * (chunk + 1) // chunks
    if (upto - own <= rank_lo) & (rank_lo < upto):
        lo = _nth_visible(bits, first, seg, n_block_max, rank_lo - (upto - own))
    if (upto - own <= rank_hi) & (rank_hi < upto):
        hi = _nth_visible(bits, first, seg, n_block_max, rank_hi - (upto - own))
    for i in cutlass.range_constexpr(5):
        lo = cutlass.min(lo, cute.arch.shuffle_sync_bfly(lo, offset=16 >> i))
        hi = cutlass.min(hi, cute.arch.shuffle_sync_bfly(hi, offset=16 >> i))
    return lo, hi


@cute.jit
def _visible(bits: cute.Tensor, n_block: cutlass.Int32, end: cutlass.Int32) -> cutlass.Int32:
    """1 if key block n_block (< end) is visible, else 0. The load is not predicated (its
    index is clamped instead), so that a loop's loads can all be in flight at once."""
    byte = cutlass.Int32(bits[cutlass.min(n_block, end - 1)])
    return byte & VISIBLE & ((n_block - end) >> 31)  # (n_block - end) >> 31: -1 below end


@cute.jit
def _nth_visible(
    bits: cute.Tensor, first: cutlass.Int32, seg: cutlass.Int32, end: cutlass.Int32, nth
) -> cutlass.Int32:
    """The visible block number nth (from 0) of the blocks [first, first + seg), which hold
    more than nth."""
    found = end
    count = cutlass.Int32(0)
    for j in cutlass.range(seg, unroll=CHUNK_SCAN_UNROLL):
        count += _visible(bits, first + j, end)
        if (count == nth + 1) & (found == end):
            found = first + j
    return found
