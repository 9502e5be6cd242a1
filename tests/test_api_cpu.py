"""flash_dmattn_func on CPU tensors: the reference behind the public API, with autograd."""

from __future__ import annotations

import pytest
import torch

import dmattn_cute
from dmattn_cute import attention
from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.reference import attention_ref


def make_inputs(
    seed, b, sq, sk, h, hkv, d, dtype, mask_shape=None, bias_shape=None, bias_dtype=None
):
    """q [b, sq, h, d], k/v [b, sk, hkv, d] leaves requiring grad; optional mask and bias."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape, dtype=dtype):
        return torch.randn(shape, generator=gen).to(dtype).requires_grad_()

    q, k, v = leaf(b, sq, h, d), leaf(b, sk, hkv, d), leaf(b, sk, hkv, d)
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=gen) < 0.6
    bias = None if bias_shape is None else leaf(*bias_shape, dtype=bias_dtype or dtype)
    return q, k, v, mask, bias


def reference(q, k, v, mask, bias, **options):
    """What the CPU path must compute: the float32 reference, out cast to the query's dtype."""
    out, lse = attention_ref(q, k, v, mask, bias, compute_dtype=torch.float32, **options)
    return out.to(q.dtype), lse


FORWARD_CASES = {
    "mha": {"sizes": (2, 5, 5, 4, 4, 32)},
    "gqa_causal": {"sizes": (2, 7, 9, 6, 2, 64), "options": {"is_causal": True}},
    "mqa_window": {"sizes": (1, 6, 11, 4, 1, 40), "options": {"window_size": (3, 1)}},
    "decode_softcap": {"sizes": (3, 1, 13, 4, 2, 16), "options": {"softcap": 5.0}},
    "scale_causal_sq_gt_sk": {
        "sizes": (1, 9, 4, 2, 2, 8),
        "options": {"softmax_scale": 0.3, "is_causal": True},
    },
    "mask_bias_gqa": {"sizes": (2, 5, 8, 4, 2, 32), "mask": (2, 2, 5, 8), "bias": (1, 4, 5, 8)},
    "mask_3d_bias_3d": {"sizes": (2, 4, 6, 4, 2, 16), "mask": (1, 4, 6), "bias": (2, 2, 6)},
    "bias_fp32_window": {
        "sizes": (1, 6, 6, 2, 1, 24),
        "bias": (1, 1, 6, 6),
        "bias_dtype": torch.float32,
        "options": {"window_size": (-1, 2)},
    },
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", FORWARD_CASES.values(), ids=FORWARD_CASES.keys())
def test_forward_matches_reference(case, dtype):
    options = case.get("options", {})
    q, k, v, mask, bias = make_inputs(
        0, *case["sizes"], dtype, case.get("mask"), case.get("bias"), case.get("bias_dtype")
    )
    out, lse = flash_dmattn_func(q, k, v, mask, bias, return_lse=True, **options)
    out_ref, lse_ref = reference(q, k, v, mask, bias, **options)

    b, sq, _, h, _, d = case["sizes"]
    assert out.shape == (b, sq, h, d) and out.dtype == dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert not lse.requires_grad
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)


def test_return_lse_false_gives_out_only():
    q, k, v, _, _ = make_inputs(1, 1, 3, 4, 2, 2, 8, torch.bfloat16)
    out = flash_dmattn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, reference(q, k, v, None, None)[0], rtol=0, atol=0)


B, SQ, SK, H, HKV, D = 2, 5, 7, 4, 2, 16
BIAS_SHAPES = [
    (1, 1, 1, SK),
    (B, 1, SQ, SK),
    (B, HKV, 1, SK),
    (B, H, SQ, SK),
    (1, H, SQ, SK),
    (B, HKV, SQ, 1),
    (B, HKV, SK),
    (1, 1, SK),
    (1, H, 1),
]


