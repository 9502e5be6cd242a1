"""mma.sync GEMMs on smem tiles: operands read into registers by ldmatrix, k-block k + 1 read
while k is multiplied."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
from cutlass import cute


@dataclass(frozen=True)
class GemmOperand:
    """One MMA operand read from an smem tile (of one stage, or staged: stage mode last).

    frag: the register fragment the MMA reads; view: the same registers as the ldmatrix copy
    writes them; smem: the thread's ldmatrix source partition of the tile; copy: the tiled
    ldmatrix copy.
    """

    frag: cute.Tensor
    view: cute.Tensor
    smem: cute.Tensor
    copy: cute.TiledCopy

    @staticmethod
    def make(thr_mma, tiled_mma, src: cute.Tensor, is_a: bool, atom, tidx) -> GemmOperand:
        """Operand A (is_a) or B of tiled_mma, read from src by the ldmatrix atom."""
        one = src[None, None, 0] if cute.rank(src) == 3 else src
        if is_a:
            frag = thr_mma.make_fragment_A(thr_mma.partition_A(one))
            copy = cute.make_tiled_copy_A(atom, tiled_mma)
        else:
            frag = thr_mma.make_fragment_B(thr_mma.partition_B(one))
            copy = cute.make_tiled_copy_B(atom, tiled_mma)
        thr = copy.get_slice(tidx)
        return GemmOperand(frag, thr.retile(frag), thr.partition_S(src), copy)

    def stage(self, stage) -> cute.Tensor:
        """The ldmatrix source of one stage (the whole tile when it has no stages)."""
        return self.smem if stage is None else self.smem[None, None, None, stage]


@cute.jit
def gemm(tiled_mma, acc, a: GemmOperand, b: GemmOperand, a_stage=None, b_stage=None):
    """acc += A B, both operands from smem (stages a_stage / b_stage when staged)."""
    sA, sB = a.stage(a_stage), b.stage(b_stage)
    num_k = cute.size(sA.shape[2])
    cute.copy(a.copy, sA[None, None, 0], a.view[None, None, 0])
    cute.copy(b.copy, sB[None, None, 0], b.view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k + 1 < num_k):
            cute.copy(a.copy, sA[None, None, k + 1], a.view[None, None, k + 1])
            cute.copy(b.copy, sB[None, None, k + 1], b.view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, a.frag[None, None, k], b.frag[None, None, k], acc)


@cute.jit
def gemm_rs(tiled_mma, acc, rA: cute.Tensor, b: GemmOperand, b_stage=None):
    """acc += A B with A already in registers (an accumulator re-read as an A operand)."""
    sB = b.stage(b_stage)
    num_k = cute.size(rA.shape[2])
    cute.copy(b.copy, sB[None, None, 0], b.view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k + 1 < num_k):
            cute.copy(b.copy, sB[None, None, k + 1], b.view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, rA[None, None, k], b.frag[None, None, k], acc)
