"""Launch orders of the Hopper kernels' CTAs (kernels/launch_order.py): sections in row order,
each sorted by work, most first, ties in item order; a block mask's orders against visible
tile counts brute-forced from its element mask; memoized per block mask; and the launches
that pass them (a block mask, not deterministic) or not."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.kernels.block_mask_launch import block_bits
from dmattn_cute.kernels.fwd_launch import flash_fwd
from dmattn_cute.kernels.launch_order import (
    forward_order,
    grid_items,
    per_cta,
    sorted_items,
    walk_order,
)
from dmattn_cute.problem import Problem, make_problem
from dmattn_cute.reference import visible_mask
from tests.test_block_mask import element_mask, random_block_mask
from tests.utils import launch_block_mask, random_inputs


def check_sorted(order: torch.Tensor, work: torch.Tensor, per_section: int) -> None:
    """order: every item of work [rows, n] once; sections of per_section rows in row order,
    each by work, most first, ties in item order."""
    rows, n = work.shape
    assert order.dtype == torch.int32
    assert sorted(order.tolist()) == list(range(rows * n))
    flat = work.flatten()
    for part in order.long().split(per_section * n):
        first = part.min() // n // per_section * per_section * n
        assert sorted(part.tolist()) == list(range(first, first + len(part)))
        ranked = flat[part]
        assert (ranked[:-1] >= ranked[1:]).all()
        ties = ranked[:-1] == ranked[1:]
        assert (part[:-1][ties] < part[1:][ties]).all()


@pytest.mark.parametrize("per_section", [1, 2, 3, 7])
def test_sorted_items(per_section: int) -> None:
    work = torch.randint(0, 5, (7, 6))
    check_sorted(sorted_items(work, per_section), work, per_section)


def problem_of(seqlen_q, seqlen_k, heads, heads_kv, causal, window=(-1, -1)) -> Problem:
    q, k, v, _, _ = random_inputs(2, seqlen_q, seqlen_k, heads, heads_kv, 64, torch.bfloat16,
                                  "meta")  # fmt: skip
    problem, _, _ = make_problem(q, k, v, None, None, None, causal, 0.0, window, False)
    return problem


def tile_counts(block_mask, problem, tile_m, tile_n) -> torch.Tensor:
    """int [B, H, query tiles, key tiles]: whether each tile has a visible (query, key) pair
    of the block mask's element mask under the limits (brute force)."""
    sq, sk, heads = problem.seqlen_q, problem.seqlen_k, problem.num_heads
    window = (problem.window_left, problem.window_right)
    seen = element_mask(block_mask, sq, sk).expand(-1, -1, sq, -1)
    seen = seen.repeat_interleave(heads // block_mask.shape[1], 1).expand(problem.batch, -1, -1, -1)
    seen = seen & visible_mask(None, 1, 1, sq, sk, problem.is_causal, window)[0, 0]
    m_tiles, n_tiles = -(-sq // tile_m), -(-sk // tile_n)
    pad = torch.zeros(*seen.shape[:2], m_tiles * tile_m, n_tiles * tile_n, dtype=torch.bool)
    pad[:, :, :sq, :sk] = seen
    return pad.unflatten(3, (n_tiles, tile_n)).unflatten(2, (m_tiles, tile_m)).any(5).any(3).int()


CASES = [
    # (Sq, Sk, H, Hkv, block mask [Bm, Hm, Mq, Mk] rows and heads, causal, window)
    (1000, 1100, 4, 2, (2, 2, 8), False, (-1, -1)),
    (1000, 1100, 4, 2, (1, 4, 8), True, (-1, -1)),
    (700, 1000, 6, 2, (2, 1, 1), True, (-1, -1)),  # one row of blocks for every query block
    (900, 900, 4, 4, (1, 4, 8), False, (300, 100)),
]


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "heads", "heads_kv", "mask", "causal", "window"),
                         CASES)  # fmt: skip
