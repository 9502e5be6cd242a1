"""Public entry point: validate once, then run the CuTe kernels (CUDA) or the reference (CPU)."""

from __future__ import annotations

import torch
from torch import Tensor

from dmattn_cute.kernels.bwd_launch import flash_bwd
from dmattn_cute.kernels.fwd_launch import flash_fwd
from dmattn_cute.problem import Problem, check_bool, make_problem
from dmattn_cute.reference import attention_ref


def _cuda_forward(
    problem: Problem,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor]:
    return flash_fwd(problem, query, key, value, mask, bias)


class _FlashDMAttnFunction(torch.autograd.Function):
    """The CUDA path: forward and backward kernels on validated, normalized inputs."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        problem: Problem,
    ) -> tuple[Tensor, Tensor]:
        out, lse = _cuda_forward(problem, query, key, value, mask, bias)
        ctx.save_for_backward(query, key, value, mask, bias, out, lse)
        ctx.problem = problem
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        query, key, value, mask, bias, out, lse = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dbias = flash_bwd(
            ctx.problem, dout, query, key, value, mask, bias, out, lse, bias_grad
        )
        # The mask and the problem get no gradient.
        return dq, dk, dv, None, dbias, None


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
    problem, mask, bias = make_problem(
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
    if query.device.type == "cuda":
        out, lse = _FlashDMAttnFunction.apply(query, key, value, mask, bias, problem)
    else:
        # The original bias (not its normalized view) so autograd returns dbias in its shape.
        out, lse = attention_ref(
            query,
            key,
            value,
            attn_mask,
            attn_bias,
            problem.softmax_scale,
            problem.is_causal,
            problem.softcap,
            (problem.window_left, problem.window_right),
            compute_dtype=torch.float32,
        )
        out, lse = out.to(query.dtype), lse.detach()
    return (out, lse) if return_lse else out
