"""Hopper backward (sm_90a): warp-specialized wgmma kernel for dQ, dK, dV and dbias.

One CTA per (key block, kv head, batch), as the SM80 backward: it keeps its K and V tiles in
shared memory and dK, dV in registers, and walks the query heads of its group and the query
blocks its causal/window range allows. When that grid is too small for the GPU (few kv heads,
MQA), each group's query heads are split over `head_splits` CTAs; when one key block's walk
is long enough to set the kernel's time (a masked long sequence, whose visible blocks may
crowd into a few key columns), its query range is split over `query_splits` CTAs. Split CTAs
(split_heads) add their fp32 dK/dV partial sums into zeroed fp32 buffers by TMA reduce-add.
Under causal/window limits or with a block mask (not deterministic) the CTAs take their
(batch, kv head, key block) from an order the launch sorts by walk length, longest first
(launch_order.walk_order). With a mask, the block-bits pre-pass (kernels/block_bits.py, for
this kernel's tiles) says which (query block, key block) tiles have a True element (visible)
and which are all True (full): every role walks the same visible query blocks, a full one
loads and applies no mask tile. Four roles:

- warp 0 (producer warpgroup, few registers): K and V once, then Q and dO of every step by TMA
  into `stages` smem stages.
- warp 1: adds each step's dQ tile (fp32, smem) into the zeroed fp32 dQ accumulator in global
  memory with a TMA reduce-add (no per-thread atomics).
- warps 2-3: the step's mask and bias tiles by predicated cp.async (any view: broadcast dims,
  odd strides, key tails zero-filled), each thread arriving on the stage's mbarrier when its
  copies land; with transposed scores (below) instead the step's log2 row sums and dpsum.
- two MMA warpgroups: per step S = bias / scale + Q K^T (a query-broadcast bias added after
  Q K^T) and dP = dO V^T by wgmma (each warpgroup half of the keys), the softcap, mask and
  causal/window limits, P = exp(S - lse)
  from the forward's stats, dS = P (dP - dpsum), dbias from dS, dS times the softcap's
  derivative; P and dS to smem; then dV += P^T dO and dK += dS^T Q (each warpgroup its half of
  the keys, or of the head-dim columns when the key block is 64 wide) and dQ = dS K (each
  warpgroup half of the columns). Epilogue: dK (times the softmax scale) and dV through smem
  over sK / sV, stored by TMA (with split_heads: one after the other as fp32 tiles over sK and
  sV, added by TMA reduce-add).

Transposed scores (Sm90BwdTile.transposed: 64 x 128 tiles of two stages; an element-wise
mask, a query-broadcast bias with its gradient summed over the queries, or neither; no
softcap; as FA3/FA4's SdP_swapAB): each warpgroup computes S^T = K Q^T and dP^T = V dO^T for
its 64 keys, so P^T and dS^T stay in registers as the A operands of its dV += P^T dO and
dK += dS^T Q (no P in smem, no barrier before dV and dK); only dS is written, as dS, by
stmatrix.trans into its stage's buffer for dQ = dS K. A query is then a column: its log2 row
sum, dpsum and (with a bias) row max come through smem stages from warps 2-3, with the mask
and bias tiles (read from global memory in the softmax, their latency stalled it). The mask
and bias tiles are read through (keys, queries) views; a key's bias and its dbias sum are
per accumulator row, the sum reduced in its quad of lanes.

Shared memory and the order that protects it:
- mbar: full/empty mbarriers of the K/V, Q, dO and mask/bias pipelines, initialized before the
  CTA-wide barrier that precedes every other use.
- sK, sV: written once by TMA (K/V pipeline), read by the S, dP and dQ GEMMs; after the MMA
  warpgroups' epilogue barrier (each passes it after its last wgmma has completed) they hold
  dK and dV for the TMA store.
- sQ, sdO stages: filled by warp 0 after the stage's empty barrier, read by the GEMMs after its
  full barrier, released once the step's dK (Q) and dV (dO) GEMMs have completed.
- mask, bias stages: filled by warps 2-3 after the stage's empty barrier, read by the scores
  after its full barrier; every MMA thread releases the stage after its own last read (one
  arrive per thread).
- sP, sdS: one tile each, written by both MMA warpgroups and read by both (dQ needs every key,
  and with 64-key blocks so do dK and dV). Barrier "P/dS free" (before the writes: every
  warpgroup's GEMMs of the previous step have completed) and barrier "P/dS ready" (after the
  writes and the proxy fence, before the GEMMs) order them. Transposed scores: no sP, and one
  sdS per Q/dO stage, written after the dV GEMM is issued, read by both warpgroups' dQ GEMM
  after barrier "P/dS ready"; a stage's sdS is rewritten two steps later, after the "P/dS
  ready" of the step between, which each warpgroup passes only after its own dQ GEMM of the
  step before has completed.
- stats stages (transposed scores): part of the mask/bias stage, filled by warps 2-3 after
  the stage's empty barrier (plain stores; each thread waits for its cp.async copies, then
  arrives with release semantics), read by the MMA warpgroups after its full barrier and
  released after the dpsum reads, the last of the stage (one arrive per MMA thread).
- sdQ: written by the MMA warpgroups after barrier "dQ free" (warp 1 arrives once its previous
  reduce has read the tile), read by warp 1's TMA reduce after barrier "dQ ready" (the MMA
  warpgroups arrive after their writes and the proxy fence).
- colsum (untransposed scores): the dbias column sums of a query-broadcast bias, written and
  read between the two "dbias" barriers of the MMA warpgroups at the end of each head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as hopper
from cutlass import cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...jit.arch import compile_options
from .. import masking, operands, tiles
from ..bwd import BwdScalars, DbiasSpec
from ..config import (
    Sm90BwdTile,
    SmemBuffer,
    padded_head_dim,
    sm90_bwd_smem_buffers,
    sm90_bwd_tile,
    smem_total,
    transposed_stats,
)
from ..dbias import DbiasWriter
from ..masking import FULL, VISIBLE
from ..scores import Scores
from ..softmax import exp2_columns, fold_max, load_column_stat, load_row_stats
from ..spec import DTYPES, OperandSpec, dtype_bytes, env_stream, fake_rows, fake_tensor
from ..turns import DqTurns
from ..utils import acc_as_a_operand, acc_mn_view, round_pairs
from .wgmma import smem_layout, wgmma

# Named barriers (0 is the CTA-wide one).
_PDS_FREE = 1  # MMA warpgroups: the previous step's GEMMs have read sP / sdS
_PDS_READY = 2  # MMA warpgroups: this step's P and dS are in smem
_DQ_FREE = 3  # warp 1 -> MMA warpgroups: the previous dQ reduce has read sdQ
_DQ_READY = 4  # MMA warpgroups -> warp 1: this step's dQ is in sdQ
_EPILOGUE = 5  # MMA warpgroups: every GEMM has read sK / sV; then dK / dV are in smem
_DBIAS = 6  # MMA warpgroups: a head's dbias column sums are in (or read from) colsum
_MMA_THREADS = 256
_LOADER_THREADS = 64  # warps 2-3: mask and bias tiles, or the stats of transposed scores
# Registers per thread (producer warpgroup, MMA warpgroups) after setmaxnreg. The mask/bias
# loader warps fit in 24 too; at 232 the MMA warpgroups of the key-bias variants (D128) ran out
# and ptxas serialized their wgmmas (warning C7512).
_REGISTERS = (24, 240)


@dataclass(frozen=True)
class Sm90BwdSpec:
    """One Hopper backward kernel variant: the compile key, tiling and launch facts.

    split_heads: dk and dv are zeroed fp32 buffers that each CTA adds its partial sums into
    (a group's heads, or a key block's query range, are split over several CTAs); else they
    are written in the input dtype.
    dbias: how dS reaches dbias (bwd.DbiasSpec), None without.
    deterministic: the key blocks add their dQ in a fixed order (turn counters, as turns.py),
    and split CTAs their dK/dV partial sums in split order, so dq, dk, dv are bitwise
    repeatable; dbias is then only stored (each element has one contribution).
    """

    # Any variant may split a group's heads (its dbias elements have one contribution each, as
    # BwdSpec.can_split_heads asks of the mma.sync kernel).
    can_split_heads = True

    dtype: str
    head_dim_padded: int
    tile: Sm90BwdTile
    mask: OperandSpec | None
    bias: OperandSpec | None
    dbias: DbiasSpec | None
    has_window: bool
    has_softcap: bool
    split_heads: bool
    deterministic: bool
    # The CTAs take their (batch, kv head, key block) from a launch-sorted order, the longest
    # walks first (launch_order.walk_order): under causal/window limits or with a block mask,
    # whose walks differ in length, unless deterministic, whose turns need lower key blocks
    # launched first.
    ordered: bool = False

    @staticmethod
    @functools.cache  # called on every launch; the tile choice is pure
    def build(
        arch: str,
        dtype: str,
        head_dim: int,
        mask: OperandSpec | None,
        bias: OperandSpec | None,
        dbias: DbiasSpec | None,
        has_window: bool,
        has_softcap: bool,
        split_heads: bool = False,
        deterministic: bool = False,
        block_mask: bool = False,
    ) -> Sm90BwdSpec:
        """The variant for these choices (ValueError when its tiles do not fit `arch`, or for
        a deterministic order with dbias sums); block_mask: the mask's bits are a block
        mask's, whose walks the launch orders."""
        if deterministic and dbias is not None and not dbias.direct:
            raise ValueError("Hopper backward: a deterministic order takes a stored dbias")
        dp = padded_head_dim(head_dim)
        smem = [None if op is None else op.smem() for op in (mask, bias)]
        # transposed scores: element-wise masks (no expiry rows), a query-broadcast bias (its
        # gradient summed over the queries) or none, no softcap
        transposable = (
            not has_softcap
            and (mask is None or mask.dtype not in ("i32", "i64"))
            and (bias is None or bias.row_broadcast)
            and (dbias is None or dbias.rows_summed)
        )
        tile = sm90_bwd_tile(arch, dp, dtype_bytes(dtype), *smem, transposable)
        return Sm90BwdSpec(
            dtype, dp, tile, mask, bias, dbias, has_window, has_softcap, split_heads,
            deterministic, (has_window or block_mask) and not deterministic,
        )  # fmt: skip

    def smem_buffers(self) -> tuple[SmemBuffer, ...]:
        smem = [None if op is None else op.smem() for op in (self.mask, self.bias)]
        return sm90_bwd_smem_buffers(
            self.tile, self.head_dim_padded, dtype_bytes(self.dtype), *smem
        )

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
        mask, bias = (None if op is None else op.fake() for op in (self.mask, self.bias))
        bits = None if self.mask is None else fake_tensor("u8", ("d", "d", "d", "1"), 1)
        order = fake_tensor("i32", ("1",), 4) if self.ordered else None
        dbias = sem = None
        if self.dbias is not None:
            dbias = fake_tensor(self.dbias.dtype, self.dbias.strides, dtype_bytes(self.dbias.dtype))
        sem_kv = None
        if self.deterministic:
            sem = fake_tensor("i32", ("d", "d", "1"), 4)
            if self.split_heads:
                sem_kv = fake_tensor("i32", ("d", "d", "1"), 4)
        return [q, k, v, dout, stats, dpsum, dq_acc, dk, dv, 1, 1, 0, mask, bias, bits, order,
                dbias, sem, sem_kv,
                *BwdScalars(), env_stream()]  # fmt: skip

    def compile(self, arch: str, extra_options: str = ""):
        return cute.compile(
            FlashBwdSm90(self), *self.example_args(), options=compile_options(arch, extra_options)
        )


