"""flash_dmattn_func as a Hugging Face transformers attention implementation.

    from dmattn_cute.integrations.transformers import register
    register()  # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dmattn_cute",
                                                 dtype=torch.bfloat16)

`attention_forward` follows transformers' attention interface: it takes the module's
[B, H, Sq, D] query and [B, Hkv, Sk, D] key/value (GQA read natively, no repeat_kv) and the
4-D mask the model built, and returns ([B, Sq, H, D], None). A model written for dynamic mask
attention passes two more keyword arguments from its attention module: `attention_bias`, a
per-key (or per-query-and-key) bias, and `keep_window_size`, the number of keys each query
keeps, chosen by that bias among the keys it may see.

This module imports transformers only in `register`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.masks import create_mask
from dmattn_cute.problem import SUPPORTED_DTYPES

ATTN_IMPLEMENTATION = "dmattn_cute"


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register `attention_forward` with transformers under `name` and return the name, to pass
    as `attn_implementation`.

    The name is also given sdpa's mask builder: transformers builds no mask at all for an
    attention implementation its mask interface does not know, which would drop padding.
    sdpa's builder gives a bool [B, 1, Sq, Sk] mask (causal, sliding window and padding in
    it), or None where the causal flag alone is exact.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attention_bias: Tensor | None = None,
    keep_window_size: int | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Attention of one transformers attention module through flash_dmattn_func.

    query: [B, H, Sq, D]; key, value: [B, Hkv, Sk, D] (bf16 or fp16; float32 only under
    torch.autocast, which gives the dtype). attention_mask: the model's 4-D mask, bool
    (True = attend) or additive float, [B or 1, 1 or Hkv or H, Sq, Sk], or None. When present
    it is the whole truth about which keys a query sees (causal, sliding window, padding), as
    torch SDPA reads it. When None, `is_causal` (else `module.is_causal`, default True) and
    `sliding_window` apply as transformers' masks draw them (i - sliding_window < j <= i when
    causal, |i - j| <= sliding_window when not), and a causal prefill into a longer static
    cache sees only the first Sq keys (transformers' top-left convention without a mask).
    scaling: softmax scale (default 1/sqrt(D)); softcap: None or 0 is off.
    attention_bias: float [B, Hm, Sk] or [B, Hm, Sq or 1, Sk] (Hm in 1, Hkv, H), added to the
    scores after softcap (with an additive mask, the two are summed). keep_window_size: keep
    per query the keep_window_size keys of largest bias among those it sees (causal-aware);
    needs attention_bias, no effect when >= Sk.
    Returns (out [B, Sq, H, D] in the compute dtype, None: no attention weights).
    Raises ValueError for dropout > 0, attention sinks (`s_aux`) and a paged cache
    (continuous batching), which this attention does not compute, and TypeError for float32
    inputs outside autocast.
    """
    if dropout > 0:
        raise ValueError(
            f"dmattn_cute attention: attention dropout is not supported, got dropout={dropout} "
            f"(module {type(module).__name__}, training={module.training}); set the config's "
            "attention_dropout to 0.0, or use another attn_implementation to train with it"
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError("dmattn_cute attention: attention sinks (s_aux) are not supported")
    if kwargs.get("cache") is not None:
        # The paged cache of continuous batching is updated by the attention function itself.
        raise ValueError(
            "dmattn_cute attention: continuous batching (a paged cache) is not supported"
        )
    query, key, value = _compute_dtype(query, key, value)
    # [B, H, S, D] -> [B, S, H, D]: views, the last dim stays contiguous.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    seqlen_q = q.shape[1]

    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = (-1, -1)
    if attention_mask is not None:
        causal = False  # the mask already holds it, and may deviate from it (bidirectional spans)
    else:
        if causal and 1 < seqlen_q < k.shape[1]:
            # Prefill into an empty static cache: the keys after the first Sq are empty slots.
            k, v = k[:, :seqlen_q], v[:, :seqlen_q]
            if attention_bias is not None and attention_bias.shape[-1] > 1:
                attention_bias = attention_bias[..., :seqlen_q]
        if sliding_window is not None:
            # As transformers' sliding-window masks: causal i - sw < j <= i, else |i - j| <= sw.
            window = (sliding_window - 1, -1) if causal else (sliding_window, sliding_window)

    mask, bias = _mask_and_bias(attention_mask, attention_bias, q.dtype)
    if keep_window_size is not None:
        if attention_bias is None:
            raise ValueError(
                "keep_window_size: needs attention_bias, the scores the keys are kept by"
            )
        if keep_window_size < k.shape[1]:
            mask = _keep_top_keys(bias, mask, keep_window_size, causal, window, seqlen_q)
    out = flash_dmattn_func(
        q,
        k,
        v,
        attn_mask=mask,
        attn_bias=bias,
        softmax_scale=scaling,
        is_causal=causal,
        softcap=softcap or 0.0,
        window_size=window,
    )
    return out, None


def _compute_dtype(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in a dtype the kernels take: as they are, or autocast's dtype for float32."""
    device_type = query.device.type
    if query.dtype in SUPPORTED_DTYPES:
        return query, key, value
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return query.to(dtype), key.to(dtype), value.to(dtype)
    raise TypeError(
        f"dmattn_cute attention: query is {query.dtype}, the kernels take torch.bfloat16 or "
        "torch.float16: load the model with dtype=torch.bfloat16 (or float16), or run it "
        "under torch.autocast"
    )


def _mask_and_bias(
    attention_mask: Tensor | None, attention_bias: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """The bool attn_mask and float attn_bias of flash_dmattn_func: a bool mask stays the mask,
    an additive float mask (0 / finfo.min, eager's kind) joins the bias."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask, attention_bias
    if attention_mask.dim() != 4:
        raise ValueError(
            "attention_mask: expected a 4-D [B, 1, Sq, Sk] mask, got "
            f"{attention_mask.dim()}-D of shape {tuple(attention_mask.shape)}"
        )
    additive = attention_mask if attention_mask.dtype in (dtype, torch.float32) else None
    if additive is None:
        additive = attention_mask.to(torch.float32)
    if attention_bias is None:
        return None, additive
    if attention_bias.dim() == 3:
        attention_bias = attention_bias.unsqueeze(2)
    return None, additive + attention_bias


def _keep_top_keys(
    bias: Tensor,
    mask: Tensor | None,
    keep: int,
    causal: bool,
    window: tuple[int, int],
    seqlen_q: int,
) -> Tensor:
    """The bool mask of the `keep` keys of largest bias each query sees (create_mask)."""
    scores = bias.detach()
    if scores.dim() == 3:
        scores = scores.unsqueeze(2)
    if scores.shape[2] == 1 and seqlen_q > 1 and (causal or window != (-1, -1)):
        # Causal or windowed rows see different keys: each query row gets its own top keys.
        scores = scores.expand(-1, -1, seqlen_q, -1)
    return create_mask(scores, keep, attn_mask=mask, is_causal=causal, window_size=window)


__all__ = ["ATTN_IMPLEMENTATION", "attention_forward", "register"]
