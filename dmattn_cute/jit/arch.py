"""Target architecture of a device and the per-architecture limits kernels are sized against.

The CuTe DSL reads ``CUTE_DSL_ARCH`` once per process (the value is cached when the DSL is
imported), so the target is never switched through the environment here. Every compile names
its architecture explicitly with the ``--gpu-arch`` compile option (see ``compile_options``),
which sets both the codegen target and the DSL's trace-time architecture checks for that one
``cute.compile`` call; several architectures can be compiled in a row in one process.
"""

import functools
import os

import torch

SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
ARCH_ENV = "DMATTN_CUTE_ARCH"
# "mma_sync": run the SM80-family (mma.sync) kernels on sm_90a too, instead of the Hopper
# (wgmma) ones: the portable kernels tested on a Hopper GPU, or a fallback.
KERNELS_ENV = "DMATTN_CUTE_KERNELS"

# sm_87 (Orin) runs sm_86 code; sm_90a is the arch-specific Hopper target (wgmma, setmaxnreg),
# valid on compute capability 9.0 only.
_ARCH_OF_CAPABILITY = {
    (8, 0): "sm_80",
    (8, 6): "sm_86",
    (8, 7): "sm_86",
    (8, 9): "sm_89",
    (9, 0): "sm_90a",
}

# Opt-in shared memory per block, in bytes (the DSL's own table for these targets).
_SMEM_CAPACITY = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_89": 99 * 1024,
    "sm_90a": 227 * 1024,
}


def _supported_capabilities() -> str:
    return ", ".join(f"{major}.{minor}" for major, minor in _ARCH_OF_CAPABILITY)


def check_arch(arch: str) -> str:
    """Returns ``arch`` if it is one of ``SUPPORTED_ARCHS``, else raises ValueError."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {', '.join(SUPPORTED_ARCHS)}, got {arch!r}")
    return arch


def arch_for_capability(major: int, minor: int) -> str:
    """The compile target for a CUDA compute capability, e.g. (8, 6) -> "sm_86"."""
    if (major, minor) < (8, 0):
        raise ValueError(
            f"compute capability {major}.{minor} is not supported: dmattn_cute needs 8.0 or "
            f"newer (supported: {_supported_capabilities()})"
        )
    arch = _ARCH_OF_CAPABILITY.get((major, minor))
    if arch is None:
        raise ValueError(
            f"compute capability {major}.{minor} is not supported yet "
            f"(supported: {_supported_capabilities()})"
        )
    return arch


def target_arch(device: torch.device | None = None) -> str:
    """The architecture to compile for: ``$DMATTN_CUTE_ARCH`` if set (offline builds), else the
    architecture of ``device`` (default: the current CUDA device)."""
    override = os.environ.get(ARCH_ENV)
    if override:
        if override not in SUPPORTED_ARCHS:
            raise ValueError(
                f"{ARCH_ENV}: expected one of {', '.join(SUPPORTED_ARCHS)}, got {override!r}"
            )
        return override
    if device is not None and device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    if device is not None and device.index is not None:
        return device_arch(device.index)  # a CUDA tensor's device: no availability query
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"no CUDA device to compile for; set {ARCH_ENV} to one of "
            f"{', '.join(SUPPORTED_ARCHS)} to compile offline"
        )
    if device is None or device.index is None:
        return device_arch(torch.cuda.current_device())
    return device_arch(device.index)


@functools.cache
def device_arch(index: int) -> str:
    """The compile target of CUDA device ``index``; ValueError if the kernels have none."""
    # Asking the driver costs microseconds on every launch; a device's capability never changes.
    # (A ValueError is not cached: functools.cache stores results only.)
    return arch_for_capability(*torch.cuda.get_device_capability(index))


def smem_capacity(arch: str) -> int:
    """Shared memory one block may use on ``arch``, in bytes."""
    return _SMEM_CAPACITY[check_arch(arch)]


def compile_options(arch: str, extra: str = "") -> str:
    """The ``cute.compile`` options string that targets ``arch``, followed by ``extra``.

    Every kernel is built as a TVM-FFI function: it takes torch tensors directly and checks
    them against its compiled stride pattern in C, which costs microseconds per call where
    converting each tensor through DLPack in Python costs tens.
    """
    return f"--gpu-arch {check_arch(arch)} --enable-tvm-ffi {extra}".strip()


def dependent_launch(arch: str) -> bool:
    """Whether kernels compiled for `arch` chain by programmatic dependent launch (PDL: the
    next kernel in the stream starts while this one finishes, and waits in griddepcontrol
    before touching memory): sm_90a, where the griddepcontrol instructions exist."""
    return check_arch(arch) == "sm_90a"


def hopper_kernels(arch: str) -> bool:
    """Whether calls compiled for `arch` run the Hopper (wgmma) kernel families: on sm_90a,
    unless ``$DMATTN_CUTE_KERNELS`` is ``mma_sync``."""
    if arch != "sm_90a":
        return False
    choice = os.environ.get(KERNELS_ENV, "")
    if choice not in ("", "mma_sync"):
        raise ValueError(f"{KERNELS_ENV}: expected unset or 'mma_sync', got {choice!r}")
    return choice != "mma_sync"
