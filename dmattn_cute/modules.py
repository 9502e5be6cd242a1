"""nn.Module building blocks on top of flash_dmattn_func."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.masks import create_mask


class DynamicMaskAttention(nn.Module):
    """Self-attention with a learned dynamic mask, in the style of flash-dmattn's models.

    hidden [B, S, hidden_size] -> out [B, S, hidden_size]. The layer owns the q/k/v/o
    projections and the bias source: each key gets a per-kv-head bias computed from its value,
    ``bias[b, h, j] = exp(a[h]) * softplus(bias_proj(v[b, j]))[h]``, a [B, Hkv, Sk] tensor
    broadcast over queries and query heads. It is learned through attention's dbias. Each query
    then attends to its ``keep`` visible keys of largest bias (``create_mask``); with ``keep``
    None (or >= S) every visible key is kept and no mask is built.
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
        num_kv_heads = num_kv_heads or num_heads
        head_dim = head_dim or hidden_size // num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}"
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
