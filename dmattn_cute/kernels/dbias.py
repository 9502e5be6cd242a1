"""dbias from the backward's dS tile (fp32, accumulator layout), in the bias's shape.

- full rows (bias Qm = Sq): element-wise, stored in the bias dtype when the step is the
  element's only contribution (Bm = B, Hm = H), else added into an fp32 buffer;
- rows summed (Qm = 1): column sums over the CTA's steps in registers, reduced across threads
  through shared memory once per head, one row per key block.
Additions are red.add atomics, or, deterministic, load-add-store by the single CTA that owns
the element (the host folds broadcast batch / kv-head dims into the CTA's loop for that).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
from cutlass import cute

from .masking import BlockLimits
from .utils import acc_mn_view, quad_allreduce_sum


@dataclass(frozen=True)
class DbiasWriter:
    """One thread's dbias additions for key block `n_block` of its CTA.

    spec: the kernel's DbiasSpec; s_colsum: (warps_m, tile_n) fp32 in shared memory, one row
    per warp along the query rows of the S tile; colsum: this thread's column sums (Qm = 1);
    coord_mn: (row, col) of the thread's S elements in query block 0; barrier_id /
    barrier_threads: the barrier of the threads that hold the S tile (0: the whole CTA).
    """

    spec: cutlass.Constexpr
    mdBias: cute.Tensor
    s_colsum: cute.Tensor
    colsum: cute.Tensor
    coord_mn: cute.Tensor
    tile_n: cutlass.Constexpr[int]
    warps_m: cutlass.Constexpr[int]
    n_block: cutlass.Int32
    limits: BlockLimits
    tidx: cutlass.Int32
    barrier_id: cutlass.Constexpr[int] = 0
    barrier_threads: cutlass.Constexpr[int] = 0
    # the dS tile is dS^T (the Hopper backward's transposed scores): rows are keys, coord_mn
    # (key, query); a key's sum over the queries lies in one quad of lanes (no shared memory)
    transposed: cutlass.Constexpr[bool] = False

    @staticmethod
    def make(
        spec, mdBias, s_colsum, tScS, tile_n, warps_m, n_block, limits, tidx, barrier=(0, 0),
        transposed=False,
    ):  # fmt: skip
        coord_mn = acc_mn_view(tScS[None, None, None, 0])
        sums = cute.size(coord_mn.shape[0 if transposed else 1])
        colsum = cute.make_rmem_tensor(sums, cutlass.Float32)
        colsum.fill(0.0)
        return DbiasWriter(
            spec, mdBias, s_colsum, colsum, coord_mn, tile_n, warps_m, n_block, limits, tidx,
            *barrier, transposed,
        )  # fmt: skip

    @cute.jit
    def sync(self):
        if cutlass.const_expr(self.barrier_id == 0):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=self.barrier_threads)

    @cute.jit
    def step(self, acc_dS: cute.Tensor, coord: cute.Tensor, b, h_bias):
        """This step's dS into dbias[b, h_bias] (coord: (row, col) of each element of acc_dS)."""
        dS_mn = acc_mn_view(acc_dS)
        coord_mn = acc_mn_view(coord)
        if cutlass.const_expr(self.transposed):  # rows summed: per key (accumulator row)
            for r in cutlass.range_constexpr(cute.size(dS_mn.shape[0])):
                total = self.colsum[r]
                for c in cutlass.range_constexpr(cute.size(dS_mn.shape[1])):
                    total = total + dS_mn[r, c]
                self.colsum[r] = total
        elif cutlass.const_expr(self.spec.rows_summed):
            # Rows past Sq and columns past Sk hold dS = 0 (P = 0 there).
            for c in cutlass.range_constexpr(cute.size(dS_mn.shape[1])):
                total = self.colsum[c]
                for r in cutlass.range_constexpr(cute.size(dS_mn.shape[0])):
                    total = total + dS_mn[r, c]
                self.colsum[c] = total
        else:
            for r in cutlass.range_constexpr(cute.size(dS_mn.shape[0])):
                row = coord_mn[r, 0][0]
                for c in cutlass.range_constexpr(cute.size(dS_mn.shape[1])):
                    col = coord_mn[0, c][1]
                    if row < self.limits.seqlen_q and col < self.limits.seqlen_k:
                        self.add((b, h_bias, row, col), dS_mn[r, c])

    @cute.jit
    def add(self, crd, value):
        """One contribution to dbias[crd]: store (direct), atomic add or load-add-store."""
        if cutlass.const_expr(self.spec.direct):
            self.mdBias[crd] = value.to(self.mdBias.element_type)
        elif cutlass.const_expr(self.spec.atomic):
            ptr = self.mdBias.iterator + cute.crd2idx(crd, self.mdBias.layout)
            cute.arch.atomic_add(ptr, value)
        else:
            self.mdBias[crd] = self.mdBias[crd] + value

    @cute.jit
    def flush(self, b, h_bias):
        """Query-broadcast bias: add this head's column sums into dbias[b, h_bias, 0] (lanes
        that share columns by shuffles, warps through shared memory in a fixed order) and
        restart them. Transposed: the four lanes of a quad hold a key's sums; lane 0 of it
        adds them."""
        if cutlass.const_expr(self.transposed):
            lane = self.tidx % 32
            for r in cutlass.range_constexpr(cute.size(self.colsum)):
                value = quad_allreduce_sum(self.colsum[r])
                key = self.coord_mn[r, 0][0]
                if lane % 4 == 0 and key < self.limits.seqlen_k:
                    self.add((b, h_bias, 0, key), value)
            self.colsum.fill(0.0)
        else:
            self.flush_columns(b, h_bias)

    @cute.jit
    def flush_columns(self, b, h_bias):
        """flush of the untransposed tile: column sums through shared memory."""
        tn = self.tile_n
        lane = self.tidx % 32
        warp_m = (self.coord_mn[0, 0][0] // 16) % self.warps_m
        for c in cutlass.range_constexpr(cute.size(self.colsum)):
            value = self.colsum[c]
            # lanes 4 apart hold the same columns of other rows
            for offset in cutlass.range_constexpr(3):
                value = value + cute.arch.shuffle_sync_bfly(value, offset=4 << offset)
            if lane < 4:
                self.s_colsum[warp_m, self.coord_mn[0, c][1] - self.n_block * tn] = value
        self.sync()  # every warp's sums are in shared memory
        if self.tidx < tn:
            total = cutlass.Float32(0.0)
            for w in cutlass.range_constexpr(self.warps_m):
                total = total + self.s_colsum[w, self.tidx]
            col = self.n_block * tn + self.tidx
            if col < self.limits.seqlen_k:
                self.add((b, h_bias, 0, col), total)
        self.sync()  # the sums are read before the next head rewrites them
        self.colsum.fill(0.0)
