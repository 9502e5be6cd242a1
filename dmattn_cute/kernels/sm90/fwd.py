"""Hopper forward (sm_90a): warp-specialized wgmma kernel with bias-first scores, mask tiles and
block skip.

One CTA per (query block, head, batch), longest causal rows first: under causal/window limits
the CTAs run in sections of query heads whose K and V fit in half of L2, and within a section
the query block varies slowest (longest first), so the last wave runs every head's short rows
instead of one head's long ones while the rest of the GPU idles. With a block mask the launch
gives the order (spec.ordered): the same sections, each sorted by visible key blocks, most
first, since a random block mask leaves some rows twice the average. Without a mask, or with
a block mask alone, persistent CTAs run instead (Sm90FwdSpec.persistent: one per SM, each
walking its share of that order, the next item's Q and first key blocks loading under the
end of the current one). Three warpgroups:

- the producer (warps 0-3, few registers): warp 0 loads Q once (before the block bits are
  read, so that the two loads overlap) and K, V per visible key block by TMA into `stages`
  smem stages, and the bias tile too when its rows allow (16-bit, 16-byte aligned:
  Sm90FwdSpec's `bias.tma_tiles`; a query-broadcast bias as one row of the block's keys,
  which spares the producer's cp.async pipeline, and which warp 1 converts to fp32 in log2
  units once per block where the copy fits: convert_row; or, bias_terms, the block's terms
  of the row with its K: kernels/key_bias_terms.py); all four warps load the mask
  tile, and a bias TMA cannot read, with predicated cp.async (any view: broadcast dims, odd
  strides, key tails zero-filled), each thread arriving on the stage's mbarrier when its
  copies land. A block's bias and mask go before its K and V.
- two consumers (64 query rows each): S = bias / scale + Q K^T by wgmma from smem (a
  query-broadcast bias added after the GEMM, or by one more k-step of it: its terms against
  a tile of ones), softcap / mask / causal-window limits, the
  online softmax (with terms and no mask, an item's walk takes the unbiased kernel's bounded
  softmax where the pre-pass flagged all its keys' biases moderate, else the exact one: the
  walk compiled twice), O += P V by wgmma with P from registers.
  The next block's Q K^T is issued before the previous block's P V (so the softmax of one
  block runs under the GEMMs of its neighbours), and with head dims up to 128 the two
  consumers take turns at the tensor cores (named barriers), one's softmax under the other's
  GEMMs.
- epilogue: O (rmem -> smem over sQ, or sO, by stmatrix -> gmem by TMA store), lse and stats
  from registers.

With a mask, the block-bits pre-pass (kernels/block_bits.py) says for every (query block, key
block) whether the mask tile has a True (visible) and whether it is all True (full). Producer
and consumers read the same bits and walk the same visible blocks, from the last to the first;
a block that is not visible costs nothing, a full one loads no mask tile and masks nothing.
A CTA whose key blocks are all full (all_full) walks them as the kernel without a mask does
(`dense`): no bits, and no mask branch in its loop.

Shared memory and the order that protects it:
- mbar: full/empty mbarriers of the Q, K, V, cp.async mask/bias and TMA bias pipelines,
  initialized before the CTA-wide barrier that precedes every other use.
- sQ: written by TMA once (Q pipeline), read by every Q K^T wgmma; after the consumers'
  epilogue barrier (each consumer passes it after its last wgmma has completed) it holds O for
  the TMA store. A persistent CTA refills it per item: the consumers release Q's stage after
  their item's last Q K^T has completed, and O goes through its own buffer sO, which the
  consumers write after the storing warp has waited for the previous TMA store's reads.
- ones (bias_terms): 1 in columns 0-2 of a (tile_m, 16) tile, written by every thread
  before the CTA-wide barrier (with a proxy fence: wgmma reads it through the async proxy),
  read-only afterwards; the terms stages ride K's: same stage, barrier and release.
- sK, sV, mask, bias stages: filled by the producer after the stage's empty barrier, read by
  the consumers after its full barrier, released (empty barrier) once the wgmma reading K or
  V has completed and, for mask/bias, once the scores have read them. cp.async mask/bias
  stages count one release arrive per consumer thread, each after its own reads (with one
  elected arrive per warp, compute-sanitizer racecheck sees lanes 1-31's reads unordered with
  the refill, since the __syncwarp before it compiles to nothing); the TMA bias stage takes
  one arrive per warp, after a __syncwarp, as PipelineTmaAsync counts them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as hopper
from cutlass import cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...jit.arch import compile_options, smem_capacity
from .. import masking, operands, tiles
from ..config import (
    Sm90FwdTile,
    SmemBuffer,
    bias_row_pitch,
    padded_head_dim,
    sm90_fwd_smem_buffers,
    sm90_fwd_tile,
    smem_total,
)
from ..fwd import FwdScalars
from ..key_bias_terms import MODERATE_WORD, NUM_THREADS, TERMS, moderate_fake, terms_fake
from ..masking import FULL, VISIBLE
from ..scores import Scores
from ..softmax import OnlineSoftmax
from ..spec import DTYPES, LOG2E, OperandSpec, dtype_bytes, env_stream, fake_rows, fake_tensor
from ..utils import acc_as_a_operand, acc_mn_view, mul_rz, round_pairs
from .wgmma import smem_layout, wgmma

# K and V bytes a section of longest-first CTAs may keep in L2 (half of an H100's 50 MB).
_L2_SECTION_BYTES = 25 << 20

# Named barriers (0 is the CTA-wide one).
_EPILOGUE_BARRIER = 1  # the consumers, before O overwrites sQ and before its TMA store
_TURN_BARRIER = 2  # 2 + w: consumer warpgroup w may issue its GEMMs
# Registers per thread (producer, consumer) after the producer gives its share to the
# consumers (setmaxnreg), by (consumer warpgroups, the producer also copies mask/bias tiles).
_REGISTERS = {
    # one consumer: two CTAs per SM, 128 registers a thread at launch
    (1, False): (24, 232),
    (1, True): (32, 224),
    (2, False): (24, 240),
    (2, True): (40, 232),
    (3, False): (32, 160),
    (3, True): (40, 152),
}


def warp_uniform(state: pipeline.PipelineState) -> pipeline.PipelineState:
    """A copy of a pipeline state marked the same in every lane (it is): without the mark, a
    walk with a data-dependent branch (a mask's block bits) makes ptxas build the wgmma
    descriptors of each stage per thread and move them to uniform registers per GEMM."""
    return pipeline.PipelineState(
        state.stages, state.count, cute.arch.make_warp_uniform(state.index),
        cute.arch.make_warp_uniform(state.phase),
    )  # fmt: skip


@dataclass(frozen=True)
class Sm90FwdSpec:
    """One Hopper forward kernel variant: the compile key, tiling and launch facts."""

    dtype: str
    head_dim_padded: int
    tile: Sm90FwdTile
    mask: OperandSpec | None
    bias: OperandSpec | None
    has_window: bool
    has_softcap: bool
    # The CTAs take their (batch, head, query block) from an order the launch gives: a block
    # mask's, sorted by visible key blocks, most first (launch_order.forward_order), each
    # item decoded on the host (launch_order.forward_items: no integer division before Q).
    ordered: bool = False
    # K and V come from a pool of pages [pages, page_size, Hkv, D] (a paged kv cache): key
    # block n of row b is block n % (page_size / tile_n) of page pages[b, n * tile_n /
    # page_size]; page_size is a multiple of tile_n (fwd_launch.flash_fwd's block_table).
    paged: bool = False
    # The bits are a block mask's alone (no attn_mask ANDed in; the mask view is the all-True
    # key mask): a visible block needs no mask tile, the limits cut the tails of Sq and Sk,
    # so every block a walk visits is FULL at compile time (no mask branch per block).
    blocks_full: bool = False

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
        short_queries: bool = False,
        block_mask: bool = False,
        paged: bool = False,
        blocks_full: bool = False,
        bias_terms: bool = True,
    ) -> Sm90FwdSpec:
        """short_queries: at most config.SHORT_QUERY_ROWS query rows (narrower key tiles);
        block_mask: the mask's bits are a block mask's, whose query blocks the launch orders
        (Sm90BwdSpec.build's block_mask the same); paged, blocks_full (with block_mask): see
        the fields; bias_terms: a bias row may enter Q K^T as terms (Sm90FwdTile.bias_terms)."""
        if blocks_full and not block_mask:
            raise ValueError("blocks_full: only with a block mask's bits")
        dp = padded_head_dim(head_dim)
        smem = _smem_operands(mask, bias)
        # a bias row as terms of Q K^T (bf16: their range is fp32's; the softcap comes
        # between Q K^T and the bias; a decode step would read 32 more bytes per key)
        terms = (
            bias_terms and bias is not None and bias.row_broadcast and dtype == "bf16"
            and not has_softcap and not short_queries and not paged
        )  # fmt: skip
        tile = sm90_fwd_tile(arch, dp, dtype_bytes(dtype), *smem, short_queries, terms)
        return Sm90FwdSpec(
            dtype, dp, tile, mask, bias, has_window, has_softcap, block_mask, paged, blocks_full
        )  # fmt: skip

    def section_heads(self, seqlen_k: int, group: int, pairs: int) -> int:
        """(batch, query head) pairs per L2 section of the launch order (h fastest, then the
        batch): whole GQA groups whose K and V fit in _L2_SECTION_BYTES, at least one, at
        most all `pairs` (FlashFwdSm90.longest_first counts them the same way)."""
        key_bytes = 2 * self.head_dim_padded * dtype_bytes(self.dtype)  # K and V
        kv_heads = max(_L2_SECTION_BYTES // key_bytes // max(seqlen_k, 1), 1)
        return min(kv_heads * group, pairs)

    def smem_buffers(self) -> tuple[SmemBuffer, ...]:
        """FlashFwdSm90's shared memory: config.sm90_fwd_smem_buffers, and O's own buffer
        where the CTA is persistent (`persistent`)."""
        smem = _smem_operands(self.mask, self.bias)
        eb = dtype_bytes(self.dtype)
        buffers = sm90_fwd_smem_buffers(self.tile, self.head_dim_padded, eb, *smem)
        out = SmemBuffer("o", self.tile.tile_m * self.head_dim_padded * eb, 1024)
        # items of known work (the limits' key blocks, or a block mask alone's), sorted by it
        # on the host and dealt to the CTAs in waves (launch_order.per_cta)
        known = self.blocks_full or self.mask is None
        persistent = known and not self.paged and self.tile.consumer_warpgroups == 2
        if persistent and smem_total((*buffers, out)) <= smem_capacity("sm_90a"):
            buffers += (out,)
        return buffers

    @property
    def moderate_rows(self) -> bool:
        """The kernel reads the bias terms' moderate flags (key_bias_terms) and walks an item
        whose keys are all flagged with the bounded softmax (one FMA per score, as without a
        bias), else with the exact one: with terms and no mask (a masked walk has two forms
        already, dense and by bits)."""
        return self.tile.bias_terms and self.mask is None

    @functools.cached_property
    def persistent(self) -> bool:
        """Items whose work the host knows (no mask, or a block mask alone), two consumers,
        and room for O beside Q: one CTA per SM takes a list of items, sorted by work and
        dealt in waves (launch_order.grid_items, forward_items), and its next item's Q and
        first key blocks load under the end of the current one, whose O goes through a
        buffer of its own. No mask stage is ever filled (no mask, or blocks_full), so none
        carries over from one item to the next."""
        return any(buffer.name == "o" for buffer in self.smem_buffers())

    def smem_bytes(self) -> int:
        return smem_total(self.smem_buffers())

    def example_args(self) -> list:
        """FlashFwdSm90's arguments for an offline compile (as FwdSpec.example_args, plus the
        block bits of a mask)."""
        q, k, v, out = (fake_rows(self.dtype) for _ in range(4))
        lse = fake_tensor("fp32", ("d", "d", "1"), 4)
        stats = fake_tensor("fp32", ("d", "d", "d", "1"), 4)
        mask, bias = (None if op is None else op.fake() for op in (self.mask, self.bias))
        if self.tile.bias_terms:  # the bias's terms (key_bias_terms)
            bias = terms_fake(self.bias, "bf16")
        bits = None if self.mask is None else fake_tensor("u8", ("d", "d", "d", "1"), 1)
        order = None
        if self.persistent:  # [CTAs, items per CTA, 4]
            shape = (cute.sym_int32(), cute.sym_int32(), 4)
            stride = (cute.sym_int64(divisibility=4), 4, 1)
            order = cute.runtime.make_fake_tensor(cutlass.Int32, shape, stride, assumed_align=16)
        elif self.ordered:  # [items, 4]: one 16-byte load per CTA
            rows = cute.sym_int32()
            order = cute.runtime.make_fake_tensor(
                cutlass.Int32, (rows, 4), (4, 1), assumed_align=16
            )
        pages = fake_tensor("i32", ("d", "1"), 4) if self.paged else None
        moderate = moderate_fake(self.bias) if self.moderate_rows else None
        return [
            q, k, v, out, lse, stats, mask, bias, bits, order, pages, moderate, *FwdScalars(),
            env_stream(),
        ]  # fmt: skip

    def compile(self, arch: str, extra_options: str = ""):
        return cute.compile(
            FlashFwdSm90(self), *self.example_args(), options=compile_options(arch, extra_options)
        )


def _smem_operands(mask: OperandSpec | None, bias: OperandSpec | None):
    # The bias comes by TMA when its tiles allow it; the mask always by cp.async (its bytes
    # are read per element in the accumulator layout, and its full tiles are not loaded).
    return (
        None if mask is None else mask.smem(),
        None if bias is None else bias.smem(tma=bias.tma_tiles),
    )


class FlashFwdSm90:
    """The Hopper forward kernel for one Sm90FwdSpec."""

    def __init__(self, spec: Sm90FwdSpec):
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        self.tile_m = spec.tile.tile_m
        self.tile_n = spec.tile.tile_n
        self.stages = spec.tile.stages
        self.head_dim_padded = spec.head_dim_padded
        self.num_threads = spec.tile.num_threads
        self.consumer_threads = self.num_threads - 128
        # A bias row as terms of Q K^T: TMA copies them with K (the kernel's mBias is the
        # terms tensor), and the scores need no bias added.
        self.bias_terms = spec.tile.bias_terms
        read_bias = spec.bias is not None and not self.bias_terms  # (read as a bias)
        self.bias_tma = read_bias and spec.bias.tma_tiles
        self.bias_row = read_bias and spec.bias.row_broadcast
        self.row_f32 = spec.tile.row_f32  # (a TMA bias row: convert_row)
        # tiles the producer copies with cp.async: the mask's, and a bias TMA cannot read
        self.bias_tiles = read_bias and not self.bias_tma
        self.has_tiles = spec.mask is not None or self.bias_tiles
        # The cp.async stages hold the mask alone: a full block (its bits say every element is
        # True) then takes no stage at all, so producer and consumers count their own stages
        # over the blocks that are not full (mask_tile_state), and a fully True mask costs no
        # handshake per block (with one, the producer's four warps polled the stage's empty
        # barrier under the consumers' softmax).
        self.mask_only_tiles = spec.mask is not None and not self.bias_tiles
        # The score accumulator starts from a bias tile unless the bias follows the softcap. A
        # query-broadcast bias is added after Q K^T (Scores.finish): its per-column copies into
        # the accumulator then sit off the consumers' path to their next GEMM issue, and the
        # stage's wait moves after that issue too (5% faster on H100, bench README).
        self.bias_first = (
            spec.bias is not None and not spec.has_softcap and not spec.bias.row_broadcast
        )
        self.take_turns = spec.head_dim_padded <= 128 and spec.tile.consumer_warpgroups > 1
        # Where a consumer waits for the previous block's P V: ptxas hoists that wait to the
        # top of the softmax, where P V is still running. Without a bias, two consumers wait
        # right after the row max instead (H200: 2% off D128, 0.5% off D256; with three, D64,
        # 2% slower); with a bias ptxas's place, after the bias add, was the fastest.
        self.pv_wait_after_max = (
            spec.bias is None or self.bias_terms
        ) and spec.tile.consumer_warpgroups == 2
        self.consumer_wgs = spec.tile.consumer_warpgroups
        self.registers = _REGISTERS[(self.consumer_wgs, self.has_tiles)]
        # a dense walk copies no mask tile: its producer needs only the unmasked kernel's
        # registers, and its consumers take the rest (H100: 1-2% off the all-True rows; the
        # unmasked split in every walk made partial tiles 6% slower, the producer spilling)
        self.dense_registers = _REGISTERS[(self.consumer_wgs, self.bias_tiles)]
        # one consumer: two CTAs per SM (registers and the whole shared memory carveout, in
        # percent; given, so that no device is asked at compile time)
        self.occupancy = (
            {"min_blocks_per_mp": 2, "preferred_smem_carveout": 100}
            if self.consumer_wgs == 1
            else {"min_blocks_per_mp": 1}
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Sq, H, D]
        mK: cute.Tensor,  # [B, Sk, Hkv, D]
        mV: cute.Tensor,  # [B, Sk, Hkv, D]
        mO: cute.Tensor,  # [B, Sq, H, D]
        mLSE: cute.Tensor,  # [B, H, Sq] fp32
        mStats: cute.Tensor,  # [B, H, 2, Sq] fp32 (see fwd_launch.flash_fwd)
        mMask: cute.Tensor | None,  # [Bm, Hm, Qm, Km] uint8 view of the bool mask
        mBias: cute.Tensor | None,  # [Bm, Hm, Qm, Km]
        mBits: cute.Tensor | None,  # [Bm, Hm, query blocks (1 if Qm = 1), key blocks] uint8
        # int32 (spec.ordered) (query block, head, batch, all visible) per launch position:
        # [B * H * query blocks, 4], or per CTA [CTAs, items per CTA, 4] (spec.persistent)
        mOrder: cute.Tensor | None,
        mPages: cute.Tensor | None,  # [B, pages per row] int32 (spec.paged)
        mModerate: cute.Tensor | None,  # [Bm, Hm, Sk / 128] int32 (spec.moderate_rows)
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
        tm, tn, dp, st = self.tile_m, self.tile_n, self.head_dim_padded, self.stages
        sQ_layout = smem_layout(self.dtype, tm, dp)
        sK_layout = smem_layout(self.dtype, tn, dp, st)
        sV_layout = smem_layout(self.dtype, tn, dp, st)
        wgs = (tm // 64, 1, 1)
        tiled_mma_qk = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            cutlass.Float32, atom_layout_mnk=wgs, tiler_mn=(64, tn),
        )  # fmt: skip
        tiled_mma_pv = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            cutlass.Float32, atom_layout_mnk=wgs, tiler_mn=(64, dp),
            a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip

        # TMA views (S, D, heads, batch) of q/k/v/o: one box is a (rows, D) tile of one head.
        def tma_view(t):
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(load, tma_view(mQ), sQ_layout, (tm, dp))
        tma_k, tK = cpasync.make_tiled_tma_atom(
            load, tma_view(mK), cute.select(sK_layout, mode=[0, 1]), (tn, dp), 1
        )
        tma_v, tV = cpasync.make_tiled_tma_atom(
            load, tma_view(mV), cute.select(sV_layout, mode=[0, 1]), (tn, dp), 1
        )
        tma_o, tO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), tma_view(mO), sQ_layout, (tm, dp)
        )
        # The bias by TMA: (Sq, Sk[, heads][, batch]), its broadcast (stride-0) dims left out.
        # A query-broadcast bias: one row per block, (Sk[, heads][, batch]), a box of tn keys.
        tma_bias = tBias = sBias_layout = None
        if cutlass.const_expr(self.bias_terms or self.bias_tma):
            # the (key) row's or (query, key) tile's modes, then heads and batch where the bias
            # has them (terms: (Sk, TERMS[, heads][, batch]), a block's box as K's)
            kept = [3] if self.bias_row else [2, 3]
            kept += [d for d in (1, 0) if self.spec.bias.strides[d] != "0"]
            view = cute.make_tensor(mBias.iterator, cute.select(mBias.layout, mode=kept))
            if cutlass.const_expr(self.bias_terms):
                sBias_layout = smem_layout(self.dtype, tn, TERMS, st)
                tma_bias, tBias = cpasync.make_tiled_tma_atom(
                    load, view, cute.select(sBias_layout, mode=[0, 1]), (tn, TERMS), 1
                )
            elif cutlass.const_expr(self.bias_row):
                tma_bias, tBias = cpasync.make_tiled_tma_atom(
                    load, view, cute.make_layout(tn), (tn,), 1
                )
            else:
                sBias_layout = smem_layout(DTYPES[self.spec.bias.dtype], tm, tn, st)
                tma_bias, tBias = cpasync.make_tiled_tma_atom(
                    load, view, cute.select(sBias_layout, mode=[0, 1]), (tm, tn), 1
                )
        # batch from O: with key chunks every chunk of a row is a batch entry
        grid = (cute.ceil_div(mQ.shape[1], tm), mQ.shape[2], mO.shape[0])
        if cutlass.const_expr(self.spec.persistent):
            grid = (mOrder.shape[0], 1, 1)
        seqlen_k = mK.shape[1]
        if cutlass.const_expr(self.spec.paged):
            seqlen_k = mPages.shape[1] * mK.shape[1]  # a row's pages, page_size keys each
        self.kernel(
            tQ, tK, tV, tO, mQ.shape[1], seqlen_k, mLSE, mStats, mMask, mBias, mBits,
            mOrder, mPages, mModerate, tma_q, tma_k, tma_v, tma_o, scale_log2, bias_scale,
            softcap_scale, softcap, window_left, window_right, mask_head_div, bias_head_div,
            group, key_chunks, sQ_layout, sK_layout, sV_layout, tiled_mma_qk, tiled_mma_pv,
            tma_bias, tBias, sBias_layout,
        ).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, **self.occupancy,
            use_pdl=True,
        )  # fmt: skip

    @cute.jit
    def longest_first(self, m_rev, h, z, seqlen_k, group):
        """(m_rev, h, z) of this CTA's launch position, counted in sections of query heads
        (h fastest, then z; whole GQA groups) whose K and V fit in _L2_SECTION_BYTES, with
        the query block slowest within a section: a bijection of the grid."""
        n_m, n_h, n_z = cute.arch.grid_dim()
        key_bytes = 2 * self.head_dim_padded * dtype_bytes(self.spec.dtype)  # K and V
        kv_heads = cutlass.max(
            cutlass.Int32(_L2_SECTION_BYTES // key_bytes) // cutlass.max(seqlen_k, 1), 1
        )
        pairs = n_h * n_z
        heads = cutlass.min(kv_heads * group, pairs)
        linear = m_rev + n_m * (h + n_h * z)
        first = linear // (n_m * heads) * heads
        count = cutlass.min(heads, pairs - first)
        within = linear - first * n_m
        hz = first + within % count
        return within // count, hz % n_h, hz // n_h

    @cute.jit
    def position(self, mOrder: cute.Tensor | None, seqlen_q, seqlen_k, group):
        """(query block, head, batch entry, all visible) of this CTA. With an order
        (spec.ordered), its item at the CTA's launch position, all visible whether the limits
        leave it only visible key blocks; else the last query blocks first (under causal, the
        longest), in L2 sections of heads under causal/window limits (longest_first), and
        all visible 0 (unknown)."""
        m_rev, h, b = cute.arch.block_idx()
        m_block = cutlass.Int32(0)
        shown = cutlass.Int32(0)
        if cutlass.const_expr(self.spec.ordered):
            n_m, n_h, _ = cute.arch.grid_dim()
            item = cute.make_rmem_tensor((4,), cutlass.Int32)
            item.store(mOrder[m_rev + n_m * (h + n_h * b), None].load())
            m_block, h, b, shown = item[0], item[1], item[2], item[3]
        else:
            if cutlass.const_expr(self.spec.has_window):
                m_rev, h, b = self.longest_first(m_rev, h, b, seqlen_k, group)
            m_block = cute.ceil_div(seqlen_q, self.tile_m) - 1 - m_rev
        return m_block, h, b, shown

    @cute.kernel
    def kernel(
        self,
        tQ: cute.Tensor,
        tK: cute.Tensor,
        tV: cute.Tensor,
        tO: cute.Tensor,
        seqlen_q: cutlass.Int32,
        seqlen_k: cutlass.Int32,
        mLSE: cute.Tensor,
        mStats: cute.Tensor,
        mMask: cute.Tensor | None,
        mBias: cute.Tensor | None,
        mBits: cute.Tensor | None,
        mOrder: cute.Tensor | None,
        mPages: cute.Tensor | None,
        mModerate: cute.Tensor | None,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_o: cute.CopyAtom,
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
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_bias: cute.CopyAtom | None,
        tBias: cute.Tensor | None,
        sBias_layout: cute.ComposedLayout | None,
    ):
        spec = self.spec
        tm, tn, dp, st = self.tile_m, self.tile_n, self.head_dim_padded, self.stages
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(tma_bias is not None):
                cpasync.prefetch_descriptor(tma_bias)

        # ---- shared memory and pipelines ----
        smem = tiles.allocate_smem(spec.smem_buffers())
        sQ = tiles.swizzled_smem_tensor(smem["q"], self.dtype, sQ_layout)
        sK = tiles.swizzled_smem_tensor(smem["k"], self.dtype, sK_layout)
        sV = tiles.swizzled_smem_tensor(smem["v"], self.dtype, sV_layout)
        mbar = cute.recast_ptr(smem["mbar"][0], dtype=cutlass.Int64)
        sTerms = sOnes = None
        if cutlass.const_expr(self.bias_terms):
            sTerms = tiles.swizzled_smem_tensor(smem["bias"], self.dtype, sBias_layout)
            sOnes = tiles.swizzled_smem_tensor(
                smem["ones"], self.dtype, smem_layout(self.dtype, tm, TERMS)
            )
            # the terms' A operand: 1 in columns 0-2, for the whole kernel (wgmma reads it
            # through the async proxy after the CTA barrier below)
            tidx = cute.arch.thread_idx()[0]
            for i in cutlass.range_constexpr(-(-tm * TERMS // self.num_threads)):
                e = tidx + i * self.num_threads
                if e < tm * TERMS:
                    one = cutlass.Float32(1.0) if e % TERMS < 3 else cutlass.Float32(0.0)
                    sOnes[e // TERMS, e % TERMS] = one.to(self.dtype)
            cute.arch.fence_view_async_shared()
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.consumer_threads // 32
        )
        eb = dtype_bytes(spec.dtype)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar, num_stages=1, producer_group=one_thread,
            consumer_group=consumer_warps, tx_count=tm * dp * eb, defer_sync=True,
        )  # fmt: skip
        k_bytes = tn * (dp + (TERMS if self.bias_terms else 0)) * eb  # (a block's terms too)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar + 2, num_stages=st, producer_group=one_thread,
            consumer_group=consumer_warps, tx_count=k_bytes, defer_sync=True,
        )  # fmt: skip
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar + 2 + 2 * st, num_stages=st, producer_group=one_thread,
            consumer_group=consumer_warps, tx_count=tn * dp * eb, defer_sync=True,
        )  # fmt: skip
        # every consumer thread arrives, each after its own reads (cp.async tiles, fp32 row)
        consumer_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads)
        pipe_tiles = None
        if cutlass.const_expr(self.has_tiles):
            pipe_tiles = pipeline.PipelineCpAsync.create(
                barrier_storage=mbar + 2 + 4 * st, num_stages=st,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=consumer_threads, defer_sync=True,
            )  # fmt: skip
        pipe_bias = pipe_row = None
        if cutlass.const_expr(self.bias_tma):
            # a bias row's TMA stage is read by the producer warp that converts it (pipe_row)
            pipe_bias = pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar + 2 + 6 * st, num_stages=st, producer_group=one_thread,
                consumer_group=one_thread if self.row_f32 else consumer_warps,
                tx_count=(1 if self.bias_row else tm) * tn * dtype_bytes(spec.bias.dtype),
                defer_sync=True,
            )  # fmt: skip
        if cutlass.const_expr(self.row_f32):
            # its fp32 copy: written by producer warp 1's lanes
            pipe_row = pipeline.PipelineAsync.create(
                barrier_storage=mbar + 2 + 8 * st, num_stages=st,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=consumer_threads, defer_sync=True,
            )  # fmt: skip
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every mbarrier is initialized before any thread uses one
        # Launched as a dependent (programmatic dependent launch): the kernel before this one
        # in the stream (e.g. the block-bits pre-pass) may still run; no global memory is
        # touched before it has finished. The next dependent launch (the split-KV combine)
        # may start now: it waits for this grid the same way.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        limits = masking.BlockLimits(
            seqlen_q, seqlen_k, window_left, window_right, tm, tn, spec.has_window
        )

        # Mask and bias: smem stages, and the (tm, tn, stages) views the scores read.
        tile_smem = {}
        sBias = sRow = None
        if cutlass.const_expr(self.bias_tma and self.bias_row):
            # stage s: tn keys at s * pitch (TMA writes 128-byte aligned boxes)
            row_layout = cute.make_layout((tn, st), stride=(1, bias_row_pitch(tn)))
            sBias = tiles.smem_tensor(smem["bias"], DTYPES[spec.bias.dtype], row_layout)
        elif cutlass.const_expr(self.bias_tma):
            sBias = tiles.swizzled_smem_tensor(smem["bias"], DTYPES[spec.bias.dtype], sBias_layout)
        if cutlass.const_expr(self.bias_terms):
            sBias = sTerms
        if cutlass.const_expr(self.row_f32):
            sRow = tiles.smem_tensor(
                smem["bias_f32"], cutlass.Float32, cute.make_layout((tn, st), stride=(1, tn))
            )
        for name, op in (("mask", spec.mask), ("bias", spec.bias)):
            if cutlass.const_expr(op is not None and not (name == "bias" and self.bias_tma)):
                dtype = DTYPES[op.dtype]
                stride = operands.stage_elems(op, tm, tn, dtype)
                tile_smem[name] = operands.smem_stages(
                    smem[name], dtype, op, tm, tn, st, stride, 128
                )
        produced = (
            tK, tV, sK, sV, mMask, mBias, tile_smem, tma_k, tma_v, pipe_k, pipe_v, pipe_tiles,
            pipe_bias, pipe_row, limits, mask_head_div, bias_head_div, group, seqlen_k, tma_bias,
            tBias, sBias, sRow, mPages,
        )  # fmt: skip
        consumed = (
            tO, sQ, sK, sV, mLSE, mStats, tile_smem, sBias, sRow, tma_o, pipe_q, pipe_k, pipe_v,
            pipe_tiles, pipe_bias, pipe_row, tiled_mma_qk, tiled_mma_pv, limits, scale_log2,
            bias_scale, softcap_scale, softcap, sOnes, mModerate, bias_head_div,
        )  # fmt: skip

        if cutlass.const_expr(spec.persistent):
            sO = tiles.swizzled_smem_tensor(smem["o"], self.dtype, sQ_layout)
            if warp < 4:
                self.produce_items(
                    produced, limits, mask_head_div, key_chunks, mOrder, mBits, tma_q, tQ, sQ,
                    pipe_q,
                )  # fmt: skip
            else:
                self.consume_items(consumed, limits, mask_head_div, key_chunks, mOrder, mBits, sO)
        else:
            m_block, h, b, shown = self.position(mOrder, seqlen_q, seqlen_k, group)
            b_op, bits, n_block_min, n_block_max = self.item_tile(
                m_block, h, b, limits, mBits, mask_head_div, key_chunks
            )
            if warp == 0:
                # Q before the walk reads the block bits (all_full, then the producer's
                # window): its load runs under those reads (H200: 2-5% off block-mask forwards)
                if n_block_min < n_block_max:
                    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                    self.load_q(tma_q, tQ, sQ, pipe_q, m_block, h, b_op, q_state)
            tile = (m_block, n_block_min, n_block_max, h, b_op, bits)
            if warp < 4:
                args = (produced, tile, self.kv_state(True))
                self.walk(self.produce, args, bits, shown, n_block_min, n_block_max, producer=True)
            else:
                self.first_turn()
                item = (m_block, n_block_min, n_block_max, h, b, bits, b_op)
                args = (consumed, item, self.kv_state(False), None, sQ)
                self.walk(
                    self.consume, args, bits, shown, n_block_min, n_block_max, producer=False
                )  # fmt: skip

    def kv_state(self, producer: bool) -> pipeline.PipelineState:
        """The K / V (and mask / bias) stages' pipeline state before a CTA's first block."""
        kind = (
            pipeline.PipelineUserType.Producer if producer else pipeline.PipelineUserType.Consumer
        )
        return pipeline.make_pipeline_state(kind, self.stages)

    @cute.jit
    def item_at(self, mOrder: cute.Tensor, j):
        """(query block, head, batch, all visible) of this CTA's item j (spec.persistent);
        query block -1 past its last. Read into registers now, waited for where first used."""
        item = cute.make_rmem_tensor((4,), cutlass.Int32)
        item.fill(-1)
        if j < mOrder.shape[1]:
            item.store(mOrder[cute.arch.block_idx()[0], j, None].load())
        return item[0], item[1], item[2], item[3]

    @cute.jit
    def item_tile(self, m_block, h, b, limits, mBits, mask_head_div, key_chunks):
        """(b_op, bits, n_block_min, n_block_max) of the item (m_block, h, b): the row of Q,
        K, V, the mask and the bias, the item's block bits (a mask's) and its key blocks.
        Split-KV decode: batch entry b (of O and the row stats) is a chunk of the key blocks
        of row b_op (fwd_launch.flash_fwd's key_chunks; never with a block mask, whose launch
        alone is ordered)."""
        spec = self.spec
        n_block_min, n_block_max = limits.key_block_range(m_block)
        b_op = b
        if cutlass.const_expr(not spec.ordered):
            b_op = b // key_chunks
        bits = None
        if cutlass.const_expr(spec.mask is not None):
            bits = mBits[b_op, h // mask_head_div, m_block, None]  # stride 0 where broadcast
        if cutlass.const_expr(not spec.ordered):
            n_block_min, n_block_max = masking.chunk_block_range(
                bits, n_block_min, n_block_max, b - b_op * key_chunks, key_chunks
            )
        return b_op, bits, n_block_min, n_block_max

    @cute.jit
    def produce_items(
        self, produced, limits, mask_head_div, key_chunks, mOrder, mBits, tma_q, tQ, sQ, pipe_q
    ):  # fmt: skip
        """The producer of a persistent CTA (spec.persistent): Q, then the walk's bias, K and
        V, of each of its items in turn; the stages' states carry over from one item to the
        next, so the next item's Q and first blocks load while the consumers finish this
        one (Q as soon as they have released it: their last Q K^T has completed)."""
        self.take_registers(True, self.registers)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        state = self.kv_state(True)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        j = cutlass.Int32(0)
        m_block, h, b, shown = self.item_at(mOrder, j)
        while m_block >= 0:
            next_item = self.item_at(mOrder, j + 1)
            b_op, bits, n_block_min, n_block_max = self.item_tile(
                m_block, h, b, limits, mBits, mask_head_div, key_chunks
            )
            if warp == 0:
                self.load_q(tma_q, tQ, sQ, pipe_q, m_block, h, b_op, q_state)
            q_state.advance()
            tile = (m_block, n_block_min, n_block_max, h, b_op, bits)
            if cutlass.const_expr(self.spec.mask is None):
                state = self.produce(produced, tile, state)
            elif shown != 0:  # (a block mask alone: every key block of the item visible)
                state = self.produce(produced, tile, state, dense=True)
            else:
                state = self.produce(produced, tile, state)
            m_block, h, b, shown = next_item
            j += 1

    @cute.jit
    def consume_items(self, consumed, limits, mask_head_div, key_chunks, mOrder, mBits, sO):
        """The consumers of a persistent CTA (spec.persistent): each of its items in turn,
        the stages' states carried over; O goes through its own buffer sO (not over sQ, which
        the next item's Q refills meanwhile), each TMA store's reads of it waited for before
        the next item's O overwrites it."""
        self.take_registers(False, self.registers)
        self.first_turn()
        state = self.kv_state(False)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        j = cutlass.Int32(0)
        m_block, h, b, shown = self.item_at(mOrder, j)
        while m_block >= 0:
            next_item = self.item_at(mOrder, j + 1)
            b_op, bits, n_block_min, n_block_max = self.item_tile(
                m_block, h, b, limits, mBits, mask_head_div, key_chunks
            )
            tile = (m_block, n_block_min, n_block_max, h, b, bits, b_op)
            if cutlass.const_expr(self.spec.mask is None):
                state = self.consume(consumed, tile, state, q_state, sO)
            elif shown != 0:
                state = self.consume(consumed, tile, state, q_state, sO, dense=True)
            else:
                state = self.consume(consumed, tile, state, q_state, sO)
            q_state.advance()
            m_block, h, b, shown = next_item
            j += 1
        if cute.arch.thread_idx()[0] - 128 < 32:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sO is read before the CTA exits

    @cute.jit
    def first_turn(self):
        """The first consumer takes the first turn at the tensor cores (take_turns)."""
        if cutlass.const_expr(self.take_turns):
            wg = cute.arch.make_warp_uniform((cute.arch.thread_idx()[0] - 128) // 128)
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=_TURN_BARRIER, number_of_threads=256)

    @cute.jit
    def walk(
        self, role, args, bits: cute.Tensor | None, shown, n_block_min, n_block_max,
        producer: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """role(*args) (produce or consume) over the CTA's key blocks: as a dense walk where
        every one is FULL (all_full; for a block mask alone, every one visible: the item's
        `shown`, read with it), else by their bits; each after its register split."""
        if cutlass.const_expr(self.spec.mask is not None):
            dense = shown != 0
            if cutlass.const_expr(not self.spec.blocks_full):
                dense = self.all_full(bits, n_block_min, n_block_max)
            if dense:
                self.take_registers(producer, self.dense_registers)
                role(*args, dense=True)
            else:
                self.take_registers(producer, self.registers)
                role(*args)
        else:
            self.take_registers(producer, self.registers)
            role(*args)

    @cute.jit
    def take_registers(self, producer: cutlass.Constexpr[bool], registers):
        """The producer gives registers back (setmaxnreg), the consumers take them."""
        if cutlass.const_expr(producer):
            cute.arch.setmaxregister_decrease(registers[0])
        else:
            cute.arch.setmaxregister_increase(registers[1])

    @cute.jit
    def prev_visible(self, bits: cute.Tensor | None, n_block, n_block_min, top, visible, full):
        """The last visible key block at or below n_block (below n_block_min: none left), and
        the walk's window then: (block, top, visible, full), where visible / full hold the
        VISIBLE / FULL bits of blocks top, top - 1, ..., top - 31 (bit i: block top - i;
        blocks_window) and cover the block returned. A warp reads the bits of 32 blocks at
        once, so a walk waits for gmem once per 32 blocks, not once or twice per block (the
        load sat between a block's Q K^T and its softmax). Start a walk with top = -1."""
        if cutlass.const_expr(bits is not None):
            searching = n_block >= n_block_min
            while searching:
                if (n_block > top) | (n_block < top - 31):
                    top = n_block
                    visible, full = self.blocks_window(bits, top, n_block_min)
                ahead = visible >> (top - n_block)  # bit i: block n_block - i
                if ahead != 0:
                    # the lowest set bit is the highest visible block
                    n_block -= cutlass.Int32(cute.arch.popc((ahead & -ahead) - 1))
                    searching = False
                else:
                    n_block = top - 32
                    searching = n_block >= n_block_min
            # the same for every lane (a ballot): said so, or the stage indices that follow
            # look divergent to ptxas, which then builds the wgmma descriptors per thread
            n_block = cute.arch.make_warp_uniform(n_block)
        return n_block, top, visible, full

    @cute.jit
    def all_full(self, bits: cute.Tensor, n_block_min, n_block_max) -> cutlass.Boolean:
        """Whether every key block in [n_block_min, n_block_max) is FULL (warp-uniform): the
        walk then needs no bits and no block takes a mask stage, so it runs the unmasked
        loop (`dense`)."""
        full = cutlass.Boolean(True)
        top = n_block_max - 1
        while top >= n_block_min:
            idx = top - cute.arch.lane_idx()
            byte = cutlass.Int32(FULL)  # lanes past the range
            if idx >= n_block_min:
                byte = cutlass.Int32(bits[idx])
            full = full & cute.arch.vote_all_sync((byte & FULL) != 0)
            top -= 32
        return full

    @cute.jit
    def blocks_window(self, bits: cute.Tensor, top, n_block_min):
        """(visible, full): ballots of the VISIBLE and FULL bits of key blocks top, top - 1,
        ..., top - 31 (lane i reads block top - i; blocks below n_block_min count as empty)."""
        idx = top - cute.arch.lane_idx()
        byte = cutlass.Int32(0)
        if idx >= n_block_min:
            byte = cutlass.Int32(bits[idx])
        visible = cute.arch.vote_ballot_sync((byte & VISIBLE) != 0)
        full = cute.arch.vote_ballot_sync((byte & FULL) != 0)
        return cutlass.Int32(visible), cutlass.Int32(full)

    @cute.jit
    def block_full(self, n_block, top, full, dense: cutlass.Constexpr[bool] = False):
        """FULL if key block n_block (in the walk's window: prev_visible) is full, else 0 (and
        0 without a mask; FULL, known at compile time, in a dense walk: all_full, and for a
        block mask alone: spec.blocks_full)."""
        if cutlass.const_expr(dense or self.spec.blocks_full):
            return FULL
        flag = cutlass.Int32(0)
        if cutlass.const_expr(self.spec.mask is not None):
            flag = cute.arch.make_warp_uniform(((full >> (top - n_block)) & 1) * FULL)
        return flag

    @cute.jit
    def produce(self, produced, tile, state, dense: cutlass.Constexpr[bool] = False):
        """The producer warpgroup (Q is already on its way: load_q): the bias, mask, K and V
        of every visible key block of `tile` from the last to the first, each into the next
        free stage from `state` on (b_op: the row of Q, K, V, the mask and the bias).
        Returns the state after the walk."""
        (
            tK, tV, sK, sV, mMask, mBias, tile_smem, tma_k, tma_v, pipe_k, pipe_v, pipe_tiles,
            pipe_bias, pipe_row, limits, mask_head_div, bias_head_div, group, seqlen_k, tma_bias,
            tBias, sBias, sRow, mPages,
        ) = produced  # fmt: skip
        m_block, n_block_min, n_block_max, h, b_op, bits = tile
        spec = self.spec
        tm, tn = self.tile_m, self.tile_n
        tidx = cute.arch.thread_idx()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        hk = h // group
        # gmem -> smem TMA partitions: one box per tile (stage index / key block last)
        tKsK, tKgK = self.kv_tiles(tma_k, tK, sK, hk, b_op)
        tVsV, tVgV = self.kv_tiles(tma_v, tV, sV, hk, b_op)
        page_blocks = cutlass.Int32(1)  # key blocks per page (paged)
        if cutlass.const_expr(spec.paged):
            page_blocks = cutlass.Int32(tK.shape[0] // tn)
        tBsB = tBgB = None
        if cutlass.const_expr(self.bias_terms or self.bias_tma):  # (terms: sBias's stages)
            coord = [None] * (1 if self.bias_row else 2) + [
                x for d, x in ((1, h // bias_head_div), (0, b_op)) if spec.bias.strides[d] != "0"
            ]
            modes = 2
            if cutlass.const_expr(self.bias_terms):
                gB = cute.local_tile(tBias[tuple(coord)], (tn, TERMS), (None, 0))
            elif cutlass.const_expr(self.bias_row):
                gB = cute.local_tile(tBias[tuple(coord)], (tn,), (None,))
                modes = 1
            else:
                gB = cute.local_tile(tBias[tuple(coord)], (tm, tn), (m_block, None))
            tBsB, tBgB = cpasync.tma_partition(
                tma_bias, 0, cute.make_layout(1), cute.group_modes(sBias, 0, modes),
                cute.group_modes(gB, 0, modes),
            )  # fmt: skip
        # mask (and a bias TMA cannot read): gmem -> smem cp.async partitions of the 128
        # producer threads
        loads = {}
        for name, op, mX, head_div in (
            ("mask", spec.mask, mMask, mask_head_div),
            ("bias", spec.bias, mBias, bias_head_div),
        ):
            if cutlass.const_expr(op is not None and name in tile_smem):
                sX, _, tcopy, used = tile_smem[name]
                gX, cX, row_end = operands.gmem_tiles(
                    op, mX, b_op, h // head_div, limits, m_block, None
                )
                loads[name] = operands.OperandLoads.make(
                    op, tcopy, used, gX, cX, sX, row_end, seqlen_k, tidx, walk_queries=False
                )

        mask_tiles = cutlass.Int32(0)  # mask stages filled so far (mask_only_tiles)
        walk_bits = None if dense else bits  # (a dense walk steps down one block at a time)
        n_block, top, visible, full_bits = self.prev_visible(
            walk_bits, n_block_max - 1, n_block_min, cutlass.Int32(-1), cutlass.Int32(0),
            cutlass.Int32(0),
        )  # fmt: skip
        page = self.page_of(mPages, b_op, n_block, n_block_min, page_blocks)
        while n_block >= n_block_min:
            # Bias and mask first: the consumers read the bias before the block's first GEMM,
            # and their stage frees a block earlier than V's (whose acquire waits for the
            # previous block's P V).
            if cutlass.const_expr(self.bias_tma):
                if warp == 0:
                    pipe_bias.producer_acquire(state)
                    cute.copy(
                        tma_bias, tBgB[None, n_block], tBsB[None, state.index],
                        tma_bar_ptr=pipe_bias.producer_get_barrier(state),
                    )  # fmt: skip
            if cutlass.const_expr(self.mask_only_tiles):
                full = self.block_full(n_block, top, full_bits, dense)
                if full == 0:
                    tile_state = self.mask_tile_state(mask_tiles, True)
                    pipe_tiles.producer_acquire(tile_state)
                    loads["mask"].load(n_block, tile_state.index)
                    operands.tiles_landed(pipe_tiles, tile_state, spec.mask, None)
                mask_tiles += 1 - full // FULL
            elif cutlass.const_expr(self.bias_tiles):
                pipe_tiles.producer_acquire(state)
                if cutlass.const_expr(spec.mask is not None):
                    if self.block_full(n_block, top, full_bits, dense) == 0:
                        loads["mask"].load(n_block, state.index)
                loads["bias"].load(n_block, state.index)
                operands.tiles_landed(pipe_tiles, state, spec.mask, spec.bias)
            if warp == 0:
                k_stages, k_blocks, v_stages, v_blocks = tKsK, tKgK, tVsV, tVgV
                block = n_block
                if cutlass.const_expr(spec.paged):
                    k_stages, k_blocks = self.kv_tiles(tma_k, tK, sK, hk, page)
                    v_stages, v_blocks = self.kv_tiles(tma_v, tV, sV, hk, page)
                    block = n_block % page_blocks
                pipe_k.producer_acquire(state)
                cute.copy(
                    tma_k, k_blocks[None, block], k_stages[None, state.index],
                    tma_bar_ptr=pipe_k.producer_get_barrier(state),
                )  # fmt: skip
                if cutlass.const_expr(self.bias_terms):  # on K's barrier (its tx_count)
                    cute.copy(
                        tma_bias, tBgB[None, n_block], tBsB[None, state.index],
                        tma_bar_ptr=pipe_k.producer_get_barrier(state),
                    )  # fmt: skip
                pipe_v.producer_acquire(state)
                cute.copy(
                    tma_v, v_blocks[None, block], v_stages[None, state.index],
                    tma_bar_ptr=pipe_v.producer_get_barrier(state),
                )  # fmt: skip
            if cutlass.const_expr(self.row_f32):
                if warp == 1:  # after its share of the block's mask tile
                    self.convert_row(pipe_bias, pipe_row, sBias, sRow, state)
            state.advance()
            n_block, top, visible, full_bits = self.prev_visible(
                walk_bits, n_block - 1, n_block_min, top, visible, full_bits
            )
            page = self.page_of(mPages, b_op, n_block, n_block_min, page_blocks)
        return state

    @cute.jit
    def convert_row(self, pipe_bias, pipe_row, sBias, sRow, state):
        """Producer warp 1: a bias row's stage, once its TMA has landed, as fp32 into sRow (in
        log2 units, bias * log2(e) rounded toward zero as Scores rounds it, unless a softcap
        follows: then as it is), so that no consumer thread converts and scales its columns
        itself (32 of them per thread per block); then the TMA stage is free."""
        tn = self.tile_n
        log2_units = not self.spec.has_softcap
        # the TMA stage read as a consumer: the producer's state, in the consumers' phase
        landed = pipeline.PipelineState(state.stages, state.count, state.index, state.phase ^ 1)
        pipe_bias.consumer_wait(landed)
        pipe_row.producer_acquire(state)
        lane = cute.arch.lane_idx()
        for i in cutlass.range_constexpr(-(-tn // 32)):
            col = lane + 32 * i
            if col < tn:
                value = cutlass.Float32(sBias[col, state.index])
                if cutlass.const_expr(log2_units):
                    value = mul_rz(value, cutlass.Float32(LOG2E))
                sRow[col, state.index] = value
        pipe_row.producer_commit(state)  # every lane after its own writes
        cute.arch.sync_warp()
        pipe_bias.consumer_release(state)  # one arrive for the warp, after every lane's reads

    @cute.jit
    def load_q(self, tma_q, tQ, sQ, pipe_q, m_block, h, b_op, q_state):
        """The query block by TMA into sQ (warp 0; one box)."""
        gQ = cute.local_tile(
            tQ[None, None, h, b_op], (self.tile_m, self.head_dim_padded), (m_block, 0)
        )
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

    @cute.jit
    def kv_tiles(self, tma: cute.CopyAtom, tX: cute.Tensor, sX: cute.Tensor, hk, row):
        """(smem stages, gmem key blocks) TMA partitions of K or V of kv head hk in batch row
        `row`, or in page `row` of a pool (spec.paged)."""
        gX = cute.local_tile(
            tX[None, None, hk, row], (self.tile_n, self.head_dim_padded), (None, 0)
        )
        return cpasync.tma_partition(
            tma, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
        )

    @cute.jit
    def page_of(self, mPages: cute.Tensor | None, b_op, n_block, n_block_min, page_blocks):
        """The page that holds key block n_block of row b_op (spec.paged; else 0), loaded as
        soon as the walk has found that block, a block ahead of its TMA copies. Past the walk
        (n_block < n_block_min, or an empty one) it reads a page of the row that exists."""
        page = cutlass.Int32(0)
        if cutlass.const_expr(self.spec.paged):
            index = cutlass.max(n_block, n_block_min) // page_blocks
            page = mPages[b_op, cutlass.min(index, mPages.shape[1] - 1)]
        return page

    @cute.jit
    def consume(
        self, consumed, tile, state, q_state, sO, dense: cutlass.Constexpr[bool] = False
    ):  # fmt: skip
        """A consumer warpgroup: its 64 rows of the query block against every visible key
        block of `tile` (m_block, n_block_min, n_block_max, h, b, bits, b_op: the row of the
        operands), the stages read from `state` on, then the epilogue (O through sO).
        q_state: Q's stage of this tile in a persistent CTA (released once every Q K^T has
        completed), else None (sQ filled once, and sO over it). Returns the state after the
        walk. With moderate flags (spec.moderate_rows) the walk takes the bounded softmax
        where the item's keys are all flagged (row_moderate), else the exact one."""
        if cutlass.const_expr(self.spec.moderate_rows):
            mModerate, bias_head_div = consumed[-2:]
            _, n_block_min, n_block_max, h, _, _, b_op = tile
            flags = mModerate[b_op, h // bias_head_div, None]
            if self.row_moderate(flags, n_block_min, n_block_max):
                state = self.consume_blocks(consumed, tile, state, q_state, sO, dense, True)
            else:
                state = self.consume_blocks(consumed, tile, state, q_state, sO, dense)
        else:
            state = self.consume_blocks(consumed, tile, state, q_state, sO, dense)
        return state

    @cute.jit
    def row_moderate(self, flags: cute.Tensor, n_block_min, n_block_max) -> cutlass.Boolean:
        """Whether every key of blocks [n_block_min, n_block_max) has a moderate bias (flags:
        the item's row of key_bias_terms's words; warp-uniform): each lane reads every 32nd
        word of the range, then the warp votes."""
        first = n_block_min * self.tile_n // NUM_THREADS
        last = cutlass.min(
            (n_block_max * self.tile_n + NUM_THREADS - 1) // NUM_THREADS, flags.shape[0]
        )
        off = cutlass.Int32(0)  # the bits of any word that is not MODERATE_WORD
        for w in cutlass.range(first + cute.arch.lane_idx(), last, 32):
            off = off | (flags[w] ^ MODERATE_WORD)
        return cute.arch.vote_all_sync(off == 0)

    @cute.jit
    def consume_blocks(
        self, consumed, tile, state, q_state, sO, dense: cutlass.Constexpr[bool] = False,
        bounded: cutlass.Constexpr[bool] = False,
    ):  # fmt: skip
        """consume's walk and epilogue; bounded: the item's biases are all moderate, so its
        scores are bounded as without a bias (the bounded softmax, one FMA per score)."""
        (
            tO, sQ, sK, sV, mLSE, mStats, tile_smem, sBias, sRow, tma_o, pipe_q, pipe_k, pipe_v,
            pipe_tiles, pipe_bias, pipe_row, tiled_mma_qk, tiled_mma_pv, limits, scale_log2,
            bias_scale, softcap_scale, softcap, sOnes, _, _,
        ) = consumed  # fmt: skip
        m_block, n_block_min, n_block_max, h, b, bits, _ = tile
        spec = self.spec
        tm, tn, dp, st = self.tile_m, self.tile_n, self.head_dim_padded, self.stages
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        seqlen_q, seqlen_k = limits.seqlen_q, limits.seqlen_k

        # ---- wgmma operands: smem descriptors of Q, K, V^T; register accumulators ----
        thr_qk = tiled_mma_qk.get_slice(tidx)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        terms = None  # a bias row's k-step: (ones, the stages' terms)
        if cutlass.const_expr(self.bias_terms):
            terms = (
                wg_qk.make_fragment_A(wg_qk.partition_A(sOnes)),
                wg_qk.make_fragment_B(wg_qk.partition_B(sBias)),
            )
        sVt = tiles.transposed(sV, tn, dp, st)
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((tm, dp)), cutlass.Float32)
        acc_O.fill(0.0)
        s_shape = wg_qk.partition_shape_C((tm, tn))
        rP = cute.make_rmem_tensor(s_shape, self.dtype)
        tOrP = cute.make_tensor(rP.iterator, acc_as_a_operand(rP.layout))
        # (row, col) of every score this thread holds, per key block
        tScS = thr_qk.partition_C(
            cute.local_tile(
                cute.make_identity_tensor((seqlen_q, seqlen_k)), (tm, tn), (m_block, None)
            )
        )
        views = {name: thr_qk.partition_C(tile_smem[name][1]) for name in tile_smem}
        if cutlass.const_expr(self.row_f32):  # every row reads row 0 of the fp32 copy
            row_view = cute.make_layout((tm, tn, st), stride=(0, 1, tn))
            views["bias"] = thr_qk.partition_C(cute.make_tensor(sRow.iterator, row_view))
        elif cutlass.const_expr(self.bias_tma and self.bias_row):  # every row reads row 0
            row_view = cute.make_layout((tm, tn, st), stride=(0, 1, bias_row_pitch(tn)))
            views["bias"] = thr_qk.partition_C(cute.make_tensor(sBias.iterator, row_view))
        elif cutlass.const_expr(self.bias_tma):
            views["bias"] = thr_qk.partition_C(sBias)
        row_bias = self.bias_row
        # the bias stages the scores read: a row's fp32 copy (convert_row), else the TMA's
        pipe_read = pipe_row if cutlass.const_expr(self.row_f32) else pipe_bias
        # a row bias without softcap: scores in log2 units, one FMA each (Scores.log2_units)
        log2_units = row_bias and not spec.has_softcap
        scores = Scores(
            spec.bias is not None and not self.bias_terms, spec.mask is not None,
            spec.has_softcap, bias_scale,
            softcap_scale, softcap, bias_rows_shared=row_bias, bias_after_gemm=row_bias,
            bias_converted=self.row_f32,
            mask_expiry=spec.mask is not None and spec.mask.dtype in ("i32", "i64"),
            mask_ranges=spec.mask is not None and spec.mask.dtype == "i64",
            log2_units=log2_units, scale_log2=scale_log2,
        )  # fmt: skip
        softmax = OnlineSoftmax.create(
            cute.size(acc_mn_view(acc_O).shape[0]), scale_log2,
            spec.bias is not None and not bounded, log2_units,
        )  # fmt: skip

        if cutlass.const_expr(q_state is not None):
            pipe_q.consumer_wait(q_state)
        elif n_block_min < n_block_max:
            pipe_q.consumer_wait(
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            )
        mask_tiles = cutlass.Int32(0)  # mask stages read so far (mask_only_tiles)
        walk_bits = None if dense else bits  # (a dense walk steps down one block at a time)
        n_block, top, visible, full_bits = self.prev_visible(
            walk_bits, n_block_max - 1, n_block_min, cutlass.Int32(-1), cutlass.Int32(0),
            cutlass.Int32(0),
        )  # fmt: skip
        if n_block >= n_block_min:
            # First block: S, its softmax, P (no P V yet: it waits for the next block's S).
            acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
            self.start_scores(scores, acc_S, views, pipe_tiles, pipe_bias, state)
            pipe_k.consumer_wait(state)
            wgmma(
                tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], self.bias_first, 0,
                self.terms_step(terms, state),
            )  # fmt: skip
            pipe_k.consumer_release(state)
            mask_tiles = self.finish_scores(
                scores, acc_S, views, pipe_tiles, pipe_read, state,
                self.block_full(n_block, top, full_bits, dense), limits, tScS, m_block, n_block,
                mask_tiles,
            )  # fmt: skip
            softmax.probabilities(acc_S)  # O is still 0: nothing to rescale
            round_pairs(acc_S, rP)
            n_block, top, visible, full_bits = self.prev_visible(
                walk_bits, n_block - 1, n_block_min, top, visible, full_bits
            )
            while n_block >= n_block_min:
                state = warp_uniform(state)
                prev = state.clone()
                state.advance()
                acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                self.start_scores(scores, acc_S, views, pipe_tiles, pipe_bias, state)
                pipe_k.consumer_wait(state)
                self.turn_wait(wg)
                wgmma(
                    tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index],
                    self.bias_first, -1, self.terms_step(terms, state),
                )  # fmt: skip
                pipe_v.consumer_wait(prev)
                wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, prev.index], True, -1)
                self.turn_pass(wg)
                # the next block while the GEMMs run (a sparse walk's bit scan, and its bits
                # read every 32 blocks, stay off the chain from S to the softmax)
                full = self.block_full(n_block, top, full_bits, dense)
                current = n_block
                n_block, top, visible, full_bits = self.prev_visible(
                    walk_bits, n_block - 1, n_block_min, top, visible, full_bits
                )
                warpgroup.wait_group(1)  # S of this block is complete
                pipe_k.consumer_release(state)
                mask_tiles = self.finish_scores(
                    scores, acc_S, views, pipe_tiles, pipe_read, state, full, limits, tScS,
                    m_block, current, mask_tiles,
                )  # fmt: skip
                pv_done = functools.partial(self.pv_done, pipe_v, prev)
                correction = softmax.probabilities(
                    acc_S, pv_done if self.pv_wait_after_max else None
                )
                if cutlass.const_expr(not self.pv_wait_after_max):
                    pv_done()
                softmax.rescale_output(acc_O, correction)
                round_pairs(acc_S, rP)
            self.release_q(pipe_q, q_state)  # every Q K^T of the tile has completed
            # Last block's P V.
            pipe_v.consumer_wait(state)
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], True, 0)
            pipe_v.consumer_release(state)
            state.advance()  # past the last block read, as the producer's state is
        else:
            self.release_q(pipe_q, q_state)

        # ---- epilogue: normalize; LSE and stats (rmem -> gmem); O (rmem -> smem -> gmem) ----
        lse = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)
        log2sum = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)
        softmax.finalize(acc_O, lse, log2sum)
        softmax.store_stats(
            lse, log2sum, acc_mn_view(tScS[None, None, None, 0]), mLSE, mStats, b, h,
            seqlen_q, tidx, spec.bias is None,
        )  # fmt: skip

        if cutlass.const_expr(q_state is not None):
            if tidx < 32:  # the previous item's TMA store has read sO
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # Both consumers' wgmmas that read sQ (sO without q_state) have completed; sO is free.
        cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.consumer_threads)
        # stmatrix: 8 stores of four 8 x 8 matrices per thread (64 values), not 32 STS
        r2s = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        tiles.acc_to_smem(acc_O, self.dtype, r2s, tiled_mma_pv, tidx, sO)
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes, read by the TMA store
        cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.consumer_threads)
        if tidx < 32:
            gO = cute.local_tile(tO[None, None, h, b], (tm, dp), (m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                cute.group_modes(gO, 0, 2),
            )  # fmt: skip
            cute.copy(tma_o, tOsO, tOgO)  # rows past Sq and columns past D are not stored
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(q_state is None):
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # read before the CTA exits
        return state

    def terms_step(self, terms, state):
        """The (A, B) fragments of a bias row's k-step at `state`'s stage, or None."""
        if terms is None:
            return None
        ones, stages = terms
        return ones, stages[None, None, None, state.index]

    @cute.jit
    def release_q(self, pipe_q, q_state):
        """A persistent CTA's consumers free sQ for the next item's Q (q_state; else none)."""
        if cutlass.const_expr(q_state is not None):
            pipe_q.consumer_release(q_state)

    @cute.jit
    def start_scores(self, scores, acc_S, views, pipe_tiles, pipe_bias, state):
        """acc_S before Q K^T: bias / scale once the stage's tiles have landed (bias first),
        else left for the GEMM to overwrite."""
        if cutlass.const_expr(self.bias_tiles and self.bias_first):
            pipe_tiles.consumer_wait(state)
        if cutlass.const_expr(self.bias_tma and not self.bias_row):
            pipe_bias.consumer_wait(state)
        if cutlass.const_expr(self.bias_first):
            scores.start(acc_S, views["bias"][None, None, None, state.index])

    @cute.jit
    def finish_scores(
        self,
        scores,
        acc_S,
        views,
        pipe_tiles,
        pipe_bias,
        state,
        full,
        limits,
        tScS,
        m_block,
        n_block,
        mask_tiles,
    ):
        """acc_S after Q K^T: softcap, the bias after it, the mask tile (unless `full`: FULL,
        block_full), the causal/window/length limits; then the stage's mask/bias tiles are
        released (pipe_bias: the pipeline of the bias stages read, a bias row's fp32 copy for
        a row). Returns mask_tiles (the mask stages read so far, mask_only_tiles) after this
        block."""
        spec = self.spec
        if cutlass.const_expr(self.bias_tiles and not self.bias_first):
            pipe_tiles.consumer_wait(state)  # not waited for before Q K^T (start_scores)
        if cutlass.const_expr(self.bias_tma and self.bias_row):
            pipe_bias.consumer_wait(state)  # a bias row is added after Q K^T
        t_bias = t_mask = None
        if cutlass.const_expr(spec.bias is not None and not self.bias_terms):
            t_bias = views["bias"][None, None, None, state.index]
        tile_state = state
        if cutlass.const_expr(spec.mask is not None):
            if cutlass.const_expr(self.mask_only_tiles):
                tile_state = self.mask_tile_state(mask_tiles, False)
                if full == 0:
                    pipe_tiles.consumer_wait(tile_state)
            t_mask = views["mask"][None, None, None, tile_state.index]
        scores.finish(
            acc_S, t_bias, t_mask, full, t_coord=tScS[None, None, None, n_block],
            row_offset=limits.seqlen_k - limits.seqlen_q,
        )  # fmt: skip
        # every consumer thread arrives after its own reads of the tiles (release)
        if cutlass.const_expr(self.mask_only_tiles):
            if full == 0:
                pipe_tiles.consumer_release(tile_state)
            mask_tiles += 1 - full // FULL
        elif cutlass.const_expr(self.bias_tiles):
            pipe_tiles.consumer_release(state)
        if cutlass.const_expr(self.row_f32):
            pipe_bias.consumer_release(state)  # pipe_row: every thread after its own reads
        elif cutlass.const_expr(self.bias_tma):
            # one arrive per warp (PipelineTmaAsync); the warp's lanes have read the tile first
            cute.arch.sync_warp()
            pipe_bias.consumer_release(state)
        limits.apply(acc_S, tScS[None, None, None, n_block], m_block, n_block)
        return mask_tiles

    @cute.jit
    def pv_done(self, pipe_v, prev):
        """Wait for the previous block's P V: P's registers and V's stage `prev` are free."""
        warpgroup.wait_group(0)
        pipe_v.consumer_release(prev)

    def mask_tile_state(self, used, producer: bool):
        """The pipeline state of the mask stage after `used` of them (mask_only_tiles): stage
        used % stages, its phase flipping every round (a producer's starts at 1)."""
        st = self.stages
        phase = (used // st) % 2
        if producer:
            phase = phase ^ 1
        return pipeline.PipelineState(st, used, used % st, phase)

    @cute.jit
    def turn_wait(self, wg):
        """Wait for this consumer's turn at the tensor cores."""
        if cutlass.const_expr(self.take_turns):
            # 256: this consumer's sync and the previous consumer's arrive
            cute.arch.barrier(barrier_id=_TURN_BARRIER + wg, number_of_threads=256)

    @cute.jit
    def turn_pass(self, wg):
        """Hand the tensor cores to the next consumer (this one's GEMMs were issued)."""
        if cutlass.const_expr(self.take_turns):
            cute.arch.barrier_arrive(
                barrier_id=_TURN_BARRIER + (wg + 1) % self.consumer_wgs, number_of_threads=256
            )
