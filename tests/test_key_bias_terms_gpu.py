"""The key bias terms pre-pass (kernels/key_bias_terms.py) against float64: three bf16 terms per
key whose sum is bias * (1 / scale) rounded toward zero, infinities alone in the first term,
finfo.min exact, and a moderate flag per 32 keys; any bias dtype, broadcast dims and unaligned
key rows."""

from __future__ import annotations

import math

import pytest
import torch

from dmattn_cute.jit.arch import target_arch
from dmattn_cute.kernels.key_bias_terms import MODERATE_BIAS, TERMS, key_bias_terms

pytestmark = pytest.mark.gpu


def toward_zero_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 values rounded toward zero to float32 (finite ones stay finite)."""
    near = x.float()
    over = near.double().abs() > x.abs()
    return torch.where(over, torch.nextafter(near, torch.zeros_like(near)), near).double()


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "batch_broadcast", "unaligned_keys"])
def test_terms_sum_to_the_scaled_bias(bias_dtype, layout):
    b, h, sk = 3, 4, 1000
    scale = 1 / math.sqrt(96)
    rows = 1 if layout == "batch_broadcast" else b
    keys = sk + 1 if layout == "unaligned_keys" else sk
    base = torch.randn(rows, h, 1, keys, device="cuda")
    base = (base * torch.logspace(-30, 30, keys, device="cuda")).to(bias_dtype)
    if bias_dtype == torch.float16:
        base = base.nan_to_num(posinf=60000.0, neginf=-60000.0)
    info = torch.finfo(bias_dtype)
    base[..., -5:] = torch.tensor([info.min, -math.inf, math.inf, 0.0, info.max])
    bias = base[..., 1:] if layout == "unaligned_keys" else base
    bias = bias.expand(b, h, 1, sk)
    bias = bias.as_strided(bias.shape, (*bias.stride()[:2], 0, 1))  # as broadcast_view makes it
    terms, flags = key_bias_terms(bias, 1 / scale, target_arch(bias.device), sk)
    assert terms.dtype == torch.bfloat16 and tuple(terms.shape) == (b, h, sk, TERMS)
    if layout == "batch_broadcast":
        assert terms.stride(0) == 0
    assert bool((terms[..., 3:] == 0).all())
    hi, mid, lo = (terms[..., i].double() for i in range(3))
    bias_scale = torch.tensor(1 / scale, dtype=torch.float32).double()
    want = toward_zero_f32(bias[:, :, 0].double() * bias_scale)
    finite = want.isfinite()
    got = hi + mid + lo  # exact in float64
    err = (got[finite] - want[finite]).abs()
    assert bool((err <= want[finite].abs() * 2.0**-21).all()), err.max()
    if bias_dtype != torch.float16:  # finfo.min / max * (1 / scale): +-FLT_MAX exactly
        flt_max = torch.finfo(torch.float32).max
        assert bool((got[..., -5] == -flt_max).all()) and bool((got[..., -1] == flt_max).all())
    for key, inf in ((-4, -math.inf), (-3, math.inf)):
        assert bool((hi[..., key] == inf).all())
        assert bool((mid[..., key] == 0).all()) and bool((lo[..., key] == 0).all())
    # flags: byte g is 1 where keys 32 g .. 32 g + 31 are all -inf or within MODERATE_BIAS
    words = -(-sk // 128)
    assert flags.dtype == torch.int32 and tuple(flags.shape) == (b, h, words)
    values = bias[:, :, 0].float()
    moderate = (values == -math.inf) | (values.abs() <= MODERATE_BIAS)
    moderate = torch.nn.functional.pad(moderate, (0, 128 * words - sk), value=True)
    want_flags = moderate.view(b, h, 4 * words, 32).all(-1).to(torch.uint8)
    assert 0 < int(want_flags.sum()) < want_flags.numel()  # both kinds of group
    assert torch.equal(flags.contiguous().view(torch.uint8), want_flags)
