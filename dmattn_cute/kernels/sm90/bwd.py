"""Hopper backward (sm_90a): warp-specialized wgmma kernel for dQ, dK and dV.

One CTA per (key block, kv head, batch), as the SM80 backward: it keeps its K and V tiles in
shared memory and dK, dV in registers, and walks the query heads of its group and the query
blocks its causal/window range allows. When that grid is too small for the GPU (few kv heads,
MQA), each group's query heads are split over `head_splits` CTAs (split_heads): each adds its
fp32 dK/dV partial sums into zeroed fp32 buffers by TMA reduce-add. Three warpgroups:

- the producer (few registers): warp 0 loads K and V once, then Q and dO of every step by TMA
  into `stages` smem stages; warp 1 adds each step's dQ tile (fp32, smem) into the zeroed
  fp32 dQ accumulator in global memory with a TMA reduce-add (no per-thread atomics).
- two MMA warpgroups: per step S = Q K^T and dP = dO V^T by wgmma (each warpgroup half of the
  keys), P = exp(S - lse) from the forward's stats, dS = P (dP - dpsum) (times the softcap's
  derivative), P and dS to smem; then dV += P^T dO and dK += dS^T Q (each warpgroup its half
  of the keys, or of the head-dim columns when the key block is 64 wide) and dQ = dS K (each
  warpgroup half of the columns).
- epilogue: dK (times the softmax scale) and dV through smem over sK / sV, stored by TMA (with
  split_heads: one after the other as fp32 tiles over sK and sV, added by TMA reduce-add).

Shared memory and the order that protects it:
- mbar: full/empty mbarriers of the K/V, Q and dO pipelines, initialized before the CTA-wide
  barrier that precedes every other use.
- sK, sV: written once by TMA (K/V pipeline), read by the S, dP and dQ GEMMs; after the MMA
  warpgroups' epilogue barrier (each passes it after its last wgmma has completed) they hold
  dK and dV for the TMA store.
- sQ, sdO stages: filled by warp 0 after the stage's empty barrier, read by the GEMMs after its
  full barrier, released once the step's dK (Q) and dV (dO) GEMMs have completed.
- sP, sdS: one tile each, written by both MMA warpgroups and read by both (dQ needs every key,
  and with 64-key blocks so do dK and dV). Barrier "P/dS free" (before the writes: every
  warpgroup's GEMMs of the previous step have completed) and barrier "P/dS ready" (after the
  writes and the proxy fence, before the GEMMs) order them.
- sdQ: written by the MMA warpgroups after barrier "dQ free" (warp 1 arrives once its previous
  reduce has read the tile), read by warp 1's TMA reduce after barrier "dQ ready" (the MMA
  warpgroups arrive after their writes and the proxy fence).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as hopper
from cutlass import cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ...jit.arch import compile_options
from .. import masking, tiles
from ..bwd import BwdScalars
from ..config import (
    Sm90BwdTile,
    SmemBuffer,
    padded_head_dim,
    sm90_bwd_smem_buffers,
    sm90_bwd_tile,
    smem_total,
)
from ..scores import Scores
from ..spec import DTYPES, dtype_bytes, env_stream, fake_rows, fake_tensor
from ..utils import acc_mn_view
from .fwd import wgmma

# Named barriers (0 is the CTA-wide one).
_PDS_FREE = 1  # MMA warpgroups: the previous step's GEMMs have read sP / sdS
_PDS_READY = 2  # MMA warpgroups: this step's P and dS are in smem
_DQ_FREE = 3  # warp 1 -> MMA warpgroups: the previous dQ reduce has read sdQ
_DQ_READY = 4  # MMA warpgroups -> warp 1: this step's dQ is in sdQ
_EPILOGUE = 5  # MMA warpgroups: every GEMM has read sK / sV; then dK / dV are in smem
_MMA_THREADS = 256
# Registers per thread (producer, MMA warpgroups) after setmaxnreg.
_REGISTERS = (24, 240)


@dataclass(frozen=True)
class Sm90BwdSpec:
    """One Hopper backward kernel variant: the compile key, tiling and launch facts. No mask,
    bias or deterministic order (bwd_launch runs the SM80 kernel for those).

    split_heads: dk and dv are zeroed fp32 buffers that each CTA adds its partial sums into
    (a group's heads are split over several CTAs); else they are written in the input dtype.
    """

    dtype: str
    head_dim_padded: int
    tile: Sm90BwdTile
    has_window: bool
    has_softcap: bool
    split_heads: bool

    @staticmethod
    @functools.cache  # called on every launch; the tile choice is pure
    def build(
        arch: str,
        dtype: str,
        head_dim: int,
        has_window: bool,
        has_softcap: bool,
        split_heads: bool = False,
    ) -> Sm90BwdSpec:
        dp = padded_head_dim(head_dim)
        tile = sm90_bwd_tile(arch, dp, dtype_bytes(dtype))
        return Sm90BwdSpec(dtype, dp, tile, has_window, has_softcap, split_heads)

    def smem_buffers(self) -> tuple[SmemBuffer, ...]:
        return sm90_bwd_smem_buffers(self.tile, self.head_dim_padded, dtype_bytes(self.dtype))

    def smem_bytes(self) -> int:
        return smem_total(self.smem_buffers())

    def example_args(self) -> list:
        """FlashBwdSm90's arguments for an offline compile (fake tensors of the launch's
        stride patterns, placeholder scalars)."""
        q, k, v, dout = (fake_rows(self.dtype) for _ in range(4))
        stats = fake_tensor("fp32", ("d", "d", "d", "1"), 4)
        dpsum = fake_tensor("fp32", ("d", "d", "1"), 4)
        dq_acc, dk, dv = (
            fake_tensor("fp32", ("d", "d", "d", "1"), 16, stride_div=4) for _ in range(3)
        )
        if not self.split_heads:
            dk, dv = fake_rows(self.dtype), fake_rows(self.dtype)
        return [q, k, v, dout, stats, dpsum, dq_acc, dk, dv, 1, *BwdScalars(), env_stream()]

    def compile(self, arch: str, extra_options: str = ""):
        return cute.compile(
            FlashBwdSm90(self), *self.example_args(), options=compile_options(arch, extra_options)
        )


def smem_layout(dtype, rows: int, cols: int, major: int, stages: int | None = None):
    """(rows, cols[, stages]) row-major tile in the widest swizzle that `major` contiguous
    elements allow: a GEMM whose warpgroups each read `major` of the columns as the contiguous
    (MN) mode needs a swizzle atom no wider than that."""
    atom = warpgroup.make_smem_layout_atom(
        hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def transposed(t: cute.Tensor, rows: int, cols: int, stages: int | None = None) -> cute.Tensor:
    """The (cols, rows[, stages]) view of a (rows, cols[, stages]) smem tile."""
    if stages is None:
        return cute.composition(t, cute.make_ordered_layout((cols, rows), order=(1, 0)))
    return cute.composition(t, cute.make_ordered_layout((cols, rows, stages), order=(1, 0, 2)))


def _tiled_mma(dtype, a_major, b_major, atoms, n: int):
    return hopper.make_trivial_tiled_mma(
        dtype, dtype, a_major, b_major, cutlass.Float32, atom_layout_mnk=atoms, tiler_mn=(64, n)
    )


class FlashBwdSm90:
    """The Hopper backward kernel for one Sm90BwdSpec."""

    def __init__(self, spec: Sm90BwdSpec):
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        self.tile_m = spec.tile.tile_m
        self.tile_n = spec.tile.tile_n
        self.stages = spec.tile.stages
        self.head_dim_padded = spec.head_dim_padded
        self.split_keys = spec.tile.dkv_split_keys

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
        mdK: cute.Tensor,  # [B, Sk, Hkv, D] (fp32, zeroed, with split_heads)
        mdV: cute.Tensor,  # [B, Sk, Hkv, D] (fp32, zeroed, with split_heads)
        head_splits: cutlass.Int32,  # CTAs per group of query heads (1 without split_heads)
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
        tm, tn, dp, st = self.tile_m, self.tile_n, self.head_dim_padded, self.stages
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # dK/dV warpgroups: by keys (each 64 rows, whole D) or by columns (each D / 2)
        dkv_atoms = (2, 1, 1) if cutlass.const_expr(self.split_keys) else (1, 2, 1)
        dkv_n = dp if cutlass.const_expr(self.split_keys) else dp // 2
        # S = Q K^T, dP = dO V^T: each warpgroup half of the keys
        mma_sdp = _tiled_mma(self.dtype, K_MAJOR, K_MAJOR, (1, 2, 1), tn // 2)
        # dV = P^T dO, dK = dS^T Q: A (keys x queries) and B (D x queries) read transposed
        mma_dkv = _tiled_mma(self.dtype, MN_MAJOR, MN_MAJOR, dkv_atoms, dkv_n)
        # dQ = dS K: each warpgroup half of the columns; B (D x keys) read transposed
        mma_dq = _tiled_mma(self.dtype, K_MAJOR, MN_MAJOR, (1, 2, 1), dp // 2)

        # Swizzles: a warpgroup reading a transposed operand reads dkv_n (Q, dO) or dp / 2
        # (K, dQ) contiguous columns; P and dS 64 keys.
        sQ_layout = smem_layout(self.dtype, tm, dp, dkv_n, st)
        sK_layout = smem_layout(self.dtype, tn, dp, dp // 2)
        sV_layout = smem_layout(self.dtype, tn, dp, dkv_n)
        sPdS_layout = smem_layout(self.dtype, tm, tn, 64)
        sdQ_layout = smem_layout(cutlass.Float32, tm, dp, dp // 2)
        # dK / dV partial sums (split_heads): fp32 over sK and sV, stored as the GEMM splits them
        sKV32_layout = smem_layout(cutlass.Float32, tn, dp, dkv_n)

        # TMA views (S, D, heads, batch): one box is a (rows, D) tile of one head.
        def tma_view(t):
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))

        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        one_stage = functools.partial(cute.select, mode=[0, 1])
        tma_q, tQ = cpasync.make_tiled_tma_atom(load, tma_view(mQ), one_stage(sQ_layout), (tm, dp))
        tma_do, tdO = cpasync.make_tiled_tma_atom(
            load, tma_view(mdO), one_stage(sQ_layout), (tm, dp)
        )
        tma_k, tK = cpasync.make_tiled_tma_atom(load, tma_view(mK), sK_layout, (tn, dp))
        tma_v, tV = cpasync.make_tiled_tma_atom(load, tma_view(mV), sV_layout, (tn, dp))
        reduce = cpasync.CopyReduceBulkTensorTileS2GOp()
        if cutlass.const_expr(self.spec.split_heads):
            tma_dk, tdK = cpasync.make_tiled_tma_atom(reduce, tma_view(mdK), sKV32_layout, (tn, dp))
            tma_dv, tdV = cpasync.make_tiled_tma_atom(reduce, tma_view(mdV), sKV32_layout, (tn, dp))
        else:
            tma_dk, tdK = cpasync.make_tiled_tma_atom(store, tma_view(mdK), sK_layout, (tn, dp))
            tma_dv, tdV = cpasync.make_tiled_tma_atom(store, tma_view(mdV), sV_layout, (tn, dp))
        tma_dq, tdQ = cpasync.make_tiled_tma_atom(reduce, tma_view(mdQacc), sdQ_layout, (tm, dp))
        grid = (cute.ceil_div(mK.shape[1], tn), mK.shape[2] * head_splits, mK.shape[0])
        self.kernel(
            tQ, tK, tV, tdO, tdK, tdV, tdQ, mQ.shape[1], mK.shape[1], mStats, mDpsum,
            tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, tma_dq,
            scale_log2, softcap_scale, softcap, softmax_scale, window_left, window_right, group,
            head_splits, sQ_layout, sK_layout, sV_layout, sPdS_layout, sdQ_layout, sKV32_layout,
            mma_sdp, mma_dkv, mma_dq,
        ).launch(
            grid=grid, block=[self.spec.tile.num_threads, 1, 1], stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        tQ: cute.Tensor,
        tK: cute.Tensor,
        tV: cute.Tensor,
        tdO: cute.Tensor,
        tdK: cute.Tensor,
        tdV: cute.Tensor,
        tdQ: cute.Tensor,
        seqlen_q: cutlass.Int32,
        seqlen_k: cutlass.Int32,
        mStats: cute.Tensor,
        mDpsum: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        tma_dk: cute.CopyAtom,
        tma_dv: cute.CopyAtom,
        tma_dq: cute.CopyAtom,
        scale_log2: cutlass.Float32,
        softcap_scale: cutlass.Float32,
        softcap: cutlass.Float32,
        softmax_scale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        group: cutlass.Int32,
        head_splits: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        sKV32_layout: cute.ComposedLayout,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
    ):
        spec = self.spec
        tm, tn, dp, st = self.tile_m, self.tile_n, self.head_dim_padded, self.stages
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, tma_dq):
                cpasync.prefetch_descriptor(atom)
        n_block, hk_split, b = cute.arch.block_idx()
        # kv head hk, and the `heads` query heads of its group from h_first on
        hk = hk_split // head_splits
        heads = group // head_splits
        h_first = hk * group + (hk_split - hk * head_splits) * heads
        limits = masking.BlockLimits(
            seqlen_q, seqlen_k, window_left, window_right, tm, tn, spec.has_window
        )
        m_block_min, m_block_max = limits.query_block_range(n_block)

        # ---- shared memory and pipelines ----
        smem = tiles.allocate_smem(spec.smem_buffers())
        sQ = tiles.swizzled_smem_tensor(smem["q"], self.dtype, sQ_layout)
        sdO = tiles.swizzled_smem_tensor(smem["do"], self.dtype, sQ_layout)
        kv_ptr, kv_bytes = smem["kv"]
        sK = tiles.swizzled_smem_tensor((kv_ptr, kv_bytes // 2), self.dtype, sK_layout)
        sV = tiles.swizzled_smem_tensor(
            (kv_ptr + kv_bytes // 2, kv_bytes // 2), self.dtype, sV_layout
        )
        sKV32 = None
        if cutlass.const_expr(spec.split_heads):
            sKV32 = tiles.swizzled_smem_tensor(smem["kv"], cutlass.Float32, sKV32_layout)
        sP = tiles.swizzled_smem_tensor(smem["p"], self.dtype, sPdS_layout)
        sdS = tiles.swizzled_smem_tensor(smem["ds"], self.dtype, sPdS_layout)
        sdQ = tiles.swizzled_smem_tensor(smem["dq"], cutlass.Float32, sdQ_layout)
        mbar = cute.recast_ptr(smem["mbar"][0], dtype=cutlass.Int64)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, _MMA_THREADS // 32)
        eb = dtype_bytes(spec.dtype)
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar, num_stages=1, producer_group=one_thread,
            consumer_group=mma_warps, tx_count=2 * tn * dp * eb, defer_sync=True,
        )  # fmt: skip
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar + 2, num_stages=st, producer_group=one_thread,
            consumer_group=mma_warps, tx_count=tm * dp * eb, defer_sync=True,
        )  # fmt: skip
        pipe_do = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar + 2 + 2 * st, num_stages=st, producer_group=one_thread,
            consumer_group=mma_warps, tx_count=tm * dp * eb, defer_sync=True,
        )  # fmt: skip
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every mbarrier is initialized before any thread uses one

        if warp < 4:
            cute.arch.setmaxregister_decrease(_REGISTERS[0])
            if warp == 0:
                self.load(
                    tQ, tK, tV, tdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv,
                    pipe_q, pipe_do, n_block, hk, b, h_first, heads, m_block_min, m_block_max,
                )  # fmt: skip
            if warp == 1:
                self.reduce_dq(tdQ, sdQ, tma_dq, b, h_first, heads, m_block_min, m_block_max)
        else:
            cute.arch.setmaxregister_increase(_REGISTERS[1])
            self.mma(
                tdK, tdV, sQ, sK, sV, sdO, sP, sdS, sdQ, sKV32, mStats, mDpsum, tma_dk, tma_dv,
                pipe_kv, pipe_q, pipe_do, mma_sdp, mma_dkv, mma_dq, limits, n_block, hk, b,
                h_first, heads, m_block_min, m_block_max, scale_log2, softcap_scale, softcap,
                softmax_scale,
            )  # fmt: skip

    @cute.jit
    def load(
        self, tQ, tK, tV, tdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv, pipe_q,
        pipe_do, n_block, hk, b, h_first, heads, m_block_min, m_block_max,
    ):  # fmt: skip
        """Warp 0: K and V once, then Q and dO of every (head, query block) step, each into
        the next free stage (gmem -> smem by TMA)."""
        tm, tn, dp = self.tile_m, self.tile_n, self.head_dim_padded
        no_cluster = cute.make_layout(1)
        # K and V, always (the epilogue reuses their smem: no copy may be in flight then)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        for atom, tX, sX in ((tma_k, tK, sK), (tma_v, tV, sV)):
            gX = cute.local_tile(tX[None, None, hk, b], (tn, dp), (n_block, 0))
            tXsX, tXgX = cpasync.tma_partition(
                atom, 0, no_cluster, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
            )
            cute.copy(atom, tXgX, tXsX, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for h in cutlass.range(h_first, h_first + heads, unroll=1):
            gQ = cute.local_tile(tQ[None, None, h, b], (tm, dp), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, no_cluster, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            gdO = cute.local_tile(tdO[None, None, h, b], (tm, dp), (None, 0))
            tdOsdO, tdOgdO = cpasync.tma_partition(
                tma_do, 0, no_cluster, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2)
            )
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                pipe_q.producer_acquire(state)
                cute.copy(
                    tma_q, tQgQ[None, m_block], tQsQ[None, state.index],
                    tma_bar_ptr=pipe_q.producer_get_barrier(state),
                )  # fmt: skip
                pipe_do.producer_acquire(state)
                cute.copy(
                    tma_do, tdOgdO[None, m_block], tdOsdO[None, state.index],
                    tma_bar_ptr=pipe_do.producer_get_barrier(state),
                )  # fmt: skip
                state.advance()

    @cute.jit
    def reduce_dq(self, tdQ, sdQ, tma_dq, b, h_first, heads, m_block_min, m_block_max):
        """Warp 1: every step's dQ tile (smem, fp32) added into the dQ accumulator by a TMA
        reduce-add; rows past Sq and columns past D are not written."""
        tm, dp = self.tile_m, self.head_dim_padded
        count = _MMA_THREADS + 32
        for h in cutlass.range(h_first, h_first + heads, unroll=1):
            gdQ = cute.local_tile(tdQ[None, None, h, b], (tm, dp), (None, 0))
            tdQsdQ, tdQgdQ = cpasync.tma_partition(
                tma_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
                cute.group_modes(gdQ, 0, 2),
            )  # fmt: skip
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous reduce read sdQ
                cute.arch.barrier_arrive(barrier_id=_DQ_FREE, number_of_threads=count)
                cute.arch.barrier(barrier_id=_DQ_READY, number_of_threads=count)
                cute.copy(tma_dq, tdQsdQ, tdQgdQ[None, m_block])
                cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # sdQ is read before the CTA exits

    @cute.jit
    def mma(
        self, tdK, tdV, sQ, sK, sV, sdO, sP, sdS, sdQ, sKV32, mStats, mDpsum, tma_dk, tma_dv,
        pipe_kv, pipe_q, pipe_do, mma_sdp, mma_dkv, mma_dq, limits, n_block, hk, b, h_first,
        heads, m_block_min, m_block_max, scale_log2, softcap_scale, softcap, softmax_scale,
    ):  # fmt: skip
        """An MMA warpgroup: every step's five GEMMs and pointwise work, then the epilogue."""
        spec = self.spec
        tm, tn, dp, st = self.tile_m, self.tile_n, self.head_dim_padded, self.stages
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        seqlen_q = limits.seqlen_q

        # ---- wgmma operands: smem descriptors; register accumulators ----
        thr_sdp = mma_sdp.get_slice(tidx)
        wg_sdp = mma_sdp.get_slice(wg * 128)
        wg_dkv = mma_dkv.get_slice(wg * 128)
        wg_dq = mma_dq.get_slice(wg * 128)
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        tdVrPt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed(sP, tm, tn)))
        tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed(sdO, tm, dp, st)))
        tdKrdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed(sdS, tm, tn)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed(sQ, tm, dp, st)))
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK, tn, dp)))
        s_shape = wg_sdp.partition_shape_C((tm, tn))
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tn, dp)), cutlass.Float32)
        acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tn, dp)), cutlass.Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        # P and dS (rmem -> smem), dQ (rmem -> smem, fp32)
        r2s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        r2s_sdp = cute.make_tiled_copy_C(r2s, mma_sdp).get_slice(tidx)
        tPsP = r2s_sdp.partition_D(sP)
        tdSsdS = r2s_sdp.partition_D(sdS)
        r2s_f32 = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=64
        )
        # (row, col) of every score this thread holds, per query block
        tScS = thr_sdp.partition_C(
            cute.local_tile(
                cute.make_identity_tensor((seqlen_q, limits.seqlen_k)), (tm, tn), (None, n_block)
            )
        )
        scores = Scores(
            False, False, spec.has_softcap, cutlass.Float32(1.0), softcap_scale, softcap
        )

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, st)
        for h in cutlass.range(h_first, h_first + heads, unroll=1):
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                coord = tScS[None, None, None, m_block]
                # ---- S = Q K^T and dP = dO V^T (issued together) ----
                acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                acc_dP = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                pipe_q.consumer_wait(state)
                wgmma(mma_sdp, acc_S, tSrQ[None, None, None, state.index], tSrK, False, -1)
                pipe_do.consumer_wait(state)
                wgmma(mma_sdp, acc_dP, tdPrdO[None, None, None, state.index], tdPrV, False, -1)
                # the forward's stats and dpsum of this thread's rows, under the GEMMs
                log2sum, dpsum = self.row_stats(mStats, mDpsum, coord, b, h, seqlen_q)
                self.probabilities(
                    scores, acc_S, acc_dP, coord, limits, m_block, n_block, log2sum, dpsum,
                    scale_log2, softcap,
                )  # fmt: skip
                rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
                rdS.store(acc_dP.load().to(self.dtype))

                # ---- P, dS -> smem; dV += P^T dO, dK += dS^T Q, dQ = dS K ----
                cute.arch.barrier(barrier_id=_PDS_FREE, number_of_threads=_MMA_THREADS)
                cute.copy(r2s_sdp, r2s_sdp.retile(rP), tPsP)
                cute.copy(r2s_sdp, r2s_sdp.retile(rdS), tdSsdS)
                cute.arch.fence_view_async_shared()  # generic-proxy writes, read by wgmma
                cute.arch.barrier(barrier_id=_PDS_READY, number_of_threads=_MMA_THREADS)
                wgmma(mma_dkv, acc_dV, tdVrPt, tdVrdOt[None, None, None, state.index], True, -1)
                wgmma(mma_dkv, acc_dK, tdKrdSt, tdKrQt[None, None, None, state.index], True, -1)
                acc_dQ = cute.make_rmem_tensor(wg_dq.partition_shape_C((tm, dp)), cutlass.Float32)
                wgmma(mma_dq, acc_dQ, tdQrdS, tdQrKt, False, 0)
                pipe_q.consumer_release(state)
                pipe_do.consumer_release(state)
                state.advance()

                # ---- dQ * scale -> smem, then warp 1's reduce into global memory ----
                acc_dQ.store(acc_dQ.load() * softmax_scale)
                cute.arch.barrier(barrier_id=_DQ_FREE, number_of_threads=_MMA_THREADS + 32)
                tiles.acc_to_smem(acc_dQ, cutlass.Float32, r2s_f32, mma_dq, tidx, sdQ)
                cute.arch.fence_view_async_shared()  # generic-proxy writes, read by the TMA
                cute.arch.barrier_arrive(barrier_id=_DQ_READY, number_of_threads=_MMA_THREADS + 32)

        # ---- epilogue: dK, dV (rmem -> smem over sK / sV -> gmem by TMA) ----
        acc_dK.store(acc_dK.load() * softmax_scale)
        # Both warpgroups' GEMMs that read sK / sV have completed.
        cute.arch.barrier(barrier_id=_EPILOGUE, number_of_threads=_MMA_THREADS)
        if cutlass.const_expr(not spec.split_heads):
            tiles.acc_to_smem(acc_dK, self.dtype, r2s, mma_dkv, tidx, sK)
            tiles.acc_to_smem(acc_dV, self.dtype, r2s, mma_dkv, tidx, sV)
            self.store_tiles(((tma_dk, tdK, sK), (tma_dv, tdV, sV)), n_block, hk, b, tidx)
        else:
            # fp32 partial sums, one after the other over sK and sV, added by TMA reduce-add
            self.store_tiles(((tma_dk, tdK, sKV32),), n_block, hk, b, tidx, acc_dK, mma_dkv)
            # the reduce has read the tile before dV overwrites it
            cute.arch.barrier(barrier_id=_EPILOGUE, number_of_threads=_MMA_THREADS)
            self.store_tiles(((tma_dv, tdV, sKV32),), n_block, hk, b, tidx, acc_dV, mma_dkv)

    @cute.jit
    def store_tiles(self, stores, n_block, hk, b, tidx, acc=None, tiled_mma=None):
        """(atom, TMA view, smem tile) of each store: the (tile_n, D) tiles of key block n_block
        (smem -> gmem; rows past Sk and columns past D are not written), after `acc` (fp32)
        is written to the one smem tile when given. Returns once the stores have read smem."""
        tn, dp = self.tile_n, self.head_dim_padded
        if cutlass.const_expr(acc is not None):
            r2s_f32 = cute.make_copy_atom(
                cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=64
            )
            tiles.acc_to_smem(acc, cutlass.Float32, r2s_f32, tiled_mma, tidx, stores[0][2])
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes, read by the TMA
        cute.arch.barrier(barrier_id=_EPILOGUE, number_of_threads=_MMA_THREADS)
        if tidx < 32:
            for atom, tX, sX in stores:
                gX = cute.local_tile(tX[None, None, hk, b], (tn, dp), (n_block, 0))
                tXsX, tXgX = cpasync.tma_partition(
                    atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                    cute.group_modes(gX, 0, 2),
                )  # fmt: skip
                cute.copy(atom, tXsX, tXgX)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def probabilities(
        self, scores, acc_S, acc_dP, coord, limits, m_block, n_block, log2sum, dpsum,
        scale_log2, softcap,
    ):  # fmt: skip
        """acc_S <- P = exp(S - lse) after the softcap and the causal/window limits; acc_dP <-
        dS = P (dP - dpsum), times the softcap's derivative 1 - tanh^2. Returns with both of
        the step's S/dP wgmma groups complete."""
        warpgroup.wait_group(1)  # S is complete
        if cutlass.const_expr(self.spec.has_softcap):
            scores.finish(acc_S, None, None, cutlass.Int32(1))
        limits.apply(acc_S, coord, m_block, n_block)
        acc_mn, dP_mn = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        if cutlass.const_expr(not self.spec.has_softcap):
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                exponent = acc_mn[r, None].load() * scale_log2 - log2sum[r]
                acc_mn[r, None].store(cute.math.exp2(exponent, fastmath=True))
            warpgroup.wait_group(0)  # dP is complete
            for r in cutlass.range_constexpr(cute.size(dP_mn.shape[0])):
                dP_mn[r, None].store(acc_mn[r, None].load() * (dP_mn[r, None].load() - dpsum[r]))
        else:
            # With a softcap, P and dS in one pass after dP: tanh = S / softcap is read back
            # from S before P replaces it (no array of derivatives held across the exp).
            # Clamped at -1: a masked score (-inf) has P = 0 and gets derivative 0, not NaN.
            inv_softcap = 1.0 / softcap
            warpgroup.wait_group(0)  # dP is complete
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                for c in cutlass.range(cute.size(acc_mn.shape[1]), unroll_full=True):
                    s = acc_mn[r, c]
                    p = cute.math.exp2(s * scale_log2 - log2sum[r], fastmath=True)
                    t = cutlass.max(s * inv_softcap, cutlass.Float32(-1.0))
                    acc_mn[r, c] = p
                    dP_mn[r, c] = p * (dP_mn[r, c] - dpsum[r]) * (1.0 - t * t)

    @cute.jit
    def row_stats(self, mStats, mDpsum, coord, b, h, seqlen_q):
        """(log2 row sum, dpsum) of this thread's score rows, from the forward's stats (without
        a bias the forward folds the row max into the sum): +inf log2 sum for rows past Sq and
        fully masked rows, so P = 0 there."""
        coord_mn = acc_mn_view(coord)
        rows = cute.size(coord_mn.shape[0])
        log2sum = cute.make_rmem_tensor(rows, cutlass.Float32)
        dpsum = cute.make_rmem_tensor(rows, cutlass.Float32)
        for r in cutlass.range_constexpr(rows):
            row = coord_mn[r, 0][0]
            log2sum[r] = cutlass.Float32.inf
            dpsum[r] = 0.0
            if row < seqlen_q:
                log2sum[r] = mStats[b, h, 1, row]
                dpsum[r] = mDpsum[b, h, row]
        return log2sum, dpsum
