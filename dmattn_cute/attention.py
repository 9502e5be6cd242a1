"""Public entry point: validate once, then run the kernels (CUDA tensors in eager mode:
ops.eager_attention) or call the ``dmattn_cute::fwd`` op (traced, fake, or not CUDA; see
ops.py), which runs the CuTe kernels on CUDA tensors and the float32 reference elsewhere."""

from __future__ import annotations

import torch
from torch import Tensor

from dmattn_cute.block_mask import check_block_mask, with_block_mask
from dmattn_cute.decode import decode_step
from dmattn_cute.ops import attention_fwd, eager_attention, eager_cuda
from dmattn_cute.problem import check_bool, check_problem
from dmattn_cute.topw import check_key_expiry, with_key_expiry


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
