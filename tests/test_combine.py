"""The split-KV combine kernel (kernels/combine.py) against the log-sum-exp merge in float32:
chunks and whole rows without a visible key, more chunks than a warp has lanes, head dims
that are not multiples of 32. Argument checks on CPU."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.kernels.combine_launch import combine_spec, combine_splits


def merge_ref(parts: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Hkv, G, D] fp32 and lse [B, Hkv, G] by the definition (module docstring)."""
    lse = torch.logsumexp(part_lse, dim=1)
    weights = torch.exp(part_lse - lse[:, None]).nan_to_num(0.0)  # a row without keys: 0
    out = (weights.transpose(2, 3)[..., None] * parts.float()).sum(dim=1)  # [B, G, Hkv, D]
    return out.transpose(1, 2), lse


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 5, 40])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_matches_the_merge(dtype, head_dim, splits):
    torch.manual_seed(splits * 1000 + head_dim)
    batch, group, heads_kv = 3, 4, 2
    parts = torch.randn(batch, splits, group, heads_kv, head_dim, device="cuda", dtype=dtype)
    part_lse = 4 * torch.randn(batch, splits, heads_kv, group, device="cuda")
    if splits > 1:  # chunks without a visible key: the forward wrote out 0, lse -inf
        part_lse[0, : splits // 2] = -float("inf")
        parts[0, : splits // 2] = 0
    part_lse[1, :, 1, 2] = -float("inf")  # a row without a visible key anywhere
    parts[1, :, 2, 1] = 0
    # NaN first: an element the kernel does not write fails the comparison
    out = torch.full((batch, heads_kv, group, head_dim), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((batch, heads_kv, group), float("nan"), device="cuda")
    combine_splits(parts, part_lse, out, lse)
    want, want_lse = merge_ref(parts, part_lse)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(out[1, 1, 2], torch.zeros_like(out[1, 1, 2])) and lse[1, 1, 2].isneginf()
    finite = want_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_combine_of_one_chunk_is_the_chunk():
    parts = torch.randn(2, 1, 4, 3, 128, device="cuda", dtype=torch.bfloat16)
    part_lse = torch.randn(2, 1, 3, 4, device="cuda")
    out, lse = combine_splits(parts, part_lse)
    assert torch.equal(out, parts[:, 0].transpose(1, 2))
    torch.testing.assert_close(lse, part_lse[:, 0], rtol=1e-6, atol=1e-6)


def test_combine_checks_its_arguments():
    parts = torch.zeros(2, 3, 4, 2, 64, dtype=torch.bfloat16)
    part_lse = torch.zeros(2, 3, 2, 4)
    with pytest.raises(ValueError, match="CUDA"):
        combine_splits(parts, part_lse)
    with pytest.raises(ValueError, match="part_lse: expected float32"):
        combine_splits(parts, part_lse[:, :2])
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        combine_spec(torch.float32, 64)
    with pytest.raises(ValueError, match="at most 256"):
        combine_spec(torch.bfloat16, 320)
