"""flash_dmattn_with_kvcache: the new keys and values land in the cache in place, and the
attention equals flash_dmattn_func's reference over each row's own keys (its first
cache_seqlens[b] + Snew), causal and window aligned to that length, mask and bias by cache
position. On CPU tensors (the reference path) and, marked gpu, on CUDA (the kernels)."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute import flash_dmattn_with_kvcache
from dmattn_cute.reference import attention_ref
from tests.utils import check_close

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_cache(device, batch=3, cache_len=40, heads=4, heads_kv=2, head_dim=32, rows=None,
               dtype=torch.bfloat16, seed=0):  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    cache_rows = batch if rows is None else rows
    return {
        "q": lambda sq: normal(batch, sq, heads, head_dim),
        "k_cache": normal(cache_rows, cache_len, heads_kv, head_dim),
        "v_cache": normal(cache_rows, cache_len, heads_kv, head_dim),
        "new": lambda snew: (normal(batch, snew, heads_kv, head_dim),
                             normal(batch, snew, heads_kv, head_dim)),
        "gen": gen,
    }  # fmt: skip


def expected(q, k_cache, v_cache, rows, lengths, mask, bias, **options):
    """Per batch row b: the references (fp32, and in q's dtype) over the first lengths[b]
    keys of cache row rows[b]; mask and bias sliced alike. Returns (out, lse, out_lowp)."""
    outs, lses, lowps = [], [], []
    for b, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        keys, values = k_cache[row : row + 1, :length], v_cache[row : row + 1, :length]
        m = None if mask is None else mask[b if mask.shape[0] > 1 else 0][None, ..., :length]
        if m is not None and mask.shape[-1] == 1:
            m = mask[b if mask.shape[0] > 1 else 0][None]
        bb = None if bias is None else bias[b if bias.shape[0] > 1 else 0][None, ..., :length]
        if bb is not None and bias.shape[-1] == 1:
            bb = bias[b if bias.shape[0] > 1 else 0][None]
        qb = q[b : b + 1]
        if length == 0:  # no key at all: zero output, -inf lse
            outs.append(torch.zeros_like(qb, dtype=torch.float32))
            lses.append(torch.full((1, q.shape[2], q.shape[1]), float("-inf")))
            lowps.append(torch.zeros_like(qb))
            continue
        out, lse = attention_ref(qb, keys, values, m, bb, compute_dtype=torch.float32, **options)
        lowp, _ = attention_ref(qb, keys, values, m, bb, compute_dtype=None, **options)
        outs.append(out)
        lses.append(lse.cpu())
        lowps.append(lowp)
    return torch.cat(outs), torch.cat(lses), torch.cat(lowps)


CASES = {
    "decode": {"sq": 1, "snew": 1, "lengths": [0, 17, 39]},
    "decode-causal-window": {"sq": 1, "snew": 1, "lengths": [5, 20, 39], "is_causal": True,
                             "window_size": (8, 0)},
    "chunk-causal": {"sq": 5, "snew": 5, "lengths": [0, 9, 35], "is_causal": True},
    "queries-without-new-keys": {"sq": 3, "snew": 0, "lengths": [4, 40, 12], "is_causal": True},
    "mask-bias": {"sq": 2, "snew": 2, "lengths": [3, 21, 30], "mask": (3, 2, 2, 40),
                  "bias": (1, 4, 1, 40)},
    "key-mask-softcap": {"sq": 1, "snew": 1, "lengths": [10, 0, 38], "mask": (3, 1, 40),
                         "softcap": 3.0},
    "batch-idx": {"sq": 2, "snew": 1, "lengths": [6, 30, 2], "rows": [4, 0, 2],
                  "is_causal": True},
}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_over_each_rows_keys(case, device):
    rows = case.get("rows")
    data = make_cache(device, rows=None if rows is None else 5)
    q = data["q"](case["sq"])
    k_new, v_new = data["new"](case["snew"])
    k_cache, v_cache = data["k_cache"], data["v_cache"]
    before = (k_cache.clone(), v_cache.clone())
    gen = data["gen"]
    mask = bias = None
    if "mask" in case:
        mask = torch.rand(case["mask"], generator=gen, device=device) < 0.6
    if "bias" in case:
        bias = torch.randn(case["bias"], generator=gen, device=device, dtype=q.dtype)
    lengths = torch.tensor(case["lengths"], dtype=torch.int32, device=device)
    options = {key: case[key] for key in ("is_causal", "window_size", "softcap") if key in case}
    out, lse = flash_dmattn_with_kvcache(
        q, k_cache, v_cache, k_new if case["snew"] else None, v_new if case["snew"] else None,
        cache_seqlens=lengths, attn_mask=mask, attn_bias=bias,
        cache_batch_idx=None if rows is None else torch.tensor(rows, device=device),
        return_lse=True, **options,
    )  # fmt: skip

    # the cache: the new rows written after each row's keys, everything else untouched
    cache_rows = list(range(q.shape[0])) if rows is None else rows
    want_k, want_v = before[0].clone(), before[1].clone()
    for b, (row, length) in enumerate(zip(cache_rows, case["lengths"], strict=True)):
        want_k[row, length : length + case["snew"]] = k_new[b]
        want_v[row, length : length + case["snew"]] = v_new[b]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)

    totals = [length + case["snew"] for length in case["lengths"]]
    ref, ref_lse, lowp = expected(q, k_cache, v_cache, cache_rows, totals, mask, bias, **options)
    check_close("out", out, ref, lowp, q.dtype)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=2e-3, atol=2e-3)
    for b, total in enumerate(totals):
        if total == 0:  # a row with no key: exactly zero, lse -inf
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            assert lse[b].isneginf().all()


@pytest.mark.parametrize("device", DEVICES)
def test_default_lengths_are_the_whole_cache(device):
    data = make_cache(device)
    q = data["q"](2)
    k_cache, v_cache = data["k_cache"], data["v_cache"]
    out = flash_dmattn_with_kvcache(q, k_cache, v_cache, is_causal=True)
    ref, _, lowp = expected(q, k_cache, v_cache, range(3), [40] * 3, None, None, is_causal=True)
    check_close("out", out, ref, lowp, q.dtype)


FULL_CASES = {
    "chunk-window-mask-bias": {"sq": 3, "snew": 3, "window_size": (8, 2), "mask": (3, 1, 40),
                               "bias": (3, 2, 1, 40)},
    "chunk-causal-query-bias": {"sq": 4, "snew": 2, "is_causal": True, "bias": (1, 4, 4, 40)},
    "decode-left-window": {"sq": 1, "snew": 1, "window_size": (8, -1)},
    "decode-causal-mask-bias": {"sq": 1, "snew": 1, "is_causal": True, "mask": (3, 2, 1, 40),
                                "bias": (3, 2, 1, 40)},
}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FULL_CASES.values(), ids=FULL_CASES.keys())
def test_int_lengths_that_fill_the_cache(case, device):
    """An int cache_seqlens that fills every row: no lengths mask, the kernels' own causal /
    window limits (one query per row: packed, a left window still as a mask)."""
    data = make_cache(device)
    q = data["q"](case["sq"])
    k_new, v_new = data["new"](case["snew"])
    k_cache, v_cache, gen = data["k_cache"], data["v_cache"], data["gen"]
    mask = bias = None
    if "mask" in case:
        mask = torch.rand(case["mask"], generator=gen, device=device) < 0.6
    if "bias" in case:
        bias = torch.randn(case["bias"], generator=gen, device=device, dtype=q.dtype)
    options = {key: case[key] for key in ("is_causal", "window_size") if key in case}
    out, lse = flash_dmattn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=40 - case["snew"], attn_mask=mask,
        attn_bias=bias, return_lse=True, **options,
    )  # fmt: skip
    assert torch.equal(k_cache[:, 40 - case["snew"] :], k_new)
    ref, ref_lse, lowp = expected(q, k_cache, v_cache, range(3), [40] * 3, mask, bias, **options)
    check_close("out", out, ref, lowp, q.dtype)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=2e-3, atol=2e-3)


BAD_CALLS = {
    "k-without-v": ({"k": "new_k"}, ValueError, "k, v: expected both or neither"),
    "lengths-overflow": ({"k": "new_k", "v": "new_v", "cache_seqlens": 40}, ValueError,
                         r"cache_seqlens: expected lengths in \[0, Sk_cache - Snew\]"),
    "lengths-shape": ({"cache_seqlens": "short"}, ValueError, "cache_seqlens: expected an int"),
    "lengths-float": ({"cache_seqlens": 1.5}, TypeError, "cache_seqlens: expected an int"),
    "paged-with-batch-idx": ({"block_table": "table", "cache_batch_idx": "rows"}, ValueError,
                             "cache_batch_idx: not with block_table"),
    "paged-page-range": ({"block_table": "bad_table"}, ValueError,
                         r"block_table: expected pages in \[0, 3\)"),
    "cache-dtype": ({"k_cache": "fp16"}, TypeError, "k_cache: expected dtype"),
    "batch-idx-repeat": ({"cache_batch_idx": "repeat"}, ValueError, "distinct rows"),
    "mask-keys": ({"attn_mask": "short"}, ValueError, r"attn_mask: expected dim 3 \(keys\)"),
}  # fmt: skip


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_input_raises_before_writing(call):
    data = make_cache("cpu")
    q, (k_new, v_new) = data["q"](1), data["new"](1)
    args = {"k_cache": data["k_cache"], "v_cache": data["v_cache"]}
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    values = {
        "new_k": k_new, "new_v": v_new, "short": torch.tensor([1, 2]),
        "table": torch.zeros(3, 4, dtype=torch.int32),
        "fp16": data["k_cache"].half(), "repeat": torch.tensor([0, 0, 1]),
        "rows": torch.tensor([0, 1, 2]), "bad_table": torch.full((3, 2), 7),
    }  # fmt: skip
    kwargs, error, message = call
    for key, value in kwargs.items():
        args[key] = values.get(value, value) if isinstance(value, str) else value
    if kwargs.get("attn_mask") == "short":
        args["attn_mask"] = torch.ones(3, 2, 1, 39, dtype=torch.bool)
    with pytest.raises(error, match=message):
        flash_dmattn_with_kvcache(q, **args)
    assert torch.equal(data["k_cache"], before[0]) and torch.equal(data["v_cache"], before[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_paged_cache_matches_the_contiguous_one(device, causal):
    """A paged cache (pages of 8 slots in a shuffled pool) gives the contiguous cache's
    output and receives the new keys and values in the right pages."""
    data = make_cache(device)
    q, (k_new, v_new) = data["q"](2), data["new"](2)
    k_flat, v_flat = data["k_cache"], data["v_cache"]  # [3, 40, Hkv, D]
    page_size, per_row = 8, 5
    order = torch.randperm(3 * per_row, generator=torch.Generator().manual_seed(1))
    table = order.view(3, per_row).to(device)
    k_pages = torch.empty(3 * per_row, page_size, *k_flat.shape[2:], device=device,
                          dtype=k_flat.dtype)  # fmt: skip
    v_pages = torch.empty_like(k_pages)
    k_pages[table] = k_flat.view(3, per_row, page_size, *k_flat.shape[2:])
    v_pages[table] = v_flat.view(3, per_row, page_size, *v_flat.shape[2:])
    lengths = torch.tensor([0, 19, 38], dtype=torch.int32, device=device)
    bias = torch.randn(3, 1, 1, 40, generator=data["gen"], device=device, dtype=q.dtype)
    options = {"cache_seqlens": lengths, "attn_bias": bias, "is_causal": causal}
    paged = flash_dmattn_with_kvcache(
        q, k_pages, v_pages, k_new, v_new, block_table=table, **options
    )
    flat = flash_dmattn_with_kvcache(q, k_flat, v_flat, k_new, v_new, **options)
    assert torch.equal(paged, flat)
    assert torch.equal(k_pages[table].flatten(1, 2), k_flat)
    assert torch.equal(v_pages[table].flatten(1, 2), v_flat)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 128, 256])
@pytest.mark.parametrize("rows", ["mask", "lengths", "whole"])
def test_paged_decode_reads_the_pages_in_place(monkeypatch, page_size, rows):
    """A decode step on a paged cache whose pages hold whole key tiles of the Hopper kernel
    reads the pool where it is (the kernels get the pool and the table); other pages are
    gathered first. The key tile is 64 with a mask (an attn_mask, or the one per-row lengths
    make), 128 without (the whole cache, no attn_mask), at D 128. Either way the step gives
    the contiguous cache's output and lse bit for bit (the same kernel, splits and key
    order), and the reference's. Pages outside the table hold NaN: a read of one shows."""
    from dmattn_cute import kvcache
    from dmattn_cute.jit.arch import hopper_kernels, target_arch

    device, batch, heads, heads_kv, head_dim, seqlen = "cuda", 3, 8, 2, 128, 2048
    data = make_cache(device, batch=batch, cache_len=seqlen, heads=heads, heads_kv=heads_kv,
                      head_dim=head_dim, seed=page_size)  # fmt: skip
    gen = data["gen"]
    q, (k_new, v_new) = data["q"](1), data["new"](1)
    k_flat, v_flat = data["k_cache"], data["v_cache"]
    per_row, spare = seqlen // page_size, 5
    order = torch.randperm(batch * per_row + spare, device=device, generator=gen)
    table = order[: batch * per_row].view(batch, per_row)
    pool = (batch * per_row + spare, page_size, heads_kv, head_dim)
    k_pages = torch.full(pool, float("nan"), device=device, dtype=q.dtype)
    v_pages = torch.full(pool, float("nan"), device=device, dtype=q.dtype)
    k_pages[table] = k_flat.view(batch, per_row, page_size, heads_kv, head_dim)
    v_pages[table] = v_flat.view(batch, per_row, page_size, heads_kv, head_dim)
    lengths, mask = [seqlen - 1] * batch, None
    if rows != "whole":
        lengths = [seqlen - 1, 1000, 77]
    if rows == "mask":
        mask = torch.rand(batch, heads_kv, 1, seqlen, generator=gen, device=device) < 0.3
    bias = torch.randn(batch, heads_kv, 1, seqlen, generator=gen, device=device, dtype=q.dtype)
    options = {
        "cache_seqlens": None if rows == "whole" else torch.tensor(lengths, device=device),
        "attn_mask": mask, "attn_bias": bias, "return_lse": True,
    }  # fmt: skip

    seen = []
    run = kvcache.packed_decode

    def spy(*args):
        seen.append(args)
        return run(*args)

    monkeypatch.setattr(kvcache, "packed_decode", spy)
    paged, paged_lse = flash_dmattn_with_kvcache(
        q, k_pages, v_pages, k_new, v_new, block_table=table, **options
    )
    ((_, k_seen, v_seen, *rest),) = seen
    tile_n = 128 if rows == "whole" else 64
    if hopper_kernels(target_arch(q.device)) and page_size % tile_n == 0:
        # the pool itself, with its table
        assert k_seen is k_pages and v_seen is v_pages and torch.equal(rest[-1], table)
    else:  # the rows gathered: [B, Sk, Hkv, D], no table
        assert k_seen.shape == k_flat.shape and len(rest) == 5
    flat, flat_lse = flash_dmattn_with_kvcache(q, k_flat, v_flat, k_new, v_new, **options)
    assert torch.equal(paged, flat) and torch.equal(paged_lse, flat_lse)
    assert not paged.isnan().any()
    # the new keys landed in their pages
    assert torch.equal(k_pages[table].flatten(1, 2), k_flat)
    assert torch.equal(v_pages[table].flatten(1, 2), v_flat)
    totals = [length + 1 for length in lengths]
    ref, ref_lse, lowp = expected(q, k_flat, v_flat, range(batch), totals, mask, bias)
    check_close("out", paged, ref, lowp, q.dtype)
    torch.testing.assert_close(paged_lse.cpu(), ref_lse, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_paged_forward_refuses_pages_that_split_a_key_tile():
    """flash_fwd's block_table: a page that does not hold whole key tiles, or a table of
    another dtype, is refused before any launch."""
    from dmattn_cute.decode import _packed_problem, _packed_queries
    from dmattn_cute.kernels.fwd_launch import flash_fwd

    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(16, 32, 2, 64, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(16, device="cuda", dtype=torch.int32).view(2, 8)
    queries = _packed_queries(q, 2)
    problem = _packed_problem(queries, pool, None, 0.0, table)
    with pytest.raises(ValueError, match="page_size 32 is not a multiple of the key tile"):
        flash_fwd(problem, queries, pool, pool, None, None, block_table=table)
    with pytest.raises(ValueError, match="block_table: expected int32"):
        flash_fwd(problem, queries, pool, pool, None, None, block_table=table.long())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_captured_step_reads_lengths_and_rows_at_each_replay(layout):
    """A decode step captured into a CUDA graph with tensor cache_seqlens and cache_batch_idx
    (or a paged cache's block_table; pages of 64 keys, read in place on Hopper): nothing is
    read on the host while capturing, and each replay uses the values written into those
    tensors (and into q, k, v) since. Its output and the cache after it are an eager call's on
    the same inputs and a copy of the cache."""
    batch, cache_len, heads, heads_kv, d, page = 3, 1024, 8, 2, 128, 64
    data = make_cache("cuda", batch, cache_len, heads, heads_kv, d, rows=5)
    q, (k_new, v_new) = data["q"](1), data["new"](1)
    lengths = torch.tensor([0, 500, 1023], dtype=torch.int32, device="cuda")
    bias = torch.randn(batch, heads_kv, 1, cache_len, device="cuda", dtype=q.dtype)
    pages_of = [torch.randperm(5 * cache_len // page, generator=torch.Generator().manual_seed(s))
                for s in (1, 2)]  # fmt: skip
    if layout == "paged":
        caches = [t.view(5 * cache_len // page, page, heads_kv, d) for t in
                  (data["k_cache"], data["v_cache"])]  # fmt: skip
        where = pages_of[0][: batch * cache_len // page].view(batch, -1).int().cuda()
        placed = {"block_table": where}
    else:
        caches = [data["k_cache"], data["v_cache"]]
        where = torch.tensor([4, 0, 2], device="cuda")
        placed = {"cache_batch_idx": where}

    def step(k_cache, v_cache):
        return flash_dmattn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, attn_bias=bias, **placed
        )  # fmt: skip

    step(*(t.clone() for t in caches))  # compiles and plans outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out = step(*caches)
    for new_lengths, new_where in (
        ([7, 1023, 260], pages_of[1] if layout == "paged" else [1, 3, 0]),
        ([1000, 0, 64], pages_of[0].flip(0) if layout == "paged" else [0, 1, 2]),
    ):
        lengths.copy_(torch.tensor(new_lengths))
        if layout == "paged":
            new_where = new_where[: batch * cache_len // page].view(batch, -1)
        where.copy_(torch.as_tensor(new_where))
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        copies = [t.clone() for t in caches]
        want = step(*copies)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        for cache, copy in zip(caches, copies, strict=True):
            assert torch.equal(cache, copy)  # the new keys and values where the eager call put them
