"""Scores of one block: the bias-first accumulator, softcap, the bias, the mask tile.

The score accumulator of the bias-first kernels holds S / softmax_scale, so a bias enters as
bias * (1 / scale). A finite bias near the float32 range (e.g. torch.finfo(dtype).min, the
usual padding value) would overflow to -inf there and turn a padded row into a fully masked
one: the product is rounded toward zero, which keeps finite values finite (+-FLT_MAX) and
infinities infinite (a -inf bias masks its position, SPEC.md). Adding Q K^T to +-FLT_MAX
leaves it unchanged, as the float32 reference absorbs Q K^T into a bias of that size: the keys
of a row that carry only such biases compare equal and share the row's weight uniformly.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
from cutlass import cute

from .spec import LOG2E
from .utils import acc_mn_view, fma, mul_rz


@dataclass(frozen=True)
class Scores:
    """S of one block from the bias-first accumulator: bias / scale as its initial value,
    Q K^T added by the caller's GEMM (a query-broadcast bias in the Hopper kernels is added
    after it instead), then softcap, the bias after the cap, the mask tile.

    has_bias/has_mask/has_softcap are compile-time; the scales are the launch's scalars.
    mask_expiry: the mask tile is one row of int32 expiry rows (dmattn_cute/topw.py): query
    row i keeps key j while i + Sk - Sq < expiry[j] (the Hopper kernels; finish then needs the
    scores' coordinates and Sk - Sq); with mask_ranges, of int64 key ranges, first row << 32 |
    expiry: kept from i + Sk - Sq = first row on, too.
    """

    has_bias: cutlass.Constexpr[bool]
    has_mask: cutlass.Constexpr[bool]
    has_softcap: cutlass.Constexpr[bool]
    bias_scale: cutlass.Float32
    softcap_scale: cutlass.Float32
    softcap: cutlass.Float32
    # The bias tile is one row read by every score row (a query-broadcast bias): each column is
    # scaled once for all of a thread's rows, as the start value (the mma.sync forward) or, with
    # bias_after_gemm, added after Q K^T (the Hopper kernels: their GEMM need not wait for it).
    bias_rows_shared: cutlass.Constexpr[bool] = False
    bias_after_gemm: cutlass.Constexpr[bool] = False
    mask_expiry: cutlass.Constexpr[bool] = False
    mask_ranges: cutlass.Constexpr[bool] = False
    # With bias_after_gemm and no softcap: finish leaves the scores in log2 units,
    # S * scale_log2 + bias * log2(e) by one FMA per score (OnlineSoftmax.log2_units then
    # only subtracts the max). The bias * log2(e) of a column is rounded toward zero, as
    # bias / scale is: a finfo.min bias gives -FLT_MAX for every key of its row.
    log2_units: cutlass.Constexpr[bool] = False
    scale_log2: cutlass.Float32 | None = None
    # With bias_rows_shared and bias_after_gemm: the bias row is fp32, already multiplied by
    # log2(e) where log2_units (and rounded as above), by a producer warp (the Hopper
    # forward's convert_row), so the columns are read as they are
    bias_converted: cutlass.Constexpr[bool] = False
    # acc_s holds S^T (the Hopper backward's transposed scores): a query-broadcast bias is one
    # value per accumulator row (key), not per column
    transposed: cutlass.Constexpr[bool] = False

    @cute.jit
    def start(self, acc_s: cute.Tensor, t_bias: cute.Tensor | None):
        """acc_s before Q K^T: bias / scale (smem -> rmem, so scale * S = scale * QK^T + bias
        needs no separate pass), or 0 (no bias; softcap: the bias follows the cap; a bias added
        after Q K^T)."""
        bias_first = self.has_bias and not self.has_softcap and not self.bias_after_gemm
        if cutlass.const_expr(bias_first and self.bias_rows_shared):
            acc_mn, bias_mn = acc_mn_view(acc_s), acc_mn_view(t_bias)
            for c in cutlass.range(cute.size(acc_mn.shape[1]), unroll_full=True):
                column = mul_rz(cutlass.Float32(bias_mn[0, c]), self.bias_scale)
                for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                    acc_mn[r, c] = column
        elif cutlass.const_expr(bias_first):
            acc_s.store(t_bias.load().to(cutlass.Float32))
            # a loop the compiler unrolls: traced once, not once per element
            for i in cutlass.range(cute.size(acc_s), unroll_full=True):
                acc_s[i] = mul_rz(acc_s[i], self.bias_scale)
        else:
            acc_s.fill(0.0)

    @cute.jit
    def finish(
        self,
        acc_s: cute.Tensor,
        t_bias: cute.Tensor | None,
        t_mask: cute.Tensor | None,
        mask_full,
        dtanh: cute.Tensor | None = None,
        t_coord: cute.Tensor | None = None,
        row_offset: cutlass.Int32 | None = None,
    ):
        """acc_s after Q K^T: softcap (its derivative 1 - tanh^2 into `dtanh` when given) and
        the bias; then scores where the mask tile is False become -inf, unless the tile is
        all True (mask_full != 0: it was not loaded)."""
        if cutlass.const_expr(self.has_softcap):
            capped = cute.math.tanh(acc_s.load() * self.softcap_scale, fastmath=True)
            if cutlass.const_expr(dtanh is not None):
                dtanh.store(1.0 - capped * capped)
            capped = capped * self.softcap
            if cutlass.const_expr(self.has_bias):
                # |capped| <= softcap: no finite sum overflows. Through registers shaped as
                # acc_s: a TMA tile's view groups the same elements in other modes.
                bias = cute.make_rmem_tensor_like(acc_s)
                bias.store(t_bias.load().to(cutlass.Float32))
                capped = capped + bias.load()
            acc_s.store(capped)
        if cutlass.const_expr(self.has_bias and not self.has_softcap and self.bias_after_gemm):
            # a query-broadcast bias after Q K^T (the Hopper kernels), per column: bias / scale
            # added, or in log2 units (the Hopper forward) one FMA with S * scale_log2
            factor = (
                cutlass.Float32(LOG2E) if cutlass.const_expr(self.log2_units) else self.bias_scale
            )
            acc_mn, bias_mn = acc_mn_view(acc_s), acc_mn_view(t_bias)
            if cutlass.const_expr(self.transposed):
                for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                    key = mul_rz(cutlass.Float32(bias_mn[r, 0]), factor)
                    for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                        acc_mn[r, c] = acc_mn[r, c] + key
            else:
                for c in cutlass.range(cute.size(acc_mn.shape[1]), unroll_full=True):
                    column = bias_mn[0, c]
                    if cutlass.const_expr(not self.bias_converted):
                        column = mul_rz(cutlass.Float32(column), factor)
                    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                        if cutlass.const_expr(self.log2_units):
                            acc_mn[r, c] = fma(acc_mn[r, c], self.scale_log2, column)
                        else:
                            acc_mn[r, c] = acc_mn[r, c] + column
        if cutlass.const_expr(self.has_mask and self.mask_expiry):
            # the views are taken outside the run-time branch: a name first bound inside it
            # would have no value on the other path
            scores_mn, coord_mn, expiry_mn = (acc_mn_view(t) for t in (acc_s, t_coord, t_mask))
            if mask_full == 0:
                for c in cutlass.range_constexpr(cute.size(scores_mn.shape[1])):
                    if cutlass.const_expr(self.mask_ranges):
                        word = cutlass.Int64(expiry_mn[0, c])
                        expiry = cutlass.Int32(word & 0xFFFFFFFF)
                        first = cutlass.Int32(word >> 32)
                    else:
                        expiry = cutlass.Int32(expiry_mn[0, c])
                    for r in cutlass.range_constexpr(cute.size(scores_mn.shape[0])):
                        row = coord_mn[r, 0][0] + row_offset
                        if row >= expiry:
                            scores_mn[r, c] = -cutlass.Float32.inf
                        if cutlass.const_expr(self.mask_ranges):
                            if row < first:
                                scores_mn[r, c] = -cutlass.Float32.inf
        elif cutlass.const_expr(self.has_mask):
            if mask_full == 0:
                keep = t_mask.load() != 0
                acc_s.store(cute.where(keep, acc_s.load(), -cutlass.Float32.inf))
