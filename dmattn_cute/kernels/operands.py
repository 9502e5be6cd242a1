"""Mask and bias tiles, shared by the forward and the backward.

An operand is a [Bm, Hm, Qm, Km] view read in place (stride 0 on broadcast dims). A CTA reads
(rows, tile_n) tiles of one (batch, head) slice of it: rows = tile_m, or 1 for a
query-broadcast operand (Qm = 1), whose single row every score row reads. The forward walks
the key blocks of its query block, the backward the query blocks of its key block. Here:
the gmem tiles and their coordinates, the smem stages and the accumulator-layout view of
them that the scores read, the predicated gmem -> smem loads, and the gmem -> rmem partition
of the mask scan (masking.scan_mask_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import cutlass
from cutlass import cute

from . import tiles
from .config import tile_row_elems
from .spec import dtype_bytes


def gmem_tiles(op, mX: cute.Tensor, b, hx, limits, m_block, n_block, pack: int = 1):
    """gmem tiles of the slice mX[b, hx] and their (row, col) coordinates, indexed by the walked
    block last: the forward fixes m_block (n_block=None), the backward n_block (m_block=None).

    The slice is re-viewed with the problem's logical extents (Sq or 1, Sk). pack > 1 reads
    `pack` elements as one 32-bit word (the mask scan). A query-broadcast operand has one row:
    its tile index along the queries is 0. Returns (gX, cX, row extent).
    """
    rows = 1 if op.row_broadcast else limits.tile_m
    q_extent = 1 if op.row_broadcast else limits.seqlen_q
    ptr = mX[b, hx, None, None].iterator
    if cutlass.const_expr(pack > 1):
        ptr = cute.recast_ptr(ptr, dtype=cutlass.Int32)
    cols = limits.seqlen_k // pack
    view = cute.make_tensor(
        ptr, cute.make_layout((q_extent, cols), stride=(mX.stride[2] // pack, mX.stride[3]))
    )
    if cutlass.const_expr(op.row_broadcast and m_block is not None):
        m_block = 0
    tile = (rows, limits.tile_n // pack)
    gX = cute.local_tile(view, tile, (m_block, n_block))
    cX = cute.local_tile(cute.make_identity_tensor((q_extent, cols)), tile, (m_block, n_block))
    return gX, cX, q_extent


def smem_stages(buffer, dtype, op, tile_m: int, tile_n: int, stages: int, stride, num_threads):
    """The operand's (rows, tile_n, stages) smem tiles in a planned buffer
    (tiles.allocate_smem), stage s at s * stride elements, rows padded to tile_row_elems; the
    (tile_m, tile_n, stages) view of them in which score row i reads tile row i (row 0 of a
    query-broadcast tile, stride 0); and the tiled gmem -> smem copy of one tile with the
    number of threads it uses. Returns (sX, s_view, copy, used)."""
    rows = 1 if op.row_broadcast else tile_m
    pitch = tile_row_elems(tile_n, dtype.width // 8)
    sX = tiles.smem_tensor(
        buffer, dtype, cute.make_layout((rows, tile_n, stages), stride=(pitch, 1, stride))
    )
    row_stride = 0 if op.row_broadcast else pitch
    s_view = cute.make_tensor(
        sX.iterator, cute.make_layout((tile_m, tile_n, stages), stride=(row_stride, 1, stride))
    )
    copy, used = tiles.operand_copy(dtype, rows, tile_n, op.vec, num_threads)
    return sX, s_view, copy, used


def stage_elems(op, tile_m: int, tile_n: int, dtype) -> int:
    """Elements of one stage of an operand's own smem buffer (not shared with other tiles)."""
    rows = 1 if op.row_broadcast else tile_m
    return rows * tile_row_elems(tile_n, dtype.width // 8)


@dataclass(frozen=True)
class OperandLoads:
    """One thread's gmem -> smem copies of an operand's tiles along the walked dim.

    Every vector is predicated: rows past the row extent and columns past Sk are zero-filled
    (a mask reads False there, a bias 0). Threads >= `used` hold no share of a tile. The
    backward's query blocks all read the one tile of a query-broadcast operand (same_tile).
    """

    copy: cute.TiledCopy
    used: cutlass.Constexpr[int]
    tXgX: cute.Tensor
    tXcX: cute.Tensor
    tXsX: cute.Tensor
    row_end: cutlass.Int32
    seqlen_k: cutlass.Int32
    tidx: cutlass.Int32
    same_tile: cutlass.Constexpr[bool]

    @staticmethod
    def make(op, copy, used: int, gX, cX, sX, row_end, seqlen_k, tidx, walk_queries: bool):
        """The loads of the tiles gX (coordinates cX) into the smem stages sX; walk_queries:
        the walked dim is the queries (the backward)."""
        thr = copy.get_slice(tidx % used)
        return OperandLoads(
            copy, used, thr.partition_S(gX), thr.partition_S(cX), thr.partition_D(sX),
            cutlass.Int32(row_end), seqlen_k, tidx, op.row_broadcast and walk_queries,
        )  # fmt: skip

    @cute.jit
    def load(self, block, stage):
        """The tile of walked block `block` into smem stage `stage`."""
        tile = 0 if cutlass.const_expr(self.same_tile) else block
        if self.tidx < self.used:
            tiles.copy_tile(
                self.copy,
                self.tXgX[None, None, None, tile],
                self.tXsX[None, None, None, stage],
                self.tXcX[None, None, None, tile],
                self.row_end,
                self.seqlen_k,
                True,
                True,
            )


@dataclass(frozen=True)
class WalkLoads:
    """What a kernel loads per walked block, gmem -> smem: its two 16-bit tiles (K and V in
    the forward, Q and dO in the backward; rows checked on the tail block only, head-dim
    columns when D is padded) and the mask and bias tiles (None: no such operand)."""

    copy: cute.TiledCopy
    tAgA: cute.Tensor
    tAsA: cute.Tensor
    tBgB: cute.Tensor
    tBsB: cute.Tensor
    tXcX: cute.Tensor
    row_end: cutlass.Int32
    head_dim: cutlass.Int32
    tile_rows: cutlass.Constexpr[int]
    check_cols: cutlass.Constexpr[bool]
    mask: OperandLoads | None
    bias: OperandLoads | None

    @cute.jit
    def load(self, block, stage, mask_full):
        """The tiles of walked block `block` into smem stage `stage`; an all-True mask tile
        (mask_full != 0) is not loaded."""
        tail = (block + 1) * self.tile_rows > self.row_end
        for tXgX, tXsX in ((self.tAgA, self.tAsA), (self.tBgB, self.tBsB)):
            src = tXgX[None, None, None, block]
            dst = tXsX[None, None, None, stage]
            coord = self.tXcX[None, None, None, block]
            if tail:
                tiles.copy_tile(
                    self.copy, src, dst, coord, self.row_end, self.head_dim, True, self.check_cols
                )
            else:
                tiles.copy_tile(
                    self.copy, src, dst, coord, self.row_end, self.head_dim, False, self.check_cols
                )
        if cutlass.const_expr(self.mask is not None):
            if mask_full == 0:
                self.mask.load(block, stage)
        if cutlass.const_expr(self.bias is not None):
            self.bias.load(block, stage)


def mask_scan(op, mMask, b, hm, limits, m_block, n_block, used, num_threads, tidx):
    """The gmem -> rmem partition masking.scan_mask_blocks reads: each thread's share of every
    mask tile, as 32-bit words of 4 mask bytes when the rows allow 4-byte loads."""
    rows = 1 if op.row_broadcast else limits.tile_m
    pack = 4 if op.vec >= 4 else 1
    gM, cM, row_end = gmem_tiles(op, mMask, b, hm, limits, m_block, n_block, pack)
    scan_dtype = cutlass.Int32 if pack == 4 else cutlass.Uint8
    scan_copy, _ = tiles.operand_copy(
        scan_dtype, rows, limits.tile_n // pack, op.vec // pack, num_threads, to_registers=True
    )
    thr = scan_copy.get_slice(tidx % used)
    tMgM = thr.partition_S(gM)
    share = tMgM[None, None, None, 0]
    # make_rmem_tensor_like keeps stride-0 modes: the vectors of a key-broadcast row that one
    # thread reads along the keys would share their registers.
    if op.strides[3] == "0" and cute.size(share, mode=[2]) > 1:
        frag = cute.make_rmem_tensor(share.shape, scan_dtype)
    else:
        frag = cute.make_rmem_tensor_like(share)
    return SimpleNamespace(
        copy=scan_copy,
        used=used,
        row_end=row_end,
        col_end=limits.seqlen_k // pack,
        tXgX=tMgM,
        tXcX=thr.partition_S(cM),
        frag=frag,
        words=pack == 4,
        same_tile=op.row_broadcast and m_block is None,
    )


@cute.jit
def tiles_landed(pipe_tiles, state, mask, bias, stores: cutlass.Constexpr[bool] = False):
    """A producer thread's arrive on the full barrier of a cp.async mask/bias stage once its
    copies have landed (mask, bias: the kernel's OperandSpecs, None where absent). A copy
    narrower than 4 bytes is a plain load + store, and `stores` says the thread wrote the
    stage with plain stores too: it then waits for its cp.async copies and arrives with
    release semantics, which publishes both."""
    narrow = stores
    for op in (mask, bias):
        if cutlass.const_expr(op is not None):
            narrow = narrow or op.vec * dtype_bytes(op.dtype) < 4
    if cutlass.const_expr(narrow):
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.mbarrier_arrive(pipe_tiles.producer_get_barrier(state))
    else:
        pipe_tiles.producer_commit(state)
