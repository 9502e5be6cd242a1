"""Online softmax over the key blocks of one query tile, in exp2 with the scale folded in."""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
from cutlass import cute

from .utils import (
    acc_mn_view,
    block_after,
    mul_rz,
    quad_allreduce_max,
    quad_allreduce_sum,
    wgmma_column,
)

LN2 = math.log(2.0)


# |row max * scale_log2| under which a huge-scores row takes the bounded scores' FMA: its
# shift then rounds by at most 2^-13, as a bounded row's does. (H100, S4096 D128 bf16, full
# bias + dense mask: forward 0.832 -> 0.798 ms against subtracting in every row.)
_MODERATE = 2048.0


@cute.jit
def is_moderate(max_log2: cutlass.Float32) -> cutlass.Boolean:
    """Whether a row max in log2 units is under _MODERATE in magnitude."""
    return (max_log2 < _MODERATE) & (max_log2 > -_MODERATE)


@dataclass(frozen=True)
class OnlineSoftmax:
    """Running row max and row sum of this thread's accumulator rows.

    Scores stay in accumulator units; `scale_log2` maps them to log2 units. Without a bias the
    scores are bounded by |q| |k|, and each probability is exp2(FMA(s, scale_log2, -shift)).
    With a bias (`huge_scores`) a row may sit near the float32 range (a finfo.min padding
    bias), where max * scale_log2 rounds by more than 1: the max is subtracted before scaling,
    so equal scores give exactly exp2(0); a warp whose rows all have a moderate max (the usual
    case) takes the bounded scores' FMA instead. A row that has seen no visible key keeps
    max = -inf; its shift is taken as 0 so exp2(-inf) = 0 and nothing becomes NaN.
    """

    scale_log2: cutlass.Float32
    huge_scores: cutlass.Constexpr[bool]
    row_max: cute.Tensor
    row_sum: cute.Tensor
    # Scores arrive in log2 units (Scores.log2_units): exp2(s - max), nothing to scale, and
    # row_max in those units; store_stats converts it to accumulator units for the backward.
    log2_units: cutlass.Constexpr[bool] = False

    @staticmethod
    def create(
        num_rows: int, scale_log2: cutlass.Float32, huge_scores: bool, log2_units: bool = False
    ) -> OnlineSoftmax:
        """The state of `num_rows` rows before any key block: max -inf, sum 0."""
        row_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(scale_log2, huge_scores, row_max, row_sum, log2_units)

    @cute.jit
    def update(self, acc_s: cute.Tensor, acc_o: cute.Tensor):
        """Turn scores of one key block into probabilities; rescale the output accumulator."""
        self.rescale_output(acc_o, self.probabilities(acc_s))

    @cute.jit
    def probabilities(self, acc_s: cute.Tensor, after_max=None) -> cute.Tensor:
        """Turn scores of one key block into probabilities in place; returns each row's
        correction of the output accumulator (rescale_output), which a kernel may apply once
        the GEMM still adding into it has finished. after_max (bounded scores only): called
        once every row's max is known, before the exponentials, in a basic block of its own
        (utils.block_after), so that a wgmma wait in it stays there."""
        s_mn = acc_mn_view(acc_s)
        correction = cute.make_rmem_tensor(cute.size(self.row_max), cutlass.Float32)
        if cutlass.const_expr(after_max is not None and self.log2_units):
            raise ValueError("probabilities: after_max needs scores in accumulator units")
        if cutlass.const_expr(self.huge_scores and not self.log2_units):
            # Each row's max, then one form for the whole warp (no divergence): the FMA of
            # bounded scores where every row's max * scale_log2 is moderate, the exact
            # subtraction otherwise.
            new_maxes = cute.make_rmem_tensor(cute.size(self.row_max), cutlass.Float32)
            moderate = cutlass.Boolean(True)
            for r in cutlass.range_constexpr(cute.size(self.row_max)):
                block_max = quad_allreduce_max(
                    s_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
                )
                new_maxes[r] = cute.arch.fmax(self.row_max[r], block_max)
                base = 0.0 if new_maxes[r] == -cutlass.Float32.inf else new_maxes[r]
                moderate = moderate & is_moderate(base * self.scale_log2)
            if cutlass.const_expr(after_max is not None):
                block_after(new_maxes.load().reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0))
                after_max()
            if cute.arch.vote_all_sync(moderate):
                for r in cutlass.range_constexpr(cute.size(self.row_max)):
                    self.accept_row(s_mn, r, s_mn[r, None].load(), new_maxes[r], correction, "fma")
            else:
                for r in cutlass.range_constexpr(cute.size(self.row_max)):
                    self.accept_row(
                        s_mn, r, s_mn[r, None].load(), new_maxes[r], correction, "exact"
                    )
            return correction
        form = "log2" if cutlass.const_expr(self.log2_units) else "fma"
        if cutlass.const_expr(after_max is None):
            for r in cutlass.range_constexpr(cute.size(self.row_max)):
                row = s_mn[r, None].load()
                block_max = quad_allreduce_max(
                    row.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
                )
                new_max = cute.arch.fmax(self.row_max[r], block_max)
                self.accept_row(s_mn, r, row, new_max, correction, form)
            return correction
        new_maxes = cute.make_rmem_tensor(cute.size(self.row_max), cutlass.Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            block_max = quad_allreduce_max(
                s_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            )
            new_maxes[r] = cute.arch.fmax(self.row_max[r], block_max)
        block_after(new_maxes.load().reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0))
        after_max()
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            self.accept_row(s_mn, r, s_mn[r, None].load(), new_maxes[r], correction, form)
        return correction

    @cute.jit
    def accept_row(self, s_mn, r, row, new_max, correction, form: cutlass.Constexpr[str]):
        """Row r's scores `row` made probabilities against its new max, in `form`: "log2"
        (scores in log2 units), "fma" (one FMA per score) or "exact" (the max subtracted
        before scaling); its correction, sum and max updated."""
        prev_max = self.row_max[r]
        base = 0.0 if new_max == -cutlass.Float32.inf else new_max
        if cutlass.const_expr(form == "log2"):
            probs = cute.math.exp2(row - base, fastmath=True)
            correction[r] = cute.math.exp2(prev_max - base, fastmath=True)
        elif cutlass.const_expr(form == "fma"):
            shift = base * self.scale_log2
            probs = cute.math.exp2(row * self.scale_log2 - shift, fastmath=True)
            correction[r] = cute.math.exp2(prev_max * self.scale_log2 - shift, fastmath=True)
        else:
            probs = cute.math.exp2((row - base) * self.scale_log2, fastmath=True)
            correction[r] = cute.math.exp2((prev_max - base) * self.scale_log2, fastmath=True)
        self.row_sum[r] = self.row_sum[r] * correction[r] + probs.reduce(
            cute.ReductionOp.ADD, cutlass.Float32.zero, 0
        )
        self.row_max[r] = new_max
        s_mn[r, None] = probs

    @cute.jit
    def rescale_output(self, acc_o: cute.Tensor, correction: cute.Tensor):
        """Scale each output row by its correction (probabilities)."""
        o_mn = acc_mn_view(acc_o)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            o_mn[r, None] = o_mn[r, None].load() * correction[r]

    @cute.jit
    def finalize(self, acc_o: cute.Tensor, lse: cute.Tensor, row_log2sum: cute.Tensor):
        """Normalize the output rows; per row, the natural-log LSE into `lse` and log2 of the
        row sum into `row_log2sum` (with `row_max`, what the backward needs to rebuild P
        exactly even where LSE has lost the sum to rounding).

        Rows with no visible key have sum 0: output 0, LSE -inf, row_log2sum +inf (so the
        backward's exp2(s - max - log2sum) is 0). A NaN sum propagates.
        """
        o_mn = acc_mn_view(acc_o)
        scale = LN2 if cutlass.const_expr(self.log2_units) else self.scale_log2 * LN2
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            total = quad_allreduce_sum(self.row_sum[r])
            empty = total == 0.0
            inv = 0.0 if empty else cute.arch.rcp_approx(total)
            o_mn[r, None] = o_mn[r, None].load() * inv
            log2sum = cute.math.log2(total, fastmath=True)
            # max * scale first: it stays finite for a clamped finfo.min bias (scale <= 1).
            row_lse = self.row_max[r] * scale + log2sum * LN2
            lse[r] = -cutlass.Float32.inf if empty else row_lse
            row_log2sum[r] = cutlass.Float32.inf if empty else log2sum

    @cute.jit
    def store_stats(self, lse, row_log2sum, coord_mn, mLSE, mStats, b, h, seqlen_q, tidx, folded):
        """lse and the backward's stats of this thread's rows (finalize's outputs) into
        gmem, by the first of the 4 threads sharing a row; rows past seqlen_q are not
        stored. coord_mn: the (row, col) of each score in the acc_mn_view layout.

        folded (compile-time, no bias): scores are bounded, so max and sum fold into one
        shift (stats[0] = 0, stats[1] = max * scale_log2 + log2 sum; +inf for an empty row)
        and the backward loads one value per row. Otherwise stats[0] is the row max in
        accumulator units (0 for an empty row) and stats[1] the log2 row sum; a max in log2
        units is divided by scale_log2, rounded toward zero (a -FLT_MAX row stays finite, as
        the backward's bias / scale does).
        """
        to_accumulator = 1.0 / self.scale_log2
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = coord_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE[b, h, row] = lse[r]
                    row_max = self.row_max[r]
                    if cutlass.const_expr(folded):
                        mStats[b, h, 0, row] = 0.0
                        mStats[b, h, 1, row] = (
                            row_log2sum[r]
                            if row_max == -cutlass.Float32.inf
                            else row_max * self.scale_log2 + row_log2sum[r]
                        )
                    else:
                        if cutlass.const_expr(self.log2_units):
                            row_max = mul_rz(row_max, to_accumulator)
                        mStats[b, h, 0, row] = 0.0 if row_max == -cutlass.Float32.inf else row_max
                        mStats[b, h, 1, row] = row_log2sum[r]


