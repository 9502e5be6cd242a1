"""The Hopper backward's plan on the host: which calls it runs, how a group's query heads are
split over CTAs when the grid is small, and that precompile covers both variants."""

import dataclasses

import pytest
import torch

from dmattn_cute import precompile
from dmattn_cute.kernels.bwd import BwdSpec
from dmattn_cute.kernels.bwd_launch import (
    backward_spec_of,
    dbias_plan,
    head_splits,
    split_waves,
    sum_slots,
)
from dmattn_cute.kernels.launch_order import walk_order
from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
from dmattn_cute.problem import make_problem
from tests.utils import random_inputs


def problem_of(batch: int, seqlen: int, heads: int, heads_kv: int):
    q, k, v, _, _ = random_inputs(batch, 1, seqlen, heads, heads_kv, 128, torch.bfloat16, "meta")
    return make_problem(q, k, v, None, None, None, False, 0.0, (-1, -1), False)


@pytest.mark.parametrize(
    ("batch", "seqlen", "heads", "heads_kv", "splits"),
    [
        (2, 4096, 16, 16, 1),  # 1024 CTAs: no split
        (1, 4096, 32, 8, 2),  # 256 CTAs, 512 with two
        (1, 4096, 32, 1, 16),  # MQA: 32 CTAs, 8 x 32 = 256 short of two waves
        (1, 128, 6, 2, 3),  # too small for any split to fill the GPU: the whole group
        (8, 8192, 32, 1, 1),  # 512 CTAs
    ],
)
def test_head_splits(batch, seqlen, heads, heads_kv, splits):
    problem, _, _ = problem_of(batch, seqlen, heads, heads_kv)
    assert head_splits(problem, 128, 132) == splits


@pytest.mark.parametrize(
    ("batch", "heads", "heads_kv", "splits"),
    [
        (2, 16, 4, 4),  # 256 CTAs: four waves want 528
        (2, 16, 16, 1),  # 1024 CTAs
        (1, 32, 1, 32),  # MQA: 32 CTAs, the whole group
    ],
)
def test_masked_head_splits_fill_four_waves(batch, heads, heads_kv, splits):
    problem, _, _ = problem_of(batch, 4096, heads, heads_kv)
    assert head_splits(problem, 128, 132, waves=split_waves(problem, True, True)) == splits
    deterministic = dataclasses.replace(problem, deterministic=True)
    assert split_waves(deterministic, True, True) == split_waves(problem, False, True) == 2
    assert split_waves(problem, True, False) == 1  # the mma.sync kernel


@pytest.mark.parametrize(("heads_kv", "split"), [(16, False), (1, True)])
def test_hopper_spec_splits_small_grids(heads_kv, split):
    problem, mask4, bias4 = problem_of(1, 4096, 16, heads_kv)
    spec = backward_spec_of(problem, mask4, bias4, False, "sm_90a")
    assert isinstance(spec, Sm90BwdSpec) and spec.split_heads == split


def test_precompile_covers_both_hopper_variants():
    """A GQA call pattern compiles the Hopper backward with and without the heads split
    (which one a call runs depends on its sizes); an MHA one has nothing to split."""
    patterns = precompile.call_patterns(["bf16"], [128])
    for pattern in patterns:
        specs = [spec for kind, spec in precompile.kernel_specs(pattern, "sm_90a")]
        hopper = [spec for spec in specs if isinstance(spec, Sm90BwdSpec)]
        if pattern.deterministic:  # ordered additions; or the mma.sync kernel
            assert all(spec.deterministic for spec in hopper)
        splits = {spec.split_heads for spec in hopper}
        assert splits == ({False, True} if pattern.heads[0] > pattern.heads[1] else {False})
        for spec in hopper:
            assert dataclasses.replace(spec, split_heads=False) in specs


@pytest.mark.parametrize(
    ("bias_shape", "hopper"),
    [(None, True), ((1, 16, 1, 4096), True), ((1, 16, 64, 4096), True),
     ((1, 1, 1, 4096), True), ((1, 1, 64, 4096), False)],
)  # fmt: skip
def test_deterministic_plans(bias_shape, hopper):
    """Deterministic calls run the Hopper kernel (MQA with its heads split over CTAs, which
    add dK/dV in split order), a query-broadcast bias's dbias in per-head slots too, unless
    dbias sums a full-height broadcast bias (the mma.sync kernel folds those dims)."""
    q, k, v, _, bias = random_inputs(
        1, 64, 4096, 16, 1, 128, torch.bfloat16, "meta", bias_shape=bias_shape
    )
    problem, mask4, bias4 = make_problem(q, k, v, None, bias, None, False, 0.0, (-1, -1), True)
    spec = backward_spec_of(problem, mask4, bias4, bias is not None, "sm_90a")
    assert isinstance(spec, Sm90BwdSpec) == hopper
    if hopper:
        assert spec.deterministic and spec.split_heads  # 32 key blocks x 1 kv head