@pytest.mark.parametrize("section", [1, 3, 100])
def test_forward_order_sorts_query_tiles_by_visible_key_tiles(
    seqlen_q, seqlen_k, heads, heads_kv, mask, causal, window, section
) -> None:
    problem = problem_of(seqlen_q, seqlen_k, heads, heads_kv, causal, window)
    bm, hm, rows = mask
    block_mask = random_block_mask((bm, hm, rows, -(-seqlen_k // 128)), 0.4, "cpu")
    tile_m, tile_n = 64, 128
    bits = block_bits(block_mask, problem, tile_m, tile_n, hm)
    order = forward_order(block_mask, bits, problem, tile_m, tile_n, section)
    counts = tile_counts(block_mask, problem, tile_m, tile_n).sum(3)  # [B, H, query tiles]
    check_sorted(order, counts.flatten(0, 1), min(section, 2 * heads))
    assert forward_order(block_mask, bits, problem, tile_m, tile_n, section) is order


@pytest.mark.parametrize(("items", "ctas"), [(10, 4), (12, 4), (3, 8), (1, 1), (9, 9)])
def test_per_cta_deals_waves_in_turn(items: int, ctas: int) -> None:
    """Every item once; wave w of CTA c is item w * CTAs + c, or (odd waves) w * CTAs +
    CTAs - 1 - c; past the last item, rows of -1 that end a CTA's list."""
    rows = torch.stack([torch.arange(items, dtype=torch.int32)] * 4, 1)
    dealt = per_cta(rows, ctas)
    n = min(ctas, items)
    waves = -(-items // n)
    assert dealt.shape == (n, waves, 4) and dealt.is_contiguous()
    for c in range(n):
        for w in range(waves):
            index = w * n + (n - 1 - c if w % 2 else c)
            want = rows[index] if index < items else torch.full((4,), -1, dtype=torch.int32)
            assert torch.equal(dealt[c, w], want)
    ends = dealt[:, :, 0] < 0
    assert not ends[:, :-1].any() and int(ends.sum()) == n * waves - items


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "heads", "heads_kv", "mask", "causal", "window"),
                         CASES)  # fmt: skip
@pytest.mark.parametrize("sms", [2, 132])
def test_walk_order_sorts_key_tiles_by_their_groups_visible_tiles(
    seqlen_q, seqlen_k, heads, heads_kv, mask, causal, window, sms
) -> None:
    """With a block mask, the backward's items by the visible tiles of their walk: the query
    tiles of a key tile's column, summed over the group's query heads."""
    problem = problem_of(seqlen_q, seqlen_k, heads, heads_kv, causal, window)
    bm, hm, rows = mask
    n_tiles = -(-seqlen_k // 128)
    block_mask = random_block_mask((bm, hm, rows, n_tiles), 0.4, "cpu")
    tile_m, tile_n = 64, 128
    bits = block_bits(block_mask, problem, tile_m, tile_n, hm)
    order = walk_order(problem, tile_m, tile_n, 1, sms, "cpu", block_mask, bits)
    steps = tile_counts(block_mask, problem, tile_m, tile_n).sum(2)  # [B, H, key tiles]
    steps = steps.unflatten(1, (heads_kv, heads // heads_kv)).sum(2).flatten(0, 1)
    check_sorted(order, steps, max(1, -(-2 * sms // 1) // n_tiles))
    assert walk_order(problem, tile_m, tile_n, 1, sms, "cpu", block_mask, bits) is order
    block_mask[0, 0, 0, 0] = ~block_mask[0, 0, 0, 0]  # in place: a new order
    bits = block_bits(block_mask, problem, tile_m, tile_n, hm)
    assert walk_order(problem, tile_m, tile_n, 1, sms, "cpu", block_mask, bits) is not order


@pytest.mark.parametrize("causal", [False, True])
def test_forward_launch_passes_the_block_masks_order(launches, causal) -> None:
    """The Hopper forward with a block mask gets its order (memoized with the block mask);
    without one, none (grid order, or longest_first's under causal limits)."""
    block_mask = random_block_mask((2, 2, 3, 5), 0.5, "cpu")
    block_mask[0, :, 1] = True  # rows with every key tile visible (and more under causal)
    problem, _ = launch_block_mask(64, None, block_mask, causal=causal)
    ((spec, args),) = launches["calls"]
    assert spec.ordered and spec.persistent  # a block mask alone, D64: O fits beside Q
    tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
    m_tiles = -(-300 // tile_m)
    dealt = args[9]  # per CTA (min(132 planning SMs, items) of them), in waves
    assert dealt.dtype == torch.int32 and dealt.is_contiguous()
    assert dealt.shape == (2 * 4 * m_tiles, 1, 4)
    items = dealt[:, 0]  # decoded: (query tile, head, batch, all visible) per launch position
    order = (items[:, 2] * 4 + items[:, 1]) * m_tiles + items[:, 0]
    seen = tile_counts(block_mask, problem, tile_m, tile_n)
    check_sorted(order.to(torch.int32), seen.sum(3).flatten(0, 1), spec.section_heads(520, 2, 8))
    walked = tile_counts(torch.ones_like(block_mask), problem, tile_m, tile_n)
    shown = (seen == walked).all(3).flatten()[order.long()]
    assert shown.any() and not shown.all()
    assert torch.equal(items[:, 3], shown.to(torch.int32))
    launch_block_mask(64, None, block_mask, causal=causal)
    assert launches["calls"][-1][1][9] is dealt
    launch_block_mask(64, None, None, causal=causal)
    spec, args = launches["calls"][-1]
    assert not spec.ordered and args[9] is None


@pytest.mark.parametrize(
    ("causal", "deterministic"), [(False, False), (True, False), (False, True)]
)
def test_backward_launch_passes_the_block_masks_order(launches, causal, deterministic) -> None:
    block_mask = random_block_mask((2, 2, 3, 5), 0.5, "cpu")
    launch_block_mask(64, None, block_mask, True, causal, deterministic)
    spec, args = launches["calls"][-1]
    assert spec.ordered == (not deterministic)
    order = args[15]
    if deterministic:
        assert order is None
        return
    n_tiles = -(-520 // spec.tile.tile_n)
    assert sorted(order.tolist()) == list(range(2 * 2 * n_tiles))
    launch_block_mask(64, None, block_mask, True, causal, deterministic)
    assert launches["calls"][-1][1][15] is order
    launch_block_mask(64, None, None, True, causal, deterministic)
    spec, args = launches["calls"][-1]
    assert spec.ordered == causal and (args[15] is None) == (not causal)


@pytest.mark.parametrize(
    ("causal", "window"), [(False, (-1, -1)), (True, (-1, -1)), (False, (300, 100))]
)
@pytest.mark.parametrize("section", [1, 3, 100])
def test_grid_items_sort_query_tiles_by_walked_key_tiles(causal, window, section) -> None:
    """A persistent forward without a block mask: every (query tile, head, batch entry)
    once, sorted by the key tiles its limits leave it, most first, in sections (per_cta's
    deal undone); memoized."""
    problem = problem_of(1000, 1100, 4, 2, causal, window)
    tile_m, tile_n, ctas = 64, 128, 7
    dealt = grid_items(problem, tile_m, tile_n, 2, section, ctas, torch.device("cpu"))
    assert grid_items(problem, tile_m, tile_n, 2, section, ctas, torch.device("cpu")) is dealt
    waves = dealt.transpose(0, 1).clone()
    waves[1::2] = waves[1::2].flip(1)
    items = waves.flatten(0, 1)
    items = items[items[:, 0] >= 0]
    m_tiles = -(-1000 // tile_m)
    assert not items[:, 3].any()
    order = (items[:, 2] * 4 + items[:, 1]) * m_tiles + items[:, 0]
    counts = tile_counts(torch.ones(1, 1, 1, 9, dtype=torch.bool), problem, tile_m, tile_n)
    check_sorted(order.to(torch.int32), counts.sum(3).flatten(0, 1), min(section, 8))


@pytest.mark.parametrize(
    ("head_dim", "causal", "persistent"),
    [(128, False, True), (128, True, True), (64, False, False)],
)
def test_forward_launch_passes_grid_items_to_a_persistent_kernel(
    launches, head_dim, causal, persistent
) -> None:
    """Without a mask and with two consumers (D128; D64 runs three) the Hopper forward is
    persistent: the launch passes grid_items (132 planning SMs); else none (one CTA per
    item, in the kernel's own order)."""
    q, k, v, _, _ = random_inputs(2, 300, 520, 4, 2, head_dim, torch.bfloat16, "cpu")
    problem, _, _ = make_problem(q, k, v, None, None, None, causal, 0.0, (-1, -1), False)
    flash_fwd(problem, q, k, v, None, None)
    ((spec, args),) = launches["calls"]
    assert spec.persistent == persistent
    if persistent:
        tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
        m_tiles = -(-300 // tile_m)
        sections = spec.section_heads(520, 2, 8)
        assert args[9] is grid_items(problem, tile_m, tile_n, 2, sections, 132, q.device)
        assert args[9].shape == (2 * 4 * m_tiles, 1, 4)
    else:
        assert args[9] is None
