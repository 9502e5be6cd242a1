"""Launch orders of the Hopper kernels' CTAs: the most work first.

The block scheduler starts CTAs in launch order as SMs free up. Where their work differs (the
backward's walks under causal/window limits; a block mask whose query rows or key columns hold
different numbers of visible blocks: at density 0.25 over 32 blocks, some hold twice the
average), grid order ends with long CTAs running beside idle SMs. Sorted most work first, the
short ones fill in behind the long ones. An order is int32 [items]: the CTA at launch position
i takes item order[i] (its kernel's docstring says how an item is numbered).
"""

from __future__ import annotations

import torch

from ..block_mask import visible_blocks
from ..memo import remember, remember_for
from ..problem import Problem
from .masking import VISIBLE


def sorted_items(work: torch.Tensor, per_section: int) -> torch.Tensor:
    """int32 order of the items of work [rows, n] (item r * n + c has work[r, c]): sections
    of `per_section` rows, in row order, each sorted by work, most first, ties in item
    order. Sections keep the CTAs that run at once on a few rows' operands (L2)."""
    n = work.shape[1]
    by_work = torch.argsort(-work.flatten(), stable=True)
    section = by_work // n // max(per_section, 1)
    return by_work[torch.argsort(section, stable=True)].to(torch.int32)


def walked_tiles(
    problem: Problem, tile_m: int, tile_n: int, device, bits: torch.Tensor | None = None
) -> torch.Tensor:
    """bool [query tiles, key tiles] of the (tile_m, tile_n) tiles a kernel walks under the
    problem's causal/window limits; with block bits [Bm, Hm, query tiles or 1, key tiles],
    [Bm, Hm, query tiles, key tiles] of those that are also visible."""
    limits = visible_blocks(
        problem.seqlen_q, problem.seqlen_k, problem.is_causal, problem.window_left,
        problem.window_right, device, tile_m, tile_n,
    )  # fmt: skip
    return limits if bits is None else limits & (bits & VISIBLE).bool()


