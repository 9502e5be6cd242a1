"""Host side of the split-KV combine (kernels/combine.py): checks, output buffers, launch."""

from __future__ import annotations

import torch

from ..jit.arch import target_arch
from ..jit.cache import compiled
from .combine import CombineSpec
from .launch import dtype_name


def combine_spec(dtype: torch.dtype, head_dim: int) -> CombineSpec:
    """The combine variant for partial outputs of `dtype` (fp16 or bf16) and `head_dim`."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"parts: expected dtype float16 or bfloat16, got {dtype}")
    return CombineSpec.build(dtype_name(dtype), head_dim)


def combine_splits(
    parts: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Hkv, G, D] (parts' dtype) and lse [B, Hkv, G] fp32 of the chunks' partial
    outputs parts [B, splits, G, Hkv, D] and their LSEs part_lse [B, splits, Hkv, G] fp32
    (natural log, -inf for a chunk without a visible key), both on CUDA with the last dim
    contiguous. out/lse may be given (contiguous; e.g. poisoned by tests) and are written in
    place. Launches on the current torch CUDA stream."""
    if parts.dim() != 5 or part_lse.dim() != 4:
        raise ValueError(
            f"parts, part_lse: expected [B, splits, G, Hkv, D] and [B, splits, Hkv, G], got "
            f"{tuple(parts.shape)} and {tuple(part_lse.shape)}"
        )
    batch, splits, group, heads_kv, head_dim = parts.shape
    if part_lse.shape != (batch, splits, heads_kv, group) or part_lse.dtype != torch.float32:
        raise ValueError(
            f"part_lse: expected float32 [{batch}, {splits}, {heads_kv}, {group}], got "
            f"{part_lse.dtype} {tuple(part_lse.shape)}"
        )
    if not parts.is_cuda or part_lse.device != parts.device:
        raise ValueError(
            f"parts, part_lse: expected both on one CUDA device, got {parts.device} and "
            f"{part_lse.device}"
        )
    if parts.stride(-1) != 1 or part_lse.stride(-1) != 1:
        raise ValueError("parts, part_lse: expected the last dim contiguous")
    spec = combine_spec(parts.dtype, head_dim)
    for name, given, shape, dtype in (
        ("out", out, (batch, heads_kv, group, head_dim), parts.dtype),
        ("lse", lse, (batch, heads_kv, group), torch.float32),
    ):
        if given is not None and (
            given.shape != shape or given.dtype != dtype or given.device != parts.device
            or not given.is_contiguous()
        ):  # fmt: skip
            raise ValueError(
                f"{name}: expected a contiguous {dtype} {shape} on {parts.device}, got "
                f"{given.dtype} {tuple(given.shape)} on {given.device}"
            )
    if out is None:
        out = torch.empty(batch, heads_kv, group, head_dim, dtype=parts.dtype, device=parts.device)
    if lse is None:
        lse = torch.empty(batch, heads_kv, group, dtype=torch.float32, device=parts.device)
    if out.numel() == 0:
        return out, lse
    kernel = compiled(spec, target_arch(parts.device))
    with torch.cuda.device(parts.device):
        kernel(parts, part_lse, out, lse)
    return out, lse


__all__ = ["combine_spec", "combine_splits"]
