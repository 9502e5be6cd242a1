"""Host side of the forward: pick the kernel variant for a problem and launch it on torch tensors.

Kernels are compiled against fake tensors that carry the variant's stride pattern and
alignment (`example_args`) and called through TVM-FFI with the torch tensors themselves: the
call checks each tensor against that pattern in C, and the kernel runs on the current torch
stream.
"""

from __future__ import annotations

import torch
from cutlass import cute

from ..jit.arch import target_arch
from ..jit.cache import compiled
from ..problem import Problem
from .fwd import DTYPES, LOG2E, FwdSpec, OperandSpec

_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.uint8: "u8",
}


def _stride_kind(stride: int) -> str:
    return "0" if stride == 0 else "1" if stride == 1 else "d"


def _operand_spec(t: torch.Tensor, seqlen_k: int) -> OperandSpec:
    """Stride pattern and the widest aligned key-dim vector of a normalized mask/bias view."""
    strides = tuple(_stride_kind(s) for s in t.stride())
    es = t.element_size()
    vec = 1
    if strides[3] == "1":
        for width in (16, 8, 4, 2):
            if width < es:
                break
            multiples = [t.data_ptr(), seqlen_k * es] + [s * es for s in t.stride()[:3]]
            if all(x % width == 0 for x in multiples):
                vec = width // es
                break
    return OperandSpec(_DTYPE_NAMES[t.dtype], strides, vec)


def _operand_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor the kernel reads: bool masks as uint8; at most one unit-stride dim."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if sum(s == 1 for s in t.stride()) > 1:
        t = t.contiguous()
    return t


def _qkv_view(t: torch.Tensor) -> torch.Tensor:
    """q/k/v/out as the kernel needs them: 16-byte aligned rows (copied only when not)."""
    aligned = t.data_ptr() % 16 == 0 and all(s != 0 and s % 8 == 0 for s in t.stride()[:3])
    return t if aligned else t.contiguous()


def forward_spec_of(
    problem: Problem, mask: torch.Tensor | None, bias: torch.Tensor | None, arch: str
) -> FwdSpec:
    """The forward variant a call runs (mask/bias: normalized 4-D views; tensors may be on the
    meta device, e.g. to list variants for an offline compile)."""
    mask = None if mask is None else _operand_view(mask)
    bias = None if bias is None else _operand_view(bias)
    return fwd_spec(problem, mask, bias, arch)


def fwd_spec(
    problem: Problem, mask: torch.Tensor | None, bias: torch.Tensor | None, arch: str
) -> FwdSpec:
    """The forward variant for a problem (mask/bias: kernel views from `_operand_view`)."""
    has_window = problem.is_causal or problem.window_left >= 0 or problem.window_right >= 0
    return FwdSpec.build(
        arch,
        _DTYPE_NAMES[problem.dtype],
        problem.head_dim,
        None if mask is None else _operand_spec(mask, problem.seqlen_k),
        None if bias is None else _operand_spec(bias, problem.seqlen_k),
        has_window,
        problem.softcap > 0,
    )


def _scalars(problem: Problem, mask, bias) -> list:
    scale = problem.softmax_scale
    if problem.softcap > 0:
        # Scores are capped before the bias is added: softmax runs on final scores.
        scale_log2, bias_scale = LOG2E, 1.0
        softcap_scale, softcap = scale / problem.softcap, problem.softcap
    else:
        scale_log2, bias_scale, softcap_scale, softcap = scale * LOG2E, 1.0 / scale, 0.0, 0.0
    unbounded = problem.seqlen_q + problem.seqlen_k
    left = problem.window_left if problem.window_left >= 0 else unbounded
    right = problem.window_right if problem.window_right >= 0 else unbounded
    if problem.is_causal:
        right = min(right, 0)
    heads = problem.num_heads
    mask_div = heads // (1 if mask is None else mask.shape[1])
    bias_div = heads // (1 if bias is None else bias.shape[1])
    return [
        scale_log2,
        bias_scale,
        softcap_scale,
        softcap,
        left,
        right,
        mask_div,
        bias_div,
        heads // problem.num_heads_kv,
    ]


