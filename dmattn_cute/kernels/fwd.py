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
from cutlass.memory import SmemAllocator

from ..jit.arch import compile_options
from . import masking, scores, tiles
from .config import (
    FwdTile,
    SmemBuffer,
    fwd_smem_buffers,
    fwd_tile,
    padded_head_dim,
    smem_total,
    tile_row_elems,
)
from .masking import SCAN_BLOCKS
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
        grid = (cute.ceil_div(mQ.shape[1], self.tile_m), mQ.shape[2], mQ.shape[0])
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
            sQ_layout,
            sKV_layout,
            tiled_mma,
            copy_qkv,
            copy_o,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    def _operand_tiles(
        self, op: OperandSpec, mX: cute.Tensor, b, hx, m_block, seqlen_q, seqlen_k, pack=1
    ):
        """gmem tiles (rows, N / pack, n_blocks) of a mask/bias slice and their (row, col)
        coordinates; pack > 1 reads `pack` elements as one 32-bit word (the mask scan).

        The slice is re-viewed with the problem's logical extents (Sq or 1, Sk): broadcast dims
        keep stride 0 and read in place.
        """
        rows = 1 if op.row_broadcast else self.tile_m
        q_extent = 1 if op.row_broadcast else seqlen_q
        ptr = mX[b, hx, None, None].iterator
        if cutlass.const_expr(pack > 1):
            ptr = cute.recast_ptr(ptr, dtype=cutlass.Int32)
        cols = seqlen_k // pack
        view = cute.make_tensor(
            ptr, cute.make_layout((q_extent, cols), stride=(mX.stride[2] // pack, mX.stride[3]))
        )
        m_coord = 0 if op.row_broadcast else m_block
        tile = (rows, self.tile_n // pack)
        gX = cute.local_tile(view, tile, (m_coord, None))
        cX = cute.local_tile(cute.make_identity_tensor((q_extent, cols)), tile, (m_coord, None))
        return gX, cX, q_extent

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
        hk = h // group
        seqlen_q, seqlen_k, head_dim = mQ.shape[1], mK.shape[1], mQ.shape[3]

        n_block_min, n_block_max = masking.key_block_range(
            m_block, seqlen_q, seqlen_k, window_left, window_right, tm, tn, spec.has_window
        )

        # ---- shared memory ----
        smem = SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, sQ_layout, 1024)
        sK = smem.allocate_tensor(self.dtype, sKV_layout, 1024)
        sV = smem.allocate_tensor(self.dtype, sKV_layout, 1024)
        # V^T view for the P V GEMM: (D, N, stages)
        sVt = cute.composition(
            sV, cute.make_layout((dp, tn, self.kv_stages), stride=(tn, 1, tn * dp))
        )

        # ---- gmem tiles of this CTA ----
        gQ = cute.local_tile(mQ[b, None, h, None], (tm, dp), (m_block, 0))
        gK = cute.local_tile(mK[b, None, hk, None], (tn, dp), (None, 0))
        gV = cute.local_tile(mV[b, None, hk, None], (tn, dp), (None, 0))
        cQ = cute.local_tile(
            cute.make_identity_tensor((seqlen_q, head_dim)), (tm, dp), (m_block, 0)
        )
        cKV = cute.local_tile(cute.make_identity_tensor((seqlen_k, head_dim)), (tn, dp), (None, 0))

        thr_qkv = copy_qkv.get_slice(tidx)
        tQgQ, tQsQ, tQcQ = thr_qkv.partition_S(gQ), thr_qkv.partition_D(sQ), thr_qkv.partition_S(cQ)
        tKgK, tKsK = thr_qkv.partition_S(gK), thr_qkv.partition_D(sK)
        tVgV, tVsV = thr_qkv.partition_S(gV), thr_qkv.partition_D(sV)
        tKVcKV = thr_qkv.partition_S(cKV)

        # ---- MMA partitions and smem -> rmem copies (ldmatrix) ----
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((tm, dp)), cutlass.Float32)
        acc_O.fill(0.0)

        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        s2r_Q = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, self.dtype), tiled_mma)
        s2r_K = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, self.dtype), tiled_mma)
        s2r_V = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, self.dtype), tiled_mma)
        thr_s2r_Q, thr_s2r_K = s2r_Q.get_slice(tidx), s2r_K.get_slice(tidx)
        thr_s2r_V = s2r_V.get_slice(tidx)
        tSsQ, tSrQ_v = thr_s2r_Q.partition_S(sQ), thr_s2r_Q.retile(tSrQ)
        tSsK, tSrK_v = thr_s2r_K.partition_S(sK), thr_s2r_K.retile(tSrK)
        tOsVt, tOrVt_v = thr_s2r_V.partition_S(sVt), thr_s2r_V.retile(tOrVt)

        # (row, col) of every score this thread holds, per key block
        cS = cute.local_tile(
            cute.make_identity_tensor((seqlen_q, seqlen_k)), (tm, tn), (m_block, None)
        )
        tScS = thr_mma.partition_C(cS)

        # ---- mask and bias: smem stages, gmem tiles, copies, accumulator-layout views ----
        ops = {}
        for name, op, mX, head_div in (
            ("mask", spec.mask, mMask, mask_head_div),
            ("bias", spec.bias, mBias, bias_head_div),
        ):
            if cutlass.const_expr(op is not None):
                dtype = DTYPES[op.dtype]
                rows = 1 if op.row_broadcast else tm
                pitch = tile_row_elems(tn, dtype.width // 8)
                sX = smem.allocate_tensor(
                    dtype, tiles.operand_smem_layout(rows, tn, pitch, self.kv_stages), 16
                )
                gX, cX, row_end = self._operand_tiles(
                    op, mX, b, h // head_div, m_block, seqlen_q, seqlen_k
                )
                tcopy, used = tiles.operand_copy(dtype, rows, tn, op.vec, nthr)
                thr_x = tcopy.get_slice(tidx % used)
                # Scores of every row read row 0 of a query-broadcast tile (stride 0).
                row_stride = 0 if op.row_broadcast else pitch
                s_view = cute.make_tensor(
                    sX.iterator,
                    cute.make_layout(
                        (tm, tn, self.kv_stages), stride=(row_stride, 1, rows * pitch)
                    ),
                )
                ops[name] = SimpleNamespace(
                    copy=tcopy,
                    used=used,
                    tXgX=thr_x.partition_S(gX),
                    tXsX=thr_x.partition_D(sX),
                    tXcX=thr_x.partition_S(cX),
                    row_end=row_end,
                    tSsX=thr_mma.partition_C(s_view),
                )

        ld = SimpleNamespace(
            ops=ops,
            tidx=tidx,
            copy_qkv=copy_qkv,
            tKgK=tKgK,
            tKsK=tKsK,
            tVgV=tVgV,
            tVsV=tVsV,
            tKVcKV=tKVcKV,
            seqlen_k=seqlen_k,
            head_dim=head_dim,
        )
        mm = SimpleNamespace(
            tiled_mma=tiled_mma,
            thr_mma=thr_mma,
            tSrQ=tSrQ,
            tSrK=tSrK,
            tOrVt=tOrVt,
            tSsQ=tSsQ,
            tSrQ_v=tSrQ_v,
            tSsK=tSsK,
            tSrK_v=tSrK_v,
            tOsVt=tOsVt,
            tOrVt_v=tOrVt_v,
            s2r_Q=s2r_Q,
            s2r_K=s2r_K,
            s2r_V=s2r_V,
            tScS=tScS,
        )
        limits = SimpleNamespace(
            m_block=m_block,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            window_left=window_left,
            window_right=window_right,
        )
        score_args = SimpleNamespace(
            bias_scale=bias_scale, softcap_scale=softcap_scale, softcap=softcap
        )
        softmax = OnlineSoftmax(
            cute.size(acc_mn_view(acc_O).shape[0]), scale_log2, spec.bias is not None
        )

        # With a mask, key blocks are visited through a bitmap of the blocks whose mask tile has a
        # True byte, scanned SCAN_BLOCKS at a time (gmem -> rmem, before any K/V/bias load):
        # all-False tiles cost neither loads nor GEMMs nor barriers, and all-True tiles skip the
        # mask's smem load and per-element masking.
        scan = None
        s_words = None
        if cutlass.const_expr(spec.mask is not None):
            op = ops["mask"]
            rows = 1 if spec.mask.row_broadcast else tm
            # Rows that allow 4-byte loads are scanned as 32-bit words: 4 mask bytes per OR/AND.
            pack = 4 if spec.mask.vec >= 4 else 1
            gM, cM, _ = self._operand_tiles(
                spec.mask, mMask, b, h // mask_head_div, m_block, seqlen_q, seqlen_k, pack
            )
            scan_dtype = cutlass.Int32 if pack == 4 else cutlass.Uint8
            scan_copy, _ = tiles.operand_copy(
                scan_dtype, rows, tn // pack, spec.mask.vec // pack, nthr, to_registers=True
            )
            thr_scan = scan_copy.get_slice(tidx % op.used)
            tMgM = thr_scan.partition_S(gM)
            scan = SimpleNamespace(
                copy=scan_copy,
                used=op.used,
                row_end=op.row_end,
                col_end=seqlen_k // pack,
                tXgX=tMgM,
                tXcX=thr_scan.partition_S(cM),
                frag=cute.make_rmem_tensor_like(tMgM[None, None, None, 0]),
                words=pack == 4,
                same_tile=False,
            )
            s_words = smem.allocate_tensor(
                cutlass.Int32, cute.make_layout((2, nthr // 32), stride=(nthr // 32, 1)), 4
            )
        # state: bits of the current scan window's [0] visible and [2] all-True blocks,
        # [1] the stage the next load fills
        state = cute.make_rmem_tensor(3, cutlass.Int32)
        state[0] = -1
        state[1] = 0
        state[2] = 0

        # ---- prologue: Q (gmem -> smem), unless no key block is visible ----
        if n_block_min < n_block_max:
            tiles.copy_tile(copy_qkv, tQgQ, tQsQ, tQcQ, seqlen_q, head_dim, True, not spec.even_d)
            if cutlass.const_expr(spec.mask is None):
                self.load_block(ld, n_block_min, 0, 0)
        cute.arch.cp_async_commit_group()

        # ---- main loop over key blocks ----
        for n_block in cutlass.range(n_block_min, n_block_max, unroll=1):
            j = (n_block - n_block_min) % SCAN_BLOCKS
            if cutlass.const_expr(spec.mask is not None):
                if j == 0:
                    visible, full = masking.scan_mask_blocks(
                        scan, n_block, n_block_max, s_words, tidx, nthr // 32
                    )
                    state[0] = visible
                    state[2] = full
                    first = masking.next_set_bit(visible, -1)
                    if first < SCAN_BLOCKS:
                        self.load_block(ld, n_block + first, state[1], (full >> first) & 1)
                    cute.arch.cp_async_commit_group()
            if ((state[0] >> j) & 1) != 0:
                stage = state[1]
                # The next visible block: with a mask, the next set bit of this scan window (the
                # window's last visible block has none; the next scan loads its successor).
                step = cutlass.Int32(1)
                if cutlass.const_expr(spec.mask is not None):
                    step = masking.next_set_bit(state[0], j) - j
                has_next = (j + step < SCAN_BLOCKS) & (n_block + step < n_block_max)
                if cutlass.const_expr(spec.mask is None):
                    has_next = n_block + 1 < n_block_max
                cute.arch.cp_async_wait_group(0)
                # This block's tiles have landed for every thread, and every thread is done with
                # the previous block, whose stage the next load refills.
                cute.arch.sync_threads()
                if cutlass.const_expr(self.kv_stages == 2):
                    if has_next:
                        self.load_block(ld, n_block + step, 1 - stage, (state[2] >> (j + step)) & 1)
                    cute.arch.cp_async_commit_group()
                    state[1] = 1 - stage
                full = (state[2] >> j) & 1
                self.compute_block(
                    ops, mm, limits, score_args, softmax, acc_O, n_block, stage, full
                )
                if cutlass.const_expr(self.kv_stages == 1):
                    cute.arch.sync_threads()  # the single stage is no longer read
                    if has_next:
                        self.load_block(ld, n_block + step, 0, (state[2] >> (j + step)) & 1)
                    cute.arch.cp_async_commit_group()

        # ---- epilogue: normalize, LSE (rmem -> gmem), O (rmem -> smem -> gmem) ----
        lse = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)
        log2sum = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)
        softmax.finalize(acc_O, lse, log2sum)
        coord_mn = acc_mn_view(tScS[None, None, None, 0])
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = coord_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE[b, h, row] = lse[r]
                    row_max = softmax.row_max[r]
                    mStats[b, h, 0, row] = 0.0 if row_max == -cutlass.Float32.inf else row_max
                    mStats[b, h, 1, row] = log2sum[r]

        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        sO = cute.make_tensor(sQ.iterator, sQ_layout)
        # No cp.async may still write sQ (a Q load with no key block consumed it, or a
        # prefetch past the last visible block), and every warp is done reading sQ/sV.
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        r2s_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
        )
        thr_r2s_O = r2s_O.get_slice(tidx)
        cute.copy(r2s_O, thr_r2s_O.retile(rO), thr_r2s_O.partition_D(sO))
        cute.arch.sync_threads()  # sO complete before the 16-byte row-wise reads below
        gO = cute.local_tile(mO[b, None, h, None], (tm, dp), (m_block, 0))
        thr_o = copy_o.get_slice(tidx)
        tOsO, tOgO = thr_o.partition_S(sO), thr_o.partition_D(gO)
        tOcO = thr_o.partition_D(cQ)
        tOrO = cute.make_rmem_tensor_like(tOgO, self.dtype)
        cute.copy(copy_o, tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            for k in cutlass.range_constexpr(cute.size(tOrO.shape[2])):
                row, col = tOcO[0, m, k]
                if row < seqlen_q and col < head_dim:
                    cute.copy(copy_o, tOrO[None, m, k], tOgO[None, m, k])

    @cute.jit
    def load_operand(self, ld, name: cutlass.Constexpr, n_block, stage):
        """Mask or bias tile of key block n_block (gmem -> smem), bounds always checked."""
        o = ld.ops[name]
        if ld.tidx < o.used:
            tiles.copy_tile(
                o.copy,
                o.tXgX[None, None, None, n_block],
                o.tXsX[None, None, None, stage],
                o.tXcX[None, None, None, n_block],
                o.row_end,
                ld.seqlen_k,
                True,
                True,
            )

    @cute.jit
    def load_block(self, ld, n_block, stage, mask_full):
        """K, V, mask and bias tiles of key block n_block (gmem -> smem); K/V rows are checked
        on the tail block only; an all-True mask tile (mask_full != 0) is not loaded."""
        even_d = self.spec.even_d
        for tXgX, tXsX in ((ld.tKgK, ld.tKsK), (ld.tVgV, ld.tVsV)):
            src = tXgX[None, None, None, n_block]
            dst = tXsX[None, None, None, stage]
            coord = ld.tKVcKV[None, None, None, n_block]
            if (n_block + 1) * self.tile_n > ld.seqlen_k:
                tiles.copy_tile(
                    ld.copy_qkv, src, dst, coord, ld.seqlen_k, ld.head_dim, True, not even_d
                )
            else:
                tiles.copy_tile(
                    ld.copy_qkv, src, dst, coord, ld.seqlen_k, ld.head_dim, False, not even_d
                )
        if cutlass.const_expr(self.spec.mask is not None):
            if mask_full == 0:
                self.load_operand(ld, "mask", n_block, stage)
        if cutlass.const_expr(self.spec.bias is not None):
            self.load_operand(ld, "bias", n_block, stage)

    @cute.jit
    def compute_block(self, ops, mm, limits, score_args, softmax, acc_O, n_block, stage, mask_full):
        """S = bias + Q K^T, masking, online softmax and O += P V for one key block whose
        K/V/mask/bias tiles are in smem stage `stage` (no mask tile when mask_full != 0)."""
        spec = self.spec
        acc_S = cute.make_rmem_tensor(
            mm.thr_mma.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32
        )
        # Bias-first: S starts as bias / scale (smem -> rmem), so scale * S = scale*QK^T + bias
        # and no separate pass adds it. With softcap the bias is added after the cap instead.
        if cutlass.const_expr(spec.bias is not None and not spec.has_softcap):
            tSsB = ops["bias"].tSsX[None, None, None, stage]
            acc_S.store(scores.bias_scores(tSsB.load(), score_args.bias_scale))
        else:
            acc_S.fill(0.0)

        # S += Q K^T (smem -> rmem by ldmatrix; k-block k+1 is read while k is multiplied)
        tSsK = mm.tSsK[None, None, None, stage]
        num_k = cute.size(mm.tSsQ.shape[2])
        cute.copy(mm.s2r_Q, mm.tSsQ[None, None, 0], mm.tSrQ_v[None, None, 0])
        cute.copy(mm.s2r_K, tSsK[None, None, 0], mm.tSrK_v[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):
                cute.copy(mm.s2r_Q, mm.tSsQ[None, None, k + 1], mm.tSrQ_v[None, None, k + 1])
                cute.copy(mm.s2r_K, tSsK[None, None, k + 1], mm.tSrK_v[None, None, k + 1])
            cute.gemm(mm.tiled_mma, acc_S, mm.tSrQ[None, None, k], mm.tSrK[None, None, k], acc_S)

        if cutlass.const_expr(spec.has_softcap):
            capped = cute.math.tanh(acc_S.load() * score_args.softcap_scale, fastmath=True)
            capped = capped * score_args.softcap
            if cutlass.const_expr(spec.bias is not None):
                tSsB = ops["bias"].tSsX[None, None, None, stage]
                capped = capped + scores.bias_scores(tSsB.load(), 1.0)
            acc_S.store(capped)
        if cutlass.const_expr(spec.mask is not None):
            if mask_full == 0:
                masking.apply_mask(acc_S, ops["mask"].tSsX[None, None, None, stage])
        if masking.block_needs_limits(
            n_block,
            limits.m_block,
            limits.seqlen_q,
            limits.seqlen_k,
            limits.window_left,
            limits.window_right,
            self.tile_m,
            self.tile_n,
            spec.has_window,
        ):
            masking.apply_limits(
                acc_S,
                mm.tScS[None, None, None, n_block],
                limits.seqlen_q,
                limits.seqlen_k,
                limits.window_left,
                limits.window_right,
                spec.has_window,
            )

        softmax.update(acc_S, acc_O)

        # O += P V: P stays in registers, re-read as the A operand
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        tOrP = cute.make_tensor(rP.iterator, acc_as_a_operand(rP.layout))
        tOsVt = mm.tOsVt[None, None, None, stage]
        num_kv = cute.size(tOrP.shape[2])
        cute.copy(mm.s2r_V, tOsVt[None, None, 0], mm.tOrVt_v[None, None, 0])
        for k in cutlass.range_constexpr(num_kv):
            if cutlass.const_expr(k + 1 < num_kv):
                cute.copy(mm.s2r_V, tOsVt[None, None, k + 1], mm.tOrVt_v[None, None, k + 1])
            cute.gemm(mm.tiled_mma, acc_O, tOrP[None, None, k], mm.tOrVt[None, None, k], acc_O)
