"""Host side of the backward: the preprocess and the main kernel (variants, buffers, launches),
and the fp32 -> input dtype casts.

dq is accumulated in fp32 ([B, Sq, H, D], zeroed here) and cast at the end; dk and dv are
written by the kernel in the input dtype. On sm_90a every call whose mask/bias tiles fit runs
the Hopper kernel (kernels/sm90/bwd.py), except deterministic sums of a broadcast bias's dbias;
every other call runs the mma.sync kernel. When the Hopper kernel's grid (key blocks x kv heads
x batch) is under two waves of the GPU's SMs, a group's query heads are split over several
CTAs, which add fp32 dk/dv partial sums (in split order when deterministic). dbias is either
written by the kernel in the bias dtype, or accumulated in an fp32 buffer of the bias's shape
and cast (see kernels/bwd.py).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..jit.arch import hopper_kernels, target_arch
from ..jit.cache import compiled, holds_kernels
from ..memo import remember
from ..problem import MAX_HEAD_DIM, Problem, broadcast_view
from . import expiry_launch
from .block_bits import BlockBitsSpec
from .block_bits_launch import kernel_bits_view, mask_block_bits
from .block_mask_launch import joint_block_bits, read_as_bits
from .bwd import BwdScalars, BwdSpec, DbiasSpec
from .bwd_pre import VECTOR_BYTES, BwdPreprocessSpec
from .launch import (
    dtype_name,
    kernel_layout,
    kernel_scalars,
    operand_spec,
    operand_view,
    qkv_view,
    sm_count,
    stride_kinds,
)
from .launch_order import walk_order
from .sm90.bwd import Sm90BwdSpec


def dbias_plan(
    problem: Problem, bias_shape: torch.Size, query_split: bool = False
) -> tuple[str, bool, bool]:
    """(kind, fold_batch, fold_heads) of the dbias of a [Bm, Hm, Qm, Km] bias.

    kind: "zero" when Km = 1 (a per-row shift leaves the softmax unchanged, so its gradient is
    exactly 0), "direct" when each element has a single contributing CTA (Bm = B and Hm = H,
    and not Qm = 1 under a query split, whose CTAs share a column; stored in the bias dtype),
    "slots" for a deterministic query-broadcast one (Qm = 1) otherwise: each (batch, query
    head) writes an fp32 row of its own [B, H, 1, Sk] buffer, as "direct" does, and the
    launch sums the rows over the broadcast dims in a fixed order (a few bytes per key, where
    folding the dims into one CTA collapses the grid), else "sum" (an fp32 buffer).
    Deterministic sums of a full-height bias over a broadcast batch / all kv heads fold those
    dims into one CTA (see BwdSpec).
    """
    bm, hm, qm, km = bias_shape
    if km == 1:
        return "zero", False, False
    if bm == problem.batch and hm == problem.num_heads and not (query_split and qm == 1):
        return "direct", False, False
    det = problem.deterministic
    if det and qm == 1:
        return "slots", False, False
    return (
        "sum",
        det and bm == 1 and problem.batch > 1,
        det and hm == 1 and problem.num_heads_kv > 1,
    )


# Query rows per CTA of a masked Hopper backward's key block (about; see query_splits).
QUERY_SPLIT_ROWS = 8192


def query_splits(problem: Problem, masked: bool, arch: str) -> int:
    """CTAs over which the Hopper backward splits each key block's query range. A mask (or
    block mask) may leave a few key columns visible to almost every query (top-k blocks by a
    per-key score): one CTA walking such a column serially sets the kernel's time at long
    Sq, so a masked, non-deterministic call gives each CTA about QUERY_SPLIT_ROWS rows of
    the range. A CTA whose share holds no visible block adds nothing."""
    if not (masked and hopper_kernels(arch)) or problem.deterministic:
        return 1
    return -(-problem.seqlen_q // QUERY_SPLIT_ROWS)


def head_splits(
    problem: Problem, tile_n: int, sms: int, query_split: int = 1, waves: int = 2
) -> int:
    """CTAs per group of query heads in the backward: 1 when (key blocks x kv heads x batch x
    query splits) CTAs fill `waves` waves of `sms` SMs, else the smallest divisor of the group
    that does (the group size if none does)."""
    group = problem.num_heads // problem.num_heads_kv
    ctas = problem.batch * problem.num_heads_kv * -(-problem.seqlen_k // tile_n) * query_split
    for splits in range(1, group + 1):
        if group % splits == 0 and ctas * splits >= waves * sms:
            return splits
    return group


def split_waves(problem: Problem, masked: bool, hopper: bool) -> int:
    """The waves of CTAs head_splits fills. The Hopper kernel: two, or four for a masked,
    non-deterministic call (a sparse mask leaves the walks of different key blocks uneven, and
    shorter walks even out the last wave: H100, block density 0.25, backward -3 to -5% with
    four where two split the heads; a dense mask loses 2%). The mma.sync kernel: one (H100,
    B1 H32 S4096 D128 deterministic: 8 kv heads 3.33 ms unsplit against 3.55 ms in two
    halves; 1 kv head 12.4 ms unsplit, 3.5 ms in 16)."""
    if not hopper:
        return 1
    return 4 if masked and not problem.deterministic else 2


def spec_head_splits(
    problem: Problem, spec: BwdSpec | Sm90BwdSpec, sms: int, masked: bool, query_split: int = 1
) -> int:
    """head_splits at a variant's key tile, filling the waves of its kernel family."""
    waves = split_waves(problem, masked, isinstance(spec, Sm90BwdSpec))
    return head_splits(problem, spec.tile.tile_n, sms, query_split, waves)


