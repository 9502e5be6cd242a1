"""The mma.sync backward with a group's query heads split over CTAs (BwdSpec.split_heads):
small grids of GQA/MQA calls, whose CTAs store fp32 partial dK/dV sums summed by the launch.
On SM80/86/89 it is the kernel these calls run; on an H100/H200 they run it through
DMATTN_CUTE_KERNELS=mma_sync. Fresh random inputs against the float32 reference (as
test_bwd_gpu.py), after checking that the call's plan does split."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.jit.arch import target_arch
from dmattn_cute.kernels.bwd import BwdSpec
from dmattn_cute.kernels.bwd_launch import backward_spec_of
from dmattn_cute.problem import make_problem
from tests.utils import grads_and_check, random_inputs, rerun_grads

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("mma_sync_kernels")]


def assert_split(q, k, v, mask, bias, deterministic=False, is_causal=False, split=True):
    problem, mask4, bias4 = make_problem(
        q, k, v, mask, bias, None, is_causal, 0.0, (-1, -1), deterministic
    )
    spec = backward_spec_of(problem, mask4, bias4, bias is not None, target_arch(), q.device)
    assert isinstance(spec, BwdSpec) and spec.split_heads == split


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "heads,heads_kv,seqlen_q,seqlen_k,head_dim",
    [(8, 1, 100, 300, 128), (8, 2, 129, 65, 64), (6, 2, 1, 127, 96), (32, 1, 255, 513, 64)],
)
def test_split_gqa(heads, heads_kv, seqlen_q, seqlen_k, head_dim, deterministic):
    q, k, v, mask, bias = random_inputs(
        2, seqlen_q, seqlen_k, heads, heads_kv, head_dim, torch.bfloat16, "cuda",
        mask_shape=(2, heads_kv, seqlen_q, seqlen_k), bias_shape=(2, heads, seqlen_q, seqlen_k),
    )  # fmt: skip
    assert_split(q, k, v, mask, bias, deterministic)
    grads_and_check(q, k, v, mask, bias, deterministic=deterministic)


@pytest.mark.parametrize(
    "mask_shape,bias_shape",
    [
        (None, None),
        ((2, 8, 90, 150), (2, 1, 1, 150)),  # per-head mask, shared key bias (fp32 sums)
        ((1, 1, 90, 150), (2, 2, 90, 150)),  # broadcast mask, per-kv-head bias
        ((2, 2, 1, 150), (1, 8, 90, 150)),  # query-broadcast mask, batch-broadcast bias
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_split_operands(mask_shape, bias_shape, causal):
    q, k, v, mask, bias = random_inputs(
        2, 90, 150, 8, 2, 64, torch.float16, "cuda",
        mask_shape=mask_shape, bias_shape=bias_shape, mask_density=0.6,
    )  # fmt: skip
    assert_split(q, k, v, mask, bias, is_causal=causal)
    grads_and_check(q, k, v, mask, bias, is_causal=causal)


def test_deterministic_shared_dbias_does_not_split():
    """A deterministic call whose dbias rows are shared by a group's heads (a bias per kv head)
    keeps the whole group in one CTA."""
    q, k, v, mask, bias = random_inputs(
        1, 70, 130, 8, 2, 64, torch.bfloat16, "cuda",
        mask_shape=(1, 2, 70, 130), bias_shape=(1, 2, 70, 130),
    )  # fmt: skip
    assert_split(q, k, v, mask, bias, deterministic=True, split=False)
    grads_and_check(q, k, v, mask, bias, deterministic=True)


def test_split_is_deterministic():
    """Split partial sums are added in slot order: two runs give identical gradients."""
    q, k, v, mask, bias = random_inputs(
        1, 200, 333, 16, 2, 64, torch.bfloat16, "cuda",
        mask_shape=(1, 16, 200, 333), bias_shape=(1, 16, 200, 333),
    )  # fmt: skip
    assert_split(q, k, v, mask, bias, deterministic=True)
    dout = torch.randn_like(q)
    first, _ = grads_and_check(q, k, v, mask, bias, deterministic=True, dout=dout)
    second = rerun_grads(q, k, v, mask, bias, dout, deterministic=True)
    for a, again in zip(first, second, strict=True):
        assert torch.equal(a, again)