@cute.jit
def load_row_stats(mStats, mDpsum, coord, b, h, seqlen_q, has_bias: cutlass.Constexpr[bool]):
    """(row max, log2 row sum, dpsum) of a thread's score rows in the backward, from what
    store_stats wrote (coord: the (row, col) of each score, in the accumulator layout): the
    row max in accumulator units, read only with a bias (without one the forward folded it
    into the sum and stored 0), and +inf log2 sum for rows past Sq and fully masked rows, so
    P = 0 there."""
    coord_mn = acc_mn_view(coord)
    rows = cute.size(coord_mn.shape[0])
    row_max = cute.make_rmem_tensor(rows, cutlass.Float32)
    log2sum = cute.make_rmem_tensor(rows, cutlass.Float32)
    dpsum = cute.make_rmem_tensor(rows, cutlass.Float32)
    for r in cutlass.range_constexpr(rows):
        row = coord_mn[r, 0][0]
        row_max[r] = 0.0
        log2sum[r] = cutlass.Float32.inf
        dpsum[r] = 0.0
        if row < seqlen_q:
            if cutlass.const_expr(has_bias):
                row_max[r] = mStats[b, h, 0, row]
            log2sum[r] = mStats[b, h, 1, row]
            dpsum[r] = mDpsum[b, h, row]
    return row_max, log2sum, dpsum


