"""Compiled kernels, cached in memory and on disk.

A kernel is looked up by (spec, arch): first in this process's memory, then in the disk cache
(an object file exported by the CuTe DSL, loaded in milliseconds), else compiled and exported.
The disk key covers everything that changes the binary: the spec's fields, the target arch,
the DSL version and a hash of this package's kernel and compile sources. Several processes may
share a cache directory: a per-entry file lock makes one of them compile while the others wait
and then load. An entry that cannot be loaded (truncated, foreign, from another DSL build) is
compiled again and replaced; it never fails a call.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import tempfile
import threading
import warnings
from collections.abc import Hashable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import cutlass
from cutlass import cute

from dmattn_cute.jit.arch import check_arch

CACHE_ENV = "DMATTN_CUTE_CACHE_DIR"
# Values of $DMATTN_CUTE_CACHE_DIR that turn the disk cache off.
_DISABLED = ("0", "off", "none")
_PACKAGE = Path(__file__).resolve().parent.parent
# Sources whose change can change a compiled kernel.
_SOURCE_DIRS = ("jit", "kernels")


class KernelSpec(Hashable, Protocol):
    """A frozen dataclass describing one kernel variant; its fields are the compile key."""

    def compile(self, arch: str) -> Any:
        """``cute.compile(...)`` of the kernel for ``arch`` (see ``arch.compile_options``)."""


_memory: dict[tuple[KernelSpec, str], Any] = {}
_counts = {"compiles": 0, "loads": 0}
# cute.compile keeps its options (including the target arch) in process-wide DSL state, so two
# compiles must never overlap; the same lock makes "look up, else load or compile once" atomic.
_lock = threading.Lock()
# Other in-memory caches that hold kernels from here (e.g. the launch plans): cleared with it.
_holders: list[dict] = []


def cache_dir() -> Path | None:
    """The disk cache directory: ``$DMATTN_CUTE_CACHE_DIR`` if set (``0``/``off``/``none``
    disables the disk cache), else ``$XDG_CACHE_HOME/dmattn_cute`` (``~/.cache/dmattn_cute``)."""
    override = os.environ.get(CACHE_ENV)
    if override is not None and override.strip():
        if override.strip().lower() in _DISABLED:
            return None
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dmattn_cute"


@functools.cache
def source_hash() -> str:
    """sha256 of the package's kernel and compile sources (names and contents)."""
    digest = hashlib.sha256()
    for folder in _SOURCE_DIRS:
        for path in sorted((_PACKAGE / folder).rglob("*.py")):
            digest.update(path.relative_to(_PACKAGE).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def entry_key(spec: KernelSpec, arch: str) -> str:
    """The disk cache key of ``spec`` compiled for ``arch`` (hex, filename safe)."""
    text = "\n".join((type(spec).__qualname__, repr(spec), arch, cutlass.__version__))
    return hashlib.sha256(f"{text}\n{source_hash()}".encode()).hexdigest()[:40]


def entry_path(spec: KernelSpec, arch: str, root: Path) -> Path:
    """Where the object file of ``spec`` on ``arch`` lives under the cache root ``root``."""
    return root / f"cutlass-{cutlass.__version__}" / arch / f"{entry_key(spec, arch)}.o"


def _symbol(key: str) -> str:
    # The exported function's symbol prefix: unique per entry and a valid C identifier.
    return f"dmattn_cute_{key}"


@functools.cache
def _load_runtime_globally() -> None:
    # Exporting links the host launcher against the DSL runtime's CUDA entry points, which must
    # then be visible process-wide; on a machine without a GPU nothing else has loaded them.
    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


@contextmanager
def _file_lock(path: Path):
    with open(path.with_suffix(".lock"), "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load(path: Path, key: str) -> Any | None:
    """The kernel exported at ``path``, or None (with a warning) if it cannot be loaded."""
    try:
        return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), _symbol(key))
    except Exception as err:  # noqa: BLE001 - whatever fails to load is compiled again
        warnings.warn(
            f"dmattn_cute: recompiling the unreadable cache entry {path} ({err})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _export(kernel: Any, path: Path, key: str) -> None:
    """Writes ``kernel`` to ``path`` atomically (readers never see a partial file)."""
    _load_runtime_globally()
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        kernel.export_to_c(str(Path(tmp) / "kernel.o"), _symbol(key))
        os.replace(Path(tmp) / "kernel.o", path)


def _compile(spec: KernelSpec, arch: str) -> Any:
    _counts["compiles"] += 1
    return spec.compile(arch)


def _from_disk_or_compile(spec: KernelSpec, arch: str, root: Path) -> Any:
    path = entry_path(spec, arch, root)
    key = path.stem
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path):
        if path.exists():
            kernel = _load(path, key)
            if kernel is not None:
                _counts["loads"] += 1
                return kernel
        kernel = _compile(spec, arch)
        _export(kernel, path, key)
        return kernel


def compiled(spec: KernelSpec, arch: str) -> Any:
    """The compiled kernel for ``spec`` on ``arch``: from memory, else from the disk cache,
    else compiled now (and written to the disk cache)."""
    key = (spec, check_arch(arch))
    kernel = _memory.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _memory.get(key)
        if kernel is None:
            root = cache_dir()
            kernel = (
                _compile(spec, arch) if root is None else _from_disk_or_compile(spec, arch, root)
            )
            _memory[key] = kernel
    return kernel


def compile_count() -> int:
    """Number of kernels this process has compiled (not counting disk-cache loads)."""
    return _counts["compiles"]


def load_count() -> int:
    """Number of kernels this process has loaded from the disk cache."""
    return _counts["loads"]


def holds_kernels(holder: dict) -> dict:
    """Register a dict whose values hold compiled kernels (a launch-plan cache): clear_memory
    empties it too, so no kernel outlives the memory cache. Returns the dict."""
    _holders.append(holder)
    return holder


def clear_memory() -> None:
    """Forget the kernels held in memory (the disk cache is kept)."""
    with _lock:
        _memory.clear()
        for holder in _holders:
            holder.clear()
