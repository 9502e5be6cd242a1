"""Public entry point: validate once, then call the ``dmattn_cute::fwd`` op (see ops.py), which
runs the CuTe kernels on CUDA tensors and the float32 reference elsewhere."""

from __future__ import annotations

from torch import Tensor

from dmattn_cute.ops import attention_fwd
from dmattn_cute.problem import check_bool, check_problem


def flash_dmattn_func(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    attn_bias: Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    deterministic: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Flash dynamic mask attention, the function SPEC.md defines.

    query: [B, Sq, H, D]; key, value: [B, Sk, Hkv, D] (fp16 or bf16, H % Hkv == 0).
    attn_mask (bool, True = attend) and attn_bias (query's dtype or float32): [Bm, Hm, Qm, Km]
    or 3-D [Bm, Hm, Km], broadcast with Bm in {1, B}, Hm in {1, Hkv, H}, Qm in {1, Sq},
    Km in {1, Sk}. Returns out [B, Sq, H, D] in query's dtype, and with return_lse also
    lse [B, H, Sq] float32 (natural log; not differentiable). Differentiable in query, key,
    value and attn_bias (dbias has attn_bias's shape and dtype).
    Raises TypeError / ValueError on bad input before any work is done.
    """
    problem = check_problem(
        query,
        key,
        value,
        attn_mask,
        attn_bias,
        softmax_scale,
        is_causal,
        softcap,
        window_size,
        deterministic,
    )
    check_bool("return_lse", return_lse)
    out, lse = attention_fwd(
        query,
        key,
        value,
        attn_mask,
        attn_bias,
        problem.softmax_scale,
        problem.is_causal,
        problem.softcap,
        problem.window_left,
        problem.window_right,
        problem.deterministic,
    )
    return (out, lse) if return_lse else out
