"""Shared-memory layouts and predicated gmem -> smem tile copies (Q/K/V, mask, bias).

Every vector of a tile is either copied or zero-filled, so a tile never holds stale data:
rows past the sequence end and head-dim columns past D read as 0 (a zero V row times a zero
probability cannot make NaN), and mask bytes past the end read as False.
"""

from __future__ import annotations

import cutlass
from cutlass import cute
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator


def allocate_smem(buffers) -> dict:
    """A kernel's shared memory, allocated once from its plan (config.*_smem_buffers: name,
    bytes, alignment, in order): name -> (byte pointer, bytes)."""
    smem = SmemAllocator()
    return {
        b.name: (smem.allocate_array(cutlass.Uint8, b.bytes, byte_alignment=b.align), b.bytes)
        for b in buffers
    }


def smem_tensor(buffer, dtype, layout) -> cute.Tensor:
    """`layout` of `dtype` elements over a planned buffer (allocate_smem), which must hold it."""
    ptr, nbytes = buffer
    needed = cute.cosize(layout) * dtype.width // 8
    assert needed <= nbytes, f"smem layout needs {needed} bytes, its buffer has {nbytes}"
    return cute.make_tensor(cute.recast_ptr(ptr, dtype=dtype), layout)


def swizzled_smem_tensor(buffer, dtype, layout: cute.ComposedLayout) -> cute.Tensor:
    """A swizzled `layout` over a planned buffer with the swizzle moved into the pointer, as
    wgmma and TMA partitions need it (the buffer must hold the layout)."""
    ptr, nbytes = buffer
    needed = cute.cosize(layout) * dtype.width // 8
    assert needed <= nbytes, f"smem layout needs {needed} bytes, its buffer has {nbytes}"
    return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=dtype), layout.outer)


def qkv_smem_atom(head_dim_padded: int) -> cute.ComposedLayout:
    """Swizzled 8-row atom for 16-bit Q/K/V tiles: ldmatrix reads are bank-conflict free."""
    width = 64 if head_dim_padded % 64 == 0 else 32
    bits = 3 if width == 64 else 2
    return cute.make_composed_layout(
        cute.make_swizzle(bits, 3, 3), 0, cute.make_layout((8, width), stride=(width, 1))
    )


def qkv_copy(dtype, head_dim_padded: int, num_threads: int, store: bool = False):
    """16-byte vectors along the head dim, threads laid out over the swizzle atom: cp.async
    gmem -> smem loads, or (store=True) plain copies for the output's smem -> gmem path."""
    vec = 128 // dtype.width
    per_row = cute.size(qkv_smem_atom(head_dim_padded).outer.shape[1]) // vec
    if store:
        op = cute.nvgpu.CopyUniversalOp()
    else:
        op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=128)
    threads = cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, vec)))


def copy_threads(rows: int, per_row: int, num_threads: int) -> tuple[int, int]:
    """(thread rows, threads per row) that copy a tile of `rows` rows of `per_row` vectors,
    each thread an equal whole share: as many threads along a row as divide it (at most
    num_threads; the whole row when it fits, for coalesced rows), then as many rows as divide
    the tile. For power-of-two sizes this is (min(rows, num_threads // per_row), per_row)."""
    cols = max(d for d in range(1, min(per_row, num_threads) + 1) if per_row % d == 0)
    return max(d for d in range(1, min(rows, num_threads // cols) + 1) if rows % d == 0), cols


def operand_copy(
    dtype, rows: int, tile_n: int, vec: int, num_threads: int, to_registers: bool = False
):
    """Copy of a (rows, tile_n) mask or bias tile in `vec`-element vectors, by the threads of
    copy_threads.

    cp.async moves 4, 8 or 16 bytes to shared memory; narrower vectors (rows whose stride or
    length allows no wider aligned access) and copies into registers use plain loads.
    Returns (tiled copy, threads used).
    """
    bits = vec * dtype.width
    if bits >= 32 and not to_registers:
        op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS)
    else:
        op = cute.nvgpu.CopyUniversalOp()
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=bits)
    thread_rows, per_row = copy_threads(rows, tile_n // vec, num_threads)
    threads = cute.make_layout((thread_rows, per_row), stride=(per_row, 1))
    copy = cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, vec)))
    return copy, thread_rows * per_row


# A thread's share of this many vectors or more is walked by a loop the compiler unrolls, not
# traced once per vector: element-wide mask/bias rows give a thread 64 vectors, traced one by
# one they doubled the kernel's compile time (and the DSL warns about such static loops).
COMPILER_UNROLLED_VECTORS = 64


