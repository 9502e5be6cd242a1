"""Backward preprocess: dpsum[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d], in fp32.

The backward's dS = P * (dP - dpsum) needs this per-row dot product of the output and its
gradient; computing it once per row here keeps it out of the backward's inner loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, const_expr, cute
from cutlass.base_dsl import JitCompiledFunction

from ..jit.arch import compile_options
from .config import padded_head_dim
from .spec import DTYPES, env_stream, fake_tensor

_COPY_BITS = 128  # one vectorized global load per thread and copy
# O and dO rows are read in vectors of this many bytes: the launch checks their alignment.
VECTOR_BYTES = _COPY_BITS // 8
_MAX_HEAD_DIM = 256
_DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class BwdPreprocessSpec:
    """One compiled variant of the backward preprocess kernel (the compile-cache key).

    dtype: "bf16" or "fp16" (O and dO).
    head_dim_padded: the head dim the kernel is built for (config.padded_head_dim); a CTA
        tile is (tile_m, head_dim_padded).
    head_dim_tail: the real head dim is smaller than head_dim_padded, so columns are predicated.
    tile_m: query rows per CTA.  num_threads: threads per CTA.
    """

    dtype: str
    head_dim_padded: int
    head_dim_tail: bool = False
    tile_m: int = 64
    num_threads: int = 128

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.head_dim_padded % 32 != 0 or not 32 <= self.head_dim_padded <= _MAX_HEAD_DIM:
            raise ValueError(
                "head_dim_padded: expected a multiple of 32 in [32, "
                f"{_MAX_HEAD_DIM}], got {self.head_dim_padded}"
            )
        if self.num_threads % 32 != 0 or self.tile_m % self.rows_per_pass != 0:
            raise ValueError(
                f"tile_m={self.tile_m}, num_threads={self.num_threads}: expected whole warps "
                f"covering tile_m in passes of {self.rows_per_pass} rows"
            )

    @staticmethod
    def build(dtype: str, head_dim: int) -> BwdPreprocessSpec:
        """The variant for O/dO of the dtype named `dtype` with `head_dim` (at most 256)."""
        dp = padded_head_dim(head_dim)
        return BwdPreprocessSpec(dtype, dp, head_dim_tail=dp != head_dim)

    @property
    def cutlass_dtype(self) -> type[cutlass.Numeric]:
        return DTYPES[self.dtype]

    @property
    def vec(self) -> int:
        """Elements per 128-bit load."""
        return _COPY_BITS // self.cutlass_dtype.width

    @property
    def threads_per_row(self) -> int:
        """Threads sharing one row; a power of two <= 32, so the row sum stays in a warp."""
        cols_per_pass = 64 if self.head_dim_padded % 64 == 0 else 32
        return cols_per_pass // self.vec

    @property
    def rows_per_pass(self) -> int:
        return self.num_threads // self.threads_per_row

    def example_args(self) -> list:
        """The kernel's arguments for an offline compile: O, dO (rows aligned to VECTOR_BYTES,
        D contiguous), dpsum and the stream. Every shape and stride but the unit stride of D
        is dynamic, so one compile serves all B/Sq/H/D up to head_dim_padded."""
        out, dout = (fake_tensor(self.dtype, ("d", "d", "d", "1"), VECTOR_BYTES) for _ in range(2))
        dpsum = fake_tensor("fp32", ("d", "d", "1"), 4)
        return [out, dout, dpsum, env_stream()]

    def compile(self, arch: str, options: str = "") -> JitCompiledFunction:
        """cute.compile of this variant for `arch` (no GPU needed)."""
        return cute.compile(
            BwdPreprocessKernel(self), *self.example_args(), options=compile_options(arch, options)
        )


class BwdPreprocessKernel:
    """One CTA per (tile_m query rows, head, batch): gmem -> rmem loads of O and dO, an fp32
    dot product per row, rmem -> gmem store of dpsum."""

    def __init__(self, spec: BwdPreprocessSpec) -> None:
        self.spec = spec

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (B, Sq, H, D)
        mdO: cute.Tensor,  # (B, Sq, H, D)
        mDpsum: cute.Tensor,  # (B, H, Sq) float32
        stream: cuda.CUstream,
    ):
        spec = self.spec
        # (B, Sq, H, D) -> (Sq, D, H, B) and (B, H, Sq) -> (Sq, H, B): a CTA indexes (h, b) and
        # tiles the leading (Sq, D) / (Sq,) modes.
        mO, mdO = [
            cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 3, 2, 0]))
            for mX in (_vector_aligned(mO, spec.vec), _vector_aligned(mdO, spec.vec))
        ]
        mDpsum = cute.make_tensor(mDpsum.iterator, cute.select(mDpsum.layout, mode=[2, 1, 0]))

        # Each thread loads `vec` contiguous elements of D; threads_per_row threads span one
        # pass of a row, rows_per_pass rows per pass of the CTA.
        copy_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), spec.cutlass_dtype, num_bits_per_copy=_COPY_BITS
        )
        thr_layout = cute.make_ordered_layout(
            (spec.rows_per_pass, spec.threads_per_row), order=(1, 0)
        )
        val_layout = cute.make_layout((1, spec.vec))
        tiled_copy = cute.make_tiled_copy_tv(copy_atom, thr_layout, val_layout)

        grid = (cute.ceil_div(mO.shape[0], spec.tile_m), mO.shape[2], mO.shape[3])
        self.kernel(mO, mdO, mDpsum, tiled_copy).launch(
            grid=grid, block=[spec.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,  # (Sq, D, H, B)
        mdO: cute.Tensor,  # (Sq, D, H, B)
        mDpsum: cute.Tensor,  # (Sq, H, B)
        tiled_copy: cute.TiledCopy,
    ):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()

        tile = (spec.tile_m, spec.head_dim_padded)
        gO = cute.local_tile(mO[None, None, head, batch], tile, (m_block, 0))
        gdO = cute.local_tile(mdO[None, None, head, batch], tile, (m_block, 0))
        gDpsum = cute.local_tile(mDpsum[None, head, batch], (spec.tile_m,), (m_block,))
        rows_left = mO.shape[0] - m_block * spec.tile_m
        head_dim = mO.shape[1]

        thr_copy = tiled_copy.get_slice(tidx)
        # (CPY_ATOM, CPY_M, CPY_K) views of this thread's share of the tile
        tOgO = thr_copy.partition_S(gO)
        tOgdO = thr_copy.partition_S(gdO)
        # (row, col) of each element within the tile, for the tail predicates
        tOcO = thr_copy.partition_S(cute.make_identity_tensor(tile))

        # Elements past Sq or D are never loaded; zeros there add nothing to the row sums.
        tOrO = cute.make_rmem_tensor_like(tOgO)
        tOrdO = cute.make_rmem_tensor_like(tOgdO)
        tOrO.fill(0.0)
        tOrdO.fill(0.0)

        # Column predicate, one per 128-bit vector: a vector lies wholly inside or outside D
        # because D is a multiple of the vector width.
        tOpK = None
        if const_expr(spec.head_dim_tail):
            num_k = cute.size(tOgO, mode=[2])
            tOpK = cute.make_rmem_tensor((1, num_k), cutlass.Boolean)
            for k in cutlass.range_constexpr(num_k):
                tOpK[0, k] = tOcO[0, 0, k][1] < head_dim

        # gmem -> rmem: O and dO, row by row of this thread's share, skipping rows past Sq
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if tOcO[0, m, 0][0] < rows_left:
                cute.copy(tiled_copy, tOgO[None, m, None], tOrO[None, m, None], pred=tOpK)
                cute.copy(tiled_copy, tOgdO[None, m, None], tOrdO[None, m, None], pred=tOpK)

        # rmem: per-thread partial dot products of each of its rows, in fp32
        partial = (tOrO.load().to(Float32) * tOrdO.load().to(Float32)).reduce(
            cute.ReductionOp.ADD, init_val=0.0, reduction_profile=(0, None, 1)
        )
        rPartial = cute.make_rmem_tensor(cute.size(tOgO, mode=[1]), Float32)
        rPartial.store(partial)

        # rmem -> gmem: the threads of a row are adjacent lanes of one warp; all lanes take part
        # in the shuffles, then the row's first thread stores it if the row exists.
        for m in cutlass.range_constexpr(cute.size(rPartial)):
            row_sum = cute.arch.warp_reduction_sum(
                rPartial[m], threads_in_group=spec.threads_per_row
            )
            row = tOcO[0, m, 0][0]
            if tOcO[0, m, 0][1] == 0 and row < rows_left:
                gDpsum[row] = row_sum


@cute.jit
def _vector_aligned(mX: cute.Tensor, vec: cutlass.Constexpr[int]) -> cute.Tensor:
    """mX with its dynamic strides declared multiples of ``vec`` elements (checked on the host),
    which proves every 128-bit load of a row 16-byte aligned."""
    strides = [s if isinstance(s, int) else cute.assume(s, divby=vec) for s in mX.stride]
    return cute.make_tensor(mX.iterator, cute.make_layout(mX.shape, stride=tuple(strides)))
