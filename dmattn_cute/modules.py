"""nn.Module building blocks on top of flash_dmattn_func."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.masks import create_mask
from dmattn_cute.problem import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, SUPPORTED_DTYPES, check_bool

# What the layer's forward can run on: the kernels' dtypes directly.
LAYER_DTYPES = SUPPORTED_DTYPES
# Parameter dtypes accepted at construction: also float32, the usual master-weight dtype that
# torch.autocast (or a later .to()) turns into one of LAYER_DTYPES.
PARAM_DTYPES = (*SUPPORTED_DTYPES, torch.float32)


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return value


def _head_dim_ok(head_dim: int) -> bool:
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0


def _check_layer_args(
    hidden_size: object,
    num_heads: object,
    num_kv_heads: object,
    head_dim: object,
    keep: object,
    is_causal: object,
    dtype: object,
) -> tuple[int, int]:
    """Validates DynamicMaskAttention's constructor arguments, each error naming the argument;
    returns (num_kv_heads, head_dim) with their defaults filled in."""
    hidden_size = _positive_int("hidden_size", hidden_size)
    num_heads = _positive_int("num_heads", num_heads)
    num_kv_heads = (
        num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
    )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}"
        )
    expected = f"a multiple of {HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]"
    if head_dim is None:
        head_dim = hidden_size // num_heads
        if hidden_size % num_heads != 0 or not _head_dim_ok(head_dim):
            raise ValueError(
                f"hidden_size/num_heads: expected head_dim = hidden_size / num_heads to be "
                f"{expected}, got {hidden_size}/{num_heads} = {hidden_size / num_heads:g} "
                "(or pass head_dim)"
            )
    elif not _head_dim_ok(_positive_int("head_dim", head_dim)):
        raise ValueError(f"head_dim: expected {expected}, got {head_dim}")
    if keep is not None:
        if not isinstance(keep, int) or isinstance(keep, bool):
            raise TypeError(
                f"keep: expected None (every key) or an int >= 1, got {keep!r} "
                f"({type(keep).__name__})"
            )
        if keep < 1:
            raise ValueError(f"keep: expected None (every key) or an int >= 1, got {keep}")
    check_bool("is_causal", is_causal)
    param_dtype = torch.get_default_dtype() if dtype is None else dtype
    if param_dtype not in PARAM_DTYPES:
        given = f"{dtype}" if dtype is not None else f"None (torch's default dtype {param_dtype})"
        raise TypeError(
            "dtype: expected torch.bfloat16 or torch.float16 (or torch.float32 for weights "
            f"used under torch.autocast), got {given}"
        )
    return num_kv_heads, head_dim


class DynamicMaskAttention(nn.Module):
    """Self-attention with a learned dynamic mask, in the style of flash-dmattn's models.

    hidden [B, S, hidden_size] -> out [B, S, hidden_size]. The layer owns the q/k/v/o
    projections and the bias source: each key gets a per-kv-head bias computed from its value,
    ``bias[b, h, j] = exp(a[h]) * softplus(bias_proj(v[b, j]))[h]``, a [B, Hkv, Sk] tensor
    broadcast over queries and query heads. It is learned through attention's dbias. Each query
    then attends to its ``keep`` visible keys of largest bias (``create_mask``); with ``keep``
    None (or >= S) every visible key is kept and no mask is built.

    ``dtype``: bf16 or fp16 parameters, or float32 ones for a forward under ``torch.autocast``
    (or cast later with ``.to``). Bad arguments raise ValueError/TypeError naming the argument.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        keep: int | None = None,
        is_causal: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads, head_dim = _check_layer_args(
            hidden_size, num_heads, num_kv_heads, head_dim, keep, is_causal, dtype
        )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.keep, self.is_causal = keep, is_causal
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False, **factory)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False, **factory)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False, **factory)
        self.bias_proj = nn.Linear(num_kv_heads * head_dim, num_kv_heads, **factory)
        self.bias_log_scale = nn.Parameter(torch.zeros(num_kv_heads, **factory))

    def forward(self, hidden_states: Tensor) -> Tensor:
        batch, seqlen, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seqlen, self.num_heads, self.head_dim)
        if q.dtype not in LAYER_DTYPES:
            # float32 parameters are fine under torch.autocast, whose projections give bf16/fp16.
            raise TypeError(
                f"DynamicMaskAttention: the projections gave {q.dtype} (parameters "
                f"{self.q_proj.weight.dtype}); the attention kernels take torch.bfloat16 or "
                "torch.float16: build the layer with dtype=torch.bfloat16, call "
                ".to(torch.bfloat16), or run it under torch.autocast"
            )
        v_flat = self.v_proj(hidden_states)
        k = self.k_proj(hidden_states).view(batch, seqlen, self.num_kv_heads, self.head_dim)
        v = v_flat.view(batch, seqlen, self.num_kv_heads, self.head_dim)
        # [B, S, Hkv] -> [B, Hkv, S]: one bias per (kv head, key), shared by every query.
        bias = self.bias_log_scale.exp() * F.softplus(self.bias_proj(v_flat))
        bias = bias.transpose(1, 2).contiguous()
        mask = None
        if self.keep is not None and self.keep < seqlen:
            scores = bias.detach().unsqueeze(2).expand(batch, self.num_kv_heads, seqlen, seqlen)
            mask = create_mask(scores, self.keep, is_causal=self.is_causal)
        out = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=self.is_causal)
        return self.o_proj(out.reshape(batch, seqlen, self.num_heads * self.head_dim))


__all__ = ["DynamicMaskAttention"]