def _tiled_mma(dtype, a_major, b_major, atoms, n: int, rmem_a: bool = False):
    source = warpgroup.OperandSource.RMEM if rmem_a else warpgroup.OperandSource.SMEM
    return hopper.make_trivial_tiled_mma(
        dtype, dtype, a_major, b_major, cutlass.Float32, atom_layout_mnk=atoms,
        tiler_mn=(64, n), a_source=source,
    )  # fmt: skip


@dataclass(frozen=True)
class Walk:
    """The (head, query block) steps of one CTA, the same for every role: the query heads
    h_first .. h_first + heads - 1, and per head the visible query blocks of
    [m_block_min, m_block_max) (all of them without a mask), in `segments` runs: the blocks
    from m_rotate on, then (deterministic order only) those before it.

    Deterministic, rotated (the launch's `rotate`: at least as many query blocks as key
    blocks, and no more key blocks than SMs): key block n starts its walk at query block n,
    so at each step the key blocks of a (batch, kv head) add into different query blocks, and
    the order in which they add into one query block (the turns of turns.py) is the order in
    which they reach it: none waits for another's turn when they run in step. Ascending from
    0, key block n would reach every query block n steps after key block 0 and wait there.
    Every wait is for a key block at an earlier step of its own walk; with all of a (batch,
    kv head)'s key blocks resident at once (no more of them than SMs) someone always
    progresses. Not rotated: the turns are the key-block order, and lower key blocks are
    launched first."""

    b: cutlass.Int32
    hk: cutlass.Int32
    n_block: cutlass.Int32
    h_first: cutlass.Int32
    heads: cutlass.Int32
    m_block_min: cutlass.Int32
    m_block_max: cutlass.Int32
    m_blocks: cutlass.Int32  # query blocks of the problem
    n_blocks: cutlass.Int32  # key blocks of the problem
    split: cutlass.Int32  # which of the head_splits CTAs of (key block, kv head) this is
    m_rotate: cutlass.Int32
    rotated: cutlass.Int32  # 1: every CTA's walk starts at its key block (m_rotate = n_block)
    mask_head_div: cutlass.Int32
    bias_head_div: cutlass.Int32
    mBits: cute.Tensor | None  # [B', H', query blocks, key blocks], stride 0 where broadcast
    segments: cutlass.Constexpr[int]

    @cute.jit
    def segment(self, index: cutlass.Constexpr[int]):
        """[lo, hi) of walk segment `index`: 0 from m_rotate on, 1 before it."""
        if cutlass.const_expr(index == 0):
            return cutlass.max(self.m_rotate, self.m_block_min), self.m_block_max
        return self.m_block_min, cutlass.min(self.m_rotate, self.m_block_max)

    @cute.jit
    def turn(self, m_block):
        """This key block's place in the order of the key blocks that add into query block
        m_block: the order in which the rotated walks reach it (key-block order when they
        are not rotated)."""
        n, n_blocks = self.n_block, self.n_blocks
        turn = n
        if self.rotated != 0:
            turn = n_blocks - 1 - n
            if m_block < n_blocks - 1:
                turn = (m_block - n + n_blocks) % n_blocks
        return turn

    @cute.jit
    def bits(self, h, m_block):
        """The block bits of (query head h, query block m_block); every bit set without a
        mask."""
        bits = cutlass.Int32(VISIBLE | FULL)
        if cutlass.const_expr(self.mBits is not None):
            bits = cutlass.Int32(self.mBits[self.b, h // self.mask_head_div, m_block, self.n_block])
        return bits

    @cute.jit
    def next_visible(self, h, m_block, m_end):
        """The first visible query block in [m_block, m_end) (m_end and above: none). A warp
        reads the bits of 32 blocks at once and takes the lowest visible one from a ballot:
        one gmem latency per 32 blocks, not per block, when most are empty."""
        if cutlass.const_expr(self.mBits is not None):
            lane = cute.arch.lane_idx()
            searching = m_block < m_end
            while searching:
                idx = m_block + lane
                visible = cutlass.Int32(0)
                if idx < m_end:
                    visible = self.bits(h, idx) & VISIBLE
                ballot = cute.arch.vote_ballot_sync(visible != 0)
                if ballot != 0:
                    m_block += cutlass.Int32(cute.arch.popc((ballot & -ballot) - 1))
                    searching = False
                else:
                    m_block += 32
                    searching = m_block < m_end
        return m_block


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
        self.transposed = spec.tile.transposed
        self.has_tiles = spec.mask is not None or spec.bias is not None
        # The score accumulator starts from the bias unless the bias follows the softcap or
        # is one row (query-broadcast): that one is added after Q K^T, each column scaled once,
        # and its stage is waited for after the GEMMs are issued.
        self.bias_rows_shared = spec.bias is not None and spec.bias.row_broadcast
        self.bias_first = (
            spec.bias is not None and not spec.has_softcap and not self.bias_rows_shared
        )
        self.registers = _REGISTERS

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
        query_splits: cutlass.Int32,  # CTAs per key block's query range (1 without split_heads)
        rotate: cutlass.Int32,  # deterministic: 1 to rotate the walks (see Walk), else 0
        mMask: cute.Tensor | None,  # [Bm, Hm, Qm, Km] uint8 view of the bool mask
        mBias: cute.Tensor | None,  # [Bm, Hm, Qm, Km]
        mBits: cute.Tensor | None,  # [Bm, Hm, query blocks (1 if Qm = 1), key blocks] uint8
        mOrder: cute.Tensor | None,  # [B * Hkv * key blocks] int32 (spec.ordered)
        mdBias: cute.Tensor | None,  # [Bm, Hm, Qm, Km] (stride 0 on size-1 dims)
        mSem: cute.Tensor | None,  # [B, H, ceil(Sq / tile_m)] int32, zeroed (deterministic)
        mSemKV: cute.Tensor | None,  # [B, Hkv, ceil(Sk / tile_n)] int32, zeroed (split, det.)
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
        if cutlass.const_expr(self.transposed):
            # S^T = K Q^T, dP^T = V dO^T: each warpgroup 64 keys
            mma_sdp = _tiled_mma(self.dtype, K_MAJOR, K_MAJOR, (2, 1, 1), tm)
            # dV = P^T dO, dK = dS^T Q: A from the registers of S^T's warpgroup, B read
            # transposed
            mma_dkv = _tiled_mma(self.dtype, K_MAJOR, MN_MAJOR, dkv_atoms, dkv_n, rmem_a=True)
        else:
            # S = Q K^T, dP = dO V^T: each warpgroup half of the keys
            mma_sdp = _tiled_mma(self.dtype, K_MAJOR, K_MAJOR, (1, 2, 1), tn // 2)
            # dV = P^T dO, dK = dS^T Q: A (keys x queries) and B (D x queries) read transposed
            mma_dkv = _tiled_mma(self.dtype, MN_MAJOR, MN_MAJOR, dkv_atoms, dkv_n)
        # dQ = dS K: each warpgroup half of the columns; B (D x keys) read transposed
        mma_dq = _tiled_mma(self.dtype, K_MAJOR, MN_MAJOR, (1, 2, 1), dp // 2)

        # Swizzles: a warpgroup reading a transposed operand reads dkv_n (Q, dO) or dp / 2
        # (K, dQ) contiguous columns; P and dS 64 keys.
        sQ_layout = smem_layout(self.dtype, tm, dp, st, major=dkv_n)
        sK_layout = smem_layout(self.dtype, tn, dp, major=dp // 2)
        sV_layout = smem_layout(self.dtype, tn, dp, major=dkv_n)
        sPdS_layout = smem_layout(
            self.dtype, tm, tn, st if cutlass.const_expr(self.transposed) else None, major=64
        )
        sdQ_layout = smem_layout(cutlass.Float32, tm, dp, major=dp // 2)
        # dK / dV partial sums (split_heads): fp32 over sK and sV, stored as the GEMM splits them
        sKV32_layout = smem_layout(cutlass.Float32, tn, dp, major=dkv_n)

        # TMA views (S, D, heads, batch): one box is a (rows, D) tile of one head.
        def tma_view(t):
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))

        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        reduce = cpasync.CopyReduceBulkTensorTileS2GOp()
        one_stage = functools.partial(cute.select, mode=[0, 1])
        tma_q, tQ = cpasync.make_tiled_tma_atom(load, tma_view(mQ), one_stage(sQ_layout), (tm, dp))
        tma_do, tdO = cpasync.make_tiled_tma_atom(
            load, tma_view(mdO), one_stage(sQ_layout), (tm, dp)
        )
        tma_k, tK = cpasync.make_tiled_tma_atom(load, tma_view(mK), sK_layout, (tn, dp))
        tma_v, tV = cpasync.make_tiled_tma_atom(load, tma_view(mV), sV_layout, (tn, dp))
        if cutlass.const_expr(self.spec.split_heads):
            tma_dk, tdK = cpasync.make_tiled_tma_atom(reduce, tma_view(mdK), sKV32_layout, (tn, dp))
            tma_dv, tdV = cpasync.make_tiled_tma_atom(reduce, tma_view(mdV), sKV32_layout, (tn, dp))
        else:
            tma_dk, tdK = cpasync.make_tiled_tma_atom(store, tma_view(mdK), sK_layout, (tn, dp))
            tma_dv, tdV = cpasync.make_tiled_tma_atom(store, tma_view(mdV), sV_layout, (tn, dp))
        tma_dq, tdQ = cpasync.make_tiled_tma_atom(reduce, tma_view(mdQacc), sdQ_layout, (tm, dp))
        splits = head_splits * query_splits
        grid = (cute.ceil_div(mK.shape[1], tn), mK.shape[2] * splits, mK.shape[0])
        self.kernel(
            tQ, tK, tV, tdO, tdK, tdV, tdQ, mQ.shape[1], mK.shape[1], mStats, mDpsum, mMask,
            mBias, mBits, mOrder, mdBias, mSem, mSemKV, tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, tma_dq,
            scale_log2, bias_scale, softcap_scale, softcap, softmax_scale, window_left,
            window_right, mask_head_div, bias_head_div, group, head_splits, query_splits, rotate,
            sQ_layout,
            sK_layout, sV_layout, sPdS_layout, sdQ_layout, sKV32_layout, mma_sdp, mma_dkv,
            mma_dq,
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
        mMask: cute.Tensor | None,
        mBias: cute.Tensor | None,
        mBits: cute.Tensor | None,
        mOrder: cute.Tensor | None,
        mdBias: cute.Tensor | None,
        mSem: cute.Tensor | None,
        mSemKV: cute.Tensor | None,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        tma_dk: cute.CopyAtom,
        tma_dv: cute.CopyAtom,
        tma_dq: cute.CopyAtom,
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
        head_splits: cutlass.Int32,
        query_splits: cutlass.Int32,
        rotate: cutlass.Int32,
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
        splits = head_splits * query_splits
        if cutlass.const_expr(mOrder is not None):
            # The launch order, item by item (a (batch, kv head, key block) and its split
            # CTAs): the block scheduler starts the longest walks first, and the short ones
            # fill in behind them instead of leaving SMs idle at the end.
            n_x, n_y, _ = cute.arch.grid_dim()
            linear = n_block + n_x * (hk_split + n_y * b)
            item = mOrder[linear // splits]
            heads_kv = n_y // splits
            n_block = item % n_x
            hk_split = (item // n_x) % heads_kv * splits + linear % splits
            b = item // (n_x * heads_kv)
        # kv head hk; head part: the `heads` query heads of its group from h_first on; query
        # part: an equal share of the key block's query range
        hk = hk_split // splits
        split = hk_split - hk * splits
        query_part = split // head_splits
        head_part = split - query_part * head_splits
        heads = group // head_splits
        limits = masking.BlockLimits(
            seqlen_q, seqlen_k, window_left, window_right, tm, tn, spec.has_window
        )
        m_block_min, m_block_max = limits.query_block_range(n_block)
        if cutlass.const_expr(spec.split_heads):
            share = cute.ceil_div(cutlass.max(m_block_max - m_block_min, 0), query_splits)
            m_block_min = m_block_min + query_part * share
            m_block_max = cutlass.min(m_block_max, m_block_min + share)
        m_blocks, n_blocks = cute.ceil_div(seqlen_q, tm), cute.ceil_div(seqlen_k, tn)
        m_rotate = cutlass.Int32(0)
        if cutlass.const_expr(spec.deterministic):
            m_rotate = n_block * rotate
        walk = Walk(
            b, hk, n_block, hk * group + head_part * heads, heads,
            m_block_min, m_block_max, m_blocks, n_blocks, head_part, m_rotate,
            rotate, mask_head_div,
            bias_head_div, mBits, 2 if spec.deterministic else 1,
        )  # fmt: skip

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
        sP = None
        if cutlass.const_expr(not self.transposed):
            sP = tiles.swizzled_smem_tensor(smem["p"], self.dtype, sPdS_layout)
        sdS = tiles.swizzled_smem_tensor(smem["ds"], self.dtype, sPdS_layout)
        sdQ = tiles.swizzled_smem_tensor(smem["dq"], cutlass.Float32, sdQ_layout)
        sStats = None  # transposed: (log2 row sum / dpsum / row max, query row, stage)
        if cutlass.const_expr(self.transposed):
            stats = transposed_stats(spec.bias)
            sStats = tiles.smem_tensor(
                smem["stats"],
                cutlass.Float32,
                cute.make_layout((stats, tm, st), stride=(tm, 1, stats * tm)),
            )
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
        pipe_tiles = None  # the mask/bias tiles, or the stats of transposed scores
        if cutlass.const_expr(self.has_tiles or self.transposed):
            pipe_tiles = pipeline.PipelineCpAsync.create(
                barrier_storage=mbar + 2 + 4 * st, num_stages=st,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _LOADER_THREADS),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _MMA_THREADS),
                defer_sync=True,
            )  # fmt: skip
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every mbarrier is initialized before any thread uses one

        # Mask and bias: smem stages, and the (tm, tn, stages) views the scores read.
        tile_smem = {}
        for name, op in (("mask", spec.mask), ("bias", spec.bias)):
            if cutlass.const_expr(op is not None):
                dtype = DTYPES[op.dtype]
                stride = operands.stage_elems(op, tm, tn, dtype)
                tile_smem[name] = operands.smem_stages(
                    smem[name], dtype, op, tm, tn, st, stride, _LOADER_THREADS
                )

        if warp < 4:
            cute.arch.setmaxregister_decrease(self.registers[0])
            if warp == 0:
                self.load(
                    tQ, tK, tV, tdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv,
                    pipe_q, pipe_do, walk,
                )  # fmt: skip
            if warp == 1:
                self.reduce_dq(tdQ, sdQ, tma_dq, walk, mSem)
            if cutlass.const_expr(self.has_tiles or self.transposed):
                if warp >= 2:
                    self.load_tiles(
                        mMask, mBias, mStats, mDpsum, tile_smem, sStats, pipe_tiles, limits, walk
                    )
        else:
            cute.arch.setmaxregister_increase(self.registers[1])
            self.mma(
                tdK, tdV, sQ, sK, sV, sdO, sP, sdS, sdQ, sKV32, sStats, smem, tile_smem, mStats,
                mDpsum, mdBias, tma_dk, tma_dv, pipe_kv, pipe_q, pipe_do, pipe_tiles, mma_sdp,
                mma_dkv, mma_dq, limits, walk, scale_log2, bias_scale, softcap_scale, softcap,
                softmax_scale, mSemKV,
            )  # fmt: skip

    @cute.jit
    def load(
        self, tQ, tK, tV, tdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv, pipe_q,
        pipe_do, walk,
    ):  # fmt: skip
        """Warp 0: K and V once, then Q and dO of every step, each into the next free stage
        (gmem -> smem by TMA)."""
        tm, tn, dp = self.tile_m, self.tile_n, self.head_dim_padded
        b = walk.b
        no_cluster = cute.make_layout(1)
        # K and V, always (the epilogue reuses their smem: no copy may be in flight then)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        for atom, tX, sX in ((tma_k, tK, sK), (tma_v, tV, sV)):
            gX = cute.local_tile(tX[None, None, walk.hk, b], (tn, dp), (walk.n_block, 0))
            tXsX, tXgX = cpasync.tma_partition(
                atom, 0, no_cluster, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
            )
            cute.copy(atom, tXgX, tXsX, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for h in cutlass.range(walk.h_first, walk.h_first + walk.heads, unroll=1):
            gQ = cute.local_tile(tQ[None, None, h, b], (tm, dp), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, no_cluster, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            gdO = cute.local_tile(tdO[None, None, h, b], (tm, dp), (None, 0))
            tdOsdO, tdOgdO = cpasync.tma_partition(
                tma_do, 0, no_cluster, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2)
            )
            copies = (tma_q, tQgQ, tQsQ, tma_do, tdOgdO, tdOsdO, pipe_q, pipe_do)
            for seg in cutlass.range_constexpr(walk.segments):
                lo, hi = walk.segment(seg)
                if cutlass.const_expr(walk.mBits is None):
                    for m_block in cutlass.range(lo, hi, unroll=1):
                        self.load_step(copies, state, m_block)
                        state.advance()
                else:
                    m_block = walk.next_visible(h, lo, hi)
                    while m_block < hi:
                        self.load_step(copies, state, m_block)
                        state.advance()
                        m_block = walk.next_visible(h, m_block + 1, hi)

    @cute.jit
    def load_step(self, copies, state, m_block):
        """Q and dO of query block m_block into stage state.index."""
        tma_q, tQgQ, tQsQ, tma_do, tdOgdO, tdOsdO, pipe_q, pipe_do = copies
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

    @cute.jit
    def load_tiles(self, mMask, mBias, mStats, mDpsum, tile_smem, sStats, pipe_tiles, limits, walk):
        """Warps 2-3: the mask tile (unless all True) and the bias tile of every step, by
        predicated cp.async, and with transposed scores the step's stats, each into the next
        free stage."""
        spec = self.spec
        tidx = cute.arch.thread_idx()[0] - 64
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for h in cutlass.range(walk.h_first, walk.h_first + walk.heads, unroll=1):
            loads = {}
            for name, op, mX, head_div in (
                ("mask", spec.mask, mMask, walk.mask_head_div),
                ("bias", spec.bias, mBias, walk.bias_head_div),
            ):
                if cutlass.const_expr(op is not None):
                    sX, _, tcopy, used = tile_smem[name]
                    gX, cX, row_end = operands.gmem_tiles(
                        op, mX, walk.b, h // head_div, limits, None, walk.n_block
                    )
                    loads[name] = operands.OperandLoads.make(
                        op, tcopy, used, gX, cX, sX, row_end, limits.seqlen_k, tidx,
                        walk_queries=True,
                    )  # fmt: skip
            stats = None
            if cutlass.const_expr(self.transposed):
                # log2 row sums, dpsums and, with a bias, row maxima (as sStats holds them)
                stats = (
                    mStats[walk.b, h, 1, None],
                    mDpsum[walk.b, h, None],
                    mStats[walk.b, h, 0, None],
                )[: cute.size(sStats.shape[0])]
            for seg in cutlass.range_constexpr(walk.segments):
                lo, hi = walk.segment(seg)
                if cutlass.const_expr(walk.mBits is None):
                    for m_block in cutlass.range(lo, hi, unroll=1):
                        self.tiles_step(
                            loads, stats, sStats, limits, pipe_tiles, state, walk, h, m_block
                        )
                        state.advance()
                else:
                    m_block = walk.next_visible(h, lo, hi)
                    while m_block < hi:
                        self.tiles_step(
                            loads, stats, sStats, limits, pipe_tiles, state, walk, h, m_block
                        )
                        state.advance()
                        m_block = walk.next_visible(h, m_block + 1, hi)

    @cute.jit
    def tiles_step(self, loads, stats, sStats, limits, pipe_tiles, state, walk, h, m_block):
        """The mask tile (unless all True) and the bias tile of query block m_block into stage
        state.index; with transposed scores (`stats`: the log2 row sums, dpsums and row maxima
        of head h) its rows' stats too, a row a thread (+inf, 0 and 0 past Sq, so P = 0 there),
        published by the thread's arrive once its copies have landed (release)."""
        spec = self.spec
        pipe_tiles.producer_acquire(state)
        if cutlass.const_expr(spec.mask is not None):
            if (walk.bits(h, m_block) & FULL) == 0:
                loads["mask"].load(m_block, state.index)
        if cutlass.const_expr(spec.bias is not None):
            loads["bias"].load(m_block, state.index)
        if cutlass.const_expr(self.transposed):
            row = cute.arch.thread_idx()[0] - 64
            query = m_block * self.tile_m + row
            for i in cutlass.range_constexpr(cute.size(sStats.shape[0])):
                value = cutlass.Float32(cutlass.Float32.inf if i == 0 else 0.0)
                if query < limits.seqlen_q:
                    value = stats[i][query]
                sStats[i, row, state.index] = value
        operands.tiles_landed(pipe_tiles, state, spec.mask, spec.bias, self.transposed)

    @cute.jit
    def reduce_dq(self, tdQ, sdQ, tma_dq, walk, mSem):
        """Warp 1: every step's dQ tile (smem, fp32) added into the dQ accumulator by a TMA
        reduce-add; rows past Sq and columns past D are not written. Deterministic: each
        addition waits for this key block's turn of its (batch, head, query block), and every
        query block this CTA skips (causal/window range, an empty mask tile) passes its turn
        on, so the key blocks add in the order of Walk.turn."""
        tm, dp = self.tile_m, self.head_dim_padded
        turns = None
        if cutlass.const_expr(self.spec.deterministic):
            turns = DqTurns(mSem, cute.arch.lane_idx())
        for h in cutlass.range(walk.h_first, walk.h_first + walk.heads, unroll=1):
            gdQ = cute.local_tile(tdQ[None, None, h, walk.b], (tm, dp), (None, 0))
            tdQsdQ, tdQgdQ = cpasync.tma_partition(
                tma_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
                cute.group_modes(gdQ, 0, 2),
            )  # fmt: skip
            copies = (tma_dq, tdQsdQ, tdQgdQ)
            if cutlass.const_expr(turns is not None):
                # every query block, from m_rotate on and round: the walk's order
                for step in cutlass.range(walk.m_blocks, unroll=1):
                    m_block = walk.m_rotate + step
                    if m_block >= walk.m_blocks:
                        m_block -= walk.m_blocks
                    visited = (m_block >= walk.m_block_min) & (m_block < walk.m_block_max)
                    if cutlass.const_expr(walk.mBits is not None):
                        if visited:
                            visited = (walk.bits(h, m_block) & VISIBLE) != 0
                    turn = walk.turn(m_block)
                    if visited:
                        self.reduce_step(copies, m_block, turns, walk, h, turn)
                    else:
                        turns.take(walk.b, h, m_block, turn)
                        turns.give(walk.b, h, m_block, turn)
            elif cutlass.const_expr(walk.mBits is None):
                for m_block in cutlass.range(walk.m_block_min, walk.m_block_max, unroll=1):
                    self.reduce_step(copies, m_block)
            else:
                m_block = walk.next_visible(h, walk.m_block_min, walk.m_block_max)
                while m_block < walk.m_block_max:
                    self.reduce_step(copies, m_block)
                    m_block = walk.next_visible(h, m_block + 1, walk.m_block_max)
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # sdQ is read before the CTA exits

    @cute.jit
    def reduce_step(self, copies, m_block, turns=None, walk=None, h=None, turn=None):
        """Query block m_block's dQ tile, once the MMA warpgroups have written it (with
        `turns`: in this key block's `turn`, passed on once the addition is done). The turn
        is taken while the MMA warpgroups compute the tile: once the tile is ready the
        addition starts at once, and sdQ goes back to them one poll of the turn sooner."""
        tma_dq, tdQsdQ, tdQgdQ = copies
        count = _MMA_THREADS + 32
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous reduce read sdQ
        cute.arch.barrier_arrive(barrier_id=_DQ_FREE, number_of_threads=count)
        if cutlass.const_expr(turns is not None):
            turns.take(walk.b, h, m_block, turn)
            cute.arch.sync_warp()  # the warp adds after the previous key block
        cute.arch.barrier(barrier_id=_DQ_READY, number_of_threads=count)
        cute.copy(tma_dq, tdQsdQ, tdQgdQ[None, m_block])
        cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(turns is not None):
            cute.arch.cp_async_bulk_wait_group(0)  # the addition is done in global memory
            cute.arch.sync_warp()  # whichever lane issued it, before lane 0 passes the turn
            turns.give(walk.b, h, m_block, turn)

    @cute.jit
    def mma(
        self, tdK, tdV, sQ, sK, sV, sdO, sP, sdS, sdQ, sKV32, sStats, smem, tile_smem, mStats, mDpsum,
        mdBias, tma_dk, tma_dv, pipe_kv, pipe_q, pipe_do, pipe_tiles, mma_sdp, mma_dkv, mma_dq,
        limits, walk, scale_log2, bias_scale, softcap_scale, softcap, softmax_scale, mSemKV,
    ):  # fmt: skip
        """An MMA warpgroup: every step's five GEMMs and pointwise work, then the epilogue."""
        spec = self.spec
        tm, tn, dp, st = self.tile_m, self.tile_n, self.head_dim_padded, self.stages
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        b, n_block = walk.b, walk.n_block

        # ---- wgmma operands: smem descriptors; register accumulators ----
        thr_sdp = mma_sdp.get_slice(tidx)
        wg_sdp = mma_sdp.get_slice(wg * 128)
        wg_dkv = mma_dkv.get_slice(wg * 128)
        wg_dq = mma_dq.get_slice(wg * 128)
        if cutlass.const_expr(self.transposed):
            # S^T and dP^T: K and V are the A operands, Q and dO (staged) the B ones; P^T and
            # dS^T are the A operands of dV and dK in registers, each step
            tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
            tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
            tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
            tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
            tdVrPt = tdKrdSt = None
            s_shape = wg_sdp.partition_shape_C((tn, tm))
        else:
            tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
            tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
            tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
            tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
            tdVrPt = wg_dkv.make_fragment_A(wg_dkv.partition_A(tiles.transposed(sP, tm, tn)))
            tdKrdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(tiles.transposed(sdS, tm, tn)))
            s_shape = wg_sdp.partition_shape_C((tm, tn))
        tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(tiles.transposed(sdO, tm, dp, st)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(tiles.transposed(sQ, tm, dp, st)))
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(tiles.transposed(sK, tn, dp)))
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tn, dp)), cutlass.Float32)
        acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tn, dp)), cutlass.Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        # P and dS (rmem -> smem), dQ (rmem -> smem, fp32)
        r2s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        # P and dS by stmatrix: four 8x8 matrices per instruction, few smem addresses to keep
        # (transposed: dS^T written as dS, stmatrix.trans into the (keys, queries) view)
        stsm = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.transposed, 4), self.dtype
        )
        r2s_sdp = cute.make_tiled_copy_C(stsm, mma_sdp).get_slice(tidx)
        tPsP = None
        if cutlass.const_expr(self.transposed):
            tdSsdS = r2s_sdp.partition_D(tiles.transposed(sdS, tm, tn, st))
        else:
            tPsP = r2s_sdp.partition_D(sP)
            tdSsdS = r2s_sdp.partition_D(sdS)
        r2s_f32 = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=64
        )
        # (row, col) of every score this thread holds, per query block ((key, query) of S^T)
        if cutlass.const_expr(self.transposed):
            tScS = thr_sdp.partition_C(
                cute.local_tile(
                    cute.make_identity_tensor((limits.seqlen_k, limits.seqlen_q)), (tn, tm),
                    (n_block, None),
                )
            )  # fmt: skip
        else:
            tScS = thr_sdp.partition_C(
                cute.local_tile(
                    cute.make_identity_tensor((limits.seqlen_q, limits.seqlen_k)), (tm, tn),
                    (None, n_block),
                )
            )  # fmt: skip
        # the mask/bias stages as the scores read them ((keys, queries) views when transposed)
        views = {}
        for name in tile_smem:
            view = tile_smem[name][1]
            if cutlass.const_expr(self.transposed):
                view = tiles.transposed(view, tm, tn, st)
            views[name] = thr_sdp.partition_C(view)
        scores = Scores(
            spec.bias is not None, spec.mask is not None, spec.has_softcap, bias_scale,
            softcap_scale, softcap, bias_rows_shared=self.bias_rows_shared,
            bias_after_gemm=self.bias_rows_shared,
            mask_expiry=spec.mask is not None and spec.mask.dtype in ("i32", "i64"),
            mask_ranges=spec.mask is not None and spec.mask.dtype == "i64",
            transposed=self.transposed,
        )  # fmt: skip
        dbias = None
        if cutlass.const_expr(spec.dbias is not None):
            s_colsum = None  # transposed: a key's sums stay in one quad
            if cutlass.const_expr(not self.transposed):
                s_colsum = tiles.smem_tensor(
                    smem["colsum"], cutlass.Float32, cute.make_layout((4, tn), stride=(tn, 1))
                )
            dbias = DbiasWriter.make(
                spec.dbias, mdBias, s_colsum, tScS, tn, 4, n_block, limits, tidx,
                barrier=(_DBIAS, _MMA_THREADS), transposed=self.transposed,
            )  # fmt: skip

        mm = SimpleNamespace(
            mma_sdp=mma_sdp, mma_dkv=mma_dkv, mma_dq=mma_dq, wg_dq=wg_dq, tSrQ=tSrQ, tSrK=tSrK,
            tdPrdO=tdPrdO, tdPrV=tdPrV, tdVrPt=tdVrPt, tdVrdOt=tdVrdOt, tdKrdSt=tdKrdSt,
            tdKrQt=tdKrQt, tdQrdS=tdQrdS, tdQrKt=tdQrKt, s_shape=s_shape, r2s_sdp=r2s_sdp,
            tPsP=tPsP, tdSsdS=tdSsdS, r2s_f32=r2s_f32, sdQ=sdQ, tScS=tScS, views=views,
            scores=scores, dbias=dbias, mStats=mStats, mDpsum=mDpsum, pipe_q=pipe_q,
            pipe_do=pipe_do, pipe_tiles=pipe_tiles, limits=limits, scale_log2=scale_log2,
            softcap=softcap, softmax_scale=softmax_scale, tidx=tidx, sStats=sStats,
        )  # fmt: skip
        step = self.mma_step
        if cutlass.const_expr(self.transposed):
            # the query (in its block) of this thread's first S^T column
            tile_coord = acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor((tn, tm))))
            mm.first_col = tile_coord[0, 0][1]
            step = self.mma_step_transposed
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, st)
        steps = cutlass.Int32(0)  # the same in every MMA thread: they walk the same blocks
        for h in cutlass.range(walk.h_first, walk.h_first + walk.heads, unroll=1):
            for seg in cutlass.range_constexpr(walk.segments):
                lo, hi = walk.segment(seg)
                if cutlass.const_expr(walk.mBits is None):
                    for m_block in cutlass.range(lo, hi, unroll=1):
                        step(mm, walk, h, m_block, state, acc_dK, acc_dV)
                        state.advance()
                        steps += 1
                else:
                    m_block = walk.next_visible(h, lo, hi)
                    while m_block < hi:
                        step(mm, walk, h, m_block, state, acc_dK, acc_dV)
                        state.advance()
                        steps += 1
                        m_block = walk.next_visible(h, m_block + 1, hi)
            if cutlass.const_expr(dbias is not None):
                if cutlass.const_expr(spec.dbias.rows_summed):
                    dbias.flush(b, spec.dbias.head(h, walk.bias_head_div))

        # ---- epilogue: dK, dV (rmem -> smem over sK / sV -> gmem by TMA) ----
        acc_dK.store(acc_dK.load() * softmax_scale)
        # Both warpgroups' GEMMs that read sK / sV have completed.
        cute.arch.barrier(barrier_id=_EPILOGUE, number_of_threads=_MMA_THREADS)
        if cutlass.const_expr(not spec.split_heads):
            tiles.acc_to_smem(acc_dK, self.dtype, r2s, mma_dkv, tidx, sK)
            tiles.acc_to_smem(acc_dV, self.dtype, r2s, mma_dkv, tidx, sV)
            self.store_tiles(((tma_dk, tdK, sK), (tma_dv, tdV, sV)), walk, tidx)
        elif cutlass.const_expr(spec.deterministic):
            # fp32 partial sums, one after the other over sK and sV, added by TMA reduce-add
            # in split order (this CTA's turn from the dK add to the dV one)
            turns = DqTurns(mSemKV, tidx)
            turns.take(walk.b, walk.hk, walk.n_block, walk.split)
            self.add_partial_sums(walk, tidx, acc_dK, acc_dV, mma_dkv, sKV32, tma_dk, tdK,
                                  tma_dv, tdV, turns)  # fmt: skip
        else:
            if steps > 0:  # a split CTA that walked no block has nothing to add
                self.add_partial_sums(walk, tidx, acc_dK, acc_dV, mma_dkv, sKV32, tma_dk, tdK,
                                      tma_dv, tdV)  # fmt: skip

    @cute.jit
    def add_partial_sums(
        self, walk, tidx, acc_dK, acc_dV, mma_dkv, sKV32, tma_dk, tdK, tma_dv, tdV, turns=None
    ):
        """dK then dV as fp32 tiles over sK / sV, added into the zeroed buffers by TMA
        reduce-add (with `turns`: passed on once the dV addition is done)."""
        self.store_tiles(((tma_dk, tdK, sKV32),), walk, tidx, acc_dK, mma_dkv)
        # the reduce has read the tile before dV overwrites it
        cute.arch.barrier(barrier_id=_EPILOGUE, number_of_threads=_MMA_THREADS)
        self.store_tiles(((tma_dv, tdV, sKV32),), walk, tidx, acc_dV, mma_dkv, turns)

    @cute.jit
    def mma_step(self, mm, walk, h, m_block, state, acc_dK, acc_dV):
        """One (head, query block) step on the tiles in stage state.index: S, dP, P, dS,
        dbias; dV += P^T dO, dK += dS^T Q; dQ = dS K into sdQ for warp 1's reduce."""
        spec = self.spec
        tm, dp = self.tile_m, self.head_dim_padded
        idx = state.index
        coord = mm.tScS[None, None, None, m_block]
        # ---- S = bias / scale + Q K^T and dP = dO V^T (issued together) ----
        t_bias = t_mask = None
        if cutlass.const_expr(self.bias_first):
            mm.pipe_tiles.consumer_wait(state)
        if cutlass.const_expr(spec.bias is not None):
            t_bias = mm.views["bias"][None, None, None, idx]
        if cutlass.const_expr(spec.mask is not None):
            t_mask = mm.views["mask"][None, None, None, idx]
        acc_S = cute.make_rmem_tensor(mm.s_shape, cutlass.Float32)
        acc_dP = cute.make_rmem_tensor(mm.s_shape, cutlass.Float32)
        if cutlass.const_expr(self.bias_first):
            mm.scores.start(acc_S, t_bias)
        mm.pipe_q.consumer_wait(state)
        wgmma(mm.mma_sdp, acc_S, mm.tSrQ[None, None, None, idx], mm.tSrK, self.bias_first, -1)
        mm.pipe_do.consumer_wait(state)
        wgmma(mm.mma_sdp, acc_dP, mm.tdPrdO[None, None, None, idx], mm.tdPrV, False, -1)
        if cutlass.const_expr(self.has_tiles and not self.bias_first):
            mm.pipe_tiles.consumer_wait(state)  # read only after Q K^T
        # the forward's stats and dpsum of this thread's rows, under the GEMMs
        row_max, log2sum, dpsum = load_row_stats(
            mm.mStats, mm.mDpsum, coord, walk.b, h, mm.limits.seqlen_q, spec.bias is not None
        )
        dtanh = self.probabilities(
            mm.scores, acc_S, acc_dP, t_bias, t_mask, walk.bits(h, m_block) & FULL, coord,
            mm.limits, m_block, walk.n_block, row_max, log2sum, dpsum, mm.scale_log2,
            mm.softcap,
        )  # fmt: skip
        if cutlass.const_expr(self.has_tiles):
            # every MMA thread arrives after its own reads of the tiles (release)
            mm.pipe_tiles.consumer_release(state)
        if cutlass.const_expr(mm.dbias is not None):
            mm.dbias.step(acc_dP, coord, walk.b, spec.dbias.head(h, walk.bias_head_div))
        if cutlass.const_expr(dtanh is not None):
            acc_dP.store(acc_dP.load() * dtanh.load())
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))

        # ---- P, dS -> smem; dV += P^T dO, dK += dS^T Q, dQ = dS K ----
        cute.arch.barrier(barrier_id=_PDS_FREE, number_of_threads=_MMA_THREADS)
        cute.copy(mm.r2s_sdp, mm.r2s_sdp.retile(rP), mm.tPsP)
        cute.copy(mm.r2s_sdp, mm.r2s_sdp.retile(rdS), mm.tdSsdS)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by wgmma
        cute.arch.barrier(barrier_id=_PDS_READY, number_of_threads=_MMA_THREADS)
        wgmma(mm.mma_dkv, acc_dV, mm.tdVrPt, mm.tdVrdOt[None, None, None, idx], True, -1)
        wgmma(mm.mma_dkv, acc_dK, mm.tdKrdSt, mm.tdKrQt[None, None, None, idx], True, -1)
        acc_dQ = cute.make_rmem_tensor(mm.wg_dq.partition_shape_C((tm, dp)), cutlass.Float32)
        wgmma(mm.mma_dq, acc_dQ, mm.tdQrdS, mm.tdQrKt, False, 0)
        mm.pipe_q.consumer_release(state)
        mm.pipe_do.consumer_release(state)

        # ---- dQ * scale -> smem, then warp 1's reduce into global memory ----
        self.hand_dq_to_reduce(mm, acc_dQ)

    @cute.jit
    def hand_dq_to_reduce(self, mm, acc_dQ):
        """The step's dQ (times the softmax scale) into sdQ once warp 1's previous reduce has
        read it (barrier "dQ free"), then to warp 1 (barrier "dQ ready")."""
        acc_dQ.store(acc_dQ.load() * mm.softmax_scale)
        cute.arch.barrier(barrier_id=_DQ_FREE, number_of_threads=_MMA_THREADS + 32)
        tiles.acc_to_smem(acc_dQ, cutlass.Float32, mm.r2s_f32, mm.mma_dq, mm.tidx, mm.sdQ)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by the TMA
        cute.arch.barrier_arrive(barrier_id=_DQ_READY, number_of_threads=_MMA_THREADS + 32)

    @cute.jit
    def mma_step_transposed(self, mm, walk, h, m_block, state, acc_dK, acc_dV):
        """mma_step with transposed scores (an element-wise mask, a query-broadcast bias or
        none, no softcap): S^T = K Q^T and dP^T = V dO^T, P^T and dS^T in registers as the A
        operands of dV += P^T dO and dK += dS^T Q; dS^T to its stage's smem buffer (as dS)
        for dQ = dS K.

        The dS buffer of a stage is rewritten two steps later, after barrier "P/dS ready" of
        the step between: both warpgroups have then completed the dQ GEMM that read it."""
        spec = self.spec
        tm, dp = self.tile_m, self.head_dim_padded
        idx = state.index
        coord = mm.tScS[None, None, None, m_block]
        t_bias = t_mask = None
        if cutlass.const_expr(spec.bias is not None):
            t_bias = mm.views["bias"][None, None, None, idx]
        if cutlass.const_expr(spec.mask is not None):
            t_mask = mm.views["mask"][None, None, None, idx]
        acc_S = cute.make_rmem_tensor(mm.s_shape, cutlass.Float32)
        acc_dP = cute.make_rmem_tensor(mm.s_shape, cutlass.Float32)
        mm.pipe_q.consumer_wait(state)
        wgmma(mm.mma_sdp, acc_S, mm.tSrK, mm.tSrQ[None, None, None, idx], False, -1)
        mm.pipe_do.consumer_wait(state)
        wgmma(mm.mma_sdp, acc_dP, mm.tdPrV, mm.tdPrdO[None, None, None, idx], False, -1)
        # the stats of this thread's query columns (smem, 16 registers each) under the GEMMs;
        # dpsum only after the exp2s (not held with P, dP, the log2 sums and the maxima)
        mm.pipe_tiles.consumer_wait(state)
        shift = load_column_stat(mm.sStats[0, None, idx], mm.first_col, acc_S)
        moderate = None
        if cutlass.const_expr(spec.bias is not None):
            # with a bias the row max comes too: folded into the log2 sum at once (one stat
            # held under the GEMMs, one FMA per score) where the warp's maxima are moderate,
            # else both are read again for the exact subtraction
            moderate = fold_max(
                shift, load_column_stat(mm.sStats[2, None, idx], mm.first_col, acc_S),
                mm.scale_log2,
            )  # fmt: skip
        warpgroup.wait_group(1)  # S^T is complete
        if cutlass.const_expr(self.has_tiles):
            mm.scores.finish(acc_S, t_bias, t_mask, walk.bits(h, m_block) & FULL)
        mm.limits.apply(acc_S, coord, m_block, walk.n_block, transposed=True)
        acc_mn, dP_mn = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        # (not one `or`: the first test is compile-time, the second the warp's run-time vote)
        if cutlass.const_expr(spec.bias is None):  # noqa: SIM114
            exp2_columns(acc_mn, mm.scale_log2, shift)
        elif moderate:
            exp2_columns(acc_mn, mm.scale_log2, shift)
        else:
            log2sum = load_column_stat(mm.sStats[0, None, idx], mm.first_col, acc_S)
            row_max = load_column_stat(mm.sStats[2, None, idx], mm.first_col, acc_S)
            exp2_columns(acc_mn, mm.scale_log2, log2sum, row_max)
        warpgroup.wait_group(0)  # dP^T is complete
        dpsum = load_column_stat(mm.sStats[1, None, idx], mm.first_col, acc_S)
        # every MMA thread arrives after its own reads of the stage (stats, mask, bias)
        mm.pipe_tiles.consumer_release(state)
        for c in cutlass.range_constexpr(cute.size(dP_mn.shape[1])):
            for r in cutlass.range_constexpr(cute.size(dP_mn.shape[0])):
                dP_mn[r, c] = acc_mn[r, c] * (dP_mn[r, c] - dpsum[c])
        if cutlass.const_expr(mm.dbias is not None):
            mm.dbias.step(acc_dP, coord, walk.b, spec.dbias.head(h, walk.bias_head_div))
        rP = cute.make_rmem_tensor(mm.s_shape, self.dtype)
        round_pairs(acc_S, rP)
        rdS = cute.make_rmem_tensor(mm.s_shape, self.dtype)
        round_pairs(acc_dP, rdS)

        # ---- dV += P^T dO; dS -> smem; dQ = dS K, dK += dS^T Q ----
        tdVrPt = cute.make_tensor(rP.iterator, acc_as_a_operand(rP.layout))
        wgmma(mm.mma_dkv, acc_dV, tdVrPt, mm.tdVrdOt[None, None, None, idx], True, -1)
        cute.copy(mm.r2s_sdp, mm.r2s_sdp.retile(rdS), mm.tdSsdS[None, None, None, idx])
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by wgmma
        cute.arch.barrier(barrier_id=_PDS_READY, number_of_threads=_MMA_THREADS)
        acc_dQ = cute.make_rmem_tensor(mm.wg_dq.partition_shape_C((tm, dp)), cutlass.Float32)
        wgmma(mm.mma_dq, acc_dQ, mm.tdQrdS[None, None, None, idx], mm.tdQrKt, False, 1)
        mm.pipe_do.consumer_release(state)  # dV has read dO
        tdKrdSt = cute.make_tensor(rdS.iterator, acc_as_a_operand(rdS.layout))
        wgmma(mm.mma_dkv, acc_dK, tdKrdSt, mm.tdKrQt[None, None, None, idx], True, 1)

        # ---- dQ * scale -> smem (under dK), then warp 1's reduce into global memory ----
        self.hand_dq_to_reduce(mm, acc_dQ)
        warpgroup.wait_group(0)  # dK has read Q and the registers of dS^T
        mm.pipe_q.consumer_release(state)

    @cute.jit
    def store_tiles(self, stores, walk, tidx, acc=None, tiled_mma=None, turns=None):
        """(atom, TMA view, smem tile) of each store: the (tile_n, D) tiles of the CTA's key
        block (smem -> gmem; rows past Sk and columns past D are not written), after `acc`
        (fp32) is written to the one smem tile when given. Returns once the stores have read
        smem; with `turns`, once every addition of this CTA is done, and passes the turn."""
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
                gX = cute.local_tile(tX[None, None, walk.hk, walk.b], (tn, dp), (walk.n_block, 0))
                tXsX, tXgX = cpasync.tma_partition(
                    atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                    cute.group_modes(gX, 0, 2),
                )  # fmt: skip
                cute.copy(atom, tXsX, tXgX)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if cutlass.const_expr(turns is not None):
                cute.arch.cp_async_bulk_wait_group(0)  # the additions are done in global memory
                cute.arch.sync_warp()  # whichever lane issued them, before lane 0 passes on
                turns.give(walk.b, walk.hk, walk.n_block, walk.split)

    @cute.jit
    def probabilities(
        self, scores, acc_S, acc_dP, t_bias, t_mask, full, coord, limits, m_block, n_block,
        row_max, log2sum, dpsum, scale_log2, softcap,
    ):  # fmt: skip
        """acc_S <- P = exp(S - lse) after the softcap, the bias after it, the mask tile and
        the causal/window limits; acc_dP <- dS = P (dP - dpsum). Returns the softcap's
        derivative 1 - tanh^2 for the caller to apply after dbias (None: no softcap, or
        applied here), with both of the step's S/dP wgmma groups complete."""
        spec = self.spec
        warpgroup.wait_group(1)  # S is complete
        # With a softcap and no bias, P and dS are formed in one pass after dP (tanh is read
        # back from S): no array of derivatives is held across the exp.
        fused = spec.has_softcap and spec.bias is None
        dtanh = None
        if cutlass.const_expr(spec.has_softcap and not fused):
            dtanh = cute.make_rmem_tensor_like(acc_S)
        scores.finish(
            acc_S, t_bias, t_mask, full, dtanh, t_coord=coord,
            row_offset=limits.seqlen_k - limits.seqlen_q,
        )  # fmt: skip
        limits.apply(acc_S, coord, m_block, n_block)
        acc_mn, dP_mn = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        if cutlass.const_expr(not fused):
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                s_row = acc_mn[r, None].load()
                if cutlass.const_expr(spec.bias is None):
                    exponent = s_row * scale_log2 - log2sum[r]
                else:
                    exponent = (s_row - row_max[r]) * scale_log2 - log2sum[r]
                acc_mn[r, None].store(cute.math.exp2(exponent, fastmath=True))
            warpgroup.wait_group(0)  # dP is complete
            for r in cutlass.range_constexpr(cute.size(dP_mn.shape[0])):
                dP_mn[r, None].store(acc_mn[r, None].load() * (dP_mn[r, None].load() - dpsum[r]))
        else:
            # tanh = S / softcap, clamped at -1: a masked score (-inf) has P = 0 and gets
            # derivative 0, not NaN.
            inv_softcap = 1.0 / softcap
            warpgroup.wait_group(0)  # dP is complete
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                for c in cutlass.range(cute.size(acc_mn.shape[1]), unroll_full=True):
                    s = acc_mn[r, c]
                    p = cute.math.exp2(s * scale_log2 - log2sum[r], fastmath=True)
                    t = cutlass.max(s * inv_softcap, cutlass.Float32(-1.0))
                    acc_mn[r, c] = p
                    dP_mn[r, c] = p * (dP_mn[r, c] - dpsum[r]) * (1.0 - t * t)
        return dtanh
