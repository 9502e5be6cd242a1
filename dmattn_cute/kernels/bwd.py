"""Backward kernel: FlashAttention-2 style (mma.sync), one CTA per (key block, kv head, batch).

The CTA keeps its K and V tiles in shared memory and dK, dV in registers, and walks the query
heads of its group and the query blocks its causal/window range allows. Per (head, query
block) step it recomputes S from the bias-first accumulator, P = exp(S - max - log sum) from
the forward's per-row stats, then
dP = dO V^T, dS = P (dP - dpsum), and accumulates dV += P^T dO, dK += dS^T Q; dQ = dS K is
added to an fp32 accumulator in global memory. With a mask, the CTA scans the mask tiles of
the next SCAN_BLOCKS query blocks first: an all-False tile is skipped by the whole CTA (no
Q/dO/bias loads, no GEMMs), an all-True tile needs no mask tile in smem.

Shared-memory aliasing (per stage s):
- P (16-bit, swizzled) lives in the mask tile's buffer. The mask tile is read into registers
  when S is masked; barrier "scores consumed" in compute_step orders every thread's last mask
  read before any thread stores P. P is read by the dV GEMM; the next loads into stage s
  are issued only after the next step's "tiles landed" barrier.
- dS lives in the bias tile's buffer, under the same two barriers (the bias is read when S is
  initialised, dS is written after "scores consumed", read by the dK and dQ GEMMs).

dbias (the gradient of the post-softcap score) is written from dS in registers:
- full rows (bias Qm = Sq): element-wise, straight into dbias when this step is the element's
  only contribution (Bm = B, Hm = H), else added into an fp32 buffer of the bias's shape;
- rows summed (Qm = 1): column sums over the CTA's steps in registers, reduced across
  threads through shared memory once per head, one row per key block.
Additions are red.add atomics, or, deterministic, load-add-store by the single CTA that owns
the element (the host folds broadcast batch / kv-head dims into the CTA's loop for that).
dQ in deterministic mode is added in key-block order: a per-(batch, head, query block) turn
counter in global memory passes from key block n to n + 1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator

from ..jit.arch import compile_options
from . import masking, scores, tiles
from .config import (
    CACHED_WINDOWS,
    BwdTile,
    SmemBuffer,
    bwd_region_bytes,
    bwd_smem_buffers,
    bwd_tile,
    padded_head_dim,
    smem_total,
    tile_row_elems,
    warp_grid,
)
from .masking import SCAN_BLOCKS
from .spec import DTYPES, OperandSpec, dtype_bytes, env_stream, fake_rows, fake_tensor
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
    """

    dtype: str
    strides: tuple[str, str, str, str]
    rows_summed: bool
    direct: bool
    atomic: bool


