"""The function of SPEC.md in plain PyTorch: slow, materializes [B, H, Sq, Sk] scores.

Used on CPU tensors and as the ground truth the kernels are tested against.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _per_query_head(t: Tensor, num_heads: int) -> Tensor:
    """A 3-D [Bm, Hm, Km] or 4-D [Bm, Hm, Qm, Km] mask/bias as 4-D [Bm, 1 or H, Qm, Km].

    A head dim of size Hkv (neither 1 nor H) is repeated for the query heads of each group, so
    the result broadcasts against [B, H, Sq, Sk]. Only differentiable view/copy ops are used, so
    a gradient flows back to `t` in its own shape.
    """
    if t.dim() == 3:
        t = t.unsqueeze(2)
    heads_m = t.shape[1]
    if heads_m not in (1, num_heads):
        t = t.repeat_interleave(num_heads // heads_m, dim=1)
    return t


def visible_mask(
    attn_mask: Tensor | None,
    batch: int,
    num_heads: int,
    seqlen_q: int,
    seqlen_k: int,
    is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str | None = None,
) -> Tensor:
    """Which (query, key) pairs attend: the user mask AND the causal / sliding-window band.

    attn_mask: bool [Bm, Hm, Km] or [Bm, Hm, Qm, Km] broadcastable as SPEC.md says, or None.
    Causal and window are aligned to the bottom-right corner: query i sits at key i + Sk - Sq.
    A negative window side is unbounded.
    Returns a bool tensor broadcastable to [B, H, Sq, Sk] (expanded, not materialized).
    """
    if attn_mask is not None:
        device = attn_mask.device
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    left, right = window_size
    if is_causal:
        visible &= cols <= rows
    if left >= 0:
        visible &= cols >= rows - left
    if right >= 0:
        visible &= cols <= rows + right
    if attn_mask is not None:
        visible = visible & _per_query_head(attn_mask, num_heads)
    return visible.expand(batch, num_heads, seqlen_q, seqlen_k)


def attention_ref(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    attn_bias: Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    compute_dtype: torch.dtype | None = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Dynamic-mask attention exactly as SPEC.md defines it.

    query: [B, Sq, H, D]; key, value: [B, Sk, Hkv, D] with H % Hkv == 0 (query head h reads
    kv head h // (H // Hkv)).
    attn_mask: bool, True = attend; attn_bias: float, added after softcap. Both are
    [Bm, Hm, Qm, Km] or 3-D [Bm, Hm, Km] (Qm = 1) with Bm in {1, B}, Hm in {1, Hkv, H},
    Qm in {1, Sq}, Km in {1, Sk}; expanded (stride 0) views are fine.
    compute_dtype: float32 or float64 for the ground truth. None gives the low-precision
    reference of SPEC's tolerance rule: q @ k^T and p @ v in the inputs' dtype, the softmax in
    float32 (as FlashAttention's reference with upcast=False).

    Returns out [B, Sq, H, D] (compute_dtype, or the inputs' dtype when None) and lse
    [B, H, Sq] (float64 when computing in float64, else float32). Rows with no visible key get
    out 0, lse -inf and exactly zero gradients. Differentiable in query, key, value and
    attn_bias; the bias gradient comes back in attn_bias's own shape and dtype.
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(query.shape[-1])
    matmul_dtype = compute_dtype or query.dtype
    softmax_dtype = compute_dtype or torch.float32
    _, _, v, probs, lse, _ = _probabilities(
        query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap, window_size,
        matmul_dtype, softmax_dtype,
    )  # fmt: skip
    out = probs.to(matmul_dtype) @ v  # [B, H, Sq, D]
    return out.transpose(1, 2), lse


def _probabilities(
    query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap, window_size,
    matmul_dtype, softmax_dtype,
):  # fmt: skip
    """q, k, v as [B, H, S, D] in matmul_dtype, the attention probabilities [B, H, Sq, Sk], lse
    [B, H, Sq] and the softcap's tanh (None without softcap), all as autograd-tracked ops."""
    batch, seqlen_q, num_heads, _ = query.shape
    seqlen_k, num_heads_kv = key.shape[1], key.shape[2]
    group = num_heads // num_heads_kv

    q = query.to(matmul_dtype).transpose(1, 2)  # [B, H, Sq, D]
    k = key.to(matmul_dtype).repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, Sk, D]
    v = value.to(matmul_dtype).repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, Sk, D]

    scores = (q @ k.transpose(-1, -2)).to(softmax_dtype) * softmax_scale  # [B, H, Sq, Sk]
    capped = None
    if softcap > 0:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    if attn_bias is not None:
        scores = scores + _per_query_head(attn_bias, num_heads).to(softmax_dtype)
    visible = visible_mask(
        attn_mask, batch, num_heads, seqlen_q, seqlen_k, is_causal, window_size, query.device
    )
    scores = scores.masked_fill(~visible, float("-inf"))

    # Shifting by a constant row max leaves softmax unchanged; a max of 0 on rows with no
    # finite score keeps exp() at exactly 0 there instead of exp(nan).
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    empty = row_sum == 0
    # Dividing by 1 on empty rows gives p = 0 with finite gradients (never 0 / 0).
    row_sum = row_sum.masked_fill(empty, 1.0)
    probs = weights / row_sum
    lse = (row_max + torch.log(row_sum)).masked_fill(empty, float("-inf")).squeeze(-1)
    return q, k, v, probs, lse, capped


