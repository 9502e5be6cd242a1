"""The backward preprocess kernel against dpsum = rowsum(dO * O) computed by torch in fp32."""

import pytest
import torch

from dmattn_cute.jit import compile_count
from dmattn_cute.kernels.bwd_launch import bwd_preprocess

pytestmark = pytest.mark.gpu


def make_pair(
    batch: int, seqlen: int, heads: int, head_dim: int, dtype: torch.dtype, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random O and dO [B, Sq, H, D] on CUDA; "strided" gives non-contiguous views: O a slice
    of a packed [B, Sq, 3, H, D] tensor, dO a transpose of [B, H, Sq, D] storage."""
    if layout == "contiguous":
        shape = (batch, seqlen, heads, head_dim)
        out = torch.randn(shape, device="cuda", dtype=dtype)
        return out, torch.randn_like(out)
    packed = torch.randn(batch, seqlen, 3, heads, head_dim, device="cuda", dtype=dtype)
    head_major = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype)
    return packed[:, :, 1], head_major.transpose(1, 2)


def dpsum_ref(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    return (out.float() * dout.float()).sum(-1).transpose(1, 2)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 40, 64, 128, 256])
@pytest.mark.parametrize("seqlen", [1, 63, 65, 1000])
def test_bwd_pre_matches_rowsum(
    seqlen: int, head_dim: int, dtype: torch.dtype, layout: str
) -> None:
    torch.manual_seed(seqlen * 1000 + head_dim)
    out, dout = make_pair(2, seqlen, 3, head_dim, dtype, layout)
    # NaN everywhere first: a row the kernel skips stays NaN and fails the comparison.
    dpsum = torch.full((2, 3, seqlen), float("nan"), device="cuda")
    result = bwd_preprocess(out, dout, dpsum)
    torch.cuda.synchronize()
    assert result is dpsum
    torch.testing.assert_close(dpsum, dpsum_ref(out, dout), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bwd_pre_writes_only_its_rows(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    out, dout = make_pair(1, 65, 2, 64, dtype, "contiguous")
    # A view into a larger buffer: columns past Sq (the next tile's worth) must stay untouched.
    buffer = torch.full((1, 2, 128), float("nan"), device="cuda")
    dpsum = bwd_preprocess(out, dout, buffer[:, :, :65])
    torch.cuda.synchronize()
    torch.testing.assert_close(dpsum, dpsum_ref(out, dout), rtol=1e-5, atol=1e-4)
    assert buffer[:, :, 65:].isnan().all()


def test_one_compile_serves_all_shapes() -> None:
    torch.manual_seed(0)
    bwd_preprocess(*make_pair(1, 7, 1, 96, torch.float16, "contiguous"))
    before = compile_count()
    for batch, seqlen, heads in [(3, 1, 5), (1, 4097, 2), (2, 300, 1)]:
        out, dout = make_pair(batch, seqlen, heads, 96, torch.float16, "strided")
        dpsum = bwd_preprocess(out, dout)
        torch.testing.assert_close(dpsum, dpsum_ref(out, dout), rtol=1e-5, atol=1e-4)
    assert compile_count() == before
