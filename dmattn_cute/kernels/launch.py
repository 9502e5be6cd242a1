"""The torch side shared by every launch: the tensors a kernel reads, the compile-time facts of
them (dtype names, stride patterns, vector alignment) that pick its variant, and its scalar
arguments, named as the kernel names them.
"""

from __future__ import annotations

import functools
from typing import TypeVar

import torch

from ..problem import Problem
from .spec import LOG2E, OperandSpec

_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int32: "i32",  # a mask of top-w expiry rows (kernels/expiry_launch.py)
    torch.int64: "i64",  # a mask of key ranges: first row << 32 | expiry (the same)
}

Scalars = TypeVar("Scalars", bound=tuple)


def dtype_name(dtype: torch.dtype) -> str:
    """The name specs use for `dtype` (see spec.DTYPES)."""
    return _DTYPE_NAMES[dtype]


def stride_kinds(t: torch.Tensor) -> tuple[str, ...]:
    """Per dim "0" (broadcast), "1" (unit) or "d" (any other stride), as OperandSpec's."""
    return tuple("0" if s == 0 else "1" if s == 1 else "d" for s in t.stride())


def operand_spec(t: torch.Tensor | None, seqlen_k: int) -> OperandSpec | None:
    """Stride pattern and the widest aligned key-dim vector of a mask/bias kernel view
    (operand_view); None for None."""
    if t is None:
        return None
    strides = stride_kinds(t)
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
    return OperandSpec(dtype_name(t.dtype), strides, vec)


def operand_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor a kernel reads for a 4-D mask/bias view (problem.broadcast_view): bool masks
    as uint8; at most one unit-stride dim. None for None."""
    if t is None:
        return None
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if sum(s == 1 for s in t.stride()) > 1:
        t = t.contiguous()
    return t


def qkv_view(t: torch.Tensor) -> torch.Tensor:
    """q/k/v/out as the kernels need them: 16-byte aligned rows (copied only when not; a
    contiguous tensor at a misaligned address too, which contiguous() would return as is)."""
    aligned = t.data_ptr() % 16 == 0 and all(s != 0 and s % 8 == 0 for s in t.stride()[:3])
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


def kernel_layout(t: torch.Tensor | None) -> tuple | None:
    """What a mask/bias kernel view contributes to a variant (operand_spec) and to its block
    bits: the key of the launch plans that remember them."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16)


def kernel_scalars(
    kind: type[Scalars],
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> Scalars:
    """The scalar arguments of a kernel whose NamedTuple of them is `kind` (e.g. FwdScalars),
    for `problem` with these mask/bias views; each field is taken by its name."""
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
    values = {
        "scale_log2": scale_log2,
        "bias_scale": bias_scale,
        "softcap_scale": softcap_scale,
        "softcap": softcap,
        "softmax_scale": scale,
        "window_left": left,
        "window_right": right,
        "mask_head_div": heads // (1 if mask is None else mask.shape[1]),
        "bias_head_div": heads // (1 if bias is None else bias.shape[1]),
        "group": heads // problem.num_heads_kv,
        "key_chunks": 1,  # fwd_launch.flash_fwd sets its own
    }
    return kind(**{name: values[name] for name in kind._fields})


# SMs of an architecture's largest GPU (H100/H200 SXM), for plans made without a GPU.
_PLANNING_SMS = {"sm_90a": 132}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, arch: str) -> int:
    """SMs of `device`, or of `arch`'s largest GPU for a device that is not CUDA (planning)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return _PLANNING_SMS.get(arch, 108)
