"""The disk cache of compiled kernels: round trip, keys, corrupt entries, concurrent processes.

Runs on a CPU: kernels compile offline for a named arch, export to the cache directory and load
back (loading needs no GPU; only running does).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dmattn_cute.jit import cache
from dmattn_cute.kernels.bwd_pre import BwdPreprocessSpec
from dmattn_cute.kernels.fwd import FwdSpec, OperandSpec

pytestmark = pytest.mark.compile

ARCH = "sm_89"


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    cache.clear_memory()
    yield tmp_path
    cache.clear_memory()


def _small_spec(head_dim: int = 64) -> BwdPreprocessSpec:
    return BwdPreprocessSpec.build("bf16", head_dim)


def test_cache_dir_default_override_and_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "dmattn_cute"
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"
    for off in ("0", "off", "NONE"):
        monkeypatch.setenv(cache.CACHE_ENV, off)
        assert cache.cache_dir() is None


def test_round_trip_loads_without_compiling(cache_root: Path) -> None:
    spec = _small_spec()
    compiles, loads = cache.compile_count(), cache.load_count()
    cache.compiled(spec, ARCH)
    path = cache.entry_path(spec, ARCH, cache_root)
    assert path.is_file() and path.stat().st_size > 0
    assert (cache.compile_count(), cache.load_count()) == (compiles + 1, loads)

    cache.clear_memory()
    kernel = cache.compiled(spec, ARCH)
    assert (cache.compile_count(), cache.load_count()) == (compiles + 1, loads + 1)
    assert callable(kernel)
    # Held in memory after the load: no second disk access.
    assert cache.compiled(spec, ARCH) is kernel
    assert cache.load_count() == loads + 1


def test_first_compile_and_cached_load_times(cache_root: Path, capsys) -> None:
    """Prints the first-use compile time and the cached load time of a full forward kernel."""
    operand = OperandSpec("u8", ("d", "0", "d", "1"), 16)
    bias = OperandSpec("bf16", ("d", "d", "0", "1"), 8)
    spec = FwdSpec.build(ARCH, "bf16", 128, operand, bias, True, False)
    start = time.perf_counter()
    cache.compiled(spec, ARCH)
    compile_s = time.perf_counter() - start
    cache.clear_memory()
    start = time.perf_counter()
    cache.compiled(spec, ARCH)
    load_s = time.perf_counter() - start
    with capsys.disabled():
        print(
            f"\nforward bf16 D=128 mask+bias+causal on {ARCH}: first use (compile + export) "
            f"{compile_s:.2f} s, cached load {load_s * 1e3:.1f} ms"
        )
    assert load_s < 0.5
    assert load_s < compile_s / 10


def test_key_covers_spec_arch_dsl_and_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _small_spec()
    base = cache.entry_key(spec, ARCH)
    assert cache.entry_key(_small_spec(), ARCH) == base
    assert cache.entry_key(_small_spec(128), ARCH) != base
    assert cache.entry_key(spec, "sm_80") != base
    monkeypatch.setattr(cache.cutlass, "__version__", "0.0.0-other")
    assert cache.entry_key(spec, ARCH) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache, "source_hash", lambda: "edited sources")
    assert cache.entry_key(spec, ARCH) != base


def test_source_hash_covers_kernel_files() -> None:
    files = sorted(p.name for p in (cache._PACKAGE / "kernels").glob("*.py"))
    assert {"fwd.py", "bwd.py", "bwd_pre.py", "config.py"} <= set(files)
    assert len(cache.source_hash()) == 64


@pytest.mark.parametrize("damage", [b"", b"not an object file", b"\x7fELF" + b"\0" * 60])
def test_corrupt_entry_is_recompiled(cache_root: Path, damage: bytes) -> None:
    spec = _small_spec()
    path = cache.entry_path(spec, ARCH, cache_root)
    path.parent.mkdir(parents=True)
    path.write_bytes(damage)
    compiles = cache.compile_count()
    with pytest.warns(RuntimeWarning, match="recompiling the unreadable cache entry"):
        cache.compiled(spec, ARCH)
    assert cache.compile_count() == compiles + 1
    assert path.read_bytes() != damage
    # The rewritten entry loads.
    cache.clear_memory()
    loads = cache.load_count()
    cache.compiled(spec, ARCH)
    assert (cache.compile_count(), cache.load_count()) == (compiles + 1, loads + 1)


def test_disabled_cache_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cache.Path, "home", lambda: tmp_path)
    cache.clear_memory()
    compiles = cache.compile_count()
    cache.compiled(_small_spec(), ARCH)
    assert cache.compile_count() == compiles + 1
    assert list(tmp_path.iterdir()) == []


_WORKER = """
import json, sys
from dmattn_cute.jit import cache
from dmattn_cute.kernels.bwd_pre import BwdPreprocessSpec
sys.stdin.readline()  # start together
cache.compiled(BwdPreprocessSpec.build("bf16", 64), "sm_89")
print(json.dumps([cache.compile_count(), cache.load_count()]))
"""


def test_concurrent_processes_compile_once(tmp_path: Path) -> None:
    env = {**os.environ, cache.CACHE_ENV: str(tmp_path)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    # Each worker imports first, then all are released at once into the same cache entry.
    for worker in workers:
        worker.stdin.write("go\n")
        worker.stdin.flush()
    results = [worker.communicate(timeout=300)[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    counts = [json.loads(out.strip().splitlines()[-1]) for out in results]
    assert sum(c for c, _ in counts) == 1
    assert sum(n for _, n in counts) == 2
    assert len(list(tmp_path.rglob("*.o"))) == 1
