"""Backward kernel: FlashAttention-2 style (mma.sync), one CTA per (key block, kv head, batch).

The CTA keeps its K and V tiles in shared memory and dK, dV in registers, and walks the query
heads of its group and the query blocks its causal/window range allows. Per (head, query
block) step it recomputes S from the bias-first accumulator, P = exp(S - max - log sum) from
the forward's per-row stats, then dP = dO V^T, dS = P (dP - dpsum), and accumulates
dV += P^T dO, dK += dS^T Q; dQ = dS K is added to an fp32 accumulator in global memory. With a mask, the CTA scans the mask tiles of
the next SCAN_BLOCKS query blocks first: an all-False tile is skipped by the whole CTA (no
Q/dO/bias loads, no GEMMs), an all-True tile needs no mask tile in smem.

Shared-memory aliasing (per stage s):
- P (16-bit, swizzled) lives in the mask tile's buffer. The mask tile is read into registers
  when S is masked; barrier "scores consumed" in compute_step orders every thread's last mask
  read before any thread stores P. P is read by the dV GEMM; the next loads into stage s
  are issued only after the next step's "tiles landed" barrier.
- dS lives in the bias tile's buffer, under the same two barriers (the bias is read when S is
  initialised, dS is written after "scores consumed", read by the dK and dQ GEMMs).

dbias (the gradient of the post-softcap score) is written from dS in registers (dbias.py);
dQ in deterministic mode is added in key-block order (turns.py).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.cute.nvgpu import warp

from ..jit.arch import compile_options
from . import gemm, masking, operands, tiles
from .config import (
    CACHED_WINDOWS,
    BwdTile,
    SmemBuffer,
    bwd_region_bytes,
    bwd_smem_buffers,
    bwd_tile,
    padded_head_dim,
    smem_total,
    warp_grid,
)
from .dbias import DbiasWriter
from .masking import SCAN_BLOCKS, ScanState
from .scores import Scores
from .softmax import load_row_stats
from .spec import DTYPES, OperandSpec, dtype_bytes, env_stream, fake_rows, fake_tensor
from .turns import DqTurns
from .utils import acc_mn_view, red_add_f32x2


class BwdScalars(NamedTuple):
    """The scalar arguments of FlashBwd.__call__, named and ordered as there (launch.
    kernel_scalars builds them from a problem). The defaults are an offline compile's
    placeholders: any value of the right type."""

    scale_log2: float = 1.0
    bias_scale: float = 1.0
    softcap_scale: float = 0.0
    softcap: float = 0.0
    softmax_scale: float = 1.0
    window_left: int = 0
    window_right: int = 0
    mask_head_div: int = 1
    bias_head_div: int = 1
    group: int = 1


@dataclass(frozen=True)
class DbiasSpec:
    """How dS reaches dbias, a [Bm, Hm, Qm, Km] tensor of `dtype` with stride pattern
    `strides` (as OperandSpec's).

    rows_summed: the bias has Qm = 1, so dS is summed over query rows.
    direct: every element gets exactly one contribution from one CTA (Bm = B, Hm = H), so it
        is stored in the bias dtype; otherwise it is added into an fp32 buffer.
    atomic: additions are red.add atomics (default) or load-add-store (deterministic).
    per_head: the buffer has a row per query head ([B, H, 1, Sk], the launch's "slots" of a
        deterministic broadcast bias), indexed by the query head, not the bias head.
    """

    dtype: str
    strides: tuple[str, str, str, str]
    rows_summed: bool
    direct: bool
    atomic: bool
    per_head: bool = False

    def head(self, h, bias_head_div):
        """The dbias head of query head h."""
        return h if self.per_head else h // bias_head_div


@dataclass(frozen=True)
class BwdSpec:
    """One backward kernel variant: the compile key, tiling and launch facts.

    fold_batch / fold_heads: deterministic dbias of a bias broadcast over the batch / all kv
    heads: one CTA walks every batch / kv head of its key block, so it owns its dbias rows.
    split_heads: a group's query heads are split over `head_splits` CTAs (a runtime value), each
    storing its fp32 dK/dV partial sums into a head slot of its own (dK, dV: [B, Sk, Hkv x
    head_splits, D] fp32), which the launch sums over the slots in a fixed order: no atomics,
    deterministic either way. Not with folded dims.
    """

    dtype: str
    head_dim_padded: int
    even_d: bool
    tile: BwdTile
    mask: OperandSpec | None
    bias: OperandSpec | None
    dbias: DbiasSpec | None
    has_window: bool
    has_softcap: bool
    deterministic: bool
    fold_batch: bool
    fold_heads: bool
    vector_atomics: bool  # red.global.add.v2.f32 (sm_90)
    split_heads: bool = False

    @staticmethod
    @functools.cache  # called on every launch; the tile search is pure
    def build(
        arch: str,
        dtype: str,
        head_dim: int,
        mask: OperandSpec | None,
        bias: OperandSpec | None,
        dbias: DbiasSpec | None,
        has_window: bool,
        has_softcap: bool,
        deterministic: bool,
        fold_batch: bool = False,
        fold_heads: bool = False,
        split_heads: bool = False,
    ) -> BwdSpec:
        """The variant for these choices, tiled by the per-arch table (ValueError if nothing
        fits the architecture's shared memory)."""
        dp = padded_head_dim(head_dim)
        smem = [None if op is None else op.smem() for op in (mask, bias)]
        tile = bwd_tile(arch, dp, dtype_bytes(dtype), *smem)
        spec = BwdSpec(
            dtype,
            dp,
            head_dim == dp,
            tile,
            mask,
            bias,
            dbias,
            has_window,
            has_softcap,
            deterministic,
            fold_batch,
            fold_heads,
            arch.startswith("sm_90"),
        )
        if split_heads:
            if not spec.can_split_heads:
                raise ValueError("split_heads: not with folded dims or deterministic dbias sums")
            spec = dataclasses.replace(spec, split_heads=True)
        return spec

    @property
    def can_split_heads(self) -> bool:
        """Whether a group's heads may be split over CTAs: not with folded dims, nor with
        deterministic dbias sums, whose rows the group's heads share (a bias per query head
        has none to share: its dbias is direct)."""
        folded = self.fold_batch or self.fold_heads
        shared_sums = self.deterministic and self.dbias is not None and not self.dbias.direct
        return not (folded or shared_sums)

    def smem_buffers(self) -> tuple[SmemBuffer, ...]:
        """The kernel's shared-memory buffers in allocation order (config.bwd_smem_buffers)."""
        smem = [None if op is None else op.smem() for op in (self.mask, self.bias)]
        return bwd_smem_buffers(self.tile, self.head_dim_padded, dtype_bytes(self.dtype), *smem)

    def smem_bytes(self) -> int:
        """Shared memory of one CTA, in bytes."""
        return smem_total(self.smem_buffers())

    def example_args(self) -> list:
        """FlashBwd's arguments for an offline compile (see FwdSpec.example_args)."""
        q, k, v, dout = (fake_rows(self.dtype) for _ in range(4))
        dk, dv = (fake_rows("fp32" if self.split_heads else self.dtype) for _ in range(2))
        stats = fake_tensor("fp32", ("d", "d", "d", "1"), 4)
        dpsum = fake_tensor("fp32", ("d", "d", "1"), 4)
        dq_acc = fake_tensor("fp32", ("d", "d", "d", "1"), 16, stride_div=4)
        mask, bias = (None if op is None else op.fake() for op in (self.mask, self.bias))
        dbias = sem = None
        if self.dbias is not None:
            dbias = fake_tensor(self.dbias.dtype, self.dbias.strides, dtype_bytes(self.dbias.dtype))
        if self.deterministic:
            sem = fake_tensor("i32", ("d", "d", "1"), 4)
        return [q, k, v, dout, stats, dpsum, dq_acc, dk, dv, 1, mask, bias, dbias, sem,
                *BwdScalars(), env_stream()]  # fmt: skip

    def compile(self, arch: str, extra_options: str = ""):
        """cute.compile of this variant for `arch` (no GPU needed)."""
        return cute.compile(
            FlashBwd(self), *self.example_args(), options=compile_options(arch, extra_options)
        )


def _tiled_mma(dtype, grid: tuple[int, int]) -> cute.TiledMma:
    wm, wn = grid
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
        (wm, wn, 1),
        permutation_mnk=(wm * 16, wn * 16, 16),
    )


class FlashBwd:
    """The backward kernel for one BwdSpec."""

    def __init__(self, spec: BwdSpec):
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        self.tile_m = spec.tile.tile_m
        self.tile_n = spec.tile.tile_n
        self.num_threads = spec.tile.num_threads
        self.num_warps = spec.tile.num_warps
        self.stages = spec.tile.stages
        self.head_dim_padded = spec.head_dim_padded
        elem = self.dtype.width // 8
        smem = [None if op is None else op.smem() for op in (spec.mask, spec.bias)]
        # bytes of one stage of the P/mask and dS/bias buffers
        self.region_p = bwd_region_bytes(spec.tile, elem, smem[0])
        self.region_ds = bwd_region_bytes(spec.tile, elem, smem[1])
        dp, w = self.head_dim_padded, self.num_warps
        self.sdp_grid = warp_grid(self.tile_m, self.tile_n, w, 2)
        self.dkv_grid = warp_grid(self.tile_n, dp, w, 4)
        self.dq_grid = warp_grid(self.tile_m, dp, w, 2)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Sq, H, D]
        mK: cute.Tensor,  # [B, Sk, Hkv, D]
        mV: cute.Tensor,  # [B, Sk, Hkv, D]
        mdO: cute.Tensor,  # [B, Sq, H, D]
        mStats: cute.Tensor,  # [B, H, 2, Sq] fp32: the forward's row max and log2 row sum
        mDpsum: cute.Tensor,  # [B, H, Sq] fp32
        mdQacc: cute.Tensor,  # [B, Sq, H, D] fp32, zeroed
        mdK: cute.Tensor,  # [B, Sk, Hkv, D]; split_heads: [B, Sk, Hkv x head_splits, D] fp32
        mdV: cute.Tensor,  # as mdK
        head_splits: cutlass.Int32,  # CTAs per group of query heads (1 without split_heads)
        mMask: cute.Tensor | None,  # [Bm, Hm, Qm, Km] uint8 view of the bool mask
        mBias: cute.Tensor | None,  # [Bm, Hm, Qm, Km]
        mdBias: cute.Tensor | None,  # [Bm, Hm, Qm, Km] (stride 0 on size-1 dims)
        mSem: cute.Tensor | None,  # [B, H, ceil(Sq / tile_m)] int32, zeroed (deterministic)
        scale_log2: cutlass.Float32,
        bias_scale: cutlass.Float32,
        softcap_scale: cutlass.Float32,
        softcap: cutlass.Float32,
        softmax_scale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        mask_head_div: cutlass.Int32,
        bias_head_div: cutlass.Int32,
        group: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        spec = self.spec
        dp, tm, tn, st = self.head_dim_padded, self.tile_m, self.tile_n, self.stages
        atom = tiles.qkv_smem_atom(dp)
        sQ_layout = cute.tile_to_shape(atom, (tm, dp, st), (0, 1, 2))
        sK_layout = cute.tile_to_shape(atom, (tn, dp), (0, 1))
        elem = self.dtype.width // 8
        sP_layout = tiles.staged_swizzled_layout(tm, tn, st, self.region_p // elem)
        sdS_layout = tiles.staged_swizzled_layout(tm, tn, st, self.region_ds // elem)
        mmas = SimpleNamespace(
            sdp=_tiled_mma(self.dtype, self.sdp_grid),
            dkv=_tiled_mma(self.dtype, self.dkv_grid),
            dq=_tiled_mma(self.dtype, self.dq_grid),
        )
        copy_qkv = tiles.qkv_copy(self.dtype, dp, self.num_threads)
        copy_out = tiles.qkv_copy(self.dtype, dp, self.num_threads, store=True)
        heads_kv, batch = mK.shape[2], mK.shape[0]
        grid = (
            cute.ceil_div(mK.shape[1], tn),
            1 if cutlass.const_expr(spec.fold_heads) else heads_kv * head_splits,
            1 if cutlass.const_expr(spec.fold_batch) else batch,
        )
        self.kernel(
            mQ,
            mK,
            mV,
            mdO,
            mStats,
            mDpsum,
            mdQacc,
            mdK,
            mdV,
            head_splits,
            mMask,
            mBias,
            mdBias,
            mSem,
            scale_log2,
            bias_scale,
            softcap_scale,
            softcap,
            softmax_scale,
            window_left,
            window_right,
            mask_head_div,
            bias_head_div,
            group,
            sQ_layout,
            sK_layout,
            sP_layout,
            sdS_layout,
            mmas.sdp,
            mmas.dkv,
            mmas.dq,
            copy_qkv,
            copy_out,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mStats: cute.Tensor,
        mDpsum: cute.Tensor,
        mdQacc: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        head_splits: cutlass.Int32,
        mMask: cute.Tensor | None,
        mBias: cute.Tensor | None,
        mdBias: cute.Tensor | None,
        mSem: cute.Tensor | None,
        scale_log2: cutlass.Float32,
        bias_scale: cutlass.Float32,
        softcap_scale: cutlass.Float32,
        softcap: cutlass.Float32,
        softmax_scale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        mask_head_div: cutlass.Int32,
        bias_head_div: cutlass.Int32,
        group: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        copy_qkv: cute.TiledCopy,
        copy_out: cute.TiledCopy,
    ):
        spec = self.spec
        tm, tn, dp, st = self.tile_m, self.tile_n, self.head_dim_padded, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        n_block, hk_block, b_block = cute.arch.block_idx()
        # with split heads, grid y walks (kv head, split) pairs
        split = hk_block % head_splits
        hk_block = hk_block // head_splits
        seqlen_q, seqlen_k = mQ.shape[1], mK.shape[1]
        limits = masking.BlockLimits(
            seqlen_q, seqlen_k, window_left, window_right, tm, tn, spec.has_window
        )

        # ---- shared memory ----
        smem = tiles.allocate_smem(spec.smem_buffers())
        sK = tiles.smem_tensor(smem["k"], self.dtype, sK_layout)
        sV = tiles.smem_tensor(smem["v"], self.dtype, sK_layout)
        sQ = tiles.smem_tensor(smem["q"], self.dtype, sQ_layout)
        sdO = tiles.smem_tensor(smem["do"], self.dtype, sQ_layout)
        # P over the mask tiles, dS over the bias tiles (lifetimes: the module docstring)
        sP = tiles.smem_tensor(smem["p"], self.dtype, sP_layout)
        sdS = tiles.smem_tensor(smem["ds"], self.dtype, sdS_layout)
        s_colsum = tiles.smem_tensor(
            smem["colsum"],
            cutlass.Float32,
            cute.make_layout((self.sdp_grid[0], tn), stride=(tn, 1)),
        )
        s_words = tiles.smem_tensor(
            smem["scan_words"],
            cutlass.Int32,
            cute.make_layout((2, self.num_warps), stride=(self.num_warps, 1)),
        )
        # Scan bitmaps (visible, all-True) of the first CACHED_WINDOWS windows, reused by the
        # other query heads of the group when they read the same mask head.
        s_bits = tiles.smem_tensor(
            smem["scan_bits"],
            cutlass.Int32,
            cute.make_layout((2, CACHED_WINDOWS), stride=(CACHED_WINDOWS, 1)),
        )

        # ---- MMA operands (smem -> rmem by ldmatrix) ----
        # Transposed views: the dV/dK GEMMs read P^T, dS^T, dO^T, Q^T; the dQ GEMM reads K^T.
        sPt = tiles.transposed(sP, tm, tn, st)
        sdSt = tiles.transposed(sdS, tm, tn, st)
        sQt = tiles.transposed(sQ, tm, dp, st)
        sdOt = tiles.transposed(sdO, tm, dp, st)
        sKt = tiles.transposed(sK, tn, dp)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), self.dtype)
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        r2s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        r2s_sdp = cute.make_tiled_copy_C(r2s, mma_sdp).get_slice(tidx)
        operand = gemm.GemmOperand.make
        mm = SimpleNamespace(
            mma_sdp=mma_sdp,
            mma_dkv=mma_dkv,
            mma_dq=mma_dq,
            thr_dq=thr_dq,
            # S = Q K^T and dP = dO V^T
            Q=operand(thr_sdp, mma_sdp, sQ, True, ldsm, tidx),
            K=operand(thr_sdp, mma_sdp, sK, False, ldsm, tidx),
            dO=operand(thr_sdp, mma_sdp, sdO, True, ldsm, tidx),
            V=operand(thr_sdp, mma_sdp, sV, False, ldsm, tidx),
            # dV += P^T dO and dK += dS^T Q
            Pt=operand(thr_dkv, mma_dkv, sPt, True, ldsm_t, tidx),
            dOt=operand(thr_dkv, mma_dkv, sdOt, False, ldsm_t, tidx),
            dSt=operand(thr_dkv, mma_dkv, sdSt, True, ldsm_t, tidx),
            Qt=operand(thr_dkv, mma_dkv, sQt, False, ldsm_t, tidx),
            # dQ = dS K
            dS=operand(thr_dq, mma_dq, sdS, True, ldsm, tidx),
            Kt=operand(thr_dq, mma_dq, sKt, False, ldsm_t, tidx),
            # P and dS (rmem -> smem, over the mask and bias tiles)
            r2s=r2s,
            r2s_sdp=r2s_sdp,
            tPsP=r2s_sdp.partition_D(sP),
            tdSsdS=r2s_sdp.partition_D(sdS),
            acc_shape_s=thr_sdp.partition_shape_C((tm, tn)),
            # (row, col) of every score this thread holds, per query block
            tScS=thr_sdp.partition_C(
                cute.local_tile(
                    cute.make_identity_tensor((seqlen_q, seqlen_k)), (tm, tn), (None, n_block)
                )
            ),
        )

        # ---- mask and bias smem tiles (stage stride: the P / dS buffers they share) ----
        op_copies = {}
        views = {}
        for name, op, region, region_bytes in (
            ("mask", spec.mask, smem["p"], self.region_p),
            ("bias", spec.bias, smem["ds"], self.region_ds),
        ):
            if cutlass.const_expr(op is not None):
                dtype = DTYPES[op.dtype]
                stride = region_bytes // (dtype.width // 8)
                sX, s_view, tcopy, used = operands.smem_stages(
                    region, dtype, op, tm, tn, st, stride, self.num_threads
                )
                op_copies[name] = SimpleNamespace(copy=tcopy, used=used, sX=sX)
                views[name] = thr_sdp.partition_C(s_view)

        m_min, m_max = limits.query_block_range(n_block)
        # Deterministic dQ passes a turn per query block from key block to key block, so every
        # CTA visits every query block (skipped ones only pass the turn on).
        m_lo, m_hi = m_min, m_max
        if cutlass.const_expr(spec.deterministic):
            m_lo, m_hi = cutlass.Int32(0), cute.ceil_div(seqlen_q, tm)
        gmem = SimpleNamespace(
            mQ=mQ, mK=mK, mV=mV, mdO=mdO, mStats=mStats, mDpsum=mDpsum, mdQacc=mdQacc,
            mdK=mdK, mdV=mdV, mMask=mMask, mBias=mBias, head_dim=mQ.shape[3],
        )  # fmt: skip
        shared = SimpleNamespace(
            sK=sK, sV=sV, sQ=sQ, sdO=sdO, s_words=s_words, s_bits=s_bits, op_copies=op_copies,
            copy_qkv=copy_qkv, thr_qkv=copy_qkv.get_slice(tidx), copy_out=copy_out,
        )  # fmt: skip
        walk = SimpleNamespace(
            n_block=n_block,
            m_lo=m_lo,
            m_hi=m_hi,
            m_min=m_min,
            m_max=m_max,
            limits=limits,
            scores=Scores(
                spec.bias is not None,
                spec.mask is not None,
                spec.has_softcap,
                bias_scale,
                softcap_scale,
                softcap,
            ),
            scale_log2=scale_log2,
            softmax_scale=softmax_scale,
            views=views,
            state=cute.make_rmem_tensor(ScanState.SLOTS, cutlass.Int32),
            group=group,
            head_splits=head_splits,
            split=split,
            mask_head_div=mask_head_div,
            bias_head_div=bias_head_div,
            dbias=None,
            turns=None,
            tidx=tidx,
        )
        if cutlass.const_expr(spec.dbias is not None):
            walk.dbias = DbiasWriter.make(
                spec.dbias, mdBias, s_colsum, mm.tScS, tn, self.sdp_grid[0], n_block, limits, tidx
            )
        if cutlass.const_expr(spec.deterministic):
            walk.turns = DqTurns(mSem, tidx)
        fold_b = mK.shape[0] if cutlass.const_expr(spec.fold_batch) else 1
        fold_h = mK.shape[2] if cutlass.const_expr(spec.fold_heads) else 1
        for fb in cutlass.range(fold_b, unroll=1):
            for fh in cutlass.range(fold_h, unroll=1):
                b = fb if cutlass.const_expr(spec.fold_batch) else b_block
                hk = fh if cutlass.const_expr(spec.fold_heads) else hk_block
                self.kv_block(b, hk, gmem, shared, mm, walk)

    @cute.jit
    def kv_block(self, b, hk, gmem, shared, mm, walk):
        """The CTA's work for one (batch, kv head): every query head of the group, every query
        block, then dK and dV of the key block."""
        spec = self.spec
        tn, dp, st = self.tile_n, self.head_dim_padded, self.stages
        n_block, tidx, state = walk.n_block, walk.tidx, walk.state
        seqlen_k, head_dim = walk.limits.seqlen_k, gmem.head_dim
        sK, sV, thr_qkv = shared.sK, shared.sV, shared.thr_qkv
        acc_dK = cute.make_rmem_tensor(
            mm.mma_dkv.get_slice(tidx).partition_shape_C((tn, dp)), cutlass.Float32
        )
        acc_dV = cute.make_rmem_tensor(
            mm.mma_dkv.get_slice(tidx).partition_shape_C((tn, dp)), cutlass.Float32
        )
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # ---- K and V of this key block (gmem -> smem), rows checked ----
        cKV = cute.local_tile(
            cute.make_identity_tensor((seqlen_k, head_dim)), (tn, dp), (n_block, 0)
        )
        tKVcKV = thr_qkv.partition_S(cKV)
        for mX, sX in ((gmem.mK, sK), (gmem.mV, sV)):
            gX = cute.local_tile(mX[b, None, hk, None], (tn, dp), (n_block, 0))
            tiles.copy_tile(
                shared.copy_qkv,
                thr_qkv.partition_S(gX),
                thr_qkv.partition_D(sX),
                tKVcKV,
                seqlen_k,
                head_dim,
                True,
                not spec.even_d,
            )
        cute.arch.cp_async_commit_group()

        heads = walk.group // walk.head_splits  # the query heads of this CTA
        for i in cutlass.range(heads, unroll=1):
            hi = walk.split * heads + i
            h = hk * walk.group + hi
            ld = self.head_loads(b, h, gmem, shared, walk)
            scan = None
            if cutlass.const_expr(spec.mask is not None):
                scan = operands.mask_scan(
                    spec.mask, gmem.mMask, b, h // walk.mask_head_div, walk.limits, None,
                    n_block, shared.op_copies["mask"].used, self.num_threads, tidx,
                )  # fmt: skip
            h_dbias = None
            if cutlass.const_expr(spec.dbias is not None):
                h_dbias = spec.dbias.head(h, walk.bias_head_div)
            head = SimpleNamespace(b=b, h=h, h_bias=h // walk.bias_head_div, h_dbias=h_dbias)
            state[ScanState.STAGE] = 0
            state[ScanState.LOADED] = -1
            cute.arch.sync_threads()  # the previous head's cached scan bitmaps are visible
            for m in cutlass.range(walk.m_lo, walk.m_hi, unroll=1):
                j = (m - walk.m_lo) % SCAN_BLOCKS
                if j == 0:
                    visible = masking.range_bits(m, walk.m_min, walk.m_max)
                    full = cutlass.Int32(0)
                    if cutlass.const_expr(spec.mask is not None):
                        seen, every = self.window_bits(walk, shared, scan, i, m)
                        visible = visible & seen
                        full = every & visible
                    state[ScanState.VISIBLE] = visible
                    state[ScanState.FULL] = full
                    first = masking.next_set_bit(visible, -1)
                    # (without a mask the previous step may have prefetched it already)
                    if first < SCAN_BLOCKS and m + first != state[ScanState.LOADED]:
                        ld.load(m + first, state[ScanState.STAGE], (full >> first) & 1)
                    cute.arch.cp_async_commit_group()
                if ((state[ScanState.VISIBLE] >> j) & 1) != 0:
                    stage = state[ScanState.STAGE]
                    # The next step: the next set bit of this window; without a mask simply the
                    # next block, also across windows (all bits of a window are known ahead).
                    step = masking.next_set_bit(state[ScanState.VISIBLE], j) - j
                    has_next = (j + step < SCAN_BLOCKS) & (m + step < walk.m_hi)
                    if cutlass.const_expr(spec.mask is None):
                        step = cutlass.Int32(1)
                        has_next = m + 1 < walk.m_max
                    full_next = (state[ScanState.FULL] >> (j + step)) & 1
                    cute.arch.cp_async_wait_group(0)
                    # "tiles landed": this step's tiles are in smem for every thread,
                    # and every thread is done with the stage the next load refills.
                    cute.arch.sync_threads()
                    if cutlass.const_expr(st == 2):
                        if has_next:
                            ld.load(m + step, 1 - stage, full_next)
                            state[ScanState.LOADED] = m + step
                        cute.arch.cp_async_commit_group()
                        state[ScanState.STAGE] = 1 - stage
                    self.compute_step(
                        gmem, mm, walk, head, acc_dK, acc_dV, m, stage,
                        (state[ScanState.FULL] >> j) & 1,
                    )  # fmt: skip
                    if cutlass.const_expr(st == 1):
                        cute.arch.sync_threads()  # the single stage is no longer read
                        if has_next:
                            ld.load(m + step, 0, full_next)
                            state[ScanState.LOADED] = m + step
                        cute.arch.cp_async_commit_group()
                else:
                    if cutlass.const_expr(spec.deterministic):
                        walk.turns.skip(b, h, m, n_block)
            if cutlass.const_expr(spec.dbias is not None):
                if cutlass.const_expr(spec.dbias.rows_summed):
                    walk.dbias.flush(b, head.h_dbias)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # every GEMM is done reading sK / sV
        acc_dK.store(acc_dK.load() * walk.softmax_scale)
        if cutlass.const_expr(spec.split_heads):
            self.store_partials(b, hk, gmem, mm, walk, acc_dK, acc_dV, cKV)
        else:
            self.store_dkv(b, hk, gmem, shared, mm, walk, acc_dK, acc_dV, cKV)

    @cute.jit
    def store_dkv(self, b, hk, gmem, shared, mm, walk, acc_dK, acc_dV, cKV):
        """dK and dV of the key block: rmem -> smem over K/V -> gmem, in the input dtype."""
        tn, dp = self.tile_n, self.head_dim_padded
        tidx, n_block = walk.tidx, walk.n_block
        sK, sV = shared.sK, shared.sV
        seqlen_k, head_dim = walk.limits.seqlen_k, gmem.head_dim
        for acc, sX in ((acc_dK, sK), (acc_dV, sV)):
            tiles.acc_to_smem(acc, self.dtype, mm.r2s, mm.mma_dkv, tidx, sX)
        cute.arch.sync_threads()  # dK / dV complete in smem before the row-wise reads
        thr_out = shared.copy_out.get_slice(tidx)
        for mX, sX in ((gmem.mdK, sK), (gmem.mdV, sV)):
            gX = cute.local_tile(mX[b, None, hk, None], (tn, dp), (n_block, 0))
            tiles.store_tile(shared.copy_out, thr_out, sX, gX, cKV, seqlen_k, head_dim)
        cute.arch.sync_threads()  # sK / sV are read before the next fold reloads them

    @cute.jit
    def store_partials(self, b, hk, gmem, mm, walk, acc_dK, acc_dV, cKV):
        """split_heads: this CTA's fp32 dK/dV sums straight from registers into its own head
        slot (hk x head_splits + split), pairs of adjacent columns per store; every element
        of the key block's rows is written, zero where no query head of the CTA reached it."""
        tn, dp = self.tile_n, self.head_dim_padded
        seqlen_k, head_dim = walk.limits.seqlen_k, gmem.head_dim
        thr_dkv = mm.mma_dkv.get_slice(walk.tidx)
        c_mn = acc_mn_view(thr_dkv.partition_C(cKV))
        slot = hk * walk.head_splits + walk.split
        for acc, mX in ((acc_dK, gmem.mdK), (acc_dV, gmem.mdV)):
            gX = cute.local_tile(mX[b, None, slot, None], (tn, dp), (walk.n_block, 0))
            g_mn = acc_mn_view(thr_dkv.partition_C(gX))
            a_mn = acc_mn_view(acc)
            for r in cutlass.range_constexpr(cute.size(a_mn.shape[0])):
                if c_mn[r, 0][0] < seqlen_k:
                    for c in cutlass.range_constexpr(0, cute.size(a_mn.shape[1]), 2):
                        inside = cutlass.Boolean(True)
                        if cutlass.const_expr(not self.spec.even_d):
                            inside = c_mn[0, c][1] < head_dim
                        if inside:
                            g_mn[r, c] = a_mn[r, c]
                            g_mn[r, c + 1] = a_mn[r, c + 1]

    @cute.jit
    def window_bits(self, walk, shared, scan, i, m_first):
        """(visible, all-True) bits of the scan window starting at query block m_first: scanned,
        or, for the CTA's later query heads (i > 0) when the mask is shared by the group (Hm in
        {1, Hkv}), read back from shared memory."""
        w = (m_first - walk.m_lo) // SCAN_BLOCKS
        group_shares_mask = walk.mask_head_div % walk.group == 0
        seen = cutlass.Int32(0)
        every = cutlass.Int32(0)
        s_bits = shared.s_bits
        if i > 0 and group_shares_mask and w < CACHED_WINDOWS:
            seen = s_bits[0, w]
            every = s_bits[1, w]
        else:
            seen, every = masking.scan_mask_blocks(
                scan, m_first, walk.m_max, shared.s_words, walk.tidx, self.num_warps
            )
            # read by the later heads, after the barrier that starts each head
            if w < CACHED_WINDOWS and walk.tidx == 0:
                s_bits[0, w] = seen
                s_bits[1, w] = every
        return seen, every

    def head_loads(self, b, h, gmem, shared, walk):
        """The gmem -> smem loads of the Q, dO, mask and bias tiles of query head h."""
        tm, dp = self.tile_m, self.head_dim_padded
        limits, thr_qkv = walk.limits, shared.thr_qkv
        cQ = cute.local_tile(
            cute.make_identity_tensor((limits.seqlen_q, gmem.head_dim)), (tm, dp), (None, 0)
        )
        loads = {}
        for name, op, mX, head_div in (
            ("mask", self.spec.mask, gmem.mMask, walk.mask_head_div),
            ("bias", self.spec.bias, gmem.mBias, walk.bias_head_div),
        ):
            if cutlass.const_expr(op is not None):
                gX, cX, row_end = operands.gmem_tiles(
                    op, mX, b, h // head_div, limits, None, walk.n_block
                )
                c = shared.op_copies[name]
                loads[name] = operands.OperandLoads.make(
                    op, c.copy, c.used, gX, cX, c.sX, row_end, limits.seqlen_k, walk.tidx,
                    walk_queries=True,
                )  # fmt: skip
        return operands.WalkLoads(
            shared.copy_qkv,
            thr_qkv.partition_S(cute.local_tile(gmem.mQ[b, None, h, None], (tm, dp), (None, 0))),
            thr_qkv.partition_D(shared.sQ),
            thr_qkv.partition_S(cute.local_tile(gmem.mdO[b, None, h, None], (tm, dp), (None, 0))),
            thr_qkv.partition_D(shared.sdO),
            thr_qkv.partition_S(cQ),
            limits.seqlen_q,
            gmem.head_dim,
            tm,
            not self.spec.even_d,
            loads.get("mask"),
            loads.get("bias"),
        )

    @cute.jit
    def compute_step(self, gmem, mm, walk, head, acc_dK, acc_dV, m_block, stage, mask_full):
        """One (head, query block) step on the tiles in smem stage `stage`: S, P, dP, dS,
        dbias, then dV += P^T dO, dK += dS^T Q and dQ += dS K (fp32, global memory)."""
        spec = self.spec
        tm, dp = self.tile_m, self.head_dim_padded
        b, h, limits = head.b, head.h, walk.limits
        coord = mm.tScS[None, None, None, m_block]

        # The forward's row max and log2 row sum, and dpsum, per row; with a bias the max is
        # subtracted before scaling, as in the forward (a finfo.min bias row keeps its 1/n
        # weights, kernels/softmax.py).
        row_max, log2sum, dpsum = load_row_stats(
            gmem.mStats, gmem.mDpsum, coord, b, h, limits.seqlen_q, spec.bias is not None
        )
        rows = cute.size(row_max)

        # ---- S = bias + Q K^T (bias-first), softcap, mask, limits; P ----
        t_bias = t_mask = dtanh = None
        if cutlass.const_expr(spec.bias is not None):
            t_bias = walk.views["bias"][None, None, None, stage]
        if cutlass.const_expr(spec.mask is not None):
            t_mask = walk.views["mask"][None, None, None, stage]
        if cutlass.const_expr(spec.has_softcap):
            dtanh = cute.make_rmem_tensor(mm.acc_shape_s, cutlass.Float32)
        acc_S = cute.make_rmem_tensor(mm.acc_shape_s, cutlass.Float32)
        walk.scores.start(acc_S, t_bias)
        gemm.gemm(mm.mma_sdp, acc_S, mm.Q, mm.K, stage, None)
        walk.scores.finish(acc_S, t_bias, t_mask, mask_full, dtanh)
        limits.apply(acc_S, coord, m_block, walk.n_block)
        acc_mn = acc_mn_view(acc_S)
        for r in cutlass.range_constexpr(rows):
            s_row = acc_mn[r, None].load()
            if cutlass.const_expr(spec.bias is None):
                exponent = s_row * walk.scale_log2 - log2sum[r]
            else:
                exponent = (s_row - row_max[r]) * walk.scale_log2 - log2sum[r]
            acc_mn[r, None].store(cute.math.exp2(exponent, fastmath=True))

        # ---- dP = dO V^T, dS = P (dP - dpsum) ----
        acc_dP = cute.make_rmem_tensor(mm.acc_shape_s, cutlass.Float32)
        acc_dP.fill(0.0)
        gemm.gemm(mm.mma_sdp, acc_dP, mm.dO, mm.V, stage, None)
        dP_mn = acc_mn_view(acc_dP)
        for r in cutlass.range_constexpr(rows):
            dP_mn[r, None].store(acc_mn[r, None].load() * (dP_mn[r, None].load() - dpsum[r]))

        if cutlass.const_expr(spec.dbias is not None):
            walk.dbias.step(acc_dP, coord, b, head.h_dbias)
        if cutlass.const_expr(spec.has_softcap):
            acc_dP.store(acc_dP.load() * dtanh.load())

        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        # "scores consumed": every thread's reads of the mask and bias tiles of this stage are
        # done, so P and dS may overwrite them (no such tile: nothing to wait for).
        if cutlass.const_expr(spec.bias is not None):
            cute.arch.sync_threads()
        elif cutlass.const_expr(spec.mask is not None):
            if mask_full == 0:
                cute.arch.sync_threads()
        cute.copy(mm.r2s_sdp, mm.r2s_sdp.retile(rP), mm.tPsP[None, None, None, stage])
        cute.copy(mm.r2s_sdp, mm.r2s_sdp.retile(rdS), mm.tdSsdS[None, None, None, stage])
        cute.arch.sync_threads()  # P and dS complete in smem

        # ---- dV += P^T dO, dK += dS^T Q ----
        gemm.gemm(mm.mma_dkv, acc_dV, mm.Pt, mm.dOt, stage, stage)
        gemm.gemm(mm.mma_dkv, acc_dK, mm.dSt, mm.Qt, stage, stage)

        # ---- dQ += scale * dS K (fp32 atomics into the accumulator) ----
        acc_dQ = cute.make_rmem_tensor(mm.thr_dq.partition_shape_C((tm, dp)), cutlass.Float32)
        acc_dQ.fill(0.0)
        gemm.gemm(mm.mma_dq, acc_dQ, mm.dS, mm.Kt, stage, None)
        gdQ = cute.local_tile(gmem.mdQacc[b, None, h, None], (tm, dp), (m_block, 0))
        cdQ = cute.local_tile(
            cute.make_identity_tensor((limits.seqlen_q, gmem.mdQacc.shape[3])), (tm, dp),
            (m_block, 0),
        )  # fmt: skip
        if cutlass.const_expr(spec.deterministic):
            walk.turns.wait(b, h, m_block, walk.n_block)
        # Per row, pairs of adjacent columns (one red.v2 on sm_90); D is a multiple of 8, so a
        # pair lies wholly inside or outside D.
        dQ_mn = acc_mn_view(acc_dQ)
        g_mn = acc_mn_view(mm.thr_dq.partition_C(gdQ))
        c_mn = acc_mn_view(mm.thr_dq.partition_C(cdQ))
        head_dim = gmem.mdQacc.shape[3]
        for r in cutlass.range_constexpr(cute.size(dQ_mn.shape[0])):
            if c_mn[r, 0][0] < limits.seqlen_q:
                for c in cutlass.range_constexpr(0, cute.size(dQ_mn.shape[1]), 2):
                    inside = cutlass.Boolean(True)
                    if cutlass.const_expr(not spec.even_d):
                        inside = c_mn[0, c][1] < head_dim
                    if inside:
                        ptr = g_mn.iterator + cute.crd2idx((r, c), g_mn.layout)
                        lo = dQ_mn[r, c] * walk.softmax_scale
                        hi = dQ_mn[r, c + 1] * walk.softmax_scale
                        if cutlass.const_expr(spec.vector_atomics):
                            red_add_f32x2(ptr, lo, hi)
                        else:
                            cute.arch.atomic_add(ptr, lo)
                            cute.arch.atomic_add(ptr + 1, hi)
        if cutlass.const_expr(spec.deterministic):
            walk.turns.end(b, h, m_block, walk.n_block)
