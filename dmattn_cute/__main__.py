"""`python -m dmattn_cute`: a short end-to-end run of what this machine can do.

On a CUDA GPU: a masked, biased forward checked against the float32 reference and timed, then
forward + backward (with the bias gradient) timed. On a CPU-only machine: the reference path,
then offline compiles of the kernels the GPU run launches (planned as a launch plans them) for
every supported architecture (no GPU needed), saying so.
"""

from __future__ import annotations

import time

import torch

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.jit import SUPPORTED_ARCHS
from dmattn_cute.precompile import planned_kernels
from dmattn_cute.reference import attention_ref

# The GPU run's problem: B2 H16 Hkv4 S4096 D128.
SIZES = (2, 4096, 16, 4, 128)
KERNELS = {"fwd": "forward", "bwd_pre": "backward preprocess", "bwd": "backward"}


def _inputs(device: str, b: int, s: int, h: int, hkv: int, d: int):
    q = torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device=device, dtype=torch.bfloat16)
    mask = torch.rand(b, hkv, s, s, device=device) < 0.3
    bias = torch.randn(b, hkv, 1, s, device=device, dtype=torch.bfloat16)
    return q, k, v, mask, bias


def _gpu() -> None:
    q, k, v, mask, bias = _inputs("cuda", *SIZES)
    start = time.perf_counter()
    out = flash_dmattn_func(q, k, v, mask, bias)
    torch.cuda.synchronize()
    print(f"first call (compile + run): {time.perf_counter() - start:.2f} s")
    ref, _ = attention_ref(q[:1, :512], k[:1], v[:1], mask[:1, :, :512], bias[:1])
    err = (out[:1, :512].float() - ref).abs().max().item()
    print(f"max |out - reference| on a slice: {err:.2e}")
    flops = 4 * q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] * q.shape[3]
    name = torch.cuda.get_device_name()
    ms = _median_ms(lambda: flash_dmattn_func(q, k, v, mask, bias))
    print(
        f"{name}: forward B2 H16 Hkv4 S4096 D128 bf16, bias + mask (density 0.3): "
        f"{ms:.3f} ms median, {flops / ms / 1e9:.1f} TFLOP/s dense-equivalent"
    )
    for t in (q, k, v, bias):
        t.requires_grad_(True)
    dout = torch.randn_like(q)
    ms = _median_ms(lambda: flash_dmattn_func(q, k, v, mask, bias).backward(dout))
    print(
        f"{name}: forward + backward (dq, dk, dv, dbias), same problem: {ms:.3f} ms median, "
        f"{3.5 * flops / ms / 1e9:.1f} TFLOP/s dense-equivalent"
    )


def _median_ms(fn) -> float:
    """Median CUDA-event time of 20 calls, after one warm-up call (the compile)."""
    fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for _ in range(20):
        events[0].record()
        fn()
        events[1].record()
        torch.cuda.synchronize()
        times.append(events[0].elapsed_time(events[1]))
    return sorted(times)[len(times) // 2]


def _cpu() -> None:
    print("no CUDA GPU: running the PyTorch reference path and offline kernel compiles")
    q, k, v, mask, bias = _inputs("cpu", 1, 64, 4, 2, 64)
    bias.requires_grad_(True)
    out = flash_dmattn_func(q, k, v, mask, bias, is_causal=True)
    out.float().sum().backward()
    print(
        f"reference forward/backward on CPU: out {tuple(out.shape)}, "
        f"dbias {tuple(bias.grad.shape)} {bias.grad.dtype}"
    )
    # The kernels the GPU run launches, planned on meta tensors by the launches' own code.
    q, k, v, mask, bias = _inputs("meta", *SIZES)
    for arch in SUPPORTED_ARCHS:
        for kind, spec in planned_kernels(arch, q, k, v, mask, bias):
            start = time.perf_counter()
            spec.compile(arch)
            detail = ""
            if hasattr(spec, "tile"):  # the preprocess has no tile table
                detail = f": tile {spec.tile}, {spec.smem_bytes() // 1024} KiB shared memory"
            print(
                f"compiled the {KERNELS[kind]} (D=128, mask + bias) for {arch} offline in "
                f"{time.perf_counter() - start:.1f} s{detail}"
            )


if __name__ == "__main__":
    if torch.cuda.is_available():
        _gpu()
    else:
        _cpu()