@cute.jit
def fold_max(log2sum: cute.Tensor, row_max: cute.Tensor, scale_log2: cutlass.Float32):
    """The backward's stats of biased rows folded into one shift each: log2sum <- row_max *
    scale_log2 + log2sum, so P = exp2(s * scale_log2 - shift) takes one FMA per score.
    Returns whether every row of the warp has a moderate max (warp-uniform), where that shift
    rounds as the bounded scores' does (OnlineSoftmax.probabilities); where not, the caller
    reads both stats again and subtracts the max first."""
    moderate = cutlass.Boolean(True)
    for i in cutlass.range_constexpr(cute.size(log2sum)):
        max_log2 = row_max[i] * scale_log2
        moderate = moderate & is_moderate(max_log2)
        log2sum[i] = max_log2 + log2sum[i]
    return cute.arch.vote_all_sync(moderate)


@cute.jit
def exp2_columns(acc_mn, scale_log2: cutlass.Float32, shift: cute.Tensor, col_max=None):
    """P = exp2(s * scale_log2 - shift) in place over the transposed score tile acc_mn (one
    stat per query column), or with col_max exp2((s - max) * scale_log2 - shift)."""
    for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
            if cutlass.const_expr(col_max is None):
                exponent = acc_mn[r, c] * scale_log2 - shift[c]
            else:
                exponent = (acc_mn[r, c] - col_max[c]) * scale_log2 - shift[c]
            acc_mn[r, c] = cute.math.exp2(exponent, fastmath=True)


@cute.jit
def load_column_stat(stat_row, first, acc):
    """One statistic per query column of the transposed score tile `acc` (S^T in a wgmma
    accumulator: rows are keys) from stat_row, the (query in block) row of a stage in smem.
    `first` is the thread's first column (the others: utils.wgmma_column)."""
    cols = cute.size(acc_mn_view(acc).shape[1])
    stat = cute.make_rmem_tensor(cols, cutlass.Float32)
    for c in cutlass.range_constexpr(cols):
        stat[c] = stat_row[first + wgmma_column(c)]
    return stat
