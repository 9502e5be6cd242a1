import os
import tempfile
import zlib

import pytest
import torch

from dmattn_cute.jit import CACHE_ENV, KERNELS_ENV, arch_for_capability

# Markers of tests that need a GPU of one architecture, and the arch each stands for.
ARCH_MARKERS = {"sm80": "sm_80", "sm86": "sm_86", "sm89": "sm_89", "sm90": "sm_90a"}


def pytest_configure(config: pytest.Config) -> None:
    # Tests compile into a cache of their own, so every run proves its kernels compile; set
    # DMATTN_CUTE_CACHE_DIR to reuse a cache across runs.
    os.environ.setdefault(CACHE_ENV, tempfile.mkdtemp(prefix="dmattn_cute_test_cache_"))


def _gpu_arch() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        return arch_for_capability(*torch.cuda.get_device_capability())
    except ValueError:
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_arch = _gpu_arch()
    here = gpu_arch or ("no GPU" if not torch.cuda.is_available() else "an unsupported GPU")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    # An arch marker without `gpu` would be skipped here and left out of the device's
    # `-m gpu` runs alike: the test would never run anywhere.
    unrun = [
        i.nodeid
        for i in items
        if "gpu" not in i.keywords and ARCH_MARKERS.keys() & i.keywords.keys()
    ]
    if unrun:
        raise pytest.UsageError(f"arch-marked tests without the gpu marker: {unrun}")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
            continue
        for marker, arch in ARCH_MARKERS.items():
            if marker in item.keywords and arch != gpu_arch:
                item.add_marker(
                    pytest.mark.skip(reason=f"needs an {arch} GPU (this machine: {here})")
                )


@pytest.fixture(autouse=True)
def _seed_per_test(request: pytest.FixtureRequest) -> None:
    """Every test draws its own inputs (a seed from its node id: fresh per test, the same on
    every run), so a failure reproduces and no test depends on the tests run before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch):
    """The launch code's kernels replaced by recorders, on sm_90a (CPU tensors): every
    compiled() request ("compiled": specs) and every kernel call ("calls": (spec, args)), in
    order, of the forward, the backward and the block-bits pre-pass; a call with another
    number of arguments than the variant's compiled function takes fails."""
    from dmattn_cute.jit import ARCH_ENV, cache
    from dmattn_cute.kernels import block_bits_launch, bwd_launch, fwd_launch

    monkeypatch.setenv(ARCH_ENV, "sm_90a")
    cache.clear_memory()
    record = {"compiled": [], "calls": []}

    def compiled(spec, arch):
        record["compiled"].append(spec)
        # the compiled function's arguments: its example_args but the stream (TVM-FFI
        # passes the current one)
        takes = len(spec.example_args()) - 1

        def call(*args):
            assert len(args) == takes, f"{type(spec).__name__}: {len(args)} args, takes {takes}"
            record["calls"].append((spec, args))

        return call

    for module in (fwd_launch, bwd_launch, block_bits_launch):
        monkeypatch.setattr(module, "compiled", compiled)
    yield record
    cache.clear_memory()


@pytest.fixture
def mma_sync_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SM80-family (mma.sync) kernels on a Hopper GPU too (other GPUs run them anyway)."""
    monkeypatch.setenv(KERNELS_ENV, "mma_sync")
