"""Which key blocks a query block visits, per-element limits, and the CTA-wide tile vote.

Causal is the window (left=inf, right=0), bottom-right aligned: query row i sees key j when
i + Sk - Sq - left <= j <= i + Sk - Sq + right. The host passes unbounded sides as a large
finite value so the arithmetic here needs no special case.
"""

from __future__ import annotations

import cutlass
from cutlass import cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .utils import acc_mn_view


@dsl_user_op
def cta_any(pred: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    """1 in every thread if `pred` is non-zero in any thread of the CTA, else 0.

    One `bar.red.or.pred`: the barrier and the reduction in a single instruction. It is also a
    full CTA barrier (barrier 0, all threads), which callers rely on.
    """
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [cutlass.Int32(pred).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 q, $1, 0;\n\t"
            "bar.red.or.pred p, 0, q;\n\tselp.u32 $0, 1, 0, p;\n\t}",
            "=r,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def key_block_range(
    m_block: cutlass.Int32,
    seqlen_q: cutlass.Int32,
    seqlen_k: cutlass.Int32,
    window_left: cutlass.Int32,
    window_right: cutlass.Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    has_window: cutlass.Constexpr,
):
    """[n_block_min, n_block_max) of the key blocks query block `m_block` can see."""
    n_block_min = cutlass.Int32(0)
    n_block_max = cute.ceil_div(seqlen_k, tile_n)
    if cutlass.const_expr(has_window):
        diag = seqlen_k - seqlen_q
        row_first = m_block * tile_m
        row_last = cutlass.min(row_first + tile_m, seqlen_q) - 1
        col_hi = cutlass.max(row_last + diag + window_right + 1, 0)
        n_block_max = cutlass.min(n_block_max, cute.ceil_div(col_hi, tile_n))
        n_block_min = cutlass.max(row_first + diag - window_left, 0) // tile_n
    return n_block_min, n_block_max


@cute.jit
def block_needs_limits(
    n_block: cutlass.Int32,
    m_block: cutlass.Int32,
    seqlen_q: cutlass.Int32,
    seqlen_k: cutlass.Int32,
    window_left: cutlass.Int32,
    window_right: cutlass.Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    has_window: cutlass.Constexpr,
) -> cutlass.Boolean:
    """Whether some element of block (m_block, n_block) lies past Sk or outside the window."""
    needs = (n_block + 1) * tile_n > seqlen_k
    if cutlass.const_expr(has_window):
        diag = seqlen_k - seqlen_q
        row_first = m_block * tile_m
        row_last = row_first + tile_m - 1
        needs = needs | ((n_block + 1) * tile_n - 1 > row_first + diag + window_right)
        needs = needs | (n_block * tile_n < row_last + diag - window_left)
    return needs


@cute.jit
def apply_limits(
    acc_s: cute.Tensor,
    t_coord: cute.Tensor,
    seqlen_q: cutlass.Int32,
    seqlen_k: cutlass.Int32,
    window_left: cutlass.Int32,
    window_right: cutlass.Int32,
    has_window: cutlass.Constexpr,
):
    """Set scores past Sk or outside the window to -inf (t_coord: (row, col) of acc_s)."""
    acc_mn = acc_mn_view(acc_s)
    coord_mn = acc_mn_view(t_coord)
    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
        col_end = seqlen_k
        col_begin = cutlass.Int32(0)
        if cutlass.const_expr(has_window):
            row = coord_mn[r, 0][0]
            diag_col = row + seqlen_k - seqlen_q
            col_end = cutlass.min(col_end, diag_col + window_right + 1)
            col_begin = diag_col - window_left
        for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
            col = coord_mn[0, c][1]
            if col >= col_end or col < col_begin:
                acc_mn[r, c] = -cutlass.Float32.inf


@cute.jit
def apply_mask(acc_s: cute.Tensor, t_mask: cute.Tensor):
    """Scores where the boolean mask tile (smem, accumulator layout) is False become -inf."""
    keep = t_mask.load() != 0
    acc_s.store(cute.where(keep, acc_s.load(), -cutlass.Float32.inf))


@cute.jit
def tile_has_visible(
    s_words: cute.Tensor, tidx: cutlass.Int32, num_threads: cutlass.Constexpr
) -> cutlass.Int32:
    """CTA-uniform: 1 if any byte of a mask tile is non-zero.

    s_words: (rows, words per row) Int32 view of the tile's valid columns; every thread ORs a
    strided share of the words, then one barrier-reduction combines the CTA.
    """
    rows, cols = cute.size(s_words.shape[0]), cute.size(s_words.shape[1])
    total = rows * cols
    acc = cutlass.Int32(0)
    for i in cutlass.range_constexpr(cute.ceil_div(total, num_threads)):
        w = tidx + i * num_threads
        if cutlass.const_expr(total % num_threads == 0):
            acc = acc | s_words[w // cols, w % cols]
        else:
            if w < total:
                acc = acc | s_words[w // cols, w % cols]
    return cta_any(acc)
