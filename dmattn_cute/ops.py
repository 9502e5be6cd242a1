"""The torch.library ops ``dmattn_cute::fwd`` and ``dmattn_cute::bwd``, and the eager path.

The ops make the attention a single opaque node for autograd, FakeTensor/meta tracing and
``torch.compile``: the fake implementations give the exact output shapes, dtypes and strides
without running anything, and the forward op's autograd formula calls the backward op.
On CUDA tensors the ops launch the CuTe kernels; on other devices they run the float32
reference (the backward differentiates it), so the same graph works on a CPU.

Eager calls on CUDA tensors (not traced, not under a FakeTensor mode) go through
``EagerAttention``, an autograd.Function that launches the same kernels with the same
autograd formula, without the op dispatcher: on an H100 host each op call cost 0.1-0.2 ms of
CPU over the launch code itself, more than the GPU time of a sparse forward + backward. A
call that autograd does not record (``eager_attention``) launches the forward alone.

The ops trust their arguments: flash_dmattn_func validates every call (SPEC.md's errors)
before it reaches them. mask and bias are passed as the caller gave them (3-D or 4-D,
broadcast, expanded): the ops normalize them, and dbias comes back in the bias's own shape
and dtype. Ops cannot return an
optional tensor, so a dbias that was not asked for is an empty tensor (no attention-sized
allocation), which the autograd formula turns into None.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dmattn_cute.jit.arch import target_arch
from dmattn_cute.kernels.bwd_launch import flash_bwd
from dmattn_cute.kernels.fwd_launch import flash_fwd
from dmattn_cute.kernels.paired_bits import paired_bits
from dmattn_cute.problem import Problem, broadcast_view, check_device
from dmattn_cute.reference import attention_ref, attention_ref_backward


def _problem(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None,
    attn_bias: Tensor | None,
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    window_left: int,
    window_right: int,
    deterministic: bool,
) -> tuple[Problem, Tensor | None, Tensor | None]:
    """The problem and the 4-D mask/bias views of an op's arguments."""
    # flash_dmattn_func validated these arguments (check_problem) before calling the op, so
    # they are only described here; the device is checked again because under torch.compile
    # validation ran at trace time.
    if query.device.type == "cuda":
        check_device(query.device)
    problem = Problem.from_tensors(
        query,
        key,
        softmax_scale=softmax_scale,
        is_causal=is_causal,
        softcap=softcap,
        window_left=window_left,
        window_right=window_right,
        deterministic=deterministic,
    )
    return problem, broadcast_view(attn_mask), broadcast_view(attn_bias)


def _reference(query, key, value, attn_mask, attn_bias, problem: Problem) -> tuple[Tensor, Tensor]:
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
    return out.to(query.dtype), lse


def eager_cuda(query: Tensor) -> bool:
    """Kernels launched directly (no op): a plain CUDA tensor (not a FakeTensor or another
    subclass) outside torch.compile's tracing."""
    return (
        type(query) in (Tensor, torch.nn.Parameter)
        and query.is_cuda
        and not torch.compiler.is_compiling()
    )


