"""Attention over packed variable-length sequences, in FlashAttention's `flash_attn_varlen_func`
convention, with a mask and a trainable bias.

    out = flash_dmattn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, attn_bias=bias, is_causal=True)

q is [total_q, H, D] and k, v are [total_k, Hkv, D]: sequence i holds the query rows
cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1 and the key rows cu_seqlens_k[i] ..
cu_seqlens_k[i + 1] - 1, and attends only within itself (causal and window limits aligned to
its own bottom-right corner). A mask or a bias is given either

- per key token: [Hm, total_k] (Hm in 1, Hkv, H), the same for every query of the sequence
  (e.g. a per-key dynamic-mask bias), or
- per sequence: a list of N tensors, tensor i broadcastable as flash_dmattn_func's operands
  over that sequence: [Hm, Qm, Km] (Qm in 1, Sq_i; Km in 1, Sk_i) or [Hm, Km].

Differentiable in q, k, v and the bias (dbias in the bias's shape and dtype). Nothing is
padded or copied; the packed tensors are read through views, in one of two ways:

- self-attention (cu_seqlens_q equal to cu_seqlens_k), operands per key token or none, eager
  on the Hopper kernels: one flash_dmattn_func call over all tokens as one sequence, each key
  kept for the query rows of its own sequence (its key_expiry: causal, the rows up to the
  sequence's end; else the key range of rows from its start to its end; a per-key-token mask
  folds in as an empty range). The kernels skip the tiles between sequences by their block
  bits;
- otherwise one flash_dmattn_func call per run of consecutive sequences of equal lengths (one
  batched call), so sequences of many different lengths cost one launch each. A kernel that
  walks cu_seqlens itself is the next step (issue 16).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.jit.arch import hopper_kernels, target_arch
from dmattn_cute.memo import remember_for
from dmattn_cute.ops import eager_cuda
from dmattn_cute.problem import check_bool, check_problem

Operand = Tensor | Sequence[Tensor] | None

# Host copies of recent cu_seqlens, and the expiry rows of recent packings (memo.remember_for)
_BOUNDS: dict[tuple, tuple] = {}
_EXPIRY: dict[tuple, tuple] = {}


def flash_dmattn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    attn_mask: Operand = None,
    attn_bias: Operand = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    deterministic: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of each packed sequence with itself.

    q: [total_q, H, D]; k, v: [total_k, Hkv, D]. cu_seqlens_q, cu_seqlens_k: integer [N + 1],
    starting at 0, non-decreasing, ending at total_q / total_k. max_seqlen_q / max_seqlen_k:
    at least the longest sequence (as FlashAttention takes them). attn_mask (bool) and
    attn_bias: per key token [Hm, total_k], or a list of N per-sequence operands (module
    docstring). Other arguments as flash_dmattn_func. Returns out [total_q, H, D] and, with
    return_lse, lse [H, total_q] (float32; -inf for a query whose sequence has no key, whose
    output is then 0).
    Raises TypeError / ValueError on bad input before any kernel runs.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            got = f"{t.dim()}-D" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 3-D packed tensor [total, heads, D], got {got}")
    seqlens_q = _seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    seqlens_k = _seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    if len(seqlens_q) != len(seqlens_k):
        raise ValueError(
            f"cu_seqlens_k: expected {len(seqlens_q) + 1} entries like cu_seqlens_q, got "
            f"{len(seqlens_k) + 1}"
        )
    check_bool("return_lse", return_lse)
    masks = _per_sequence("attn_mask", attn_mask, seqlens_k)
    biases = _per_sequence("attn_bias", attn_bias, seqlens_k)

    pieces = list(
        zip(q.split(seqlens_q), k.split(seqlens_k), v.split(seqlens_k), masks, biases, strict=True)
    )
    options = (softmax_scale, is_causal, softcap, window_size, deterministic)
    per_token = not any(isinstance(t, (list, tuple)) for t in (attn_mask, attn_bias))
    for i, (q_i, k_i, v_i, mask_i, bias_i) in enumerate(pieces):
        # every sequence is checked before any runs (a message names its index); with operands
        # per key token or none the sequences differ only in their lengths, on which no check
        # depends: the first with queries and keys stands for all
        if q_i.shape[0] and k_i.shape[0]:
            try:
                check_problem(
                    q_i[None], k_i[None], v_i[None], _batch(mask_i), _batch(bias_i), *options
                )
            except (TypeError, ValueError) as err:
                raise type(err)(f"sequence {i}: {err}") from err
            if per_token:
                break

    runs = _runs(seqlens_q, seqlens_k, attn_mask, attn_bias)
    if len(runs) > 1 and _as_documents(q, seqlens_q, seqlens_k, attn_mask, attn_bias):
        expiry = _document_expiry(cu_seqlens_k, seqlens_k, attn_mask, not is_causal, q.device)
        out, lse = flash_dmattn_func(
            q[None], k[None], v[None], None,
            None if attn_bias is None else attn_bias[None, :, None],
            softmax_scale=softmax_scale, is_causal=is_causal, softcap=softcap,
            window_size=window_size, deterministic=deterministic, return_lse=True,
            key_expiry=expiry,
        )  # fmt: skip
        return (out[0], lse[0]) if return_lse else out[0]
    outs, lses = [], []
    for first, last in runs:
        rows_q = slice(sum(seqlens_q[:first]), sum(seqlens_q[: last + 1]))
        count, len_q, len_k = last + 1 - first, seqlens_q[first], seqlens_k[first]
        if len_q == 0:
            continue
        if len_k == 0:  # no key: out 0, lse -inf (and no gradient flows)
            outs.append(torch.zeros_like(q[rows_q]))
            lses.append(q.new_full((q.shape[1], count * len_q), float("-inf"), dtype=torch.float32))
            continue
        rows_k = slice(sum(seqlens_k[:first]), sum(seqlens_k[: last + 1]))
        batch = (q[rows_q].unflatten(0, (count, len_q)),
                 *(t[rows_k].unflatten(0, (count, len_k)) for t in (k, v)))  # fmt: skip
        out_i, lse_i = flash_dmattn_func(
            *batch, _run_operand(attn_mask, masks, first, count, rows_k, len_k),
            _run_operand(attn_bias, biases, first, count, rows_k, len_k),
            softmax_scale=softmax_scale, is_causal=is_causal, softcap=softcap,
            window_size=window_size, deterministic=deterministic, return_lse=True,
        )  # fmt: skip
        outs.append(out_i.flatten(0, 1))
        lses.append(lse_i.transpose(0, 1).flatten(1, 2))  # [N, H, Sq] -> [H, N * Sq]
    out = torch.cat(outs) if outs else q.new_zeros(q.shape)
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros((q.shape[1], 0), dtype=torch.float32)
    return out, lse


def _as_documents(
    q: Tensor, seqlens_q: list[int], seqlens_k: list[int], attn_mask: Operand, attn_bias: Operand
) -> bool:
    """Whether the sequences run as one call over all tokens (module docstring): equal query
    and key lengths, operands per key token or none, and the Hopper kernels reading the
    expiry themselves (elsewhere it would become an element mask of total_q x total_k)."""
    return (
        seqlens_q == seqlens_k
        and all(t is None or isinstance(t, Tensor) for t in (attn_mask, attn_bias))
        and eager_cuda(q)
        and hopper_kernels(target_arch(q.device))
    )


def _document_expiry(
    cu_seqlens_k: Tensor,
    seqlens: list[int],
    attn_mask: Tensor | None,
    ranges: bool,
    device: torch.device,
) -> Tensor:
    """key_expiry [1, Hm, total] of packed sequences: int32, each key's sequence end (the
    causal call: query rows from there on belong to later sequences); with `ranges`, int64
    key ranges, its sequence's start << 32 | end. 0 (no row) where a per-key-token mask
    [Hm, total] hides the key. Remembered for the mask (or cu_seqlens_k) and the lengths,
    and with it its block bits (kernels/expiry_launch.py): every layer of a step reuses
    them."""
    anchor = cu_seqlens_k if attn_mask is None else attn_mask
    key = (tuple(seqlens), ranges, device)
    total = sum(seqlens)
    return remember_for(
        _EXPIRY, anchor, key,
        lambda: _expiry_rows(cu_seqlens_k, attn_mask, ranges, total, device), graphs=True,
    )  # fmt: skip


def _expiry_rows(
    cu_seqlens_k: Tensor, attn_mask: Tensor | None, ranges: bool, total: int, device
) -> Tensor:
    cu = cu_seqlens_k.to(device=device, dtype=torch.int64)
    lengths = torch.diff(cu)
    expiry = torch.repeat_interleave(cu[1:], lengths, output_size=total)
    if ranges:
        expiry |= torch.repeat_interleave(cu[:-1], lengths, output_size=total) << 32
    if attn_mask is not None:
        expiry = torch.where(attn_mask, expiry, 0)
    return expiry.to(torch.int64 if ranges else torch.int32).view(1, -1, total)


def _runs(
    seqlens_q: list[int], seqlens_k: list[int], attn_mask: Operand, attn_bias: Operand
) -> list[tuple[int, int]]:
    """[first, last] of each run of consecutive sequences that one batched call computes: equal
    (Sq, Sk) and operands given per key token (or not at all); a per-sequence list keeps each
    sequence on its own."""
    grouped = not isinstance(attn_mask, (list, tuple)) and not isinstance(attn_bias, (list, tuple))
    runs: list[tuple[int, int]] = []
    for i, lengths in enumerate(zip(seqlens_q, seqlens_k, strict=True)):
        if grouped and runs and (seqlens_q[runs[-1][0]], seqlens_k[runs[-1][0]]) == lengths:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _run_operand(
    operand: Operand, pieces: list, first: int, count: int, rows_k: slice, len_k: int
) -> Tensor | None:
    """A run's mask or bias with its batch dim: a per-key-token [Hm, total_k] tensor's keys of
    the run as [count, Hm, Sk] (a view), or the sequence's own operand (runs of one)."""
    if operand is None:
        return None
    if isinstance(operand, Tensor):
        return operand[:, rows_k].unflatten(1, (count, len_k)).transpose(0, 1)
    return _batch(pieces[first])


