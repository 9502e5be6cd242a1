"""wgmma helpers shared by the Hopper kernels: swizzled smem tiles that TMA writes and wgmma
reads, and one GEMM issued as a wgmma group."""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as hopper
from cutlass import cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None, major: int | None = None):
    """(rows, cols[, stages]) row-major tile in the widest swizzle that `major` (default:
    cols) contiguous elements allow: what TMA writes and wgmma reads, K-major or, through
    tiles.transposed, MN-major. A GEMM whose warpgroups each read only `major` of the columns as
    the contiguous (MN) mode needs a swizzle atom no wider than that."""
    atom = warpgroup.make_smem_layout_atom(
        hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major or cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


@cute.jit
def wgmma(
    tiled_mma,
    acc,
    tCrA,
    tCrB,
    accumulate: cutlass.Constexpr[bool],
    wait: cutlass.Constexpr[int],
    extra=None,
):
    """acc (+)= A B over the k-blocks of the fragments, issued as one wgmma group; waits until
    at most `wait` groups are in flight (-1: no wait). extra: (A, B) fragments of more k-blocks
    added in the same group (the forward's key bias terms)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    if cutlass.const_expr(extra is not None):
        extra_a, extra_b = extra
        for k in cutlass.range_constexpr(cute.size(extra_a.shape[2])):
            cute.gemm(atom, acc, extra_a[None, None, k], extra_b[None, None, k], acc)
    warpgroup.commit_group()
    if cutlass.const_expr(wait >= 0):
        warpgroup.wait_group(wait)
