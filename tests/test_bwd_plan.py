"""The Hopper backward's plan on the host: which calls it runs, how a group's query heads are
split over CTAs when the grid is small, and that precompile covers both variants."""

import dataclasses

import pytest
import torch

from dmattn_cute import precompile
from dmattn_cute.kernels.bwd_launch import backward_spec_of, head_splits
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
     ((1, 1, 1, 4096), False), ((1, 1, 64, 4096), False)],
)  # fmt: skip
def test_deterministic_plans(bias_shape, hopper):
    """Deterministic calls run the Hopper kernel (MQA with its heads split over CTAs, which
    add dK/dV in split order), unless dbias sums a broadcast bias (the mma.sync kernel folds
    those dims)."""
    q, k, v, _, bias = random_inputs(
        1, 64, 4096, 16, 1, 128, torch.bfloat16, "meta", bias_shape=bias_shape
    )
    problem, mask4, bias4 = make_problem(q, k, v, None, bias, None, False, 0.0, (-1, -1), True)
    spec = backward_spec_of(problem, mask4, bias4, bias is not None, "sm_90a")
    assert isinstance(spec, Sm90BwdSpec) == hopper
    if hopper:
        assert spec.deterministic and spec.split_heads  # 32 key blocks x 1 kv head