def _args(q, k, v, out, lse, stats, mask, bias, scalars) -> list:
    return [q, k, v, out, lse, stats, mask, bias, *scalars]


def fake_tensor(dtype: str, strides: tuple[str, ...], align: int, stride_div: int = 1):
    """A compile-time stand-in for a gmem tensor: dynamic extents, the given stride pattern."""
    stride = [{"0": 0, "1": 1}.get(kind) for kind in strides]
    stride = [cute.sym_int64(divisibility=stride_div) if s is None else s for s in stride]
    shape = [cute.sym_int32() for _ in strides]
    return cute.runtime.make_fake_tensor(
        DTYPES[dtype], tuple(shape), tuple(stride), assumed_align=align
    )


def env_stream():
    """The compile-time stream argument: at call time TVM-FFI passes the caller's current
    torch stream (it is not an argument of the compiled function)."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def example_args(spec: FwdSpec) -> list:
    """Arguments for an offline `cute.compile` of `spec`: fake gmem tensors, placeholder scalars.

    They must match what `_args` passes at launch: q/k/v/out rows 16-byte aligned (strides
    multiples of 8), mask/bias with their stride pattern and vector alignment.
    """
    # One fake per argument: each gets its own symbolic shape and strides (a shared fake would
    # make the call require q, k, v and out to have one shape and one set of strides).
    q, k, v, out = (
        fake_tensor(spec.dtype, ("d", "d", "d", "1"), 16, stride_div=8) for _ in range(4)
    )
    lse = fake_tensor("fp32", ("d", "d", "1"), 4)
    stats = fake_tensor("fp32", ("d", "d", "d", "1"), 4)
    mask = bias = None
    if spec.mask is not None:
        mask = fake_tensor(spec.mask.dtype, spec.mask.strides, spec.mask.vec, spec.mask.vec)
    if spec.bias is not None:
        elem = DTYPES[spec.bias.dtype].width // 8
        bias = fake_tensor(spec.bias.dtype, spec.bias.strides, spec.bias.vec * elem, spec.bias.vec)
    scalars = [1.0, 1.0, 0.0, 0.0, 0, 0, 1, 1, 1]
    return [q, k, v, out, lse, stats, mask, bias, *scalars, env_stream()]


def flash_fwd(
    problem: Problem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward on CUDA tensors; returns out [B, Sq, H, D], lse [B, H, Sq] fp32 and
    the backward's softmax stats [B, H, 2, Sq] fp32 (per row: the max score in accumulator
    units and log2 of the row sum; a kernel without a bias folds the max into the sum and
    stores 0 as the max; see kernels/softmax.py).

    mask/bias are the normalized 4-D views of `problem.make_problem`; out/lse/stats may be
    given (e.g. poisoned by tests) and are written in place.
    """
    q, k, v = _qkv_view(q), _qkv_view(k), _qkv_view(v)
    mask = None if mask is None else _operand_view(mask)
    bias = None if bias is None else _operand_view(bias)
    arch = target_arch(q.device)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        lse = torch.empty(
            problem.batch, problem.num_heads, problem.seqlen_q, dtype=torch.float32, device=q.device
        )
    if stats is None:
        stats = torch.empty(
            problem.batch, problem.num_heads, 2, problem.seqlen_q, dtype=torch.float32,
            device=q.device,
        )  # fmt: skip
    spec = fwd_spec(problem, mask, bias, arch)
    kernel = compiled(spec, arch)
    kernel(*_args(q, k, v, out, lse, stats, mask, bias, _scalars(problem, mask, bias)))
    return out, lse, stats


__all__ = [
    "env_stream",
    "example_args",
    "fake_tensor",
    "flash_fwd",
    "forward_spec_of",
    "fwd_spec",
]