def sum_slots(slots: torch.Tensor, bias_shape: torch.Size) -> torch.Tensor:
    """The fp32 [B, H, 1, Sk] rows of a "slots" dbias summed into the bias's [Bm, Hm, 1, Sk]
    (query heads h and h' share a bias head when h // (H / Hm) equals h' // (H / Hm)), by
    torch's reductions: the same order every call."""
    batch, heads, _, keys = slots.shape
    bm, hm = bias_shape[:2]
    rows = slots.view(batch, hm, heads // hm, 1, keys).sum(2)
    return rows.sum(0, keepdim=True) if bm == 1 and batch > 1 else rows


def bwd_spec(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    dbias_buf: torch.Tensor | None,
    kind: str,
    fold: tuple[bool, bool],
    arch: str,
    sms: int,
    block_mask: bool = False,
) -> BwdSpec | Sm90BwdSpec:
    """The backward variant for a problem on a GPU of `sms` SMs (mask/bias: kernel views from
    launch.operand_view; dbias_buf: the broadcast view the kernel writes, None for no dbias
    work; block_mask: the Hopper kernel's bits will be a block mask's)."""
    dbias = None
    if dbias_buf is not None:
        dbias = DbiasSpec(
            dtype_name(dbias_buf.dtype),
            stride_kinds(dbias_buf),
            rows_summed=dbias_buf.shape[2] == 1,
            direct=kind in ("direct", "slots"),
            atomic=not problem.deterministic,
            per_head=kind == "slots",
        )
    dtype = dtype_name(problem.dtype)
    operands = (operand_spec(mask, problem.seqlen_k), operand_spec(bias, problem.seqlen_k))
    flags = (problem.has_window, problem.softcap > 0)
    # Deterministic dbias sums fold broadcast dims into one CTA: only the mma.sync kernel.
    det_sums = problem.deterministic and dbias is not None and not dbias.direct
    if hopper_kernels(arch) and not det_sums:
        try:
            spec = Sm90BwdSpec.build(
                arch, dtype, problem.head_dim, *operands, dbias, *flags,
                deterministic=problem.deterministic, block_mask=block_mask,
            )  # fmt: skip
        except ValueError:
            spec = None  # its mask/bias tiles do not fit: the mma.sync kernel
        if spec is not None:
            splits = query_splits(problem, mask is not None, arch)
            if splits > 1 or spec_head_splits(problem, spec, sms, mask is not None, splits) > 1:
                spec = Sm90BwdSpec.build(
                    arch, dtype, problem.head_dim, *operands, dbias, *flags, split_heads=True,
                    deterministic=problem.deterministic, block_mask=block_mask,
                )  # fmt: skip
            return spec
    spec = BwdSpec.build(
        arch, dtype, problem.head_dim, *operands, dbias, *flags, problem.deterministic, *fold
    )
    if spec.can_split_heads and spec_head_splits(problem, spec, sms, mask is not None) > 1:
        spec = BwdSpec.build(
            arch, dtype, problem.head_dim, *operands, dbias, *flags, problem.deterministic,
            split_heads=True,
        )  # fmt: skip
    return spec


def _dbias_buffers(
    problem: Problem, bias: torch.Tensor | None, bias_grad: bool, device=None,
    query_split: bool = False, fp32_buf: torch.Tensor | None = None,
) -> tuple[str, tuple[bool, bool], torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(kind, fold, dbias, dbias_buf): the dbias returned to the caller and the buffer the
    kernel writes (the same tensor for "direct"), both zeroed, on `device` (default: the
    bias's); None where there is none. fp32_buf: the zeroed fp32 buffer of a "sum" / "slots"
    kind where the caller carved it from a larger allocation (its plan's dbias_shape; made
    here when None)."""
    if bias is None or not bias_grad:
        return "zero", (False, False), None, None
    kind, *fold = dbias_plan(problem, bias.shape, query_split)
    device = bias.device if device is None else device
    dbias = dbias_buf = None
    if kind == "direct":
        # Zeroed: tiles that causal/window ranges or all-False mask tiles skip are never
        # written by the kernel.
        dbias = dbias_buf = torch.zeros(bias.shape, dtype=bias.dtype, device=device)
    elif kind in ("sum", "slots"):  # slots: a row per (batch, query head)
        dbias_buf = fp32_buf
        if dbias_buf is None:
            rows = (problem.batch, problem.num_heads, 1, bias.shape[3])
            shape = bias.shape if kind == "sum" else rows
            dbias_buf = torch.zeros(shape, dtype=torch.float32, device=device)
    else:
        dbias = torch.zeros(bias.shape, dtype=bias.dtype, device=device)
    return kind, tuple(fold), dbias, dbias_buf


def backward_variants(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    bias_grad: bool,
    arch: str,
    device: torch.device | None = None,
    block_mask: torch.Tensor | None = None,
) -> tuple[BwdSpec | Sm90BwdSpec, BlockBitsSpec | None]:
    """The backward variant a call runs on `device`, and the block-bits pre-pass it runs first
    or None (mask/bias: normalized 4-D views, block_mask as flash_bwd takes it; tensors may be
    on the meta device, e.g. to list variants for an offline compile, and without a CUDA
    device the plan assumes `arch`'s largest GPU). Only the Hopper kernel with a mask to scan
    runs a pre-pass: an expiry's bits need none, nor does a block mask read as bits without
    an attn_mask (backward_operands)."""
    device = device or torch.device("meta")
    mask, blocks, mask_given = backward_operands(
        problem, mask, block_mask, bias, bias_grad, arch, device
    )
    mask_k, bias_k = operand_view(mask), operand_view(bias)
    # Planning only needs the buffer's strides: allocated on the meta device.
    split = query_splits(problem, mask is not None, arch) > 1
    kind, fold, _, dbias_buf = _dbias_buffers(problem, bias, bias_grad, "meta", split)
    dbias_view = broadcast_view(dbias_buf)
    sms = sm_count(device, arch)
    spec = bwd_spec(problem, mask_k, bias_k, dbias_view, kind, fold, arch, sms, blocks is not None)
    if (
        not isinstance(spec, Sm90BwdSpec)
        or spec.mask is None
        or spec.mask.dtype in ("i32", "i64")
        or (blocks is not None and not mask_given)
    ):
        return spec, None
    return spec, BlockBitsSpec(spec.mask, spec.tile.tile_m, spec.tile.tile_n)


def backward_spec_of(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    bias_grad: bool,
    arch: str,
    device: torch.device | None = None,
    block_mask: torch.Tensor | None = None,
) -> BwdSpec | Sm90BwdSpec:
    """The backward variant a call runs (as backward_variants)."""
    return backward_variants(problem, mask, bias, bias_grad, arch, device, block_mask)[0]


def preprocess_spec(dtype: torch.dtype, head_dim: int) -> BwdPreprocessSpec:
    """The preprocess variant for O/dO of `dtype` (fp16 or bf16) and `head_dim` (a multiple of
    8, at most 256)."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"out: expected dtype float16 or bfloat16, got {dtype}")
    if head_dim % 8 != 0 or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"out: expected head dim a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}"
        )
    return BwdPreprocessSpec.build(dtype_name(dtype), head_dim)


def _check_vector_aligned(name: str, t: torch.Tensor) -> None:
    vec = VECTOR_BYTES // t.element_size()
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected the last dim contiguous, got strides {t.stride()}")
    # A size-1 dim is only ever indexed at 0, so its stride does not matter.
    misaligned = any(s % vec for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    if t.data_ptr() % VECTOR_BYTES != 0 or misaligned:
        raise ValueError(
            f"{name}: expected a {VECTOR_BYTES}-byte aligned base and strides that are multiples "
            f"of {vec} elements, got data_ptr % {VECTOR_BYTES} = "
            f"{t.data_ptr() % VECTOR_BYTES}, strides {t.stride()}"
        )


def bwd_preprocess(
    out: torch.Tensor, dout: torch.Tensor, dpsum: torch.Tensor | None = None
) -> torch.Tensor:
    """dpsum [B, H, Sq] float32 = rowsum over D of dout * out, both [B, Sq, H, D] fp16/bf16 on
    CUDA (last dim contiguous, other strides multiples of 8 elements). Writes into ``dpsum``
    when given (any strides, last dim contiguous), else into a new tensor. Launches on the
    current torch CUDA stream."""
    if out.dim() != 4:
        raise ValueError(f"out: expected 4 dims [B, Sq, H, D], got shape {tuple(out.shape)}")
    if out.shape != dout.shape or out.dtype != dout.dtype or out.device != dout.device:
        raise ValueError(
            f"dout: expected shape {tuple(out.shape)}, dtype {out.dtype} and device "
            f"{out.device} like out, got {tuple(dout.shape)}, {dout.dtype}, {dout.device}"
        )
    batch, seqlen_q, heads, head_dim = out.shape
    spec = preprocess_spec(out.dtype, head_dim)
    _check_vector_aligned("out", out)
    _check_vector_aligned("dout", dout)
    if dpsum is None:
        dpsum = torch.empty(batch, heads, seqlen_q, device=out.device, dtype=torch.float32)
    elif (
        dpsum.shape != (batch, heads, seqlen_q)
        or dpsum.dtype != torch.float32
        or dpsum.device != out.device
        or dpsum.stride(-1) != 1
    ):
        raise ValueError(
            f"dpsum: expected float32 [{batch}, {heads}, {seqlen_q}] on {out.device} with the "
            f"last dim contiguous, got {dpsum.dtype} {tuple(dpsum.shape)} on {dpsum.device} "
            f"with strides {dpsum.stride()}"
        )
    if dpsum.numel() == 0:
        return dpsum
    kernel = compiled(spec, target_arch(out.device))
    # The launch goes to the current device's context; make that out's device.
    with torch.cuda.device(out.device):
        kernel(out, dout, dpsum)
    return dpsum


class _BwdPlan(NamedTuple):
    """What one backward call launches, shared by every call with the same problem, arch,
    GPU size, mask/bias layouts and dbias request: the preprocess kernel, the variant's
    kernel and scalars, the query split (query_splits: the dbias kind follows it, only the
    Hopper kernel runs it), and for the Hopper kernel its heads split, walk rotation and
    (with a mask) the tile of its block-bits pre-pass."""

    pre_kernel: Any
    spec: BwdSpec | Sm90BwdSpec
    kernel: Any
    scalars: tuple
    bits_tile: tuple[int, int] | None
    splits: int
    query_splits: int
    rotate: int
    n_blocks: int
    dbias_shape: tuple[int, ...] | None  # the fp32 dbias buffer's ("sum" / "slots"), else None


# Plans by (problem, arch, kernel family choice, SMs, mask/bias layouts, dbias request);
# cleared when full and with the kernels' memory cache (jit.cache.clear_memory).
_PLANS: dict[tuple, _BwdPlan] = holds_kernels({})
_PLANS_MAX = 256


def _plan(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    bias_grad: bool,
    arch: str,
    sms: int,
    block_mask: bool,
) -> _BwdPlan:
    # the layout of the dbias buffer a call makes: on the meta device
    split = query_splits(problem, mask is not None, arch)
    kind, fold, _, dbias_buf = _dbias_buffers(problem, bias, bias_grad, "meta", split > 1)
    dbias_view = broadcast_view(dbias_buf)
    spec = bwd_spec(problem, mask, bias, dbias_view, kind, fold, arch, sms, block_mask)
    pre_kernel = compiled(preprocess_spec(problem.dtype, problem.head_dim), arch)
    scalars = kernel_scalars(BwdScalars, problem, mask, bias)
    bits_tile, rotate, n_blocks = None, 0, 0
    splits = 1
    if spec.split_heads:  # (query splits: the Hopper kernel's only)
        query_split = split if isinstance(spec, Sm90BwdSpec) else 1
        splits = spec_head_splits(problem, spec, sms, mask is not None, query_split)
    if isinstance(spec, Sm90BwdSpec):
        tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
        bits_tile = (tile_m, tile_n) if mask is not None else None
        # deterministic walks start at their own key block when every key block of a
        # (batch, kv head) fits on the GPU at once and there are as many query blocks
        m_blocks = -(-problem.seqlen_q // tile_m)
        n_blocks = -(-problem.seqlen_k // tile_n)
        rotate = int(spec.deterministic and n_blocks <= min(m_blocks, sms))
    dbias_shape = tuple(dbias_buf.shape) if kind in ("sum", "slots") else None
    return _BwdPlan(
        pre_kernel, spec, compiled(spec, arch), scalars, bits_tile, splits, split, rotate,
        n_blocks, dbias_shape,
    )  # fmt: skip


# The variant a mask view (not yet planned) would run, by problem, arch, GPU size, the mask's
# and bias's layouts and the dbias request: what decides how a block mask is read, without a
# variant (and a meta dbias buffer) built per call.
_VARIANTS: dict[tuple, BwdSpec | Sm90BwdSpec] = {}


def _variant(problem, mask, bias, bias_grad: bool, arch: str, device) -> BwdSpec | Sm90BwdSpec:
    key = (
        problem, arch, hopper_kernels(arch), sm_count(device, arch),
        kernel_layout(operand_view(mask)), kernel_layout(operand_view(bias)),
        bias_grad and bias is not None,
    )  # fmt: skip
    return remember(
        _VARIANTS, key, lambda: backward_spec_of(problem, mask, bias, bias_grad, arch, device)
    )


def backward_operands(
    problem: Problem, mask, block_mask, bias, bias_grad: bool, arch: str, device
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """(the mask view the backward reads, the block mask where it reads that as bits,
    whether attn_mask `mask` is ANDed into them): block_mask_launch.read_as_bits for this
    backward. mask/bias: 4-D views."""

    def tile_of(view):
        spec = _variant(problem, view, bias, bias_grad, arch, device)
        return (spec.tile.tile_m, spec.tile.tile_n) if isinstance(spec, Sm90BwdSpec) else None

    return read_as_bits(problem, mask, block_mask, tile_of)


def _zeroed_fp32(shapes: list[torch.Size], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One zeroed fp32 allocation, and contiguous tensors of these shapes carved from it in
    order."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    return flat, [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]


def _cast(flat: torch.Tensor, sums: list[torch.Tensor], dtype, one_storage: bool):
    """The fp32 sums (consecutive from the start of `flat`) in `dtype`: one cast of that span
    whose views they are where one_storage (a launch and a torch call instead of one per sum;
    the results then share a storage, which a custom op may not return), else one each."""
    if not one_storage:
        return [t.to(dtype) for t in sums]
    sizes = [t.numel() for t in sums]
    span = flat[: sum(sizes)].to(dtype)
    return [part.view(t.shape) for part, t in zip(span.split(sizes), sums, strict=True)]


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
    block_mask: torch.Tensor | None = None,
    bits: torch.Tensor | None = None,
    key_expiry: torch.Tensor | None = None,
    one_storage: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk, dv and (bias_grad) dbias of one forward call, on CUDA tensors.

    mask/bias are 4-D views (problem.broadcast_view); stats is the forward's [B, H, 2, Sq]
    row max / log2 row sum (see flash_fwd); dbias has bias's shape and dtype. block_mask: as
    flash_fwd takes it (bits of the Hopper kernel's tiles, or expanded into the mask). bits:
    the mask's block bits for this variant as its kernel reads them (kernels/paired_bits.py),
    which the pre-pass then does not compute (its own are remembered with the mask, as
    flash_fwd's); only without a block mask. key_expiry: as flash_fwd takes it. one_storage:
    the gradients the kernel sums in fp32 (dq, split dk/dv, a summed dbias of q's dtype) come
    from one cast, as views of one tensor.
    """
    q, k, v, out, dout = (qkv_view(t) for t in (q, k, v, out, dout))
    bias_k = operand_view(bias)
    arch = target_arch(q.device)
    sms = sm_count(q.device, arch)

    def plan_of(mask_k, blocks):
        key = (
            problem, arch, hopper_kernels(arch), sms, kernel_layout(mask_k), kernel_layout(bias_k),
            bias_grad and bias is not None and (bias.shape, bias.dtype), blocks,
        )  # fmt: skip
        return remember(
            _PLANS, key, lambda: _plan(problem, mask_k, bias_k, bias_grad, arch, sms, blocks),
            _PLANS_MAX,
        )  # fmt: skip

    expiry = None  # the expiry view, where the kernel reads it as its mask (as flash_fwd)
    if key_expiry is not None:
        view = broadcast_view(key_expiry)
        spec = None
        if mask is None and block_mask is None:
            spec = _variant(problem, view, bias, bias_grad, arch, q.device)
        if isinstance(spec, Sm90BwdSpec):
            expiry = mask = view
        else:
            mask = expiry_launch.element_mask(mask, key_expiry, problem)
    # blocks: the block mask, where the kernel reads it as bits
    mask, blocks, mask_given = backward_operands(
        problem, mask, block_mask, bias, bias_grad, arch, q.device
    )
    mask_k = operand_view(mask)
    plan = plan_of(mask_k, blocks is not None)
    spec = plan.spec

    _check_vector_aligned("out", out)
    _check_vector_aligned("dout", dout)
    dpsum = torch.empty(
        problem.batch, problem.num_heads, problem.seqlen_q, device=q.device, dtype=torch.float32
    )
    if dpsum.numel():
        plan.pre_kernel(out, dout, dpsum)
    # fp32 accumulators, zeroed by one fill: dq, with split heads the dk / dv partial sums
    # (each part starts on a multiple of D floats: 32-byte aligned, as TMA needs 16), and last
    # any fp32 dbias buffer
    split = isinstance(spec, Sm90BwdSpec) and spec.split_heads
    shapes = [q.shape, k.shape, v.shape] if split else [q.shape]
    dbias_shape = plan.dbias_shape
    flat, (dq_acc, *parts) = _zeroed_fp32(shapes + ([dbias_shape] if dbias_shape else []), q.device)
    kv_acc = parts[:2] if split else []
    kind, _, dbias, dbias_buf = _dbias_buffers(
        problem, bias, bias_grad, query_split=plan.query_splits > 1,
        fp32_buf=parts[-1] if dbias_shape else None,
    )  # fmt: skip
    dbias_view = broadcast_view(dbias_buf)
    sem = None
    if problem.deterministic:
        num_m = -(-problem.seqlen_q // spec.tile.tile_m)
        sem = torch.zeros(
            problem.batch, problem.num_heads, num_m, dtype=torch.int32, device=q.device
        )
    given, bits = bits, None
    if isinstance(spec, Sm90BwdSpec):
        from_blocks = None  # the block mask's bits (memoized with it)
        if plan.bits_tile is not None:
            seqlens = (problem.seqlen_q, problem.seqlen_k)
            tiles = tuple(-(-n // t) for n, t in zip(seqlens, plan.bits_tile, strict=True))
            if given is not None:
                if blocks is not None or tuple(given.shape[2:]) != tiles:
                    raise ValueError(f"bits: expected {tiles} tiles, got {tuple(given.shape)}")
                bits = given
            elif expiry is not None:
                bits = expiry_launch.expiry_bits(key_expiry, problem, *plan.bits_tile)
            elif blocks is None or mask_given:
                bits = mask_block_bits(mask, mask_k, spec.mask, *seqlens, plan.bits_tile, arch)
            if blocks is not None:
                from_blocks, joint_bits = joint_block_bits(
                    blocks, bits, mask_given, problem, *plan.bits_tile, mask_k.shape[1]
                )
                bits = kernel_bits_view(joint_bits, -(-problem.seqlen_q // plan.bits_tile[0]))
        if spec.split_heads:  # fp32 partial sums of the CTAs that share a kv head
            dk, dv = kv_acc
        else:
            dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
        sem_kv = None  # deterministic split: the dK/dV partial sums' turns per key block
        if spec.deterministic and spec.split_heads:
            sem_kv = torch.zeros(
                problem.batch, problem.num_heads_kv, plan.n_blocks, dtype=torch.int32,
                device=q.device,
            )  # fmt: skip
        order = None
        if spec.ordered:
            order = walk_order(
                problem, spec.tile.tile_m, spec.tile.tile_n, plan.splits * plan.query_splits,
                sms, q.device, blocks, from_blocks,
            )  # fmt: skip
        plan.kernel(
            q, k, v, dout, stats, dpsum, dq_acc, dk, dv, plan.splits, plan.query_splits,
            plan.rotate, mask_k,
            bias_k, bits, order, dbias_view, sem, sem_kv, *plan.scalars,
        )  # fmt: skip
    else:
        if spec.split_heads:  # fp32 partial sums, a head slot per (kv head, split), each whole
            slots = (*k.shape[:2], k.shape[2] * plan.splits, k.shape[3])
            dk, dv = (torch.empty(slots, dtype=torch.float32, device=q.device) for _ in range(2))
        else:
            dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
        plan.kernel(
            q, k, v, dout, stats, dpsum, dq_acc, dk, dv, plan.splits, mask_k, bias_k,
            dbias_view, sem, *plan.scalars,
        )  # fmt: skip
        if spec.split_heads:  # the slots summed in order: deterministic
            dk, dv = (
                x.unflatten(2, (k.shape[2], plan.splits)).sum(3).to(t.dtype)
                for x, t in ((dk, k), (dv, v))
            )
    # The sums in the inputs' dtype, in their order in `flat`: dq, the split dk / dv, a
    # summed dbias of that dtype (the fp32 dbias is returned as it is, slots are summed first).
    sums = [dq_acc, *kv_acc]
    if kind == "sum" and bias.dtype == q.dtype:
        sums.append(dbias_buf)
    dq, *rest = _cast(flat, sums, q.dtype, one_storage)
    if kv_acc:
        dk, dv, *rest = rest
    if rest:
        (dbias,) = rest
    elif kind in ("sum", "slots"):
        if kind == "slots":
            dbias_buf = sum_slots(dbias_buf, bias.shape)
        dbias = dbias_buf if bias.dtype == torch.float32 else dbias_buf.to(bias.dtype)
    return dq, dk, dv, dbias


__all__ = [
    "backward_operands",
    "backward_spec_of",
    "backward_variants",
    "bwd_preprocess",
    "bwd_spec",
    "dbias_plan",
    "flash_bwd",
    "preprocess_spec",
    "sum_slots",
]
