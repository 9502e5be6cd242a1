"""In-memory cache of compiled kernels, keyed by (kernel spec, target arch, DSL version)."""

import threading
from collections.abc import Hashable
from typing import Any, Protocol

import cutlass

from dmattn_cute.jit.arch import check_arch


class KernelSpec(Hashable, Protocol):
    """A frozen dataclass describing one kernel variant; its fields are the compile key."""

    def compile(self, arch: str) -> Any:
        """``cute.compile(...)`` of the kernel for ``arch`` (see ``arch.compile_options``)."""


_cache: dict[tuple[KernelSpec, str, str], Any] = {}
_compile_count = 0
# cute.compile keeps its options (including the target arch) in process-wide DSL state, so two
# compiles must never overlap; the same lock makes "look up, else compile once" atomic.
_lock = threading.Lock()


def compiled(spec: KernelSpec, arch: str) -> Any:
    """The compiled kernel for ``spec`` on ``arch``; compiles on first use, then reuses it."""
    global _compile_count
    key = (spec, check_arch(arch), cutlass.__version__)
    with _lock:
        kernel = _cache.get(key)
        if kernel is None:
            kernel = spec.compile(arch)
            _cache[key] = kernel
            _compile_count += 1
    return kernel


def compile_count() -> int:
    """Number of compiles this process has done through ``compiled``."""
    return _compile_count
