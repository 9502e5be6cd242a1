"""Kernels for Hopper (sm_90a): TMA, wgmma, warp specialization."""