def _batch(t: Tensor | None) -> Tensor | None:
    """A sequence's operand with the batch dim of one (a view)."""
    return None if t is None else t[None]


def _seqlens(name: str, cu: object, total: int, max_len: object, max_name: str) -> list[int]:
    """The sequence lengths of a cu_seqlens tensor, checked against the packed total and the
    given maximum."""
    if not isinstance(cu, Tensor) or cu.dtype.is_floating_point or cu.dim() != 1:
        raise TypeError(f"{name}: expected a 1-D integer tensor [N + 1]")
    if cu.numel() < 2:
        raise ValueError(f"{name}: expected at least 2 entries (one sequence), got {cu.numel()}")
    # read once per tensor (a device -> host copy waits for the GPU): every layer of a step
    # passes the same cu_seqlens
    bounds = remember_for(_BOUNDS, cu, None, cu.tolist)
    lengths = [hi - lo for lo, hi in itertools.pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != total or min(lengths) < 0:
        raise ValueError(
            f"{name}: expected non-decreasing offsets from 0 to {total} (the packed length), "
            f"got {bounds[0]}..{bounds[-1]}" + (" with a decrease" if min(lengths) < 0 else "")
        )
    if not isinstance(max_len, int) or isinstance(max_len, bool):
        raise TypeError(f"{max_name}: expected an int, got {type(max_len).__name__}")
    if max_len < max(lengths):
        raise ValueError(
            f"{max_name}: expected at least the longest sequence {max(lengths)}, got {max_len}"
        )
    return lengths


def _per_sequence(name: str, operand: Operand, seqlens_k: list[int]) -> list[Tensor | None]:
    """The operand of each sequence: None, a slice of a per-key-token [Hm, total_k] tensor
    (as [Hm, Sk_i], which flash_dmattn_func reads as Qm = 1), or the list's own tensor."""
    count = len(seqlens_k)
    if operand is None:
        return [None] * count
    if isinstance(operand, Tensor):
        if operand.dim() != 2 or operand.shape[1] != sum(seqlens_k):
            raise ValueError(
                f"{name}: expected a per-key-token [Hm, total_k={sum(seqlens_k)}] tensor or a "
                f"list of {count} per-sequence tensors, got shape {tuple(operand.shape)}"
            )
        return list(operand.split(seqlens_k, dim=1))
    if isinstance(operand, (list, tuple)) and len(operand) == count:
        for i, t in enumerate(operand):
            if not isinstance(t, Tensor) or t.dim() not in (2, 3):
                raise ValueError(
                    f"{name}[{i}]: expected a 2-D [Hm, Km] or 3-D [Hm, Qm, Km] tensor of sequence {i}"
                )
        return list(operand)
    raise ValueError(
        f"{name}: expected a per-key-token [Hm, total_k] tensor or a list of {count} "
        f"per-sequence tensors, got {type(operand).__name__}"
    )


__all__ = ["flash_dmattn_varlen_func"]
