"""Forward kernel: FlashAttention-2 style (mma.sync) with bias-first scores and mask tile skip.

One CTA per (query block, head, batch). Q is loaded once; the CTA walks the key blocks its
causal/window range allows. Per key block: S starts from the bias tile (not from zero), gets
Q K^T added by the tensor cores, is masked, goes through the online softmax and P V is added
to the output accumulator. With a mask, the CTA first scans the mask tiles of the next
SCAN_BLOCKS key blocks (gmem -> registers) into two CTA-uniform bitmaps: a block whose tile is
all False is skipped by the whole CTA (no K/V/bias loads, no GEMMs, no barriers), and a block
whose tile is all True needs no mask tile in smem and no per-element masking. K, V, mask and
bias tiles of the next visible block are loaded by cp.async while the current one is computed.
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

from ..jit.arch import compile_options
from . import gemm, masking, operands, tiles
from .config import (
    FwdTile,
    SmemBuffer,
    fwd_smem_buffers,
    fwd_tile,
    padded_head_dim,
    smem_total,
)
from .masking import SCAN_BLOCKS, ScanState
from .scores import Scores
from .softmax import OnlineSoftmax
from .spec import DTYPES, OperandSpec, dtype_bytes, env_stream, fake_rows, fake_tensor
from .utils import acc_as_a_operand, acc_mn_view


class FwdScalars(NamedTuple):
    """The scalar arguments of FlashFwd.__call__, named and ordered as there (launch.
    kernel_scalars builds them from a problem). The defaults are an offline compile's
    placeholders: any value of the right type."""

    scale_log2: float = 1.0
    bias_scale: float = 1.0
    softcap_scale: float = 0.0
    softcap: float = 0.0
    window_left: int = 0
    window_right: int = 0
    mask_head_div: int = 1
    bias_head_div: int = 1
    group: int = 1
    key_chunks: int = 1  # split-KV decode: see fwd_launch.flash_fwd


@dataclass(frozen=True)
class FwdSpec:
    """One forward kernel variant: the compile key, tiling and launch facts."""

    dtype: str
    head_dim_padded: int
    even_d: bool
    tile: FwdTile
    mask: OperandSpec | None
    bias: OperandSpec | None
    has_window: bool
    has_softcap: bool

    @staticmethod
    @functools.cache  # called on every launch; the tile search is pure
    def build(
        arch: str,
        dtype: str,
        head_dim: int,
        mask: OperandSpec | None,
        bias: OperandSpec | None,
        has_window: bool,
        has_softcap: bool,
    ) -> FwdSpec:
        """The variant for these choices, tiled by the per-arch table (ValueError if nothing
        fits the architecture's shared memory)."""
        dp = padded_head_dim(head_dim)
        smem = [None if op is None else op.smem() for op in (mask, bias)]
        tile = fwd_tile(arch, dp, dtype_bytes(dtype), *smem)
        return FwdSpec(dtype, dp, head_dim == dp, tile, mask, bias, has_window, has_softcap)

    def smem_buffers(self) -> tuple[SmemBuffer, ...]:
        """The kernel's shared-memory buffers in allocation order (config.fwd_smem_buffers)."""
        smem = [None if op is None else op.smem() for op in (self.mask, self.bias)]
        return fwd_smem_buffers(self.tile, self.head_dim_padded, dtype_bytes(self.dtype), *smem)

    def smem_bytes(self) -> int:
        """Shared memory of one CTA, in bytes."""
        return smem_total(self.smem_buffers())

    def example_args(self) -> list:
        """FlashFwd's arguments for an offline compile: fake gmem tensors with the stride
        patterns and alignment the launch guarantees (fwd_launch.flash_fwd), placeholder
        scalars."""
        q, k, v, out = (fake_rows(self.dtype) for _ in range(4))
        lse = fake_tensor("fp32", ("d", "d", "1"), 4)
        stats = fake_tensor("fp32", ("d", "d", "d", "1"), 4)
        mask, bias = (None if op is None else op.fake() for op in (self.mask, self.bias))
        return [q, k, v, out, lse, stats, mask, bias, *FwdScalars(), env_stream()]

    def compile(self, arch: str, extra_options: str = ""):
        """cute.compile of this variant for `arch` (no GPU needed)."""
        return cute.compile(
            FlashFwd(self), *self.example_args(), options=compile_options(arch, extra_options)
        )


class FlashFwd:
    """The forward kernel for one FwdSpec."""

    def __init__(self, spec: FwdSpec):
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        self.tile_m = spec.tile.tile_m
        self.tile_n = spec.tile.tile_n
        self.num_threads = spec.tile.num_threads
        self.kv_stages = spec.tile.kv_stages
        self.head_dim_padded = spec.head_dim_padded

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Sq, H, D]
        mK: cute.Tensor,  # [B, Sk, Hkv, D]
        mV: cute.Tensor,  # [B, Sk, Hkv, D]
        mO: cute.Tensor,  # [B, Sq, H, D]
        mLSE: cute.Tensor,  # [B, H, Sq] fp32
        mStats: cute.Tensor,  # [B, H, 2, Sq] fp32: row max (accumulator units), log2 row sum
        mMask: cute.Tensor | None,  # [Bm, Hm, Qm, Km] uint8 view of the bool mask
        mBias: cute.Tensor | None,  # [Bm, Hm, Qm, Km]
        scale_log2: cutlass.Float32,
        bias_scale: cutlass.Float32,
        softcap_scale: cutlass.Float32,
        softcap: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        mask_head_div: cutlass.Int32,
        bias_head_div: cutlass.Int32,
        group: cutlass.Int32,
        key_chunks: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dp, tn = self.head_dim_padded, self.tile_n
        atom = tiles.qkv_smem_atom(dp)
        sQ_layout = cute.tile_to_shape(atom, (self.tile_m, dp), (0, 1))
        sKV_layout = cute.tile_to_shape(atom, (tn, dp, self.kv_stages), (0, 1, 2))
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (self.num_threads // 32, 1, 1),
            permutation_mnk=(self.num_threads // 32 * 16, 16, 16),
        )
        copy_qkv = tiles.qkv_copy(self.dtype, dp, self.num_threads)
        copy_o = tiles.qkv_copy(self.dtype, dp, self.num_threads, store=True)
        # batch from O: with key chunks every chunk of a row is a batch entry
        grid = (cute.ceil_div(mQ.shape[1], self.tile_m), mQ.shape[2], mO.shape[0])
        self.kernel(
            mQ,
            mK,
            mV,
            mO,
            mLSE,
            mStats,
            mMask,
            mBias,
            scale_log2,
            bias_scale,
            softcap_scale,
            softcap,
            window_left,
            window_right,
            mask_head_div,
            bias_head_div,
            group,
            key_chunks,
            sQ_layout,
            sKV_layout,
            tiled_mma,
            copy_qkv,
            copy_o,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mStats: cute.Tensor,
        mMask: cute.Tensor | None,
        mBias: cute.Tensor | None,
        scale_log2: cutlass.Float32,
        bias_scale: cutlass.Float32,
        softcap_scale: cutlass.Float32,
        softcap: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        mask_head_div: cutlass.Int32,
        bias_head_div: cutlass.Int32,
        group: cutlass.Int32,
        key_chunks: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        copy_qkv: cute.TiledCopy,
        copy_o: cute.TiledCopy,
    ):
        spec = self.spec
        tm, tn, dp, nthr = self.tile_m, self.tile_n, self.head_dim_padded, self.num_threads
        tidx, _, _ = cute.arch.thread_idx()
        m_block, h, b = cute.arch.block_idx()
        # split-KV decode: batch entry b (of O and the row stats) is a chunk of the key blocks
        # of row b_op of Q, K, V, the mask and the bias (fwd_launch.flash_fwd's key_chunks)
        b_op = b // key_chunks
        hk = h // group
        seqlen_q, seqlen_k, head_dim = mQ.shape[1], mK.shape[1], mQ.shape[3]
        limits = masking.BlockLimits(
            seqlen_q, seqlen_k, window_left, window_right, tm, tn, spec.has_window
        )
        n_block_min, n_block_max = limits.key_block_range(m_block)
        n_block_min, n_block_max = masking.chunk_block_range(
            None, n_block_min, n_block_max, b - b_op * key_chunks, key_chunks
        )

        # ---- shared memory ----
        smem = tiles.allocate_smem(spec.smem_buffers())
        sQ = tiles.smem_tensor(smem["q"], self.dtype, sQ_layout)
        sK = tiles.smem_tensor(smem["k"], self.dtype, sKV_layout)
        sV = tiles.smem_tensor(smem["v"], self.dtype, sKV_layout)
        # V^T view for the P V GEMM: (D, N, stages)
        sVt = cute.composition(
            sV, cute.make_layout((dp, tn, self.kv_stages), stride=(tn, 1, tn * dp))
        )

        # ---- gmem tiles of this CTA ----
        gQ = cute.local_tile(mQ[b_op, None, h, None], (tm, dp), (m_block, 0))
        gK = cute.local_tile(mK[b_op, None, hk, None], (tn, dp), (None, 0))
        gV = cute.local_tile(mV[b_op, None, hk, None], (tn, dp), (None, 0))
        cQ = cute.local_tile(
            cute.make_identity_tensor((seqlen_q, head_dim)), (tm, dp), (m_block, 0)
        )
        cKV = cute.local_tile(cute.make_identity_tensor((seqlen_k, head_dim)), (tn, dp), (None, 0))
        thr_qkv = copy_qkv.get_slice(tidx)

        # ---- MMA operands (smem -> rmem by ldmatrix) and the output accumulator ----
        thr_mma = tiled_mma.get_slice(tidx)
        ldsm = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        ldsm_t = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
        )
        mm = SimpleNamespace(
            tiled_mma=tiled_mma,
            thr_mma=thr_mma,
            Q=gemm.GemmOperand.make(thr_mma, tiled_mma, sQ, True, ldsm, tidx),
            K=gemm.GemmOperand.make(thr_mma, tiled_mma, sK, False, ldsm, tidx),
            Vt=gemm.GemmOperand.make(thr_mma, tiled_mma, sVt, False, ldsm_t, tidx),
            # (row, col) of every score this thread holds, per key block
            tScS=thr_mma.partition_C(
                cute.local_tile(
                    cute.make_identity_tensor((seqlen_q, seqlen_k)), (tm, tn), (m_block, None)
                )
            ),
        )
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((tm, dp)), cutlass.Float32)
        acc_O.fill(0.0)

        # ---- mask and bias: smem stages, their gmem -> smem loads, accumulator-layout views ----
        loads = {}
        views = {}
        for name, op, mX, head_div in (
            ("mask", spec.mask, mMask, mask_head_div),
            ("bias", spec.bias, mBias, bias_head_div),
        ):
            if cutlass.const_expr(op is not None):
                dtype = DTYPES[op.dtype]
                stride = operands.stage_elems(op, tm, tn, dtype)
                sX, s_view, tcopy, used = operands.smem_stages(
                    smem[name], dtype, op, tm, tn, self.kv_stages, stride, nthr
                )
                gX, cX, row_end = operands.gmem_tiles(
                    op, mX, b_op, h // head_div, limits, m_block, None
                )
                loads[name] = operands.OperandLoads.make(
                    op, tcopy, used, gX, cX, sX, row_end, seqlen_k, tidx, walk_queries=False
                )
                views[name] = thr_mma.partition_C(s_view)
        kv = operands.WalkLoads(
            copy_qkv, thr_qkv.partition_S(gK), thr_qkv.partition_D(sK), thr_qkv.partition_S(gV),
            thr_qkv.partition_D(sV), thr_qkv.partition_S(cKV), seqlen_k, head_dim, tn,
            not spec.even_d, loads.get("mask"), loads.get("bias"),
        )  # fmt: skip
        scores = Scores(
            spec.bias is not None, spec.mask is not None, spec.has_softcap, bias_scale,
            softcap_scale, softcap, spec.bias is not None and spec.bias.row_broadcast,
        )  # fmt: skip
        softmax = OnlineSoftmax.create(
            cute.size(acc_mn_view(acc_O).shape[0]), scale_log2, spec.bias is not None
        )

        # With a mask, key blocks are visited through a bitmap of the blocks whose mask tile has a
        # True byte, scanned SCAN_BLOCKS at a time (gmem -> rmem, before any K/V/bias load):
        # all-False tiles cost neither loads nor GEMMs nor barriers, and all-True tiles skip the
        # mask's smem load and per-element masking.
        scan = None
        s_words = None
        if cutlass.const_expr(spec.mask is not None):
            scan = operands.mask_scan(
                spec.mask, mMask, b_op, h // mask_head_div, limits, m_block, None,
                loads["mask"].used, nthr, tidx,
            )  # fmt: skip
            s_words = tiles.smem_tensor(
                smem["scan_words"],
                cutlass.Int32,
                cute.make_layout((2, nthr // 32), stride=(nthr // 32, 1)),
            )
        state = cute.make_rmem_tensor(ScanState.SLOTS, cutlass.Int32)
        state[ScanState.VISIBLE] = -1
        state[ScanState.STAGE] = 0
        state[ScanState.FULL] = 0

        # ---- prologue: Q (gmem -> smem), unless no key block is visible ----
        if n_block_min < n_block_max:
            tiles.copy_tile(
                copy_qkv,
                thr_qkv.partition_S(gQ),
                thr_qkv.partition_D(sQ),
                thr_qkv.partition_S(cQ),
                seqlen_q,
                head_dim,
                True,
                not spec.even_d,
            )
            if cutlass.const_expr(spec.mask is None):
                kv.load(n_block_min, 0, 0)
        cute.arch.cp_async_commit_group()

        # ---- main loop over key blocks ----
        for n_block in cutlass.range(n_block_min, n_block_max, unroll=1):
            j = (n_block - n_block_min) % SCAN_BLOCKS
            if cutlass.const_expr(spec.mask is not None):
                if j == 0:
                    visible, full = masking.scan_mask_blocks(
                        scan, n_block, n_block_max, s_words, tidx, nthr // 32
                    )
                    state[ScanState.VISIBLE] = visible
                    state[ScanState.FULL] = full
                    first = masking.next_set_bit(visible, -1)
                    if first < SCAN_BLOCKS:
                        kv.load(n_block + first, state[ScanState.STAGE], (full >> first) & 1)
                    cute.arch.cp_async_commit_group()
            if ((state[ScanState.VISIBLE] >> j) & 1) != 0:
                stage = state[ScanState.STAGE]
                # The next visible block: with a mask, the next set bit of this scan window (the
                # window's last visible block has none; the next scan loads its successor).
                step = cutlass.Int32(1)
                if cutlass.const_expr(spec.mask is not None):
                    step = masking.next_set_bit(state[ScanState.VISIBLE], j) - j
                has_next = (j + step < SCAN_BLOCKS) & (n_block + step < n_block_max)
                if cutlass.const_expr(spec.mask is None):
                    has_next = n_block + 1 < n_block_max
                full_next = (state[ScanState.FULL] >> (j + step)) & 1
                cute.arch.cp_async_wait_group(0)
                # This block's tiles have landed for every thread, and every thread is done with
                # the previous block, whose stage the next load refills.
                cute.arch.sync_threads()
                if cutlass.const_expr(self.kv_stages == 2):
                    if has_next:
                        kv.load(n_block + step, 1 - stage, full_next)
                    cute.arch.cp_async_commit_group()
                    state[ScanState.STAGE] = 1 - stage
                full = (state[ScanState.FULL] >> j) & 1
                self.compute_block(
                    mm, views, limits, scores, softmax, acc_O, m_block, n_block, stage, full
                )
                if cutlass.const_expr(self.kv_stages == 1):
                    cute.arch.sync_threads()  # the single stage is no longer read
                    if has_next:
                        kv.load(n_block + step, 0, full_next)
                    cute.arch.cp_async_commit_group()

        # ---- epilogue: normalize, LSE and stats (rmem -> gmem), O (rmem -> smem -> gmem) ----
        lse = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)
        log2sum = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)
        softmax.finalize(acc_O, lse, log2sum)
        softmax.store_stats(
            lse, log2sum, acc_mn_view(mm.tScS[None, None, None, 0]), mLSE, mStats, b, h,
            seqlen_q, tidx, spec.bias is None,
        )  # fmt: skip

        sO = cute.make_tensor(sQ.iterator, sQ_layout)
        # No cp.async may still write sQ (a Q load with no key block consumed it, or a
        # prefetch past the last visible block), and every warp is done reading sQ/sV.
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        r2s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        tiles.acc_to_smem(acc_O, self.dtype, r2s, tiled_mma, tidx, sO)
        cute.arch.sync_threads()  # sO complete before the 16-byte row-wise reads below
        gO = cute.local_tile(mO[b, None, h, None], (tm, dp), (m_block, 0))
        tiles.store_tile(copy_o, copy_o.get_slice(tidx), sO, gO, cQ, seqlen_q, head_dim)

    @cute.jit
    def compute_block(
        self, mm, views, limits, scores, softmax, acc_O, m_block, n_block, stage, mask_full
    ):
        """S = bias + Q K^T, masking, online softmax and O += P V for one key block whose
        K/V/mask/bias tiles are in smem stage `stage` (no mask tile when mask_full != 0)."""
        spec = self.spec
        t_bias = t_mask = None
        if cutlass.const_expr(spec.bias is not None):
            t_bias = views["bias"][None, None, None, stage]
        if cutlass.const_expr(spec.mask is not None):
            t_mask = views["mask"][None, None, None, stage]
        acc_S = cute.make_rmem_tensor(
            mm.thr_mma.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32
        )
        scores.start(acc_S, t_bias)
        gemm.gemm(mm.tiled_mma, acc_S, mm.Q, mm.K, None, stage)
        scores.finish(acc_S, t_bias, t_mask, mask_full)
        limits.apply(acc_S, mm.tScS[None, None, None, n_block], m_block, n_block)
        softmax.update(acc_S, acc_O)

        # O += P V: P stays in registers, re-read as the A operand
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        tOrP = cute.make_tensor(rP.iterator, acc_as_a_operand(rP.layout))
        gemm.gemm_rs(mm.tiled_mma, acc_O, tOrP, mm.Vt, stage)