def _sum_to_shape(t: Tensor, shape: torch.Size) -> Tensor:
    """t [B, H, Sq, Sk] summed down to a mask/bias shape (3-D or 4-D, broadcast, Hm = Hkv)."""
    shape4 = (shape[0], shape[1], 1, shape[2]) if len(shape) == 3 else tuple(shape)
    batch, heads = t.shape[:2]
    if shape4[1] not in (1, heads):  # Hkv: sum the query heads of each group
        t = t.view(batch, shape4[1], heads // shape4[1], *t.shape[2:]).sum(2)
    dims = [d for d in range(4) if shape4[d] == 1 and t.shape[d] != 1]
    t = t.sum(dims, keepdim=True) if dims else t
    return t.reshape(shape)


def attention_ref_backward(
    dout: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    attn_bias: Tensor | None,
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    window_size: tuple[int, int],
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """dq, dk, dv and (bias_grad) dbias of ``attention_ref(..., compute_dtype=float32)``,
    written out (no autograd), computed in float32 and returned in the inputs' shapes and
    dtypes. For callers that cannot use autograd, e.g. a torch.library op's implementation.
    """
    f32 = torch.float32
    q, k, v, probs, _, capped = _probabilities(
        query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap, window_size,
        f32, f32,
    )  # fmt: skip
    do = dout.to(f32).transpose(1, 2)  # [B, H, Sq, D]
    dv = probs.transpose(-1, -2) @ do  # [B, H, Sk, D]
    dprobs = do @ v.transpose(-1, -2)
    # Softmax backward: dS = P * (dP - rowsum(P * dP)); zero on masked keys and empty rows.
    dscores = probs * (dprobs - (probs * dprobs).sum(-1, keepdim=True))
    dbias = None
    if bias_grad and attn_bias is not None:
        dbias = _sum_to_shape(dscores, attn_bias.shape).to(attn_bias.dtype)
    if capped is not None:
        dscores = dscores * (1 - capped.square())
    dq = dscores @ k * softmax_scale
    dk = dscores.transpose(-1, -2) @ q * softmax_scale
    batch, heads, seqlen_k, head_dim = dk.shape
    heads_kv = key.shape[2]

    def per_kv_head(t: Tensor) -> Tensor:  # [B, H, Sk, D] -> [B, Sk, Hkv, D]
        t = t.view(batch, heads_kv, heads // heads_kv, seqlen_k, head_dim).sum(2)
        return t.transpose(1, 2)

    return (
        dq.transpose(1, 2).to(query.dtype),
        per_kv_head(dk).to(key.dtype),
        per_kv_head(dv).to(value.dtype),
        dbias,
    )
