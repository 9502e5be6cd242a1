"""Compile support: target architecture of a device, per-arch limits, and the compile cache."""

from dmattn_cute.jit.arch import (
    ARCH_ENV,
    SUPPORTED_ARCHS,
    arch_for_capability,
    check_arch,
    compile_options,
    smem_capacity,
    target_arch,
)
from dmattn_cute.jit.cache import KernelSpec, compile_count, compiled

__all__ = [
    "ARCH_ENV",
    "SUPPORTED_ARCHS",
    "KernelSpec",
    "arch_for_capability",
    "check_arch",
    "compile_count",
    "compile_options",
    "compiled",
    "smem_capacity",
    "target_arch",
]
