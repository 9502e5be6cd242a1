"""Causal top-w masks as per-key expiry rows (dmattn_cute/topw.py) against the mask built by
definition: for each query row, a stable descending sort of the scores it may see, first w."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.topw import expiry_mask, topw_expiry, with_key_expiry
from tests.utils import expiry_grads_and_check


def topw_by_definition(scores: torch.Tensor, w: int, seqlen_q: int) -> torch.Tensor:
    seqlen_k = scores.shape[-1]
    flat = scores.reshape(-1, seqlen_k)
    mask = torch.zeros(flat.shape[0], seqlen_q, seqlen_k, dtype=torch.bool)
    for n, row in enumerate(flat):
        for i in range(seqlen_q):
            last = i + seqlen_k - seqlen_q  # bottom-right aligned
            if last >= 0:
                top = torch.sort(row[: last + 1], descending=True, stable=True).indices[:w]
                mask[n, i, top] = True
    return mask.reshape(*scores.shape[:-1], seqlen_q, seqlen_k)


@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("w", [1, 3, 16, 65, 300])
@pytest.mark.parametrize("seqlen", [1, 2, 63, 65, 200])
def test_expiry_is_the_causal_topw_mask(seqlen, w, chunk) -> None:
    """Scores drawn from 7 values: ties rank by position."""
    scores = torch.randint(0, 7, (2, 3, seqlen)).float()
    expiry = topw_expiry(scores, w, chunk)
    assert expiry.shape == scores.shape and expiry.dtype == torch.int32
    assert torch.equal(expiry_mask(expiry, seqlen), topw_by_definition(scores, w, seqlen))


@pytest.mark.parametrize("seqlen_q", [1, 50, 129])
def test_fewer_queries_are_bottom_right_aligned(seqlen_q) -> None:
    scores = torch.randn(2, 129)
    expiry = topw_expiry(scores, 20)
    assert torch.equal(expiry_mask(expiry, seqlen_q), topw_by_definition(scores, 20, seqlen_q))


def test_expiry_by_hand() -> None:
    """w = 2: keys 0 and 2 (the two highest) never expire; key 1 expires at row 2 (keys 0 and
    2 rank above it), key 3 at row 1 (keys 0 and 1) and key 4 at row 2 (keys 0 and 2): the
    last two before they appear, so no row keeps them."""
    scores = torch.tensor([[5.0, 1.0, 4.0, 0.0, 3.0]])
    assert topw_expiry(scores, 2).tolist() == [[5, 2, 5, 1, 2]]


@pytest.mark.parametrize("w", [0, -1, 1.5, True])
def test_rejects_bad_w(w) -> None:
    with pytest.raises(ValueError, match="w: expected a positive int"):
        topw_expiry(torch.randn(1, 8), w)


def test_rejects_integer_scores() -> None:
    with pytest.raises(ValueError, match="scores: expected a float tensor"):
        topw_expiry(torch.arange(8), 2)


def test_rows_in_groups_give_the_same_expiry(monkeypatch) -> None:
    """Many rows are processed in groups that bound the temporaries: one row per group here."""
    from dmattn_cute import topw

    scores = torch.randint(0, 5, (3, 2, 100)).float()
    whole = topw_expiry(scores, 7)
    groups = []
    running = topw._running_wth_smallest
    monkeypatch.setattr(topw, "_TEMP_BYTES", 1)
    monkeypatch.setattr(
        topw,
        "_running_wth_smallest",
        lambda part, *a: groups.append(len(part)) or running(part, *a),
    )
    assert torch.equal(topw_expiry(scores, 7), whole)
    assert groups == [1] * 6


# ---- key_expiry in flash_dmattn_func ----

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


EXPIRY_CASES = {
    # (Sq, Sk, H, Hkv, D, expiry heads, w, attn_mask shape, bias shape)
    "kv-heads-key-bias": (300, 300, 4, 2, 64, 2, 40, None, (2, 2, 1, 300)),
    "query-heads-fewer-queries": (65, 257, 4, 2, 128, 4, 17, None, (2, 2, 1, 257)),
    "with-attn-mask": (129, 200, 2, 1, 64, 1, 30, (2, 1, 129, 200), None),
    "no-bias": (200, 200, 2, 2, 128, 2, 25, None, None),
}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", EXPIRY_CASES.values(), ids=EXPIRY_CASES.keys())
def test_key_expiry_is_the_topw_mask(case, device) -> None:
    from tests.utils import random_inputs

    sq, sk, h, hkv, d, he, w, mask_shape, bias_shape = case
    q, k, v, mask, bias = random_inputs(
        2, sq, sk, h, hkv, d, torch.bfloat16, device, mask_shape=mask_shape,
        bias_shape=bias_shape,
    )  # fmt: skip
    expiry = topw_expiry(torch.randn(2, he, sk, device=device), w)
    expiry_grads_and_check(q, k, v, mask, bias, expiry, is_causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_shape", [None, (1, 2, 1, 190)])
def test_key_expiry_without_causal(bias_shape, device) -> None:
    """Any int32 rows, not causal: only the upper bound holds (rows past every key's expiry
    are fully masked: zero output)."""
    from tests.utils import random_inputs

    q, k, v, _, bias = random_inputs(
        2, 150, 190, 4, 2, 64, torch.bfloat16, device, bias_shape=bias_shape
    )  # fmt: skip
    expiry = torch.randint(0, 191, (2, 2, 190), dtype=torch.int32, device=device)
    expiry[0, 0] = torch.randint(0, 100, (190,), dtype=torch.int32)  # later rows see no key
    expiry_grads_and_check(q, k, v, None, bias, expiry)


def test_key_expiry_is_validated() -> None:
    from dmattn_cute import flash_dmattn_func

    q, k = (
        torch.randn(2, 10, 4, 32, dtype=torch.bfloat16),
        torch.randn(2, 12, 2, 32, dtype=torch.bfloat16),
    )
    good = torch.zeros(2, 2, 12, dtype=torch.int32)
    flash_dmattn_func(q, k, k, key_expiry=good)
    flash_dmattn_func(q, k, k, key_expiry=good.long())  # int64: key ranges
    with pytest.raises(TypeError, match="key_expiry: expected dtype torch.int32"):
        flash_dmattn_func(q, k, k, key_expiry=good.float())
    with pytest.raises(ValueError, match="key_expiry: expected \\[Be, He, Sk\\]"):
        flash_dmattn_func(q, k, k, key_expiry=good[:, :, :11])
    with pytest.raises(ValueError, match="key_expiry: expected \\[Be, He, Sk\\]"):
        flash_dmattn_func(q, k, k, key_expiry=torch.zeros(2, 3, 12, dtype=torch.int32))
    with pytest.raises(TypeError, match="key_expiry: expected a torch.Tensor"):
        flash_dmattn_func(q, k, k, key_expiry=[1, 2])


def test_hopper_launches_read_the_expiry_as_their_mask(launches) -> None:
    """sm_90a: the forward and backward get the expiry as an int32 [Be, He, 1, Sk] view
    (stride 0 on the queries) and bits equal to the definition's on the element mask it
    stands for, at each kernel's tiles; no block-bits pre-pass runs. With attn_mask too, the
    two become one element mask (the pre-pass runs on it)."""
    from dmattn_cute.kernels.bwd_launch import flash_bwd
    from dmattn_cute.kernels.fwd_launch import flash_fwd
    from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
    from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
    from dmattn_cute.problem import make_problem
    from tests.test_block_bits_gpu import bits_ref

    sq, sk = 300, 520
    q = torch.randn(2, sq, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, sk, 2, 64, dtype=torch.bfloat16)
    expiry = topw_expiry(torch.randn(2, 2, sk), 100)
    problem, _, _ = make_problem(q, k, k, None, None, None, True, 0.0, (-1, -1), False)
    dense = with_key_expiry(None, expiry, sq, 2)
    flash_fwd(problem, q, k, k, None, None, key_expiry=expiry)
    out, stats = torch.randn_like(q), torch.zeros(2, 4, 2, sq)
    flash_bwd(problem, torch.randn_like(q), q, k, k, None, None, out, stats, False,
              key_expiry=expiry)  # fmt: skip
    (fwd, fwd_args), _, (bwd, bwd_args) = launches["calls"]  # fwd, bwd preprocess, bwd
    assert isinstance(fwd, Sm90FwdSpec) and isinstance(bwd, Sm90BwdSpec)
    for spec, mask, bits in ((fwd, fwd_args[6], fwd_args[8]), (bwd, bwd_args[12], bwd_args[14])):
        assert spec.mask.dtype == "i32" and mask.dtype == torch.int32
        assert mask.shape == (2, 2, 1, sk) and mask.stride(2) == 0
        tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
        assert torch.equal(bits, bits_ref(dense, sq, sk, tile_m, tile_n)), type(spec).__name__
    launches["calls"].clear()
    mask = torch.rand(2, 1, sq, sk) < 0.5
    problem, mask4, _ = make_problem(q, k, k, mask, None, None, True, 0.0, (-1, -1), False)
    flash_fwd(problem, q, k, k, mask4, None, key_expiry=expiry)
    (_, pre_args), (_, args) = launches["calls"]  # the pre-pass of the element mask, the fwd
    assert args[6].dtype == torch.uint8 and torch.equal(args[6].bool(), mask & dense)
    assert pre_args[0] is args[6]


@pytest.mark.parametrize("device", DEVICES)
def test_key_expiry_compiles_without_graph_breaks(device) -> None:
    """Under torch.compile the expiry becomes an element mask inside the graph."""
    from dmattn_cute import flash_dmattn_func
    from tests.utils import random_inputs

    q, k, v, _, bias = random_inputs(
        1, 200, 300, 2, 1, 32, torch.bfloat16, device, bias_shape=(1, 1, 1, 300)
    )
    expiry = topw_expiry(torch.randn(1, 1, 300, device=device), 50)

    def attend(q, k, v, bias, expiry):
        return flash_dmattn_func(q, k, v, attn_bias=bias, is_causal=True, key_expiry=expiry)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(
        compiled(q, k, v, bias, expiry), attend(q, k, v, bias, expiry), atol=2e-2, rtol=0
    )


def test_an_expiry_splits_long_walks(launches, monkeypatch) -> None:
    """An expiry is a mask to the backward's query split: long walks split (fp32 partials)."""
    from dmattn_cute.kernels import bwd_launch
    from dmattn_cute.problem import make_problem

    monkeypatch.setattr(bwd_launch, "QUERY_SPLIT_ROWS", 128)
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 2, 64, dtype=torch.bfloat16)
    problem, _, _ = make_problem(q, k, k, None, None, None, True, 0.0, (-1, -1), False)
    expiry = topw_expiry(torch.randn(2, 2, 300), 64)
    out, stats = torch.randn_like(q), torch.zeros(2, 4, 2, 300)
    bwd_launch.flash_bwd(problem, torch.randn_like(q), q, k, k, None, None, out, stats, False,
                         key_expiry=expiry)  # fmt: skip
    spec, args = launches["calls"][-1]
    assert spec.split_heads and args[10] == 3 and args[7].dtype == torch.float32


