"""Host side of the backward: preprocess, the main kernel, and the fp32 -> input dtype casts.

dq is accumulated in fp32 ([B, Sq, H, D], zeroed here) and cast at the end; dk and dv are
written by the kernel in the input dtype. dbias is either written by the kernel in the bias
dtype, or accumulated in an fp32 buffer of the bias's shape and cast (see kernels/bwd.py).
"""

from __future__ import annotations

import torch

from ..jit.arch import target_arch
from ..jit.cache import compiled
from ..problem import Problem, broadcast_view
from .bwd import BwdScalars, BwdSpec, DbiasSpec
from .bwd_pre import bwd_preprocess
from .launch import dtype_name, kernel_scalars, operand_spec, operand_view, qkv_view, stride_kinds


def dbias_plan(problem: Problem, bias_shape: torch.Size) -> tuple[str, bool, bool]:
    """(kind, fold_batch, fold_heads) of the dbias of a [Bm, Hm, Qm, Km] bias.

    kind: "zero" when Km = 1 (a per-row shift leaves the softmax unchanged, so its gradient is
    exactly 0), "direct" when each element has a single contributing CTA (Bm = B and Hm = H;
    stored in the bias dtype), else "sum" (an fp32 buffer). Deterministic sums over a
    broadcast batch / all kv heads fold those dims into one CTA (see BwdSpec).
    """
    bm, hm, _, km = bias_shape
    if km == 1:
        return "zero", False, False
    if bm == problem.batch and hm == problem.num_heads:
        return "direct", False, False
    det = problem.deterministic
    return (
        "sum",
        det and bm == 1 and problem.batch > 1,
        det and hm == 1 and problem.num_heads_kv > 1,
    )


def bwd_spec(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    dbias_buf: torch.Tensor | None,
    kind: str,
    fold: tuple[bool, bool],
    arch: str,
) -> BwdSpec:
    """The backward variant for a problem (mask/bias: kernel views from launch.operand_view;
    dbias_buf: the broadcast view the kernel writes, None for no dbias work)."""
    dbias = None
    if dbias_buf is not None:
        dbias = DbiasSpec(
            dtype_name(dbias_buf.dtype),
            stride_kinds(dbias_buf),
            rows_summed=dbias_buf.shape[2] == 1,
            direct=kind == "direct",
            atomic=not problem.deterministic,
        )
    return BwdSpec.build(
        arch,
        dtype_name(problem.dtype),
        problem.head_dim,
        None if mask is None else operand_spec(mask, problem.seqlen_k),
        None if bias is None else operand_spec(bias, problem.seqlen_k),
        dbias,
        problem.has_window,
        problem.softcap > 0,
        problem.deterministic,
        *fold,
    )


def _dbias_buffers(
    problem: Problem, bias: torch.Tensor | None, bias_grad: bool, device=None
) -> tuple[str, tuple[bool, bool], torch.Tensor | None, torch.Tensor | None]:
    """(kind, fold, dbias, dbias_buf): the dbias returned to the caller and the buffer the
    kernel writes (the same tensor for "direct"), both zeroed, on `device` (default: the
    bias's); None where there is none."""
    if bias is None or not bias_grad:
        return "zero", (False, False), None, None
    kind, *fold = dbias_plan(problem, bias.shape)
    device = bias.device if device is None else device
    dbias = dbias_buf = None
    if kind == "direct":
        # Zeroed: tiles that causal/window ranges or all-False mask tiles skip are never
        # written by the kernel.
        dbias = dbias_buf = torch.zeros(bias.shape, dtype=bias.dtype, device=device)
    elif kind == "sum":
        dbias_buf = torch.zeros(bias.shape, dtype=torch.float32, device=device)
    else:
        dbias = torch.zeros(bias.shape, dtype=bias.dtype, device=device)
    return kind, tuple(fold), dbias, dbias_buf


def backward_spec_of(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    bias_grad: bool,
    arch: str,
) -> BwdSpec:
    """The backward variant a call runs (mask/bias: normalized 4-D views; tensors may be on
    the meta device, e.g. to list variants for an offline compile)."""
    mask_k, bias_k = operand_view(mask), operand_view(bias)
    # Planning only needs the buffer's strides: allocated on the meta device.
    kind, fold, _, dbias_buf = _dbias_buffers(problem, bias, bias_grad, "meta")
    dbias_view = broadcast_view(dbias_buf)
    return bwd_spec(problem, mask_k, bias_k, dbias_view, kind, fold, arch)


def flash_bwd(
    problem: Problem,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    stats: torch.Tensor,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk, dv and (bias_grad) dbias of one forward call, on CUDA tensors.

    mask/bias are the normalized 4-D views of `problem.make_problem`; stats is the forward's
    [B, H, 2, Sq] row max / log2 row sum (see flash_fwd); dbias has bias's shape and dtype.
    """
    q, k, v, out, dout = (qkv_view(t) for t in (q, k, v, out, dout))
    mask_k, bias_k = operand_view(mask), operand_view(bias)
    dpsum = bwd_preprocess(out, dout)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    kind, fold, dbias, dbias_buf = _dbias_buffers(problem, bias, bias_grad)
    dbias_view = broadcast_view(dbias_buf)

    arch = target_arch(q.device)
    spec = bwd_spec(problem, mask_k, bias_k, dbias_view, kind, fold, arch)
    sem = None
    if problem.deterministic:
        num_m = -(-problem.seqlen_q // spec.tile.tile_m)
        sem = torch.zeros(
            problem.batch, problem.num_heads, num_m, dtype=torch.int32, device=q.device
        )
    kernel = compiled(spec, arch)
    scalars = kernel_scalars(BwdScalars, problem, mask_k, bias_k)
    kernel(q, k, v, dout, stats, dpsum, dq_acc, dk, dv, mask_k, bias_k, dbias_view, sem, *scalars)
    if kind == "sum":
        dbias = dbias_buf if bias.dtype == torch.float32 else dbias_buf.to(bias.dtype)
    return dq_acc.to(q.dtype), dk, dv, dbias


__all__ = ["backward_spec_of", "bwd_spec", "dbias_plan", "flash_bwd"]
