"""Split-KV combine: the partial outputs of a decode's key chunks merged into one, by their
log-sum-exps, in one launch (dmattn_cute/decode.py runs the chunks as one forward).

For a row r (one query head of one batch entry) with chunk outputs O_s and LSEs l_s:
    lse_r = log(sum_s exp(l_s)),   out_r = sum_s exp(l_s - lse_r) O_s.
A chunk without a visible key has l_s = -inf and weighs 0; a row with none anywhere gets
out 0 and lse -inf, as the forward gives such a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, cute
from cutlass.base_dsl import JitCompiledFunction

from ..jit.arch import compile_options, dependent_launch
from .config import padded_head_dim
from .softmax import LN2
from .spec import DTYPES, LOG2E, env_stream, fake_tensor

NUM_THREADS = 128
ROWS_PER_CTA = NUM_THREADS // 32  # one warp per row
_DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class CombineSpec:
    """One compiled combine variant (the compile-cache key): the dtype of the partial and
    final outputs, and the head dim it is built for (config.padded_head_dim; each lane
    holds head_dim_padded / 32 columns, predicated past the real head dim)."""

    dtype: str
    head_dim_padded: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.head_dim_padded % 32 != 0 or not 32 <= self.head_dim_padded <= 256:
            raise ValueError(
                f"head_dim_padded: expected a multiple of 32 in [32, 256], got "
                f"{self.head_dim_padded}"
            )

    @staticmethod
    def build(dtype: str, head_dim: int) -> CombineSpec:
        return CombineSpec(dtype, padded_head_dim(head_dim))

    def example_args(self) -> list:
        """Combine's arguments for an offline compile: the parts [B, splits, G, Hkv, D], their
        LSEs [B, splits, Hkv, G], out [B, Hkv, G, D] and lse [B, Hkv, G], every extent and
        stride dynamic but the unit stride of the last dim."""
        parts = fake_tensor(self.dtype, ("d", "d", "d", "d", "1"), 2)
        part_lse = fake_tensor("fp32", ("d", "d", "d", "1"), 4)
        out = fake_tensor(self.dtype, ("d", "d", "d", "1"), 2)
        lse = fake_tensor("fp32", ("d", "d", "1"), 4)
        return [parts, part_lse, out, lse, env_stream()]

    def compile(self, arch: str, options: str = "") -> JitCompiledFunction:
        """cute.compile of this variant for `arch` (no GPU needed)."""
        return cute.compile(
            Combine(self, dependent_launch(arch)), *self.example_args(),
            options=compile_options(arch, options),
        )  # fmt: skip


class Combine:
    """One warp per row (b, kv head, group member g): the lanes take the chunks' LSEs 32 at a
    time for the max and the sum (warp reductions), then walk the chunks together, each lane
    adding its columns of the weighted part (lanes read consecutive columns: coalesced), and
    store the row (gmem -> rmem -> gmem; no shared memory). Launched as a dependent of the
    forward before it (`dependent`: on Hopper), it starts while that one finishes and waits
    for it before reading the parts."""

    def __init__(self, spec: CombineSpec, dependent: bool) -> None:
        self.spec = spec
        self.dependent = dependent

    @cute.jit
    def __call__(
        self,
        mParts: cute.Tensor,  # [B, splits, G, Hkv, D]
        mPartLse: cute.Tensor,  # [B, splits, Hkv, G] fp32
        mOut: cute.Tensor,  # [B, Hkv, G, D]
        mLse: cute.Tensor,  # [B, Hkv, G] fp32
        stream: cuda.CUstream,
    ):
        rows = mOut.shape[0] * mOut.shape[1] * mOut.shape[2]
        self.kernel(mParts, mPartLse, mOut, mLse).launch(
            grid=(cute.ceil_div(rows, ROWS_PER_CTA), 1, 1),
            block=[NUM_THREADS, 1, 1],
            stream=stream,
            use_pdl=self.dependent,
        )

    @cute.kernel
    def kernel(
        self, mParts: cute.Tensor, mPartLse: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor
    ):
        if cutlass.const_expr(self.dependent):
            cute.arch.griddepcontrol_wait()  # the forward's parts are complete and visible
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = cta * ROWS_PER_CTA + tidx // 32
        batch, heads_kv, group, head_dim = mOut.shape
        splits = mParts.shape[1]
        if row < batch * heads_kv * group:
            g = row % group
            h = (row // group) % heads_kv
            b = row // (group * heads_kv)
            # the chunks' max LSE (-inf where none sees a key), then log2 of the sum of
            # exp(l_s - max) in log2 units
            top = -Float32.inf
            for s in cutlass.range(lane, splits, 32):
                top = cute.arch.fmax(top, mPartLse[b, s, h, g])
            top = cute.arch.warp_reduction_max(top)
            base = Float32(0.0) if top == -Float32.inf else top
            total = Float32(0.0)
            for s in cutlass.range(lane, splits, 32):
                total += cute.math.exp2((mPartLse[b, s, h, g] - base) * LOG2E, fastmath=True)
            total = cute.arch.warp_reduction_sum(total)
            lse = -Float32.inf
            if total > 0.0:
                lse = base + cute.math.log2(total, fastmath=True) * LN2
            cols = self.spec.head_dim_padded // 32
            acc = cute.make_rmem_tensor(cols, Float32)
            acc.fill(0.0)
            if total > 0.0:
                # unrolled: the loads of several chunks in flight at once, not one latency each
                for s in cutlass.range(splits, unroll=8):
                    weight = cute.math.exp2((mPartLse[b, s, h, g] - lse) * LOG2E, fastmath=True)
                    for i in cutlass.range_constexpr(cols):
                        d = lane + 32 * i
                        if d < head_dim:
                            acc[i] += weight * Float32(mParts[b, s, g, h, d])
            for i in cutlass.range_constexpr(cols):
                d = lane + 32 * i
                if d < head_dim:
                    mOut[b, h, g, d] = acc[i].to(DTYPES[self.spec.dtype])
            if lane == 0:
                mLse[b, h, g] = lse