def grads_f64(q, k, v, mask, bias, dout, **options):
    """Gradients of attention_ref in float64, taken on exact float64 copies of the leaves: the
    exact gradients of these low-precision inputs, up to float64 rounding."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    out, _ = attention_ref(*leaves[:3], mask, leaves[3], compute_dtype=torch.float64, **options)
    return torch.autograd.grad(out, leaves, dout.double())


@pytest.mark.parametrize("bias_dtype", [None, torch.float32], ids=["query_dtype", "fp32"])
@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_reference_in_bias_shape(bias_shape, bias_dtype):
    dtype = torch.bfloat16
    q, k, v, mask, bias = make_inputs(
        2, B, SQ, SK, H, HKV, D, dtype, (B, 1, SQ, SK), bias_shape, bias_dtype
    )
    options = {"is_causal": True, "softcap": 3.0}
    dout = torch.randn(B, SQ, H, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    leaves = (q, k, v, bias)

    grads = torch.autograd.grad(flash_dmattn_func(q, k, v, mask, bias, **options), leaves, dout)
    grads_ref = grads_f64(q, k, v, mask, bias, dout, **options)

    for name, leaf, grad, grad_ref in zip(
        ("q", "k", "v", "bias"), leaves, grads, grads_ref, strict=True
    ):
        assert grad.shape == leaf.shape and grad.dtype == leaf.dtype, name
        assert not grad.isnan().any(), name
        # The CPU op computes every gradient in float32 (broadcast dbias summed there too) and
        # rounds it once to the leaf's dtype: |grad - exact| <= u * |exact| + float32 error,
        # with u = eps / 2 the unit roundoff of that dtype (bf16 2^-8, fp32 2^-24). The float32
        # part is sums of at most ~90 terms (dbias [1, H, 1]: 70 dS values, each from a 16-term
        # dP) of unit-variance inputs and probabilities <= 1; over 200 seeds of inputs and dout
        # it stayed below 50 * 2^-24 * max(|exact|, 1). atol allows 2^-14 = 1024 * 2^-24 of it,
        # still 64x under a bf16 half-ulp of the largest gradient. (Autograd through the bf16
        # leaves is no reference: it rounds each query head's dbias to bf16 before summing a
        # kv-head group, two roundings off the exact sum, which made this test flaky.)
        rtol = torch.finfo(leaf.dtype).eps / 2
        atol = 2**-14 * max(grad_ref.abs().max().item(), 1.0)
        torch.testing.assert_close(grad.double(), grad_ref, rtol=rtol, atol=atol, msg=name)
    assert grads[3].abs().sum() > 0


def test_mask_gets_no_grad_and_fully_masked_rows_are_zero():
    q, k, v, mask, bias = make_inputs(
        3, B, SQ, SK, H, HKV, D, torch.float16, (B, H, SQ, SK), (B, H, SQ, SK)
    )
    mask[:, :, 1] = False  # query 1 sees no key
    out = flash_dmattn_func(q, k, v, mask, bias)
    out.float().square().sum().backward()

    assert mask.grad is None and not mask.requires_grad
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert torch.equal(bias.grad[:, :, 1], torch.zeros_like(bias.grad[:, :, 1]))
    for leaf in (q, k, v, bias):
        assert not leaf.grad.isnan().any()


def test_packed_qkv_slices():
    packed = torch.randn(B, SK, H + 2 * HKV, D).to(torch.bfloat16)
    q, k, v = packed[:, :, :H], packed[:, :, H : H + HKV], packed[:, :, H + HKV :]
    out = flash_dmattn_func(q, k, v, is_causal=True)
    out_ref = reference(q.contiguous(), k.contiguous(), v.contiguous(), None, None, is_causal=True)[
        0
    ]
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)


def test_package_exports():
    assert dmattn_cute.flash_dmattn_func is attention.flash_dmattn_func
    assert dmattn_cute.create_mask is dmattn_cute.masks.create_mask
    assert dmattn_cute.create_block_mask is dmattn_cute.block_mask.create_block_mask
    assert dmattn_cute.flash_dmattn_with_kvcache is dmattn_cute.kvcache.flash_dmattn_with_kvcache
    assert dmattn_cute.flash_dmattn_varlen_func is dmattn_cute.varlen.flash_dmattn_varlen_func
    assert set(dmattn_cute.__all__) == {
        "flash_dmattn_func",
        "create_block_mask",
        "create_mask",
        "flash_dmattn_varlen_func",
        "flash_dmattn_with_kvcache",
    }