def _per_head(counts: torch.Tensor, heads: int) -> torch.Tensor:
    """counts [Bm, Hm, ...] with Hm in {1, heads / g, heads} as [Bm, heads, ...] (mask head
    h // g of head h)."""
    if 1 < counts.shape[1] < heads:
        return counts.repeat_interleave(heads // counts.shape[1], 1)
    return counts.expand(counts.shape[0], heads, *counts.shape[2:])


# Orders of live block masks (memo.remember_for), by kernel, problem, tiles and sections.
_MASK_ORDERS: dict[tuple, torch.Tensor] = {}
# Orders of the backward's causal/window limits alone, by problem, tiles and sections.
_LIMIT_ORDERS: dict[tuple, torch.Tensor] = {}


def forward_order(
    block_mask: torch.Tensor,
    bits: torch.Tensor,
    problem: Problem,
    tile_m: int,
    tile_n: int,
    section_heads: int,
) -> torch.Tensor:
    """int32 [B * H * query tiles]: the Hopper forward's (batch, query head, query tile)
    items, as (b * H + h) * query tiles + query tile, in sections of `section_heads` (batch,
    head) pairs (h fastest; Sm90FwdSpec.section_heads), each by the key tiles its bits [Bm,
    Hm, query tiles or 1, key tiles] (of `block_mask`, block_mask_launch.block_bits) and the
    limits leave it, most first. Memoized per block mask, as its bits are."""

    def make() -> torch.Tensor:
        return sorted_items(_visible_counts(bits, problem, tile_m, tile_n), section_heads)

    key = ("fwd", problem, tile_m, tile_n, section_heads)
    return remember_for(_MASK_ORDERS, block_mask, key, make, graphs=True)


def _visible_counts(bits: torch.Tensor, problem: Problem, tile_m: int, tile_n: int):
    """[B * H, query tiles]: the key tiles the bits and the limits leave each forward item."""
    counts = walked_tiles(problem, tile_m, tile_n, bits.device, bits).sum(3)
    batch, heads = problem.batch, problem.num_heads
    return _per_head(counts, heads).expand(batch, heads, -1).reshape(batch * heads, -1)


def forward_items(
    block_mask: torch.Tensor,
    bits: torch.Tensor,
    problem: Problem,
    tile_m: int,
    tile_n: int,
    section_heads: int,
    ctas: int = 0,
) -> torch.Tensor:
    """int32 [items, 4]: forward_order's items (same arguments) decoded, (query tile, head,
    batch, all visible) per launch position, all visible 1 where the limits leave the item
    only key tiles its block mask shows (a block mask alone's dense walk, known without
    reading bits): a 16-byte row the Hopper forward loads at once, with no integer division
    and no bits read before its first TMAs. With `ctas` (a persistent forward), the same
    items as int32 [CTAs, items per CTA, 4] (per_cta). Memoized per block mask, as the order
    is."""

    def make() -> torch.Tensor:
        # the order as forward_order makes it, from the same counts (one memo entry per mask)
        counts = _visible_counts(bits, problem, tile_m, tile_n)
        items = sorted_items(counts, section_heads).long()
        walked = walked_tiles(problem, tile_m, tile_n, bits.device).sum(1)  # per query tile
        shown = (counts == walked).flatten()
        decoded = _decoded(items, shown[items].long(), problem, tile_m)
        return per_cta(decoded, ctas) if ctas else decoded

    key = ("fwd items", problem, tile_m, tile_n, section_heads, ctas)
    return remember_for(_MASK_ORDERS, block_mask, key, make, graphs=True)


# Persistent forwards' items without a block mask, by problem, tiles, batch entries, sections,
# CTAs and device.
_GRID_ITEMS: dict[tuple, torch.Tensor] = {}


def grid_items(
    problem: Problem,
    tile_m: int,
    tile_n: int,
    entries: int,
    section_heads: int,
    ctas: int,
    device: torch.device,
) -> torch.Tensor:
    """int32 [CTAs, items per CTA, 4]: a persistent forward's items without a block mask,
    (query tile, head, batch entry, 0) for `entries` batch entries (key chunks included), in
    sections of `section_heads` (entry, head) pairs, each by the key tiles the causal/window
    limits leave the query tile, most first (without limits, all alike: item order), dealt
    by per_cta. Memoized."""

    def make() -> torch.Tensor:
        work = walked_tiles(problem, tile_m, tile_n, device).sum(1)  # [query tiles]
        work = work.expand(entries * problem.num_heads, work.shape[0])
        items = sorted_items(work, section_heads).long()
        return per_cta(_decoded(items, torch.zeros_like(items), problem, tile_m), ctas)

    key = (problem, tile_m, tile_n, entries, section_heads, ctas, device)
    return remember(_GRID_ITEMS, key, make, 64, graphs=True)


def _decoded(items: torch.Tensor, flags: torch.Tensor, problem: Problem, tile_m: int):
    """int32 [items, 4] of int64 items (b * H + h) * query tiles + query tile: (query tile,
    head, batch, flag) per item."""
    m_tiles, heads = -(-problem.seqlen_q // tile_m), problem.num_heads
    fields = (items % m_tiles, items // m_tiles % heads, items // (m_tiles * heads), flags)
    return torch.stack(fields, 1).to(torch.int32)


def per_cta(items: torch.Tensor, ctas: int) -> torch.Tensor:
    """items [n, 4] (most work first) dealt to min(ctas, n) persistent CTAs as [CTAs, waves,
    4]: wave w takes the next CTAs-many items, every other wave dealt in reverse (CTA 0
    takes the first of wave 0, the last of wave 1, ...), so that each CTA's sum of work is
    about even; the last wave's missing items are rows of -1 (past a CTA's last item)."""
    n = items.shape[0]
    ctas = max(1, min(ctas, n))
    waves = -(-n // ctas)
    dealt = items.new_full((waves * ctas, 4), -1)
    dealt[:n] = items
    dealt = dealt.view(waves, ctas, 4)
    dealt[1::2] = dealt[1::2].flip(1)
    return dealt.transpose(0, 1).contiguous()


def walk_order(
    problem: Problem,
    tile_m: int,
    tile_n: int,
    ctas_per_item: int,
    sms: int,
    device,
    block_mask: torch.Tensor | None = None,
    bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 [B * Hkv * key tiles]: the Hopper backward's (batch, kv head, key tile) items, as
    (b * Hkv + kv head) * key tiles + key tile, by the query tiles their walks visit (of all
    the group's heads), most first, ties in grid order; in sections of (batch, kv head)s
    whose CTAs (`ctas_per_item` each) make about two waves on `sms` SMs. Under causal limits
    every run of key tiles in grid order holds the whole triangle. Without a block mask, by
    the limits alone, made once per problem and tile; with one, also by its bits (as
    forward_order takes them), memoized per block mask."""
    n_tiles = -(-problem.seqlen_k // tile_n)
    waves = -(-2 * sms // ctas_per_item)  # key tiles of two waves
    per_section = max(1, waves // n_tiles)
    items = problem.batch * problem.num_heads_kv

    def make() -> torch.Tensor:
        if block_mask is None:
            steps = walked_tiles(problem, tile_m, tile_n, "cpu").sum(0)
            return sorted_items(steps.expand(items, -1), per_section).to(device)
        steps = walked_tiles(problem, tile_m, tile_n, bits.device, bits).sum(2)
        heads, heads_kv = problem.num_heads, problem.num_heads_kv
        steps = _per_head(steps, heads).unflatten(1, (heads_kv, heads // heads_kv)).sum(2)
        steps = steps.expand(problem.batch, -1, -1).reshape(items, -1)
        return sorted_items(steps, per_section)

    key = ("bwd", problem, tile_m, tile_n, per_section, torch.device(device))
    if block_mask is None:
        return remember(_LIMIT_ORDERS, key, make, graphs=True)
    return remember_for(_MASK_ORDERS, block_mask, key, make, graphs=True)


__all__ = [
    "forward_items",
    "forward_order",
    "per_cta",
    "sorted_items",
    "walk_order",
    "walked_tiles",
]