@dataclass(frozen=True)
class BwdSpec:
    """One backward kernel variant: the compile key, tiling and launch facts.

    fold_batch / fold_heads: deterministic dbias of a bias broadcast over the batch / all kv
    heads: one CTA walks every batch / kv head of its key block, so it owns its dbias rows.
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
    ) -> BwdSpec:
        """The variant for these choices, tiled by the per-arch table (ValueError if nothing
        fits the architecture's shared memory)."""
        dp = padded_head_dim(head_dim)
        smem = [None if op is None else op.smem() for op in (mask, bias)]
        tile = bwd_tile(arch, dp, dtype_bytes(dtype), *smem)
        return BwdSpec(
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

    def smem_buffers(self) -> tuple[SmemBuffer, ...]:
        """The kernel's shared-memory buffers in allocation order (config.bwd_smem_buffers)."""
        smem = [None if op is None else op.smem() for op in (self.mask, self.bias)]
        return bwd_smem_buffers(self.tile, self.head_dim_padded, dtype_bytes(self.dtype), *smem)

    def smem_bytes(self) -> int:
        """Shared memory of one CTA, in bytes."""
        return smem_total(self.smem_buffers())

    def example_args(self) -> list:
        """FlashBwd's arguments for an offline compile (see FwdSpec.example_args)."""
        q, k, v, dout, dk, dv = (fake_rows(self.dtype) for _ in range(6))
        stats = fake_tensor("fp32", ("d", "d", "d", "1"), 4)
        dpsum = fake_tensor("fp32", ("d", "d", "1"), 4)
        dq_acc = fake_tensor("fp32", ("d", "d", "d", "1"), 16, stride_div=4)
        mask, bias = (None if op is None else op.fake() for op in (self.mask, self.bias))
        dbias = sem = None
        if self.dbias is not None:
            dbias = fake_tensor(self.dbias.dtype, self.dbias.strides, dtype_bytes(self.dbias.dtype))
        if self.deterministic:
            sem = fake_tensor("i32", ("d", "d", "1"), 4)
        return [q, k, v, dout, stats, dpsum, dq_acc, dk, dv, mask, bias, dbias, sem,
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


@cute.jit
def _gemm(tiled_mma, acc, rA, rB, sA, sB, s2r_A, s2r_B, rA_view, rB_view):
    """acc += A B with both operands read from smem by ldmatrix, k-block k+1 read while k is
    multiplied (sA/sB: the s2r partitions of one stage; rA_view/rB_view: retiled fragments)."""
    num_k = cute.size(sA.shape[2])
    cute.copy(s2r_A, sA[None, None, 0], rA_view[None, None, 0])
    cute.copy(s2r_B, sB[None, None, 0], rB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k + 1 < num_k):
            cute.copy(s2r_A, sA[None, None, k + 1], rA_view[None, None, k + 1])
            cute.copy(s2r_B, sB[None, None, k + 1], rB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, rA[None, None, k], rB[None, None, k], acc)


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
        mdK: cute.Tensor,  # [B, Sk, Hkv, D]
        mdV: cute.Tensor,  # [B, Sk, Hkv, D]
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
            1 if cutlass.const_expr(spec.fold_heads) else heads_kv,
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

    def _operand_tiles(
        self, op: OperandSpec, mX: cute.Tensor, b, hx, n_block, seqlen_q, seqlen_k, pack=1
    ):
        """gmem tiles (rows, N / pack, query blocks) of a mask/bias slice in key block n_block
        and their (row, col) coordinates; a query-broadcast operand has a single 1-row tile.
        pack > 1 reads `pack` elements as one 32-bit word (the mask scan)."""
        rows = 1 if op.row_broadcast else self.tile_m
        q_extent = 1 if op.row_broadcast else seqlen_q
        ptr = mX[b, hx, None, None].iterator
        if cutlass.const_expr(pack > 1):
            ptr = cute.recast_ptr(ptr, dtype=cutlass.Int32)
        cols = seqlen_k // pack
        view = cute.make_tensor(
            ptr, cute.make_layout((q_extent, cols), stride=(mX.stride[2] // pack, mX.stride[3]))
        )
        tile = (rows, self.tile_n // pack)
        gX = cute.local_tile(view, tile, (None, n_block))
        cX = cute.local_tile(cute.make_identity_tensor((q_extent, cols)), tile, (None, n_block))
        return gX, cX, q_extent

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
        nthr = self.num_threads
        tidx, _, _ = cute.arch.thread_idx()
        n_block, hk_block, b_block = cute.arch.block_idx()
        seqlen_q, seqlen_k, head_dim = mQ.shape[1], mK.shape[1], mQ.shape[3]
        num_m = cute.ceil_div(seqlen_q, tm)

        # ---- shared memory ----
        smem = SmemAllocator()
        sK = smem.allocate_tensor(self.dtype, sK_layout, 1024)
        sV = smem.allocate_tensor(self.dtype, sK_layout, 1024)
        sQ = smem.allocate_tensor(self.dtype, sQ_layout, 1024)
        sdO = smem.allocate_tensor(self.dtype, sQ_layout, 1024)
        region_p = smem.allocate_array(cutlass.Uint8, st * self.region_p, byte_alignment=1024)
        region_ds = smem.allocate_array(cutlass.Uint8, st * self.region_ds, byte_alignment=1024)
        sP = cute.make_tensor(cute.recast_ptr(region_p, dtype=self.dtype), sP_layout)
        sdS = cute.make_tensor(cute.recast_ptr(region_ds, dtype=self.dtype), sdS_layout)
        wm_count = self.sdp_grid[0]
        s_colsum = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((wm_count, tn), stride=(tn, 1)), 16
        )
        s_words = smem.allocate_tensor(
            cutlass.Int32,
            cute.make_layout((2, self.num_warps), stride=(self.num_warps, 1)),
            4,
        )
        # Scan bitmaps (visible, all-True) of the first CACHED_WINDOWS windows, reused by the
        # other query heads of the group when they read the same mask head.
        s_bits = smem.allocate_tensor(
            cutlass.Int32, cute.make_layout((2, CACHED_WINDOWS), stride=(CACHED_WINDOWS, 1)), 4
        )
        # Transposed views: the dV/dK GEMMs read P^T, dS^T, dO^T, Q^T; the dQ GEMM reads K^T.
        sPt = tiles.transposed(sP, tm, tn, st)
        sdSt = tiles.transposed(sdS, tm, tn, st)
        sQt = tiles.transposed(sQ, tm, dp, st)
        sdOt = tiles.transposed(sdO, tm, dp, st)
        sKt = tiles.transposed(sK, tn, dp)

        # ---- MMA fragments and ldmatrix copies ----
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), self.dtype)
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        mm = SimpleNamespace(mma_sdp=mma_sdp, mma_dkv=mma_dkv, mma_dq=mma_dq, thr_sdp=thr_sdp)
        for name, thr_mma, tiled_mma, src, is_a, atom_ in (
            ("Q", thr_sdp, mma_sdp, sQ, True, ldsm),
            ("K", thr_sdp, mma_sdp, sK, False, ldsm),
            ("dO", thr_sdp, mma_sdp, sdO, True, ldsm),
            ("V", thr_sdp, mma_sdp, sV, False, ldsm),
            ("Pt", thr_dkv, mma_dkv, sPt, True, ldsm_t),
            ("dOt", thr_dkv, mma_dkv, sdOt, False, ldsm_t),
            ("dSt", thr_dkv, mma_dkv, sdSt, True, ldsm_t),
            ("Qt", thr_dkv, mma_dkv, sQt, False, ldsm_t),
            ("dS", thr_dq, mma_dq, sdS, True, ldsm),
            ("Kt", thr_dq, mma_dq, sKt, False, ldsm_t),
        ):
            staged = cute.rank(src) == 3
            one = src[None, None, 0] if staged else src
            if cutlass.const_expr(is_a):
                frag = thr_mma.make_fragment_A(thr_mma.partition_A(one))
                s2r = cute.make_tiled_copy_A(atom_, tiled_mma)
            else:
                frag = thr_mma.make_fragment_B(thr_mma.partition_B(one))
                s2r = cute.make_tiled_copy_B(atom_, tiled_mma)
            thr_s2r = s2r.get_slice(tidx)
            setattr(mm, "r" + name, frag)
            setattr(mm, "v" + name, thr_s2r.retile(frag))
            setattr(mm, "s" + name, thr_s2r.partition_S(src))
            setattr(mm, "c" + name, s2r)

        r2s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        r2s_sdp = cute.make_tiled_copy_C(r2s, mma_sdp).get_slice(tidx)
        mm.r2s_sdp = r2s_sdp
        mm.tPsP = r2s_sdp.partition_D(sP)
        mm.tdSsdS = r2s_sdp.partition_D(sdS)

        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, dp)), cutlass.Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, dp)), cutlass.Float32)
        acc_shape_s = thr_sdp.partition_shape_C((tm, tn))
        # (row, col) of every score this thread holds, per query block
        cS = cute.local_tile(
            cute.make_identity_tensor((seqlen_q, seqlen_k)), (tm, tn), (None, n_block)
        )
        tScS = thr_sdp.partition_C(cS)
        colsum = cute.make_rmem_tensor(
            cute.size(acc_mn_view(tScS[None, None, None, 0]).shape[1]), cutlass.Float32
        )

        # ---- mask and bias smem tiles (stage stride: the P / dS buffers they share) ----
        sops = {}
        for name, op, region, region_bytes in (
            ("mask", spec.mask, region_p, self.region_p),
            ("bias", spec.bias, region_ds, self.region_ds),
        ):
            if cutlass.const_expr(op is not None):
                dtype = DTYPES[op.dtype]
                ebytes = dtype.width // 8
                rows = 1 if op.row_broadcast else tm
                pitch = tile_row_elems(tn, ebytes)
                stage_elems = region_bytes // ebytes
                sX = cute.make_tensor(
                    cute.recast_ptr(region, dtype=dtype),
                    cute.make_layout((rows, tn, st), stride=(pitch, 1, stage_elems)),
                )
                tcopy, used = tiles.operand_copy(dtype, rows, tn, op.vec, nthr)
                # Scores of every row read row 0 of a query-broadcast tile (stride 0).
                s_view = cute.make_tensor(
                    sX.iterator,
                    cute.make_layout(
                        (tm, tn, st), stride=(0 if op.row_broadcast else pitch, 1, stage_elems)
                    ),
                )
                sops[name] = SimpleNamespace(
                    copy=tcopy,
                    used=used,
                    tXsX=tcopy.get_slice(tidx % used).partition_D(sX),
                    tSsX=thr_sdp.partition_C(s_view),
                )

        limits = SimpleNamespace(
            n_block=n_block,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            window_left=window_left,
            window_right=window_right,
        )
        score_args = SimpleNamespace(
            scale_log2=scale_log2,
            bias_scale=bias_scale,
            softcap_scale=softcap_scale,
            softcap=softcap,
            softmax_scale=softmax_scale,
        )
        m_min, m_max = masking.query_block_range(
            n_block, seqlen_q, seqlen_k, window_left, window_right, tm, tn, spec.has_window
        )
        # Deterministic dQ passes a turn per query block from key block to key block, so every
        # CTA visits every query block (skipped ones only pass the turn on).
        m_lo, m_hi = m_min, m_max
        if cutlass.const_expr(spec.deterministic):
            m_lo, m_hi = cutlass.Int32(0), num_m
        # state: [0] visible and [2] all-True bits of the current scan window, [1] the stage
        # the next load fills, [3] the query block whose tiles that load already holds
        state = cute.make_rmem_tensor(4, cutlass.Int32)
        thr_qkv = copy_qkv.get_slice(tidx)

        ctx = SimpleNamespace(
            mQ=mQ, mK=mK, mV=mV, mdO=mdO, mStats=mStats, mDpsum=mDpsum, mdQacc=mdQacc, mdK=mdK,
            mdV=mdV, mMask=mMask, mBias=mBias, mdBias=mdBias, mSem=mSem, sK=sK, sV=sV, sQ=sQ,
            sdO=sdO, sops=sops, mm=mm, limits=limits, scores=score_args, acc_dK=acc_dK,
            acc_dV=acc_dV, tScS=tScS, acc_shape_s=acc_shape_s, colsum=colsum, state=state,
            s_words=s_words, s_bits=s_bits, s_colsum=s_colsum, copy_qkv=copy_qkv, thr_qkv=thr_qkv,
            copy_out=copy_out, r2s=r2s, m_lo=m_lo, m_hi=m_hi, m_min=m_min, m_max=m_max,
            group=group, mask_head_div=mask_head_div, bias_head_div=bias_head_div, tidx=tidx,
            n_block=n_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
            softmax_scale=softmax_scale,
        )  # fmt: skip
        fold_b = mK.shape[0] if cutlass.const_expr(spec.fold_batch) else 1
        fold_h = mK.shape[2] if cutlass.const_expr(spec.fold_heads) else 1
        for fb in cutlass.range(fold_b, unroll=1):
            for fh in cutlass.range(fold_h, unroll=1):
                b = fb if cutlass.const_expr(spec.fold_batch) else b_block
                hk = fh if cutlass.const_expr(spec.fold_heads) else hk_block
                self.kv_block(ctx, b, hk)

    @cute.jit
    def kv_block(self, ctx, b, hk):
        """The CTA's work for one (batch, kv head): every query head of the group, every query
        block, then dK and dV of the key block."""
        spec = self.spec
        tn, dp, st = self.tile_n, self.head_dim_padded, self.stages
        n_block, tidx = ctx.n_block, ctx.tidx
        seqlen_k, head_dim = ctx.seqlen_k, ctx.head_dim
        sK, sV, state, acc_dK, acc_dV = ctx.sK, ctx.sV, ctx.state, ctx.acc_dK, ctx.acc_dV
        thr_qkv, copy_qkv, copy_out = ctx.thr_qkv, ctx.copy_qkv, ctx.copy_out
        mK, mV, mdK, mdV, colsum = ctx.mK, ctx.mV, ctx.mdK, ctx.mdV, ctx.colsum
        m_lo, m_hi, m_min, m_max = ctx.m_lo, ctx.m_hi, ctx.m_min, ctx.m_max
        sops, mm, tScS, s_bits, s_colsum = ctx.sops, ctx.mm, ctx.tScS, ctx.s_bits, ctx.s_colsum
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # ---- K and V of this key block (gmem -> smem), rows checked ----
        cKV = cute.local_tile(
            cute.make_identity_tensor((seqlen_k, head_dim)), (tn, dp), (n_block, 0)
        )
        tKVcKV = thr_qkv.partition_S(cKV)
        for mX, sX in ((mK, sK), (mV, sV)):
            gX = cute.local_tile(mX[b, None, hk, None], (tn, dp), (n_block, 0))
            tiles.copy_tile(
                copy_qkv,
                thr_qkv.partition_S(gX),
                thr_qkv.partition_D(sX),
                tKVcKV,
                seqlen_k,
                head_dim,
                True,
                not spec.even_d,
            )
        cute.arch.cp_async_commit_group()

        for hi in cutlass.range(ctx.group, unroll=1):
            h = hk * ctx.group + hi
            ld = self.head_loads(ctx, b, h)
            scan = self.mask_scan(ctx, b, h)
            out = SimpleNamespace(
                b=b,
                h=h,
                mStats=ctx.mStats,
                mDpsum=ctx.mDpsum,
                mdQacc=ctx.mdQacc,
                mdBias=ctx.mdBias,
                mSem=ctx.mSem,
                dbias_h=h // ctx.bias_head_div,
                colsum=colsum,
                tidx=tidx,
            )
            colsum.fill(0.0)
            state[1] = 0
            state[3] = -1
            cute.arch.sync_threads()  # the previous head's cached scan bitmaps are visible
            for m in cutlass.range(m_lo, m_hi, unroll=1):
                j = (m - m_lo) % SCAN_BLOCKS
                if j == 0:
                    visible = masking.range_bits(m, m_min, m_max)
                    full = cutlass.Int32(0)
                    if cutlass.const_expr(spec.mask is not None):
                        seen, every = self.window_bits(ctx, scan, s_bits, hi, m)
                        visible = visible & seen
                        full = every & visible
                    state[0] = visible
                    state[2] = full
                    first = masking.next_set_bit(visible, -1)
                    # (without a mask the previous step may have prefetched it already)
                    if first < SCAN_BLOCKS and m + first != state[3]:
                        self.load_step(ld, m + first, state[1], (full >> first) & 1)
                    cute.arch.cp_async_commit_group()
                if ((state[0] >> j) & 1) != 0:
                    stage = state[1]
                    # The next step: the next set bit of this window; without a mask simply the
                    # next block, also across windows (all bits of a window are known ahead).
                    step = masking.next_set_bit(state[0], j) - j
                    has_next = (j + step < SCAN_BLOCKS) & (m + step < m_hi)
                    if cutlass.const_expr(spec.mask is None):
                        step = cutlass.Int32(1)
                        has_next = m + 1 < m_max
                    full_next = (state[2] >> (j + step)) & 1
                    cute.arch.cp_async_wait_group(0)
                    # "tiles landed": this step's tiles are in smem for every thread,
                    # and every thread is done with the stage the next load refills.
                    cute.arch.sync_threads()
                    if cutlass.const_expr(st == 2):
                        if has_next:
                            self.load_step(ld, m + step, 1 - stage, full_next)
                            state[3] = m + step
                        cute.arch.cp_async_commit_group()
                        state[1] = 1 - stage
                    self.compute_step(
                        sops, mm, ctx.limits, ctx.scores, out, acc_dK, acc_dV, tScS,
                        ctx.acc_shape_s, m, stage, (state[2] >> j) & 1,
                    )  # fmt: skip
                    if cutlass.const_expr(st == 1):
                        cute.arch.sync_threads()  # the single stage is no longer read
                        if has_next:
                            self.load_step(ld, m + step, 0, full_next)
                            state[3] = m + step
                        cute.arch.cp_async_commit_group()
                else:
                    if cutlass.const_expr(spec.deterministic):
                        self.pass_turn(out, m, n_block)
            if cutlass.const_expr(spec.dbias is not None):
                if cutlass.const_expr(spec.dbias.rows_summed):
                    self.flush_colsum(out, s_colsum, tScS, n_block, seqlen_k)

        # ---- dK, dV (rmem -> smem over K/V -> gmem) ----
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # every GEMM is done reading sK / sV
        acc_dK.store(acc_dK.load() * ctx.softmax_scale)
        r2s_dkv = cute.make_tiled_copy_C(ctx.r2s, mm.mma_dkv).get_slice(tidx)
        thr_out = copy_out.get_slice(tidx)
        for acc, sX in ((acc_dK, sK), (acc_dV, sV)):
            rX = cute.make_rmem_tensor_like(acc, self.dtype)
            rX.store(acc.load().to(self.dtype))
            cute.copy(r2s_dkv, r2s_dkv.retile(rX), r2s_dkv.partition_D(sX))
        cute.arch.sync_threads()  # dK / dV complete in smem before the row-wise reads
        tOcO = thr_out.partition_D(cKV)
        for mX, sX in ((mdK, sK), (mdV, sV)):
            gX = cute.local_tile(mX[b, None, hk, None], (tn, dp), (n_block, 0))
            tOgO = thr_out.partition_D(gX)
            tOrO = cute.make_rmem_tensor_like(tOgO, self.dtype)
            cute.copy(copy_out, thr_out.partition_S(sX), tOrO)
            for r in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
                for c in cutlass.range_constexpr(cute.size(tOrO.shape[2])):
                    row, col = tOcO[0, r, c]
                    if row < seqlen_k and col < head_dim:
                        cute.copy(copy_out, tOrO[None, r, c], tOgO[None, r, c])
        cute.arch.sync_threads()  # sK / sV are read before the next fold reloads them

    @cute.jit
    def window_bits(self, ctx, scan, s_bits, hi, m_first):
        """(visible, all-True) bits of the scan window starting at query block m_first: scanned,
        or, for the group's later heads when the mask is shared by the group (Hm in {1, Hkv}),
        read back from shared memory."""
        w = (m_first - ctx.m_lo) // SCAN_BLOCKS
        shared = ctx.mask_head_div % ctx.group == 0
        seen = cutlass.Int32(0)
        every = cutlass.Int32(0)
        if hi > 0 and shared and w < CACHED_WINDOWS:
            seen = s_bits[0, w]
            every = s_bits[1, w]
        else:
            seen, every = masking.scan_mask_blocks(
                scan, m_first, ctx.m_max, ctx.s_words, ctx.tidx, self.num_warps
            )
            # read by the later heads, after the barrier that starts each head
            if w < CACHED_WINDOWS and ctx.tidx == 0:
                s_bits[0, w] = seen
                s_bits[1, w] = every
        return seen, every

    def head_loads(self, ctx, b, h):
        """gmem -> smem partitions of the Q, dO, mask and bias tiles of query head h."""
        tm, dp = self.tile_m, self.head_dim_padded
        seqlen_q, seqlen_k, head_dim = ctx.seqlen_q, ctx.seqlen_k, ctx.head_dim
        n_block, tidx, thr_qkv, sops = ctx.n_block, ctx.tidx, ctx.thr_qkv, ctx.sops
        mQ, mdO, mMask, mBias, sQ, sdO = ctx.mQ, ctx.mdO, ctx.mMask, ctx.mBias, ctx.sQ, ctx.sdO
        mask_head_div, bias_head_div = ctx.mask_head_div, ctx.bias_head_div
        cQ = cute.local_tile(cute.make_identity_tensor((seqlen_q, head_dim)), (tm, dp), (None, 0))
        ops = {}
        for name, op, mX, head_div in (
            ("mask", self.spec.mask, mMask, mask_head_div),
            ("bias", self.spec.bias, mBias, bias_head_div),
        ):
            if cutlass.const_expr(op is not None):
                gX, cX, row_end = self._operand_tiles(
                    op, mX, b, h // head_div, n_block, seqlen_q, seqlen_k
                )
                s = sops[name]
                thr_x = s.copy.get_slice(tidx % s.used)
                ops[name] = SimpleNamespace(
                    copy=s.copy,
                    used=s.used,
                    same_tile=op.row_broadcast,
                    tXgX=thr_x.partition_S(gX),
                    tXsX=s.tXsX,
                    tXcX=thr_x.partition_S(cX),
                    row_end=row_end,
                )
        return SimpleNamespace(
            ops=ops,
            tidx=tidx,
            copy_qkv=ctx.copy_qkv,
            tQgQ=thr_qkv.partition_S(cute.local_tile(mQ[b, None, h, None], (tm, dp), (None, 0))),
            tdOgdO=thr_qkv.partition_S(cute.local_tile(mdO[b, None, h, None], (tm, dp), (None, 0))),
            tQsQ=thr_qkv.partition_D(sQ),
            tdOsdO=thr_qkv.partition_D(sdO),
            tQcQ=thr_qkv.partition_S(cQ),
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            head_dim=head_dim,
        )

    def mask_scan(self, ctx, b, h):
        """The gmem -> rmem partition the mask scan reads (None without a mask)."""
        op = self.spec.mask
        if cutlass.const_expr(op is None):
            return None
        seqlen_q, seqlen_k, n_block, tidx = ctx.seqlen_q, ctx.seqlen_k, ctx.n_block, ctx.tidx
        mMask, hm, sops = ctx.mMask, h // ctx.mask_head_div, ctx.sops
        rows = 1 if op.row_broadcast else self.tile_m
        # Rows that allow 4-byte loads are scanned as 32-bit words: 4 mask bytes per OR/AND.
        pack = 4 if op.vec >= 4 else 1
        gM, cM, row_end = self._operand_tiles(op, mMask, b, hm, n_block, seqlen_q, seqlen_k, pack)
        scan_dtype = cutlass.Int32 if pack == 4 else cutlass.Uint8
        scan_copy, _ = tiles.operand_copy(
            scan_dtype, rows, self.tile_n // pack, op.vec // pack, self.num_threads,
            to_registers=True,
        )  # fmt: skip
        used = sops["mask"].used
        thr_scan = scan_copy.get_slice(tidx % used)
        tMgM = thr_scan.partition_S(gM)
        return SimpleNamespace(
            copy=scan_copy,
            used=used,
            row_end=row_end,
            col_end=seqlen_k // pack,
            tXgX=tMgM,
            tXcX=thr_scan.partition_S(cM),
            frag=cute.make_rmem_tensor_like(tMgM[None, None, None, 0]),
            words=pack == 4,
            same_tile=op.row_broadcast,
        )

    @cute.jit
    def load_operand(self, ld, name: cutlass.Constexpr, m_block, stage):
        """Mask or bias tile of query block m_block (gmem -> smem), bounds always checked."""
        o = ld.ops[name]
        tile = 0 if cutlass.const_expr(o.same_tile) else m_block
        if ld.tidx < o.used:
            tiles.copy_tile(
                o.copy,
                o.tXgX[None, None, None, tile],
                o.tXsX[None, None, None, stage],
                o.tXcX[None, None, None, tile],
                o.row_end,
                ld.seqlen_k,
                True,
                True,
            )

    @cute.jit
    def load_step(self, ld, m_block, stage, mask_full):
        """Q, dO, mask and bias tiles of query block m_block (gmem -> smem); Q/dO rows are
        checked on the tail block only; an all-True mask tile (mask_full != 0) is not loaded."""
        even_d = self.spec.even_d
        for tXgX, tXsX in ((ld.tQgQ, ld.tQsQ), (ld.tdOgdO, ld.tdOsdO)):
            src = tXgX[None, None, None, m_block]
            dst = tXsX[None, None, None, stage]
            coord = ld.tQcQ[None, None, None, m_block]
            if (m_block + 1) * self.tile_m > ld.seqlen_q:
                tiles.copy_tile(
                    ld.copy_qkv, src, dst, coord, ld.seqlen_q, ld.head_dim, True, not even_d
                )
            else:
                tiles.copy_tile(
                    ld.copy_qkv, src, dst, coord, ld.seqlen_q, ld.head_dim, False, not even_d
                )
        if cutlass.const_expr(self.spec.mask is not None):
            if mask_full == 0:
                self.load_operand(ld, "mask", m_block, stage)
        if cutlass.const_expr(self.spec.bias is not None):
            self.load_operand(ld, "bias", m_block, stage)

    @cute.jit
    def compute_step(
        self, sops, mm, limits, scores_in, out, acc_dK, acc_dV, tScS, acc_shape_s, m_block, stage,
        mask_full,
    ):  # fmt: skip
        """One (head, query block) step on the tiles in smem stage `stage`: S, P, dP, dS,
        dbias, then dV += P^T dO, dK += dS^T Q and dQ += dS K (fp32, global memory)."""
        spec = self.spec
        tm, tn, dp = self.tile_m, self.tile_n, self.head_dim_padded
        b, h = out.b, out.h
        coord = tScS[None, None, None, m_block]
        coord_mn = acc_mn_view(coord)

        # The forward's row max (accumulator units) and log2 row sum (+inf for rows past Sq
        # and fully masked rows: P = 0 there), and dpsum, per row. Without a bias, max and sum
        # fold into one log2 shift; with one, the max is subtracted before scaling, as in the
        # forward (a finfo.min bias row keeps its 1/n weights, see kernels/softmax.py).
        rows = cute.size(coord_mn.shape[0])
        row_max = cute.make_rmem_tensor(rows, cutlass.Float32)
        log2sum = cute.make_rmem_tensor(rows, cutlass.Float32)
        dpsum = cute.make_rmem_tensor(rows, cutlass.Float32)
        for r in cutlass.range_constexpr(rows):
            row = coord_mn[r, 0][0]
            row_max[r] = 0.0
            log2sum[r] = cutlass.Float32.inf
            dpsum[r] = 0.0
            if row < limits.seqlen_q:
                row_max[r] = out.mStats[b, h, 0, row]
                log2sum[r] = out.mStats[b, h, 1, row]
                dpsum[r] = out.mDpsum[b, h, row]
            if cutlass.const_expr(spec.bias is None):
                log2sum[r] = row_max[r] * scores_in.scale_log2 + log2sum[r]

        # ---- S = bias + Q K^T (bias-first: S starts as bias / scale) ----
        acc_S = cute.make_rmem_tensor(acc_shape_s, cutlass.Float32)
        if cutlass.const_expr(spec.bias is not None and not spec.has_softcap):
            tSsB = sops["bias"].tSsX[None, None, None, stage]
            acc_S.store(scores.bias_scores(tSsB.load(), scores_in.bias_scale))
        else:
            acc_S.fill(0.0)
        _gemm(
            mm.mma_sdp, acc_S, mm.rQ, mm.rK, mm.sQ[None, None, None, stage], mm.sK,
            mm.cQ, mm.cK, mm.vQ, mm.vK,
        )  # fmt: skip
        dtanh = None
        if cutlass.const_expr(spec.has_softcap):
            capped = cute.math.tanh(acc_S.load() * scores_in.softcap_scale, fastmath=True)
            dtanh = cute.make_rmem_tensor(acc_shape_s, cutlass.Float32)
            dtanh.store(1.0 - capped * capped)
            capped = capped * scores_in.softcap
            if cutlass.const_expr(spec.bias is not None):
                tSsB = sops["bias"].tSsX[None, None, None, stage]
                capped = capped + scores.bias_scores(tSsB.load(), 1.0)
            acc_S.store(capped)
        if cutlass.const_expr(spec.mask is not None):
            if mask_full == 0:
                masking.apply_mask(acc_S, sops["mask"].tSsX[None, None, None, stage])
        if masking.block_needs_limits(
            limits.n_block,
            m_block,
            limits.seqlen_q,
            limits.seqlen_k,
            limits.window_left,
            limits.window_right,
            tm,
            tn,
            spec.has_window,
        ):
            masking.apply_limits(
                acc_S,
                coord,
                limits.seqlen_q,
                limits.seqlen_k,
                limits.window_left,
                limits.window_right,
                spec.has_window,
            )
        acc_mn = acc_mn_view(acc_S)
        for r in cutlass.range_constexpr(rows):
            s_row = acc_mn[r, None].load()
            if cutlass.const_expr(spec.bias is None):
                exponent = s_row * scores_in.scale_log2 - log2sum[r]
            else:
                exponent = (s_row - row_max[r]) * scores_in.scale_log2 - log2sum[r]
            acc_mn[r, None].store(cute.math.exp2(exponent, fastmath=True))

        # ---- dP = dO V^T, dS = P (dP - dpsum) ----
        acc_dP = cute.make_rmem_tensor(acc_shape_s, cutlass.Float32)
        acc_dP.fill(0.0)
        _gemm(
            mm.mma_sdp, acc_dP, mm.rdO, mm.rV, mm.sdO[None, None, None, stage], mm.sV,
            mm.cdO, mm.cV, mm.vdO, mm.vV,
        )  # fmt: skip
        dP_mn = acc_mn_view(acc_dP)
        for r in cutlass.range_constexpr(rows):
            dP_mn[r, None].store(acc_mn[r, None].load() * (dP_mn[r, None].load() - dpsum[r]))

        if cutlass.const_expr(spec.dbias is not None):
            self.dbias_step(out, acc_dP, coord, limits)
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
        _gemm(
            mm.mma_dkv, acc_dV, mm.rPt, mm.rdOt, mm.sPt[None, None, None, stage],
            mm.sdOt[None, None, None, stage], mm.cPt, mm.cdOt, mm.vPt, mm.vdOt,
        )  # fmt: skip
        _gemm(
            mm.mma_dkv, acc_dK, mm.rdSt, mm.rQt, mm.sdSt[None, None, None, stage],
            mm.sQt[None, None, None, stage], mm.cdSt, mm.cQt, mm.vdSt, mm.vQt,
        )  # fmt: skip

        # ---- dQ += scale * dS K (fp32 atomics into the accumulator) ----
        thr_dq = mm.mma_dq.get_slice(out.tidx)
        acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, dp)), cutlass.Float32)
        acc_dQ.fill(0.0)
        _gemm(
            mm.mma_dq, acc_dQ, mm.rdS, mm.rKt, mm.sdS[None, None, None, stage], mm.sKt,
            mm.cdS, mm.cKt, mm.vdS, mm.vKt,
        )  # fmt: skip
        gdQ = cute.local_tile(out.mdQacc[b, None, h, None], (tm, dp), (m_block, 0))
        cdQ = cute.local_tile(
            cute.make_identity_tensor((limits.seqlen_q, out.mdQacc.shape[3])), (tm, dp),
            (m_block, 0),
        )  # fmt: skip
        if cutlass.const_expr(spec.deterministic):
            self.wait_turn(out, m_block, limits.n_block)
        # Per row, pairs of adjacent columns (one red.v2 on sm_90); D is a multiple of 8, so a
        # pair lies wholly inside or outside D.
        dQ_mn = acc_mn_view(acc_dQ)
        g_mn = acc_mn_view(thr_dq.partition_C(gdQ))
        c_mn = acc_mn_view(thr_dq.partition_C(cdQ))
        head_dim = out.mdQacc.shape[3]
        for r in cutlass.range_constexpr(cute.size(dQ_mn.shape[0])):
            if c_mn[r, 0][0] < limits.seqlen_q:
                for c in cutlass.range_constexpr(0, cute.size(dQ_mn.shape[1]), 2):
                    inside = cutlass.Boolean(True)
                    if cutlass.const_expr(not spec.even_d):
                        inside = c_mn[0, c][1] < head_dim
                    if inside:
                        ptr = g_mn.iterator + cute.crd2idx((r, c), g_mn.layout)
                        lo = dQ_mn[r, c] * scores_in.softmax_scale
                        hi = dQ_mn[r, c + 1] * scores_in.softmax_scale
                        if cutlass.const_expr(spec.vector_atomics):
                            red_add_f32x2(ptr, lo, hi)
                        else:
                            cute.arch.atomic_add(ptr, lo)
                            cute.arch.atomic_add(ptr + 1, hi)
        if cutlass.const_expr(spec.deterministic):
            self.end_turn(out, m_block, limits.n_block)

    @cute.jit
    def dbias_step(self, out, acc_dS, coord, limits):
        """This step's dS (fp32, accumulator layout) into dbias (see the module docstring)."""
        db = self.spec.dbias
        dS_mn = acc_mn_view(acc_dS)
        coord_mn = acc_mn_view(coord)
        if cutlass.const_expr(db.rows_summed):
            # Rows past Sq and columns past Sk hold dS = 0 (P = 0 there).
            for c in cutlass.range_constexpr(cute.size(dS_mn.shape[1])):
                total = out.colsum[c]
                for r in cutlass.range_constexpr(cute.size(dS_mn.shape[0])):
                    total = total + dS_mn[r, c]
                out.colsum[c] = total
        else:
            mdB = out.mdBias
            for r in cutlass.range_constexpr(cute.size(dS_mn.shape[0])):
                row = coord_mn[r, 0][0]
                for c in cutlass.range_constexpr(cute.size(dS_mn.shape[1])):
                    col = coord_mn[0, c][1]
                    if row < limits.seqlen_q and col < limits.seqlen_k:
                        self.dbias_add(mdB, (out.b, out.dbias_h, row, col), dS_mn[r, c])

    @cute.jit
    def dbias_add(self, mdB, crd, value):
        """One contribution to dbias[crd]: store (direct), atomic add or load-add-store."""
        db = self.spec.dbias
        if cutlass.const_expr(db.direct):
            mdB[crd] = value.to(DTYPES[db.dtype])
        elif cutlass.const_expr(db.atomic):
            ptr = mdB.iterator + cute.crd2idx(crd, mdB.layout)
            cute.arch.atomic_add(ptr, value)
        else:
            mdB[crd] = mdB[crd] + value

    @cute.jit
    def flush_colsum(self, out, s_colsum, tScS, n_block, seqlen_k):
        """Add this head's dS column sums (query-broadcast bias) into dbias row 0: lanes that
        share columns by shuffles, warps through shared memory in a fixed order."""
        tn = self.tile_n
        coord_mn = acc_mn_view(tScS[None, None, None, 0])
        lane = out.tidx % 32
        warp_m = (coord_mn[0, 0][0] // 16) % self.sdp_grid[0]
        for c in cutlass.range_constexpr(cute.size(out.colsum)):
            value = out.colsum[c]
            # lanes 4 apart hold the same columns of other rows
            for offset in cutlass.range_constexpr(3):
                value = value + cute.arch.shuffle_sync_bfly(value, offset=4 << offset)
            if lane < 4:
                s_colsum[warp_m, coord_mn[0, c][1] - n_block * tn] = value
        cute.arch.sync_threads()  # every warp's sums are in shared memory
        if out.tidx < tn:
            total = cutlass.Float32(0.0)
            for w in cutlass.range_constexpr(self.sdp_grid[0]):
                total = total + s_colsum[w, out.tidx]
            col = n_block * tn + out.tidx
            if col < seqlen_k:
                self.dbias_add(out.mdBias, (out.b, out.dbias_h, 0, col), total)
        cute.arch.sync_threads()  # the sums are read before the next head rewrites them

    @cute.jit
    def wait_turn(self, out, m_block, n_block):
        """Deterministic dQ: wait until key blocks 0..n_block-1 have added their dQ of
        (batch, head, m_block)."""
        ptr = out.mSem.iterator + cute.crd2idx((out.b, out.h, m_block), out.mSem.layout)
        if out.tidx == 0:
            turn = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
            while turn != n_block:
                turn = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
        cute.arch.sync_threads()  # the whole CTA adds after the previous key block

    @cute.jit
    def end_turn(self, out, m_block, n_block):
        """Deterministic dQ: this key block's additions are visible; pass the turn on."""
        ptr = out.mSem.iterator + cute.crd2idx((out.b, out.h, m_block), out.mSem.layout)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()  # every thread's additions precede the release
        if out.tidx == 0:
            cute.arch.store(ptr, n_block + 1, sem="release", scope="gpu")

    @cute.jit
    def pass_turn(self, out, m_block, n_block):
        """Deterministic dQ, skipped step: take the turn and pass it on with nothing added."""
        if out.tidx == 0:
            ptr = out.mSem.iterator + cute.crd2idx((out.b, out.h, m_block), out.mSem.layout)
            turn = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
            while turn != n_block:
                turn = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
            cute.arch.store(ptr, n_block + 1, sem="release", scope="gpu")
