"""Small device helpers shared by the kernels: accumulator views and warp reductions."""

from __future__ import annotations

import cutlass
from cutlass import cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an MMA accumulator as (rows, cols) of this thread: mma.sync's ((2, 2), MMA_M,
    MMA_N) or wgmma's ((2, 2, N / 8), MMA_M, MMA_N).

    Mode 0 is (column pair, row half[, n8 atom]): rows are (mode0[1], MMA_M) and columns
    (mode0[0][, mode0[2]], MMA_N).
    """
    shape, stride = acc.layout.shape, acc.layout.stride
    if cutlass.const_expr(cute.rank(shape[0]) == 3):
        cols = ((shape[0][0], shape[0][2], shape[2]), (stride[0][0], stride[0][2], stride[2]))
    else:
        cols = ((shape[0][0], shape[2]), (stride[0][0], stride[2]))
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), cols[0]),
        stride=((stride[0][1], stride[1]), cols[1]),
    )
    return cute.make_tensor(acc.iterator, mn)


def wgmma_column(c: int) -> int:
    """How far column c of a wgmma accumulator's (rows, cols) view (acc_mn_view) lies after
    the thread's first column: two neighbouring columns per 8-column atom."""
    return c % 2 + 8 * (c // 2)


def acc_as_a_operand(acc_layout: cute.Layout) -> cute.Layout:
    """Re-read a 16-bit accumulator layout as the register A operand of a k16 MMA: two
    neighbouring n8 atoms of C make one k16 atom of A.

    mma.sync (m16n8 C): (4, MMA_M, MMA_N) -> ((4, 2), MMA_M, MMA_N / 2);
    wgmma: ((2, 2, N / 8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N / 16, MMA_N)).
    """
    if cutlass.const_expr(cute.rank(acc_layout.shape[0]) == 3):
        div = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
        (pair, half, (k2, n16)), rows, cols = div.shape
        (s_pair, s_half, (s_k2, s_n16)), s_rows, s_cols = div.stride
        return cute.make_layout(
            ((pair, half, k2), rows, (n16, cols)),
            stride=((s_pair, s_half, s_k2), s_rows, (s_n16, s_cols)),
        )
    div = cute.logical_divide(acc_layout, (None, None, 2))
    return cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )


@cute.jit
def quad_allreduce_max(val: cutlass.Float32) -> cutlass.Float32:
    """Max over the 4 threads that share an accumulator row."""
    for offset in cutlass.range_constexpr(2):
        other = cute.arch.shuffle_sync_bfly(val, offset=2 >> offset)
        val = cute.arch.fmax(val, other)
    return val


@cute.jit
def quad_allreduce_sum(val: cutlass.Float32) -> cutlass.Float32:
    """Sum over the 4 threads that share an accumulator row."""
    for offset in cutlass.range_constexpr(2):
        val = val + cute.arch.shuffle_sync_bfly(val, offset=2 >> offset)
    return val


@dsl_user_op
def red_add_f32x2(ptr: cute.Pointer, a: cutlass.Float32, b: cutlass.Float32, *, loc=None, ip=None):
    """Atomically add (a, b) to two adjacent fp32 words in global memory (8-byte aligned), one
    vector reduction with no result (sm_90+)."""
    llvm.inline_asm(
        None,
        [
            ptr.toint(loc=loc, ip=ip).ir_value(),
            cutlass.Float32(a).ir_value(loc=loc, ip=ip),
            cutlass.Float32(b).ir_value(loc=loc, ip=ip),
        ],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def mul_rz(a: cutlass.Float32, b: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """a * b rounded toward zero: a finite product that overflows becomes +-FLT_MAX, not
    +-inf (infinite operands still give infinities)."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [
                cutlass.Float32(a).ir_value(loc=loc, ip=ip),
                cutlass.Float32(b).ir_value(loc=loc, ip=ip),
            ],
            "mul.rz.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def fma(a: cutlass.Float32, b: cutlass.Float32, c: cutlass.Float32, *, loc=None, ip=None):
    """a * b + c with one rounding (fma.rn.f32), whatever the compiler's contraction."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c)],
            "fma.rn.f32 $0, $1, $2, $3;",
            "=f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def pack_f32x2(lo: cutlass.Float32, hi: cutlass.Float32, dtype, *, loc=None, ip=None):
    """(lo, hi) rounded to nearest into one 32-bit word of two 16-bit floats (`dtype`), lo in
    the low half: one cvt instead of two and a pack."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [
                cutlass.Float32(lo).ir_value(loc=loc, ip=ip),
                cutlass.Float32(hi).ir_value(loc=loc, ip=ip),
            ],
            f"cvt.rn.{kind}.f32 $0, $2, $1;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def block_after(value: cutlass.Float32):
    """End the basic block after the computation of `value`: a branch on it (taken only for
    a NaN, into a fence that changes nothing). ptxas moves a wgmma wait up to the top of its
    block; a wait that follows this call stays below `value`."""
    if value != value:  # noqa: PLR0124 (NaN)
        cute.arch.fence_view_async_shared()


@cute.jit
def round_pairs(src: cute.Tensor, dst: cute.Tensor):
    """fp32 `src` rounded into the 16-bit `dst` of the same size, two elements per cvt: the
    packed words are what a register-operand wgmma reads, so none is rebuilt next to it."""
    words = cute.recast_tensor(dst, cutlass.Int32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = pack_f32x2(src[2 * i], src[2 * i + 1], dst.element_type)
