"""Deterministic dQ: the key blocks of a (batch, head, query block) add their dQ in key-block
order. A turn counter per (batch, head, query block) in global memory (zeroed by the host)
passes from key block n to n + 1."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
from cutlass import cute


@dataclass(frozen=True)
class DqTurns:
    """The turn counters mSem [B, H, ceil(Sq / tile_m)] int32, seen from thread tidx."""

    mSem: cute.Tensor
    tidx: cutlass.Int32

    def _ptr(self, b, h, m_block):
        return self.mSem.iterator + cute.crd2idx((b, h, m_block), self.mSem.layout)

    @cute.jit
    def _wait(self, ptr, n_block):
        turn = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
        while turn != n_block:
            turn = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")

    @cute.jit
    def wait(self, b, h, m_block, n_block):
        """Wait until key blocks 0..n_block-1 have added their dQ of (b, h, m_block)."""
        if self.tidx == 0:
            self._wait(self._ptr(b, h, m_block), n_block)
        cute.arch.sync_threads()  # the whole CTA adds after the previous key block

    @cute.jit
    def end(self, b, h, m_block, n_block):
        """This key block's additions are visible: pass the turn on."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()  # every thread's additions precede the release
        if self.tidx == 0:
            cute.arch.store(self._ptr(b, h, m_block), n_block + 1, sem="release", scope="gpu")

    @cute.jit
    def skip(self, b, h, m_block, n_block):
        """A skipped step: take the turn and pass it on with nothing added."""
        if self.tidx == 0:
            ptr = self._ptr(b, h, m_block)
            self._wait(ptr, n_block)
            cute.arch.store(ptr, n_block + 1, sem="release", scope="gpu")

    @cute.jit
    def take(self, b, h, m_block, n_block):
        """Thread tidx 0 waits for key block n_block's turn (no barrier: the caller orders
        its other threads after it)."""
        if self.tidx == 0:
            self._wait(self._ptr(b, h, m_block), n_block)

    @cute.jit
    def give(self, b, h, m_block, n_block):
        """Thread tidx 0 passes the turn on (release): the caller has ordered every addition
        of this key block before it."""
        if self.tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.store(self._ptr(b, h, m_block), n_block + 1, sem="release", scope="gpu")
