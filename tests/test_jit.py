"""Target architecture selection, per-arch limits and the compile cache (CPU only)."""

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from dmattn_cute.jit import arch, cache


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        ((8, 0), "sm_80"),
        ((8, 6), "sm_86"),
        ((8, 7), "sm_86"),
        ((8, 9), "sm_89"),
        ((9, 0), "sm_90a"),
    ],
)
def test_arch_for_capability(capability: tuple[int, int], expected: str) -> None:
    assert arch.arch_for_capability(*capability) == expected


@pytest.mark.parametrize(
    ("capability", "message"),
    [
        ((7, 5), r"compute capability 7\.5 is not supported: .*8\.0 or newer"),
        ((6, 1), r"compute capability 6\.1 is not supported: .*8\.0 or newer"),
        ((10, 0), r"compute capability 10\.0 is not supported yet \(supported: 8\.0, .*9\.0\)"),
        ((12, 0), r"compute capability 12\.0 is not supported yet \(supported: 8\.0, .*9\.0\)"),
    ],
)
def test_arch_for_unsupported_capability_raises(capability: tuple[int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arch.arch_for_capability(*capability)


@pytest.mark.parametrize("override", arch.SUPPORTED_ARCHS)
@pytest.mark.parametrize("device", [None, torch.device("cuda", 0)])
def test_env_override_wins(
    monkeypatch: pytest.MonkeyPatch, override: str, device: torch.device | None
) -> None:
    monkeypatch.setenv(arch.ARCH_ENV, override)
    # The device's own capability must not be consulted.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (7, 0))
    assert arch.target_arch(device) == override


@pytest.mark.parametrize("bad", ["sm_75", "sm90a", "sm_100a", "SM_80"])
def test_env_override_rejects_unknown_arch(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(arch.ARCH_ENV, bad)
    with pytest.raises(ValueError, match=rf"{arch.ARCH_ENV}: expected one of sm_80, .*got '{bad}'"):
        arch.target_arch()


@pytest.fixture
def fresh_device_cache():
    arch.device_arch.cache_clear()
    yield
    arch.device_arch.cache_clear()


@pytest.mark.parametrize(("capability", "expected"), [((8, 6), "sm_86"), ((9, 0), "sm_90a")])
def test_target_arch_asks_each_device_once(
    monkeypatch: pytest.MonkeyPatch,
    fresh_device_cache: None,
    capability: tuple[int, int],
    expected: str,
) -> None:
    monkeypatch.delenv(arch.ARCH_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    asked = []
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda index: asked.append(index) or capability
    )
    devices = [torch.device("cuda", 1), None, torch.device("cuda"), torch.device("cuda", 2)]
    assert [arch.target_arch(device) for device in devices] == [expected] * len(devices)
    assert asked == [1, 2]


def test_target_arch_rejects_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(arch.ARCH_ENV, raising=False)
    with pytest.raises(ValueError, match="device: expected a CUDA device, got cpu"):
        arch.target_arch(torch.device("cpu"))


def test_target_arch_without_gpu_points_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(arch.ARCH_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=arch.ARCH_ENV):
        arch.target_arch()


@pytest.mark.parametrize(
    ("target", "kib"), [("sm_80", 163), ("sm_86", 99), ("sm_89", 99), ("sm_90a", 227)]
)
def test_smem_capacity(target: str, kib: int) -> None:
    assert arch.smem_capacity(target) == kib * 1024


@pytest.mark.parametrize("bad", ["sm_75", "sm_90", "sm_100a"])
def test_unknown_arch_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match=f"arch: expected one of .*got '{bad}'"):
        arch.smem_capacity(bad)
    with pytest.raises(ValueError, match=f"arch: expected one of .*got '{bad}'"):
        arch.compile_options(bad)


@pytest.mark.parametrize("target", arch.SUPPORTED_ARCHS)
def test_compile_options_name_the_arch(target: str) -> None:
    assert arch.compile_options(target) == f"--gpu-arch {target} --enable-tvm-ffi"
    expected = f"--gpu-arch {target} --enable-tvm-ffi --keep-ptx"
    assert arch.compile_options(target, "--keep-ptx") == expected


@pytest.fixture(autouse=True)
def memory_cache_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # FakeSpec's results are not DSL kernels, so they cannot be exported to disk.
    monkeypatch.setenv(cache.CACHE_ENV, "off")


@dataclass(frozen=True)
class FakeSpec:
    """Stands in for a kernel spec; records every compile it is asked for."""

    name: str
    compiles: list = field(default_factory=list, compare=False, hash=False)
    delay_s: float = field(default=0.0, compare=False)

    def compile(self, target: str) -> tuple[str, str]:
        time.sleep(self.delay_s)
        self.compiles.append(target)
        return (self.name, target)


def test_same_spec_and_arch_compiles_once() -> None:
    spec, before = FakeSpec("same"), cache.compile_count()
    first = cache.compiled(spec, "sm_80")
    again = cache.compiled(FakeSpec("same", spec.compiles), "sm_80")  # equal, not identical
    assert first == ("same", "sm_80")
    assert again is first
    assert spec.compiles == ["sm_80"]
    assert cache.compile_count() == before + 1


def test_each_arch_compiles_separately() -> None:
    spec, before = FakeSpec("per-arch"), cache.compile_count()
    results = [cache.compiled(spec, target) for target in arch.SUPPORTED_ARCHS * 2]
    assert spec.compiles == list(arch.SUPPORTED_ARCHS)
    assert results[: len(arch.SUPPORTED_ARCHS)] == [("per-arch", t) for t in arch.SUPPORTED_ARCHS]
    assert cache.compile_count() == before + len(arch.SUPPORTED_ARCHS)


def test_unknown_arch_is_not_compiled() -> None:
    spec, before = FakeSpec("bad-arch"), cache.compile_count()
    with pytest.raises(ValueError, match="arch: expected one of"):
        cache.compiled(spec, "sm_100a")
    assert spec.compiles == []
    assert cache.compile_count() == before


def test_concurrent_first_use_compiles_once() -> None:
    spec = FakeSpec("threads", delay_s=0.05)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.compiled(spec, "sm_90a")))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert spec.compiles == ["sm_90a"]
    assert results == [("threads", "sm_90a")] * 8