@pytest.mark.parametrize(
    ("seqlen_q", "seqlen_k", "heads_kv", "causal", "window"),
    [
        (1000, 700, 2, True, (-1, -1)),  # causal, bottom-right
        (300, 1000, 1, True, (-1, -1)),  # causal, Sq < Sk
        (513, 900, 3, False, (200, 70)),  # a sliding window
        (640, 640, 2, False, (-1, 100)),  # a right window only
    ],
)  # fmt: skip
def test_walk_order(seqlen_q, seqlen_k, heads_kv, causal, window):
    """The Hopper backward's launch order under causal/window limits: every (batch, kv head,
    key block) once, in sections of (batch, kv head)s of about two waves of CTAs, each by the
    query blocks its walk may visit (brute force: the tiles holding a (query, key) element of
    the band), most first, and equal counts in grid order."""
    batch, tile_m, tile_n = 2, 64, 128
    q, k, v, _, _ = random_inputs(batch, seqlen_q, seqlen_k, 2 * heads_kv, heads_kv, 64,
                                  torch.bfloat16, "meta")  # fmt: skip
    problem, _, _ = make_problem(q, k, v, None, None, None, causal, 0.0, window, False)
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    # row i sees key j when i + diag - left <= j <= i + diag + right
    i, j = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)
    diag, (left, right) = seqlen_k - seqlen_q, window
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        seen &= j >= i + diag - left
    if right >= 0 or causal:
        seen &= j <= i + diag + (0 if causal else right)
    steps = torch.zeros(n_blocks, dtype=torch.int64)
    for m in range(m_blocks):
        for n in range(n_blocks):
            steps[n] += seen[m * tile_m : (m + 1) * tile_m, n * tile_n : (n + 1) * tile_n].any()
    counts = steps.repeat(batch * heads_kv)
    # on 132 SMs, one CTA per item: every item in one section; on 2 SMs, one item each
    for sms, section in ((132, batch * heads_kv), (2, 1)):
        order = walk_order(problem, tile_m, tile_n, 1, sms, torch.device("cpu"))
        assert order.dtype == torch.int32
        assert sorted(order.tolist()) == list(range(batch * heads_kv * n_blocks))
        for part in order.split(section * n_blocks):
            assert sorted(part.tolist()) == list(range(part.min(), part.max() + 1))
            ranked = counts[part.long()]
            assert (ranked[:-1] >= ranked[1:]).all() and ranked[0] > ranked[-1]
            ties = ranked[:-1] == ranked[1:]
            assert (part[:-1][ties] < part[1:][ties]).all()


@pytest.mark.parametrize(
    ("heads_kv", "deterministic", "bias_heads", "split"),
    [
        (1, False, None, True),  # MQA, 32 CTAs: split
        (8, False, None, False),  # 256 CTAs fill a wave of 108 SMs
        (16, False, None, False),  # MHA: nothing to split
        (1, True, 16, True),  # deterministic, a bias per query head: direct dbias
        (1, True, 1, False),  # deterministic, a bias shared by the group: its sums stay whole
    ],
)
def test_mma_sync_spec_splits_small_grids(heads_kv, deterministic, bias_heads, split):
    q, k, v, _, _ = random_inputs(1, 4096, 4096, 16, heads_kv, 128, torch.bfloat16, "meta")
    bias = None if bias_heads is None else torch.empty(1, bias_heads, 4096, 4096, device="meta")
    problem, mask4, bias4 = make_problem(
        q, k, v, None, bias, None, False, 0.0, (-1, -1), deterministic
    )
    spec = backward_spec_of(problem, mask4, bias4, bias is not None, "sm_80")
    assert isinstance(spec, BwdSpec) and spec.split_heads == split


@pytest.mark.parametrize("bias_shape", [(1, 1, 1, 96), (3, 1, 1, 96), (1, 2, 1, 96), (3, 2, 1, 96)])
def test_dbias_slots_sum_to_the_bias_shape(bias_shape):
    """A deterministic query-broadcast bias's gradient comes from fp32 rows per (batch, query
    head), summed over the rows that share a bias element."""
    problem, _, _ = problem_of(3, 96, 8, 2)
    deterministic = dataclasses.replace(problem, deterministic=True)
    assert dbias_plan(deterministic, torch.Size(bias_shape)) == ("slots", False, False)
    assert dbias_plan(problem, torch.Size(bias_shape))[0] == "sum"
    slots = torch.randn(3, 8, 1, 96, dtype=torch.float64)
    got = sum_slots(slots, torch.Size(bias_shape))
    bm, hm = bias_shape[:2]
    want = torch.zeros(bias_shape, dtype=torch.float64)
    for b in range(3):
        for h in range(8):
            want[b % bm, h // (8 // hm)] += slots[b, h]
    assert got.shape == want.shape and torch.allclose(got, want)
