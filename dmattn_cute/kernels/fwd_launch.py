"""Host side of the forward: pick the kernel variant for a problem and launch it on torch tensors.

Kernels are compiled against fake tensors that carry the variant's stride pattern and
alignment (`FwdSpec.example_args`) and called through TVM-FFI with the torch tensors
themselves: the call checks each tensor against that pattern in C, and the kernel runs on the
current torch stream.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch

from ..jit.arch import hopper_kernels, target_arch
from ..jit.cache import compiled, holds_kernels
from ..memo import capturing, remember, remember_for
from ..problem import Problem, broadcast_view
from . import expiry_launch
from .block_bits import BlockBitsSpec
from .block_bits_launch import (
    block_bits_shape,
    block_bits_spec,
    kernel_bits_view,
    remembered_bits,
)
from .block_mask_launch import joint_block_bits, read_as_bits
from .config import SHORT_QUERY_ROWS
from .fwd import FwdScalars, FwdSpec
from .key_bias_terms import launch_terms, terms_spec
from .launch import (
    dtype_name,
    kernel_layout,
    kernel_scalars,
    operand_spec,
    operand_view,
    qkv_view,
    sm_count,
)
from .launch_order import forward_items, grid_items
from .sm90.fwd import Sm90FwdSpec
from .spec import OperandSpec


def forward_variants(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    arch: str,
    block_mask: torch.Tensor | None = None,
    paged: bool = False,
) -> tuple[FwdSpec | Sm90FwdSpec, BlockBitsSpec | None]:
    """The forward variant a call runs, and the block-bits pre-pass it runs first or None
    (mask/bias: normalized 4-D views, block_mask as flash_fwd takes it; tensors may be on the
    meta device, e.g. to list variants for an offline compile). Only the Hopper kernel with a
    mask to scan runs a pre-pass: an integer mask is an expiry or key ranges, and a block mask
    alone is read as bits. paged: K and V from a page pool (flash_fwd's block_table)."""
    bias = operand_view(bias)
    view, blocks, mask_given = forward_operands(problem, mask, block_mask, bias, arch)
    view = operand_view(view)
    alone = blocks is not None and not mask_given
    spec = fwd_spec(problem, view, bias, arch, blocks is not None, paged, alone)
    if (
        not isinstance(spec, Sm90FwdSpec)
        or view is None
        or view.dtype in expiry_launch.EXPIRY_DTYPES
        or alone
    ):
        return spec, None
    return spec, block_bits_spec(view, problem.seqlen_k, spec.tile.tile_m, spec.tile.tile_n)


def forward_spec_of(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    arch: str,
    block_mask: torch.Tensor | None = None,
) -> FwdSpec | Sm90FwdSpec:
    """The forward variant a call runs (as forward_variants)."""
    return forward_variants(problem, mask, bias, arch, block_mask)[0]


def forward_family(arch: str) -> type[FwdSpec | Sm90FwdSpec]:
    """The forward kernel family of an architecture: the warp-specialized wgmma kernel on
    sm_90a (unless jit.arch.hopper_kernels says otherwise), the mma.sync kernel on
    sm_80/86/89."""
    return Sm90FwdSpec if hopper_kernels(arch) else FwdSpec


def fwd_spec(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    arch: str,
    block_mask: bool = False,
    paged: bool = False,
    blocks_full: bool = False,
) -> FwdSpec | Sm90FwdSpec:
    """The forward variant for a problem (mask/bias: kernel views from launch.operand_view;
    block_mask: the mask's bits are a block mask's; paged: K and V from a page pool;
    blocks_full: the block mask alone, Sm90FwdSpec's field): the warp-specialized wgmma
    kernel on sm_90a, the mma.sync kernel elsewhere."""
    seqlen_k = problem.seqlen_k
    mask_spec, bias_spec = operand_spec(mask, seqlen_k), operand_spec(bias, seqlen_k)
    return _build(problem, mask_spec, bias_spec, arch, block_mask, paged, blocks_full)


def _build(
    problem: Problem,
    mask: OperandSpec | None,
    bias: OperandSpec | None,
    arch: str,
    block_mask: bool = False,
    paged: bool = False,
    blocks_full: bool = False,
) -> FwdSpec | Sm90FwdSpec:
    """block_mask: the Hopper kernel's bits will be a block mask's, whose query blocks the
    launch orders (launch_order.forward_order); paged: K and V come from a page pool
    (flash_fwd's block_table; the Hopper kernel only); blocks_full: the block mask alone
    (Sm90FwdSpec's field)."""
    family = forward_family(arch)
    args = (
        arch, dtype_name(problem.dtype), problem.head_dim, mask, bias, problem.has_window,
        problem.softcap > 0,
    )  # fmt: skip
    if family is Sm90FwdSpec:
        # narrow key tiles pay only where a mask skips them; without one they double the walk
        short = problem.seqlen_q <= SHORT_QUERY_ROWS and mask is not None
        # a bias row's terms cost 32 bytes per key: not where reading K and V bounds the call
        terms = problem.seqlen_q > SHORT_QUERY_ROWS
        return family.build(*args, short, block_mask, paged, blocks_full, terms)
    if paged:
        raise ValueError(f"block_table: the kernels of {arch} read no paged cache")
    return family.build(*args)


class _FwdPlan(NamedTuple):
    """What one forward call launches, shared by every call with the same problem, arch and
    mask/bias layouts: the variant's kernel and scalars and, for the Hopper kernel with a
    mask, the block-bits pre-pass's kernel (None for a block mask alone, whose bits need no
    pre-pass), the bits' shape, the pre-pass's variant (remembered_bits' key) and the strides
    of their view indexed like the mask (stride 0 on its broadcast batch and head dims)."""

    spec: FwdSpec | Sm90FwdSpec
    kernel: Any
    scalars: tuple
    bits_kernel: Any
    bits_shape: tuple[int, ...] | None
    bits_spec: BlockBitsSpec | None
    bits_view_shape: tuple[int, ...] | None
    bits_strides: tuple[int, ...] | None
    # the pre-pass of a bias row read as terms of Q K^T (Sm90FwdTile.bias_terms), else None
    terms_kernel: Any = None


# Plans by (problem, arch, kernel family choice, mask layout, bias layout); cleared when full
# and with the kernels' memory cache (jit.cache.clear_memory).
_PLANS: dict[tuple, _FwdPlan] = holds_kernels({})
_PLANS_MAX = 256


def _plan(
    problem: Problem,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    arch: str,
    key_chunks: int,
    block_mask: bool,
    scans: bool,
    paged: bool,
) -> _FwdPlan:
    mask_spec = operand_spec(mask, problem.seqlen_k)
    bias_spec = operand_spec(bias, problem.seqlen_k)
    # a block mask without attn_mask is read as its bits alone (no pre-pass scans a mask)
    spec = _build(problem, mask_spec, bias_spec, arch, block_mask, paged, block_mask and not scans)
    scalars = kernel_scalars(FwdScalars, problem, mask, bias)._replace(key_chunks=key_chunks)
    if key_chunks > 1:
        refusal = key_chunks_refusal(problem, mask, bias, key_chunks)
        if refusal is not None:
            raise ValueError(refusal)
    if (
        not isinstance(spec, Sm90FwdSpec)
        or mask is None
        or mask.dtype in expiry_launch.EXPIRY_DTYPES
    ):
        # (an integer mask is an expiry or key ranges: its bits come from expiry_launch)
        plan = _FwdPlan(spec, compiled(spec, arch), scalars, None, None, None, None, None)
        return _with_terms(plan, bias, problem, arch)
    tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
    bits_spec = BlockBitsSpec(mask_spec, tile_m, tile_n)
    shape = block_bits_shape(mask, problem.seqlen_q, problem.seqlen_k, tile_m, tile_n)
    view = kernel_bits_view(
        torch.empty(shape, dtype=torch.uint8, device="meta"), -(-problem.seqlen_q // tile_m)
    )
    kernel = compiled(spec, arch)
    bits_kernel = compiled(bits_spec, arch) if scans else None
    plan = _FwdPlan(spec, kernel, scalars, bits_kernel, shape, bits_spec, view.shape, view.stride())
    return _with_terms(plan, bias, problem, arch)


def _with_terms(plan: _FwdPlan, bias, problem: Problem, arch: str) -> _FwdPlan:
    """The plan with the terms pre-pass of its bias row where the forward reads one."""
    if not isinstance(plan.spec, Sm90FwdSpec) or not plan.spec.tile.bias_terms:
        return plan
    return plan._replace(terms_kernel=compiled(terms_spec(bias, problem.seqlen_k), arch))


def _scan(plan: _FwdPlan, mask: torch.Tensor, problem: Problem) -> torch.Tensor:
    """The block bits of a mask kernel view by the plan's pre-pass."""
    bits = torch.empty(plan.bits_shape, dtype=torch.uint8, device=mask.device)
    plan.bits_kernel(mask, bits, None, problem.seqlen_q, problem.seqlen_k)
    return bits


def _plan_of(
    problem: Problem,
    mask,
    bias,
    arch: str,
    key_chunks: int = 1,
    block_mask: bool = False,
    scans: bool = True,
    paged: bool = False,
) -> _FwdPlan:
    """The plan of a call; block_mask: the mask's bits are a block mask's; scans: a pre-pass
    scans the mask (not for a block mask alone); paged: K and V come from a page pool."""
    key = (
        problem, arch, hopper_kernels(arch), kernel_layout(mask), kernel_layout(bias), key_chunks,
        block_mask, scans, paged,
    )  # fmt: skip
    return remember(
        _PLANS, key,
        lambda: _plan(problem, mask, bias, arch, key_chunks, block_mask, scans, paged),
        _PLANS_MAX,
    )  # fmt: skip


class _Route(NamedTuple):
    """How a common forward call runs (flash_fwd: its outputs made here, no given bits, expiry,
    key chunks or page table; no operand copied to be read), decided once per layout key
    (_route_key) so that a repeated call only allocates, looks up what it remembers and
    launches: its plan; for a block mask alone, the constant key mask the kernel reads next
    to its bits and the persistent CTAs its items are dealt to; a persistent forward's items
    without a mask; a serial that keys the block-mask operands remembered for it."""

    plan: _FwdPlan
    block_mask_view: torch.Tensor | None
    ctas: int
    items: torch.Tensor | None
    serial: int


# Routes by layout key (None: the key's calls take the general path); cleared when full and
# with the kernels' memory cache.
_ROUTES: dict[tuple, _Route | None] = holds_kernels({})
_SERIALS = itertools.count()
# A block mask's bits and launch order per route serial, while the block mask lives.
_BLOCK_OPERANDS: dict[tuple, tuple] = {}


def _route_key(problem: Problem, q, k, v, mask, bias, block_mask, arch: str) -> tuple:
    """What a route's decisions depend on: the problem, device and kernel family, q/k/v
    strides and alignment (qkv_view), mask/bias layouts, the block mask's shape."""
    qkv = tuple((t.shape, t.stride(), t.data_ptr() % 16) for t in (q, k, v))
    blocks = None if block_mask is None else block_mask.shape
    return (
        problem, q.device, arch, hopper_kernels(arch), qkv, kernel_layout(mask),
        kernel_layout(bias), blocks,
    )  # fmt: skip


def _route(problem: Problem, q, k, v, mask, bias, block_mask, arch: str) -> _Route | None:
    """The route of a call that flash_fwd's general path would run without copying an
    operand or materializing a block mask, else None."""
    if any(qkv_view(t) is not t for t in (q, k, v)) or operand_view(bias) is not bias:
        return None
    view, blocks, mask_given = forward_operands(problem, mask, block_mask, bias, arch)
    if block_mask is not None and (blocks is None or mask_given):
        return None
    if view is not None and sum(s == 1 for s in view.stride()) > 1:  # operand_view copies
        return None
    view = operand_view(view)
    alone = block_mask is not None
    plan = _plan_of(problem, view, bias, arch, 1, alone, not alone, False)
    spec = plan.spec
    if alone and not isinstance(spec, Sm90FwdSpec):
        return None
    persistent = isinstance(spec, Sm90FwdSpec) and spec.persistent
    ctas = sm_count(q.device, arch) if persistent else 0
    items = None
    if persistent and view is None:
        items = grid_items(
            problem, spec.tile.tile_m, spec.tile.tile_n, problem.batch,
            _section_heads(spec, problem, problem.batch), ctas, q.device,
        )  # fmt: skip
    return _Route(plan, view if alone else None, ctas, items, next(_SERIALS))


def _block_operands(route: _Route, problem: Problem, block_mask: torch.Tensor) -> tuple:
    """(the kernel's bits view, its items) of a block mask alone on a route, remembered with
    the block mask."""

    def make() -> tuple:
        spec = route.plan.spec
        tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
        heads = route.block_mask_view.shape[1]
        from_blocks, _ = joint_block_bits(block_mask, None, False, problem, tile_m, tile_n, heads)
        bits = kernel_bits_view(from_blocks, -(-problem.seqlen_q // tile_m))
        sections = _section_heads(spec, problem, problem.batch)
        order = forward_items(
            block_mask, from_blocks, problem, tile_m, tile_n, sections, route.ctas
        )
        return bits, order

    return remember_for(_BLOCK_OPERANDS, block_mask, route.serial, make)


def _outputs(problem: Problem, q: torch.Tensor, out=None, lse=None, stats=None) -> tuple:
    """out, lse and stats of a forward (flash_fwd's): those given, the others made."""
    batch, heads, seqlen_q, device = problem.batch, problem.num_heads, problem.seqlen_q, q.device
    if out is None:
        out = torch.empty((batch, *q.shape[1:]), dtype=q.dtype, device=device)
    if lse is None:
        lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=device)
    if stats is None:
        stats = torch.empty(batch, heads, 2, seqlen_q, dtype=torch.float32, device=device)
    return out, lse, stats


def _bias_operands(plan: _FwdPlan, bias, problem: Problem) -> tuple:
    """(what the kernel reads as its bias, the moderate flags it reads or None): a bias row's
    terms and flags where the plan's pre-pass makes them, else the bias view and None."""
    if plan.terms_kernel is None:
        return bias, None
    terms, moderate = launch_terms(
        plan.terms_kernel, bias, plan.scalars.bias_scale, problem.seqlen_k
    )
    return terms, moderate if plan.spec.moderate_rows else None


def forward_route(
    problem: Problem, q, k, v, mask, bias, block_mask: torch.Tensor | None = None
) -> _Route | None:
    """The route of a common forward call (flash_fwd's arguments; see _Route), remembered by
    layout key; None where the call takes flash_fwd's general path, and while a CUDA graph
    is captured (whose replays hold what they read: the memos' `captured`)."""
    if capturing():
        return None
    arch = target_arch(q.device)
    key = _route_key(problem, q, k, v, mask, bias, block_mask, arch)
    return remember(
        _ROUTES, key, lambda: _route(problem, q, k, v, mask, bias, block_mask, arch), _PLANS_MAX
    )


def run_route(
    route: _Route, problem: Problem, q, k, v, mask, bias, block_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_fwd's out, lse and stats of a call on its route (forward_route of the call's
    layouts; mask/bias: 4-D views)."""
    plan = route.plan
    out, lse, stats = _outputs(problem, q)
    bias, moderate = _bias_operands(plan, bias, problem)
    view = operand_view(mask)
    if not isinstance(plan.spec, Sm90FwdSpec):
        plan.kernel(q, k, v, out, lse, stats, view, bias, *plan.scalars)
        return out, lse, stats
    bits, order = None, route.items
    if block_mask is not None:
        view = route.block_mask_view
        bits, order = _block_operands(route, problem, block_mask)
    elif plan.bits_shape is not None:
        lengths = (problem.seqlen_q, problem.seqlen_k)
        bits = remembered_bits(mask, lengths, plan.bits_spec, lambda: _scan(plan, view, problem))
        bits = bits.as_strided(plan.bits_view_shape, plan.bits_strides)
    plan.kernel(q, k, v, out, lse, stats, view, bias, bits, order, None, moderate, *plan.scalars)
    return out, lse, stats


def key_chunks_refusal(problem: Problem, mask, bias, key_chunks: int) -> str | None:
    """Why the forward cannot run `key_chunks` chunks of every row's keys as batch entries
    (flash_fwd's key_chunks), or None: the batch entries must be a multiple of the chunks and
    the mask/bias [Bm, Hm, Qm, Km] the rows' own or broadcast over them (Bm in {1,
    batch / key_chunks})."""
    if problem.batch % key_chunks:
        return f"key_chunks: {key_chunks} does not divide the batch {problem.batch}"
    rows = problem.batch // key_chunks
    for name, t in (("mask", mask), ("bias", bias)):
        if t is not None and t.shape[0] not in (1, rows):
            return (
                f"{name}: expected [1 or {rows}, Hm, Qm, Km] for {key_chunks} key chunks of "
                f"{rows} rows, got {tuple(t.shape)}"
            )
    return None


# The variant a mask view (not yet planned) would run, by problem, arch and the mask's and
# bias's layouts: what decides how a block mask is read, without a variant built per call.
_VARIANTS: dict[tuple, FwdSpec | Sm90FwdSpec] = {}


def _variant(problem: Problem, mask: torch.Tensor, bias, arch: str) -> FwdSpec | Sm90FwdSpec:
    view = operand_view(mask)
    key = (problem, arch, hopper_kernels(arch), kernel_layout(view), kernel_layout(bias))
    return remember(_VARIANTS, key, lambda: fwd_spec(problem, view, bias, arch))


def forward_operands(
    problem: Problem, mask, block_mask, bias, arch: str
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """(the mask view the forward reads, the block mask where it reads that as bits, whether
    attn_mask `mask` is ANDed into them): block_mask_launch.read_as_bits for this forward.
    mask/bias: 4-D views."""

    def tile_of(view):
        spec = _variant(problem, view, bias, arch)  # nothing compiled
        return (spec.tile.tile_m, spec.tile.tile_n) if isinstance(spec, Sm90FwdSpec) else None

    return read_as_bits(problem, mask, block_mask, tile_of)


def _section_heads(spec: Sm90FwdSpec, problem: Problem, entries: int) -> int:
    """(batch entry, head) pairs per L2 section of a Hopper forward's launch order, for
    `entries` batch entries (key chunks included)."""
    group = problem.num_heads // problem.num_heads_kv
    return spec.section_heads(problem.seqlen_k, group, entries * problem.num_heads)


def flash_fwd(
    problem: Problem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    block_mask: torch.Tensor | None = None,
    bits: torch.Tensor | None = None,
    key_expiry: torch.Tensor | None = None,
    key_chunks: int = 1,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward on CUDA tensors; returns out [B, Sq, H, D], lse [B, H, Sq] fp32 and
    the backward's softmax stats [B, H, 2, Sq] fp32 (per row: the max score in accumulator
    units and log2 of the row sum; a kernel without a bias folds the max into the sum and
    stores 0 as the max; see kernels/softmax.py).

    mask/bias are 4-D views (problem.broadcast_view); out/lse/stats may be given (e.g.
    poisoned by tests) and are written in place. block_mask: a validated block mask
    (dmattn_cute/block_mask.py), read as block bits by the Hopper kernel where its tiles nest
    in blocks, else expanded into the mask (kernels/block_mask_launch.py). bits: the mask's
    block bits as the pre-pass writes them for this variant (kernels/paired_bits.py), which
    then does not run; only without a block mask. The pre-pass's bits are remembered with
    the mask (block_bits_launch.remembered_bits), as a block mask's are. key_expiry:
    validated top-w expiry rows [Be, He, Sk] int32 (dmattn_cute/topw.py), the Hopper
    kernel's mask operand when it is the only mask, else part of the element mask
    (kernels/expiry_launch.py). key_chunks > 1
    (split-KV decode): out, lse and stats have problem.batch = B * key_chunks entries, entry
    b for chunk b % key_chunks of the key blocks of row b // key_chunks of q, k, v [B, ...]
    and mask/bias [1 or B, Hm, Qm, Km] (problem.seqlen_k: all of a row's keys); the chunks
    hold as many visible blocks each where the Hopper kernel has block bits and the row is
    short enough, else as many blocks (masking.chunk_block_range). Not with a block mask,
    bits or an expiry. block_table: int32 [B, pages per row] (the Hopper kernel only): k and
    v are a pool of pages [pages, page_size, Hkv, D] and row b's key p is slot p % page_size
    of page block_table[b, p // page_size] (problem.seqlen_k: pages per row x page_size;
    page_size a multiple of the variant's key tile, paged_tile_n). Not with a block mask,
    bits or an expiry either.
    """
    if key_chunks > 1 and (block_mask is not None or bits is not None or key_expiry is not None):
        raise ValueError("key_chunks: not with a block mask, given bits or a key expiry")
    rows = [("q", q), ("k", k), ("v", v)]
    if block_table is not None:  # k, v are page pools: the table has the rows
        _check_pages(problem, k, v, block_table, block_mask, bits, key_expiry)
        rows = [("q", q), ("block_table", block_table)]
    for name, t in rows:
        if t.shape[0] * key_chunks != problem.batch:
            raise ValueError(
                f"{name}: expected {problem.batch // key_chunks} rows for {problem.batch} batch "
                f"entries in {key_chunks} key chunks, got {t.shape[0]}"
            )
    given = (out, lse, stats, bits, key_expiry, block_table)
    if key_chunks == 1 and given == (None,) * 6:
        route = forward_route(problem, q, k, v, mask, bias, block_mask)
        if route is not None:
            return run_route(route, problem, q, k, v, mask, bias, block_mask)
    arch = target_arch(q.device)
    q, k, v = qkv_view(q), qkv_view(k), qkv_view(v)
    bias = operand_view(bias)
    expiry = None  # the expiry view, where the kernel reads it as its mask
    if key_expiry is not None:
        view = broadcast_view(key_expiry)
        alone = mask is None and block_mask is None and hopper_kernels(arch)
        if alone and isinstance(_variant(problem, view, bias, arch), Sm90FwdSpec):
            expiry = mask = view
        else:
            mask = expiry_launch.element_mask(mask, key_expiry, problem)
    # blocks: the block mask, where the kernel reads it as bits
    mask4, blocks, mask_given = forward_operands(problem, mask, block_mask, bias, arch)
    mask = operand_view(mask4)
    out, lse, stats = _outputs(problem, q, out, lse, stats)
    scans = blocks is None or mask_given  # (a block mask alone needs no pre-pass)
    paged = block_table is not None
    if paged and k.shape[1] % (tile_n := paged_tile_n(problem, mask, bias, arch) or 1):
        raise ValueError(
            f"block_table: page_size {k.shape[1]} is not a multiple of the key tile {tile_n}"
        )
    plan = _plan_of(problem, mask, bias, arch, key_chunks, blocks is not None, scans, paged)
    bias, moderate = _bias_operands(plan, bias, problem)
    if expiry is not None:
        tile = plan.spec.tile
        bits = expiry_launch.expiry_bits(key_expiry, problem, tile.tile_m, tile.tile_n)
        plan.kernel(q, k, v, out, lse, stats, mask, bias, bits, None, None, None, *plan.scalars)
    elif plan.bits_shape is not None:
        if bits is not None:
            if blocks is not None or tuple(bits.shape) != plan.bits_shape:
                raise ValueError(f"bits: expected {plan.bits_shape}, got {tuple(bits.shape)}")
        elif scans:
            bits = remembered_bits(
                mask4, (problem.seqlen_q, problem.seqlen_k), plan.bits_spec,
                lambda: _scan(plan, mask, problem),
            )  # fmt: skip
        order = None
        if blocks is None:
            bits = bits.as_strided(plan.bits_view_shape, plan.bits_strides)
        else:
            spec = plan.spec
            tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
            from_blocks, bits = joint_block_bits(
                blocks, bits, mask_given, problem, tile_m, tile_n, mask.shape[1]
            )
            bits = kernel_bits_view(bits, -(-problem.seqlen_q // tile_m))
            ctas = sm_count(q.device, arch) if spec.persistent else 0
            order = forward_items(
                blocks, from_blocks, problem, tile_m, tile_n,
                _section_heads(spec, problem, problem.batch), ctas,
            )  # fmt: skip
        plan.kernel(
            q, k, v, out, lse, stats, mask, bias, bits, order, block_table, None, *plan.scalars
        )  # fmt: skip
    elif isinstance(plan.spec, Sm90FwdSpec):
        items = None
        spec = plan.spec
        if spec.persistent:
            items = grid_items(
                problem, spec.tile.tile_m, spec.tile.tile_n, out.shape[0],
                _section_heads(spec, problem, out.shape[0]), sm_count(q.device, arch), q.device,
            )  # fmt: skip
        plan.kernel(
            q, k, v, out, lse, stats, mask, bias, None, items, block_table, moderate,
            *plan.scalars,
        )  # fmt: skip
    else:
        plan.kernel(q, k, v, out, lse, stats, mask, bias, *plan.scalars)
    return out, lse, stats


def _check_pages(problem: Problem, k, v, block_table, block_mask, bits, key_expiry) -> None:
    """flash_fwd's block_table against its page pools k, v."""
    if block_mask is not None or bits is not None or key_expiry is not None:
        raise ValueError("block_table: not with a block mask, given bits or a key expiry")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(
            f"block_table: expected int32 [B, pages per row], got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    if v.shape != k.shape or k.shape[1] * block_table.shape[1] != problem.seqlen_k:
        raise ValueError(
            f"k, v: expected page pools [pages, page_size, Hkv, D] with page_size x "
            f"{block_table.shape[1]} pages = {problem.seqlen_k} keys per row, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )


def paged_tile_n(
    problem: Problem, mask: torch.Tensor | None, bias: torch.Tensor | None, arch: str
) -> int | None:
    """The key tile a paged forward of this problem would read (its pages must hold a whole
    number of them), or None where no kernel of `arch` reads pages (mask/bias: 4-D views)."""
    if not hopper_kernels(arch):
        return None
    return _variant(problem, mask, operand_view(bias), arch).tile.tile_n  # (remembered)


__all__ = [
    "flash_fwd",
    "forward_family",
    "forward_operands",
    "forward_route",
    "forward_spec_of",
    "forward_variants",
    "fwd_spec",
    "key_chunks_refusal",
    "paged_tile_n",
    "run_route",
]