@cute.jit
def copy_tile(
    tiled_copy: cute.TiledCopy,
    src: cute.Tensor,
    dst: cute.Tensor,
    coord: cute.Tensor,
    row_end: cutlass.Int32,
    col_end: cutlass.Int32,
    check_rows: cutlass.Constexpr,
    check_cols: cutlass.Constexpr,
):
    """gmem -> smem copy of one thread's (V, R, C) share of a tile, zero-filling vectors whose
    first element lies at or past (row_end, col_end) when that bound is checked."""
    rows, cols = cute.size(dst.shape[1]), cute.size(dst.shape[2])
    if cutlass.const_expr(not check_rows and not check_cols):
        cute.copy(tiled_copy, src, dst)
    elif cutlass.const_expr(rows * cols < COMPILER_UNROLLED_VECTORS):
        for m in cutlass.range_constexpr(rows):
            for k in cutlass.range_constexpr(cols):
                _copy_vector(
                    tiled_copy, src, dst, coord, m, k, row_end, col_end, check_rows, check_cols
                )
    else:
        for m in cutlass.range(rows, unroll_full=True):
            for k in cutlass.range(cols, unroll_full=True):
                _copy_vector(
                    tiled_copy, src, dst, coord, m, k, row_end, col_end, check_rows, check_cols
                )


@cute.jit
def _copy_vector(
    tiled_copy: cute.TiledCopy,
    src: cute.Tensor,
    dst: cute.Tensor,
    coord: cute.Tensor,
    m,
    k,
    row_end: cutlass.Int32,
    col_end: cutlass.Int32,
    check_rows: cutlass.Constexpr,
    check_cols: cutlass.Constexpr,
):
    """Vector (m, k) of copy_tile: copied if its first element is inside the checked bounds,
    else zero-filled."""
    row, col = coord[0, m, k]
    inside = cutlass.Boolean(True)
    if cutlass.const_expr(check_rows):
        inside = inside & (row < row_end)
    if cutlass.const_expr(check_cols):
        inside = inside & (col < col_end)
    if inside:
        cute.copy(tiled_copy, src[None, m, k], dst[None, m, k])
    else:
        dst[None, m, k].fill(0)


@cute.jit
def acc_to_smem(acc: cute.Tensor, dtype, r2s_atom, tiled_mma, tidx, sX: cute.Tensor):
    """An fp32 MMA accumulator rounded to `dtype` and stored into the smem tile sX
    (rmem -> smem, each thread its accumulator elements)."""
    rX = cute.make_rmem_tensor_like(acc, dtype)
    rX.store(acc.load().to(dtype))
    thr = cute.make_tiled_copy_C(r2s_atom, tiled_mma).get_slice(tidx)
    cute.copy(thr, thr.retile(rX), thr.partition_D(sX))


@cute.jit
def store_tile(copy_out, thr_out, sX, gX, cX, row_end, col_end):
    """One thread's share of an output tile: smem -> rmem in 16-byte rows -> gmem, vectors
    whose first element lies at or past (row_end, col_end) not stored (cX: coordinates)."""
    tOgO = thr_out.partition_D(gX)
    tOcO = thr_out.partition_D(cX)
    tOrO = cute.make_rmem_tensor_like(tOgO)
    cute.copy(copy_out, thr_out.partition_S(sX), tOrO)
    for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
        for k in cutlass.range_constexpr(cute.size(tOrO.shape[2])):
            row, col = tOcO[0, m, k]
            if row < row_end and col < col_end:
                cute.copy(copy_out, tOrO[None, m, k], tOgO[None, m, k])


def staged_swizzled_layout(rows: int, cols: int, stages: int, stage_stride: int):
    """(rows, cols, stages) 16-bit tiles in the swizzled 8-row atoms of qkv_smem_atom, stage s
    at s * stage_stride elements (a multiple of the swizzle period, so every stage swizzles
    alike). Used for P and dS, whose stages share their buffers with the mask and bias tiles."""
    width = 64 if cols % 64 == 0 else 32
    bits = 3 if width == 64 else 2
    inner = cute.make_layout(
        ((8, rows // 8), (width, cols // width), stages),
        stride=((width, 8 * width), (1, rows * width), stage_stride),
    )
    return cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0, inner)


def transposed(t: cute.Tensor, rows: int, cols: int, stages: int = 0) -> cute.Tensor:
    """The (cols, rows[, stages]) view of a (rows, cols[, stages]) smem tile: an MMA operand
    read along the other dim (ldmatrix.trans)."""
    if stages:
        layout = cute.make_layout((cols, rows, stages), stride=(rows, 1, rows * cols))
    else:
        layout = cute.make_layout((cols, rows), stride=(rows, 1))
    return cute.composition(t, layout)