def test_expiry_bits_are_built_once_per_expiry() -> None:
    """An expiry's bits are memoized per tensor (memo.remember_for), as a block mask's."""
    from dmattn_cute.kernels.expiry_launch import expiry_bits
    from dmattn_cute.problem import make_problem

    q, k = (
        torch.randn(1, 300, 2, 32, dtype=torch.bfloat16),
        torch.randn(1, 300, 1, 32, dtype=torch.bfloat16),
    )
    problem, _, _ = make_problem(q, k, k, None, None, None, True, 0.0, (-1, -1), False)
    expiry = topw_expiry(torch.randn(1, 1, 300), 40)
    first = expiry_bits(expiry, problem, 128, 128)
    assert expiry_bits(expiry, problem, 128, 128) is first
    expiry[..., 0] = 0  # in place: rebuilt
    assert expiry_bits(expiry, problem, 128, 128) is not first


def document_ranges(lengths: list[int], heads: int = 1) -> torch.Tensor:
    """int64 key ranges [1, heads, sum(lengths)] of packed sequences: start << 32 | end."""
    ends = torch.tensor(lengths).cumsum(0)
    starts = ends - torch.tensor(lengths)
    ranges = torch.repeat_interleave(starts << 32 | ends, torch.tensor(lengths))
    return ranges.expand(1, heads, -1).contiguous()


