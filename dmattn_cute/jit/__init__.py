"""Compile support: target architecture of a device, per-arch limits, and the kernel cache
(memory and disk)."""

from dmattn_cute.jit.arch import (
    ARCH_ENV,
    KERNELS_ENV,
    SUPPORTED_ARCHS,
    arch_for_capability,
    check_arch,
    compile_options,
    hopper_kernels,
    smem_capacity,
    target_arch,
)
from dmattn_cute.jit.cache import (
    CACHE_ENV,
    KernelSpec,
    cache_dir,
    clear_memory,
    compile_count,
    compiled,
    load_count,
)

__all__ = [
    "ARCH_ENV",
    "CACHE_ENV",
    "KERNELS_ENV",
    "SUPPORTED_ARCHS",
    "KernelSpec",
    "arch_for_capability",
    "cache_dir",
    "check_arch",
    "clear_memory",
    "compile_count",
    "compile_options",
    "compiled",
    "hopper_kernels",
    "load_count",
    "smem_capacity",
    "target_arch",
]
