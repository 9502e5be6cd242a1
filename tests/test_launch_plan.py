"""The forward launch's plan cache (kernels/fwd_launch.py), on the CPU: kernels are replaced by
recorders, so what is checked is which variant and arguments a call launches, and when the
plan behind them is made again."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.jit import KERNELS_ENV, cache
from dmattn_cute.kernels import fwd_launch
from dmattn_cute.kernels.block_bits import BlockBitsSpec
from dmattn_cute.kernels.fwd import FwdSpec
from dmattn_cute.kernels.key_bias_terms import KeyBiasTermsSpec
from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
from dmattn_cute.problem import make_problem

B, SQ, SK, H, HKV, D = 2, 300, 200, 4, 2, 64


def forward(mask: torch.Tensor | None, bias: torch.Tensor | None, is_causal: bool = False):
    q = torch.randn(B, SQ, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, SK, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    problem, mask4, bias4 = make_problem(q, k, v, mask, bias, None, is_causal, 0.0, (-1, -1), False)
    return fwd_launch.flash_fwd(problem, q, k, v, mask4, bias4)


def test_same_layouts_reuse_the_plan(launches) -> None:
    mask = torch.rand(1, HKV, SQ, SK) < 0.5
    bias = torch.randn(B, H, 1, SK, dtype=torch.bfloat16)
    forward(mask, bias)
    forward(mask.clone(), bias.clone())  # new tensors, same layouts
    # the forward and its pre-passes, once: block bits, and the bf16 bias row's terms
    assert len(launches["compiled"]) == 3
    fwd_spec, bits_spec, terms_spec = launches["compiled"]
    assert isinstance(fwd_spec, Sm90FwdSpec) and isinstance(bits_spec, BlockBitsSpec)
    assert fwd_spec.tile.bias_terms and isinstance(terms_spec, KeyBiasTermsSpec)
    assert [spec for spec, _ in launches["calls"]] == [terms_spec, bits_spec, fwd_spec] * 2
    # the forward reads the terms the pre-pass wrote (bf16 [B, H, SK, 16]) as its bias
    words, (q, _, _, _, _, _, _, terms, *_) = launches["calls"][3][1][1], launches["calls"][5][1]
    assert terms.dtype == torch.bfloat16 and tuple(terms.shape) == (B, H, SK, 16)
    assert terms.data_ptr() == words.data_ptr() and q.shape[1] == SQ
    # the second call's bits: a fresh tensor the pre-pass wrote, viewed with stride 0 on
    # the mask's broadcast batch
    written = launches["calls"][4][1][1]
    bits = launches["calls"][5][1][8]
    assert bits.data_ptr() == written.data_ptr()
    assert bits.shape == (1, HKV, -(-SQ // fwd_spec.tile.tile_m), -(-SK // fwd_spec.tile.tile_n))
    assert bits.stride()[0] == 0 and bits.stride()[1:] == written.stride()[1:]


def test_key_bias_without_a_mask_passes_the_moderate_flags(launches) -> None:
    """A bf16 key bias without a mask: the forward reads the terms pre-pass's moderate flags
    (the int32 words it wrote, [B, H, SK / 128 rounded up]) and walks each item in the form
    they allow (Sm90FwdSpec.moderate_rows); with a mask it takes none."""
    bias = torch.randn(B, H, 1, SK, dtype=torch.bfloat16)
    forward(None, bias)
    forward(torch.rand(B, HKV, SQ, SK) < 0.5, bias)
    (terms, _), (fwd, args), (masked_terms, _), _, (masked, masked_args) = launches["calls"]
    assert isinstance(terms, KeyBiasTermsSpec) and fwd.moderate_rows
    flags = launches["calls"][0][1][2]  # the pre-pass writes them as bytes
    moderate = args[11]
    assert moderate.dtype == torch.int32 and tuple(moderate.shape) == (B, H, -(-SK // 128))
    assert moderate.data_ptr() == flags.data_ptr() and flags.dtype == torch.uint8
    assert isinstance(masked_terms, KeyBiasTermsSpec) and masked.tile.bias_terms
    assert not masked.moderate_rows and masked_args[11] is None


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda b: b.transpose(0, 1).contiguous().transpose(0, 1), id="strides"),
        pytest.param(lambda b: b.float(), id="dtype"),
        pytest.param(
            lambda b: torch.randn(B, H, SQ, SK + 1, dtype=b.dtype)[..., 1:], id="misaligned"
        ),
    ],
)
def test_another_bias_layout_makes_another_plan(launches, change) -> None:
    mask = torch.rand(B, HKV, SQ, SK) < 0.5
    bias = torch.randn(B, H, SQ, SK, dtype=torch.bfloat16)
    forward(mask, bias)
    forward(mask, change(bias))
    assert len(launches["compiled"]) == 4  # planned again (the variant may be the same)


def test_another_problem_makes_another_plan(launches) -> None:
    forward(None, None)
    forward(None, None, is_causal=True)
    assert len(launches["compiled"]) == 2
    first, second = launches["compiled"]
    assert not first.has_window and second.has_window


def test_clearing_the_kernel_memory_clears_the_plans(launches) -> None:
    forward(None, None)
    cache.clear_memory()
    forward(None, None)
    assert len(launches["compiled"]) == 2


def test_the_kernels_setting_makes_another_plan(launches, monkeypatch) -> None:
    """DMATTN_CUTE_KERNELS=mma_sync after a plan was made on sm_90a: the mma.sync forward runs,
    not the remembered Hopper plan."""
    forward(None, None)
    monkeypatch.setenv(KERNELS_ENV, "mma_sync")
    forward(None, None)
    hopper, portable = launches["compiled"]
    assert isinstance(hopper, Sm90FwdSpec) and isinstance(portable, FwdSpec)


@pytest.mark.parametrize(("seqlen_q", "tile_n"), [(1, 64), (64, 64), (65, 128), (300, 128)])
def test_short_queries_get_narrow_key_tiles(launches, seqlen_q, tile_n) -> None:
    """At most SHORT_QUERY_ROWS query rows (decode, a group's heads packed as rows): 64-key
    tiles, and the pre-pass's bits at those tiles."""
    from dmattn_cute.kernels.config import SHORT_QUERY_ROWS

    assert SHORT_QUERY_ROWS == 64
    q = torch.randn(B, seqlen_q, H, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(B, 520, HKV, 128, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.rand(B, HKV, 1, 520) < 0.5
    bias = torch.randn(B, HKV, 1, 520, dtype=torch.bfloat16)
    problem, mask4, bias4 = make_problem(q, k, v, mask, bias, None, False, 0.0, (-1, -1), False)
    fwd_launch.flash_fwd(problem, q, k, v, mask4, bias4)
    # (more rows: the bias row's terms first)
    (bits_spec, _), (fwd_spec, args) = launches["calls"][-2:]
    assert isinstance(fwd_spec, Sm90FwdSpec) and fwd_spec.tile.tile_n == tile_n
    assert len(launches["calls"]) == (2 if seqlen_q <= 64 else 3)
    assert bits_spec.tile_n == tile_n and args[8].shape[3] == -(-520 // tile_n)


def test_short_queries_without_a_mask_keep_wide_key_tiles(launches) -> None:
    """No mask, nothing to skip: a decode call keeps 128-key tiles (half the walk)."""
    q = torch.randn(B, 1, H, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(B, 520, HKV, 128, dtype=torch.bfloat16) for _ in range(2))
    bias = torch.randn(B, HKV, 1, 520, dtype=torch.bfloat16)
    problem, _, bias4 = make_problem(q, k, v, None, bias, None, False, 0.0, (-1, -1), False)
    fwd_launch.flash_fwd(problem, q, k, v, None, bias4)
    ((fwd_spec, _),) = launches["calls"]
    assert isinstance(fwd_spec, Sm90FwdSpec) and fwd_spec.tile.tile_n == 128