@pytest.mark.parametrize("causal", [False, True])
def test_key_ranges_keep_each_row_of_a_range(causal) -> None:
    """int64 key ranges (first row << 32 | expiry): query i keeps key j while first row <= i <
    expiry (and the rest), as the element mask that says so; an empty range (0) keeps no row."""
    from dmattn_cute import flash_dmattn_func
    from dmattn_cute.reference import attention_ref

    lengths = [70, 1, 129, 56]
    total = sum(lengths)
    q, k, v = (torch.randn(1, total, 2, 32, dtype=torch.bfloat16) for _ in range(3))
    ranges = document_ranges(lengths)
    ranges[0, 0, 5] = 0  # a key no row keeps
    out, lse = flash_dmattn_func(q, k, v, is_causal=causal, key_expiry=ranges, return_lse=True)
    rows = torch.arange(total)[:, None]
    keep = (rows >= ranges[0, 0] >> 32) & (rows < (ranges[0, 0] & 0xFFFFFFFF))
    mask = keep[None, None]
    ref, ref_lse = attention_ref(q, k, v, mask, None, is_causal=causal)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), atol=1e-3, rtol=1e-3)


def test_hopper_launches_read_key_ranges_as_their_mask(launches) -> None:
    """sm_90a: key ranges of packed sequences reach the forward and backward as an int64
    [Be, He, 1, Sk] view, with bits equal to the definition's on the element mask they stand
    for (exact for sequences: their keys' ranges are contiguous)."""
    from dmattn_cute.kernels.bwd_launch import flash_bwd
    from dmattn_cute.kernels.fwd_launch import flash_fwd
    from dmattn_cute.problem import make_problem
    from tests.test_block_bits_gpu import bits_ref

    lengths = [300, 129, 1, 90]
    total = sum(lengths)
    q = torch.randn(1, total, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, total, 2, 64, dtype=torch.bfloat16)
    ranges = document_ranges(lengths, 2)
    problem, _, _ = make_problem(q, k, k, None, None, None, False, 0.0, (-1, -1), False)
    dense = with_key_expiry(None, ranges, total, 2)
    flash_fwd(problem, q, k, k, None, None, key_expiry=ranges)
    out, stats = torch.randn_like(q), torch.zeros(1, 4, 2, total)
    flash_bwd(problem, torch.randn_like(q), q, k, k, None, None, out, stats, False,
              key_expiry=ranges)  # fmt: skip
    (fwd, fwd_args), _, (bwd, bwd_args) = launches["calls"]
    for spec, mask, bits in ((fwd, fwd_args[6], fwd_args[8]), (bwd, bwd_args[12], bwd_args[14])):
        assert spec.mask.dtype == "i64" and mask.dtype == torch.int64
        assert mask.shape == (1, 2, 1, total) and mask.stride(2) == 0
        tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
        assert torch.equal(bits, bits_ref(dense, total, total, tile_m, tile_n)), type(spec).__name__
