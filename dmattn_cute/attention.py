"""Public entry point: validate once, then run the kernels (CUDA tensors in eager mode:
ops.eager_attention) or call the ``dmattn_cute::fwd`` op (traced, fake, or not CUDA; see
ops.py), which runs the CuTe kernels on CUDA tensors and the float32 reference elsewhere.
An eager forward that autograd does not record is routed: its layouts' validation, problem
and launch route (kernels/fwd_launch.py's forward_route) are remembered by a key of them, so
a repeated call only allocates its outputs and launches (_routing_key)."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from dmattn_cute.block_mask import check_block_mask, with_block_mask
from dmattn_cute.decode import decode_step
from dmattn_cute.jit.arch import ARCH_ENV, KERNELS_ENV
from dmattn_cute.jit.cache import holds_kernels
from dmattn_cute.kernels.fwd_launch import forward_route, run_route
from dmattn_cute.memo import capturing, remember
from dmattn_cute.ops import attention_fwd, eager_attention, eager_cuda
from dmattn_cute.problem import (
    broadcast_layout,
    broadcast_view,
    check_bool,
    check_problem,
)
from dmattn_cute.topw import check_key_expiry, with_key_expiry

# Routed eager forwards: (problem, route, the mask's and bias's broadcast layouts) by routing
# key (_routing_key), so that a repeated call is neither validated nor planned again (the key
# holds all that both depend on); held with the kernels' memory cache, whose clearing empties
# it.
_ROUTED: dict[tuple, tuple] = holds_kernels({})
_ROUTED_MAX = 256
_SCALAR_TYPES = (int, float, bool, type(None))


def _routing_key(
    query, key, value, attn_mask, attn_bias, scalars: tuple, block_mask, key_expiry
) -> tuple | None:
    """What an eager forward call's validation, problem and route (fwd_launch.forward_route)
    depend on: each tensor's shape, strides, dtype, device and 16-byte alignment (a block
    mask's shape, dtype and device), the scalars with their types (as call_signature keys
    them), and the environment's arch and kernel choice. None for a call no route serves: not
    eager CUDA, with an expiry, recorded by autograd, or while a CUDA graph is captured.
    Written flat (no generator, no helper per tensor): it runs on every call."""
    if key_expiry is not None or not eager_cuda(query):
        return None
    grad = torch.is_grad_enabled()
    parts = []
    for t in (query, key, value, attn_mask, attn_bias):
        if t is None:
            parts.append(None)
        elif type(t) is not Tensor or (grad and t.requires_grad):
            return None  # a subclass (which may describe itself otherwise), or autograd's call
        else:
            parts.append((t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16))
    if block_mask is not None:
        if type(block_mask) is not Tensor:
            return None
        parts.append((block_mask.shape, block_mask.dtype, block_mask.get_device()))
    softmax_scale, is_causal, softcap, window_size, deterministic = scalars
    if type(window_size) is not tuple or len(window_size) != 2:
        return None
    kinds = tuple(map(type, (softmax_scale, is_causal, softcap, deterministic, *window_size)))
    for kind in kinds:
        if kind not in _SCALAR_TYPES:
            return None
    if capturing():
        return None
    parts += (scalars, kinds, os.environ.get(ARCH_ENV), os.environ.get(KERNELS_ENV))
    return tuple(parts)


def _storage_view(bias: Tensor) -> Tensor:
    """An expand()ed bias that requires grad, re-viewed as the storage it reads.

    `b.expand(B, H, S, S)` of a `[B, H, 1, S]` tensor has stride 0 on the expanded dims; its
    gradient as a `[B, H, S, S]` tensor would need an attention-sized buffer, only for
    autograd's expand backward to sum it back. Viewed from its base with size 1 on those dims
    (same storage, same strides), the op reduces dbias in the kernel, into a buffer no larger
    than the base, and autograd passes it straight to the base. Other biases pass unchanged,
    and so does every bias under torch.compile, which cannot trace a storage offset: there an
    expanded bias's gradient goes through autograd's expand (pass the unexpanded bias).
    """
    if torch.compiler.is_compiling():
        return bias
    base = bias._base
    expanded = any(st == 0 and n > 1 for n, st in zip(bias.shape, bias.stride(), strict=True))
    if not (expanded and bias.requires_grad and base is not None and base.requires_grad):
        return bias
    shape = [1 if st == 0 else n for n, st in zip(bias.shape, bias.stride(), strict=True)]
    return base.as_strided(shape, bias.stride(), bias.storage_offset())


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
    *,
    block_mask: Tensor | None = None,
    key_expiry: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Flash dynamic mask attention, the function SPEC.md defines.

    query: [B, Sq, H, D]; key, value: [B, Sk, Hkv, D] (fp16 or bf16, H % Hkv == 0).
    attn_mask (bool, True = attend) and attn_bias (query's dtype or float32): [Bm, Hm, Qm, Km]
    or 3-D [Bm, Hm, Km], broadcast with Bm in {1, B}, Hm in {1, Hkv, H}, Qm in {1, Sq},
    Km in {1, Sk}. Returns out [B, Sq, H, D] in query's dtype, and with return_lse also
    lse [B, H, Sq] float32 (natural log; not differentiable). Differentiable in query, key,
    value and attn_bias (dbias has attn_bias's shape and dtype).
    block_mask (keyword only, beyond SPEC.md): bool [Bm, Hm, Mq, Mk] of 128 x 128 (query,
    key) blocks, ANDed with the rest (dmattn_cute/block_mask.py): a mask that long sequences
    can hold. key_expiry (keyword only, beyond SPEC.md): int32 [Be, He, Sk], Be in {1, B},
    He in {1, Hkv, H}: query i keeps key j only while i + Sk - Sq < key_expiry[b, h, j],
    ANDed with the rest; with is_causal=True, topw.topw_expiry's rows give each query its top
    w keys by a per-key score (dmattn_cute/topw.py). As int64, key ranges: first row << 32 |
    expiry, query i keeping key j while first row <= i + Sk - Sq < expiry (e.g. packed
    sequences, dmattn_cute/varlen.py). Raises TypeError / ValueError on bad input before any
    work is done.
    """
    scalars = (softmax_scale, is_causal, softcap, window_size, deterministic)
    routing = _routing_key(query, key, value, attn_mask, attn_bias, scalars, block_mask, key_expiry)
    routed = None if routing is None else _ROUTED.get(routing)
    if routed is not None:  # validated and planned before
        check_bool("return_lse", return_lse)
        problem, route, mask_view, bias_view = routed
        mask = attn_mask  # the broadcast views, as_strided where they are new views
        if mask_view is not None:
            mask = attn_mask.as_strided(*mask_view, attn_mask.storage_offset())
        bias = attn_bias
        if bias_view is not None:
            bias = attn_bias.as_strided(*bias_view, attn_bias.storage_offset())
        out, lse, _ = run_route(route, problem, query, key, value, mask, bias, block_mask)
        return (out, lse) if return_lse else out
    problem = check_problem(query, key, value, attn_mask, attn_bias, *scalars)
    check_bool("return_lse", return_lse)
    if block_mask is not None:
        check_block_mask(
            block_mask, problem.batch, problem.num_heads, problem.num_heads_kv,
            problem.seqlen_q, problem.seqlen_k, query.device,
        )  # fmt: skip
    if key_expiry is not None:
        check_key_expiry(
            key_expiry, problem.batch, problem.num_heads, problem.num_heads_kv,
            problem.seqlen_k, query.device,
        )  # fmt: skip
    if attn_bias is not None:
        attn_bias = _storage_view(attn_bias)
    if eager_cuda(query):
        if block_mask is None and key_expiry is None:
            decoded = decode_step(problem, query, key, value, attn_mask, attn_bias)
            if decoded is not None:
                return decoded if return_lse else decoded[0]
        if routing is not None and problem.seqlen_q > 1:  # (decode steps are decode_step's)
            mask, bias = broadcast_view(attn_mask), broadcast_view(attn_bias)
            route = forward_route(problem, query, key, value, mask, bias, block_mask)
            if route is not None:
                views = broadcast_layout(attn_mask), broadcast_layout(attn_bias)
                remember(_ROUTED, routing, lambda: (problem, route, *views), _ROUTED_MAX)
        out, lse = eager_attention(
            problem, query, key, value, attn_mask, attn_bias, block_mask, key_expiry
        )
        return (out, lse) if return_lse else out
    group = problem.num_heads // problem.num_heads_kv
    if block_mask is not None:  # the ops take element masks
        attn_mask = with_block_mask(
            attn_mask, block_mask, problem.seqlen_q, problem.seqlen_k, group
        )
    if key_expiry is not None:
        attn_mask = with_key_expiry(attn_mask, key_expiry, problem.seqlen_q, group)
    out, lse, _ = attention_fwd(
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