@torch.library.custom_op("dmattn_cute::fwd", mutates_args=())
def attention_fwd(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    attn_bias: Tensor | None,
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    window_left: int,
    window_right: int,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """out [B, Sq, H, D] (query's dtype), lse [B, H, Sq] float32 and the backward's softmax
    stats [B, H, 2, Sq] float32 (per row: max score, log2 of the row sum; what the backward
    rebuilds P from where lse has lost the sum to rounding), all contiguous.

    ``deterministic`` does not change the forward; it is carried to the backward op.
    """
    problem, mask, bias = _problem(
        query, key, attn_mask, attn_bias, softmax_scale, is_causal, softcap, window_left,
        window_right, deterministic,
    )  # fmt: skip
    if query.device.type == "cuda":
        return flash_fwd(problem, query, key, value, mask, bias)
    out, lse = _reference(query, key, value, attn_mask, attn_bias, problem)
    # The reference backward needs no stats; these are their definition with a zero max.
    log2sum = torch.where(lse == -math.inf, math.inf, lse * math.log2(math.e))
    stats = torch.stack([torch.zeros_like(lse), log2sum], dim=2)
    return out.contiguous(), lse.contiguous(), stats


@attention_fwd.register_fake
def _attention_fwd_fake(
    query, key, value, attn_mask, attn_bias, *_
) -> tuple[Tensor, Tensor, Tensor]:
    batch, seqlen_q, heads, _ = query.shape
    out = query.new_empty(query.shape)
    lse = query.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    stats = query.new_empty((batch, heads, 2, seqlen_q), dtype=torch.float32)
    return out, lse, stats


@torch.library.custom_op("dmattn_cute::bwd", mutates_args=())
def attention_bwd(
    dout: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    attn_bias: Tensor | None,
    out: Tensor,
    stats: Tensor,
    softmax_scale: float,
    is_causal: bool,
    softcap: float,
    window_left: int,
    window_right: int,
    deterministic: bool,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (shapes and dtypes of query, key, value) and dbias (attn_bias's shape and
    dtype when ``bias_grad``, else an empty tensor), all contiguous."""
    problem, mask, bias = _problem(
        query, key, attn_mask, attn_bias, softmax_scale, is_causal, softcap, window_left,
        window_right, deterministic,
    )  # fmt: skip
    bias_grad = bias_grad and attn_bias is not None
    if query.device.type == "cuda":
        dq, dk, dv, dbias = flash_bwd(
            problem, dout, query, key, value, mask, bias, out, stats, bias_grad
        )
        # The kernels work on the 4-D view; a 3-D bias gets its gradient in its own shape.
        dbias = dbias.view(attn_bias.shape) if bias_grad else query.new_empty(0)
        return dq, dk, dv, dbias
    dq, dk, dv, dbias = attention_ref_backward(
        dout, query, key, value, attn_mask, attn_bias, problem.softmax_scale, problem.is_causal,
        problem.softcap, (problem.window_left, problem.window_right), bias_grad,
    )  # fmt: skip
    dbias = dbias.contiguous() if bias_grad else query.new_empty(0)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias


@attention_bwd.register_fake
def _attention_bwd_fake(
    dout, query, key, value, attn_mask, attn_bias, out, stats, *flags
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    bias_grad = flags[-1] and attn_bias is not None
    dbias = attn_bias.new_empty(attn_bias.shape) if bias_grad else query.new_empty(0)
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
        dbias,
    )


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
    query, key, value, attn_mask, attn_bias, *params = inputs
    out, lse, stats = output
    ctx.save_for_backward(query, key, value, attn_mask, attn_bias, out, stats)
    ctx.params = params
    ctx.mark_non_differentiable(lse, stats)
    # lse and stats get no gradient: no zero tensors of their size are made for them.
    ctx.set_materialize_grads(False)


def _backward(
    ctx, dout: Tensor, _dlse: Tensor | None, _dstats: Tensor | None
) -> tuple[Tensor | None, ...]:
    query, key, value, attn_mask, attn_bias, out, stats = ctx.saved_tensors
    bias_grad = attn_bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dbias = attention_bwd(
        dout, query, key, value, attn_mask, attn_bias, out, stats, *ctx.params, bias_grad
    )
    # No gradient for the mask or the scalar arguments.
    return dq, dk, dv, None, dbias if bias_grad else None, *([None] * len(ctx.params))


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """The eager CUDA path: flash_fwd and flash_bwd with the ops' autograd formula, for a
    problem flash_dmattn_func has validated and described (check_problem), and a block mask
    (validated) or None. The gradients the kernels sum in fp32 (dq; dk and dv where a kv
    head's query heads are split over CTAs; a summed dbias) come from one cast, as views of
    one tensor (the op returns separate tensors: its outputs may not share a storage)."""

    @staticmethod
    def forward(
        ctx, problem: Problem, query, key, value, attn_mask, attn_bias, block_mask, key_expiry
    ):  # fmt: skip
        mask, bias = broadcast_view(attn_mask), broadcast_view(attn_bias)
        # With a mask (a backward is to come: eager_attention): one block-bits pre-pass for
        # both kernels.
        bits = None
        bias_grad = attn_bias is not None and ctx.needs_input_grad[5]
        if mask is not None and block_mask is None and key_expiry is None:
            arch = target_arch(query.device)
            bits = paired_bits(problem, mask, bias, bias_grad, arch, query.device)
        out, lse, stats = flash_fwd(
            problem, query, key, value, mask, bias, block_mask=block_mask,
            bits=None if bits is None else bits[0], key_expiry=key_expiry,
        )  # fmt: skip
        ctx.bwd_bits = None if bits is None else bits[1]
        # the backward takes the same 4-D views of the mask and bias
        ctx.save_for_backward(query, key, value, mask, bias, block_mask, key_expiry, out, stats)
        ctx.problem = problem
        ctx.bias_shape = None if attn_bias is None else attn_bias.shape
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: None) -> tuple[Tensor | None, ...]:
        query, key, value, mask, bias, block_mask, key_expiry, out, stats = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[5]
        dq, dk, dv, dbias = flash_bwd(
            ctx.problem, dout, query, key, value, mask, bias, out, stats, bias_grad,
            block_mask=block_mask, bits=ctx.bwd_bits, key_expiry=key_expiry, one_storage=True,
        )  # fmt: skip
        dbias = dbias.view(ctx.bias_shape) if bias_grad else None
        return None, dq, dk, dv, None, dbias, None, None


def eager_attention(
    problem: Problem, query, key, value, attn_mask, attn_bias, block_mask, key_expiry
) -> tuple[Tensor, Tensor]:
    """out, lse of the eager CUDA path: EagerAttention where autograd records the call, else
    (no_grad, inference mode, no input that needs a gradient) flash_fwd alone, without the
    autograd.Function's host work."""
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_bias)
    ):
        return EagerAttention.apply(
            problem, query, key, value, attn_mask, attn_bias, block_mask, key_expiry
        )
    out, lse, _ = flash_fwd(
        problem, query, key, value, broadcast_view(attn_mask), broadcast_view(attn_bias),
        block_mask=block_mask, key_expiry=key_expiry,
    )  # fmt: skip
    return out, lse


__all__ = ["EagerAttention", "attention_bwd", "attention_fwd", "eager_attention", "eager_cuda"]
