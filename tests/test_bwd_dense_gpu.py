"""Backward without mask or bias vs the float32 reference gradients on the GPU (SPEC.md's
tolerance rule). On sm_90a these calls run the Hopper backward (kernels/sm90/bwd.py), on
SM80/86/89 the mma.sync one: lengths at and off the tile edges, every padded head dim, GQA and
MQA, causal and window limits (rows that see no key), the softcap."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.jit import target_arch
from dmattn_cute.kernels.bwd_launch import backward_spec_of
from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
from dmattn_cute.problem import make_problem
from tests.utils import SEQLENS, grads_and_check, leaves, random_inputs

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_seqlens(seqlen_q, seqlen_k):
    q, k, v, _, _ = random_inputs(2, seqlen_q, seqlen_k, 2, 2, 64, torch.bfloat16, "cuda")
    grads_and_check(q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 80, 96, 128, 160, 192, 256])
def test_head_dims(head_dim, dtype):
    q, k, v, _, _ = random_inputs(2, 129, 200, 4, 2, head_dim, dtype, "cuda")
    grads_and_check(q, k, v)


@pytest.mark.parametrize("heads,heads_kv", [(1, 1), (4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(heads, heads_kv, causal):
    q, k, v, _, _ = random_inputs(2, 300, 260, heads, heads_kv, 128, torch.bfloat16, "cuda")
    grads_and_check(q, k, v, is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "causal,window,seqlens",
    [
        (True, (-1, -1), (200, 300)),
        (True, (-1, -1), (300, 200)),  # the first 100 rows see no key: zero gradients
        (False, (64, 32), (250, 250)),
        (True, (100, -1), (150, 400)),
        (False, (0, 0), (333, 333)),
    ],
)
def test_causal_and_window(dtype, causal, window, seqlens):
    sq, sk = seqlens
    q, k, v, _, _ = random_inputs(2, sq, sk, 4, 2, 128, dtype, "cuda")
    (dq, _, _, _), _ = grads_and_check(q, k, v, is_causal=causal, window_size=window)
    if causal and sq > sk:
        assert torch.equal(dq[:, : sq - sk], torch.zeros_like(dq[:, : sq - sk]))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_softcap(head_dim):
    q, k, v, _, _ = random_inputs(2, 150, 170, 4, 2, head_dim, torch.bfloat16, "cuda")
    grads_and_check(q * 4, k * 4, v, softcap=5.0, softmax_scale=0.3, is_causal=True)


@pytest.mark.parametrize(
    ("batch", "heads", "heads_kv", "split"),
    [(1, 8, 2, True), (3, 16, 8, False)],
    ids=["heads-split", "whole-groups"],
)
def test_long_gqa_causal(batch, heads, heads_kv, split):
    """Many query blocks per key block, several heads per CTA, a ragged last block; a grid
    of 34 CTAs (each group's heads split over CTAs on sm_90a) and one of 288 (not split)."""
    q, k, v, _, _ = random_inputs(
        batch, 1500 + 549 * split, 1500 + 549 * split, heads, heads_kv, 128, torch.bfloat16, "cuda"
    )
    problem, mask4, bias4 = make_problem(q, k, v, None, None, None, True, 0.0, (-1, -1), False)
    spec = backward_spec_of(problem, mask4, bias4, False, target_arch(), q.device)
    if isinstance(spec, Sm90BwdSpec):
        assert spec.split_heads == split
    grads_and_check(q, k, v, is_causal=True)


@pytest.mark.sm90
def test_hopper_runs_the_wgmma_backward():
    """On sm_90a a call without mask or bias is the Hopper kernel's (the tests above then
    check it)."""
    q, k, v, _, _ = random_inputs(1, 64, 64, 2, 1, 128, torch.bfloat16, "cuda")
    problem, mask4, bias4 = make_problem(q, k, v, None, None, None, False, 0.0, (-1, -1), False)
    assert isinstance(backward_spec_of(problem, mask4, bias4, False, target_arch()), Sm90BwdSpec)


@pytest.mark.parametrize(("heads", "heads_kv", "causal"), [(4, 4, False), (8, 1, True)])
def test_deterministic_bitwise(heads, heads_kv, causal):
    """50 deterministic backward runs are bitwise equal (key blocks add dQ in a fixed order;
    the MQA case splits its heads over CTAs, which add dK/dV in split order) and match the
    reference."""
    q, k, v, _, _ = random_inputs(2, 700, 900, heads, heads_kv, 128, torch.bfloat16, "cuda")
    grads_and_check(q, k, v, deterministic=True, is_causal=causal)
    dout = torch.randn_like(q)
    first = None
    for _ in range(50):
        q1, k1, v1 = leaves((q, k, v))
        flash_dmattn_func(q1, k1, v1, deterministic=True, is_causal=causal).backward(dout)
        grads = (q1.grad, k1.grad, v1.grad)
        if first is None:
            first = grads
        for name, a, g in zip(("dq", "dk", "dv"), first, grads, strict=True):
            assert torch.equal(a, g), f"{name} differs between deterministic runs"
