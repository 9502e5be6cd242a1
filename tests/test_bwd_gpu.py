"""Backward kernels vs the float32 reference gradients on the GPU (SPEC.md's tolerance rule).

Each test draws fresh random inputs and a random dout, runs out.backward(dout) through
flash_dmattn_func, and compares dq, dk, dv and dbias with autograd through the reference run
in float32 (ground truth) and in the inputs' dtype (the low-precision error budget).
"""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.attention import flash_dmattn_func
from tests.utils import SEQLENS, broadcast_shapes, grads_and_check, random_inputs, rerun_grads

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_seqlens_mask_and_bias(seqlen_q, seqlen_k):
    b, h = 2, 2
    q, k, v, mask, bias = random_inputs(
        b, seqlen_q, seqlen_k, h, h, 64, torch.bfloat16, "cuda",
        mask_shape=(b, h, seqlen_q, seqlen_k), bias_shape=(b, h, seqlen_q, seqlen_k),
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 80, 96, 128, 160, 192, 256])
def test_head_dims(head_dim, dtype):
    q, k, v, mask, bias = random_inputs(
        2, 129, 200, 4, 2, head_dim, dtype, "cuda",
        mask_shape=(2, 2, 129, 200), bias_shape=(2, 2, 1, 200),
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("heads,heads_kv", [(1, 1), (4, 4), (8, 2), (8, 1)])
def test_gqa(heads, heads_kv):
    q, k, v, mask, bias = random_inputs(
        2, 100, 300, heads, heads_kv, 128, torch.bfloat16, "cuda",
        mask_shape=(2, heads_kv, 100, 300), bias_shape=(2, heads_kv, 100, 300),
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape", broadcast_shapes(2, 2, 4, 70, 130))
def test_dbias_broadcast(shape, deterministic):
    q, k, v, mask, bias = random_inputs(
        2, 70, 130, 4, 2, 64, torch.bfloat16, "cuda",
        mask_shape=(2, 2, 70, 130), bias_shape=shape, mask_density=0.7,
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias, deterministic=deterministic)


@pytest.mark.parametrize("shape", [(2, 1, 1, 130), (1, 4, 70, 1), (2, 2, 70, 130), (1, 1, 70, 130)])
def test_mask_broadcast(shape):
    q, k, v, mask, bias = random_inputs(
        2, 70, 130, 4, 2, 64, torch.float16, "cuda",
        mask_shape=shape, bias_shape=(2, 4, 70, 130), mask_density=0.7,
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias)


def test_three_dim_mask_and_fp32_bias():
    q, k, v, _, _ = random_inputs(2, 90, 150, 4, 2, 64, torch.bfloat16, "cuda")
    mask = torch.rand(2, 2, 150, device="cuda") < 0.6
    bias = torch.randn(2, 4, 150, device="cuda", dtype=torch.float32)
    grads_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("operands", ["none", "mask", "bias", "both"])
@pytest.mark.parametrize(
    "causal,window,seqlens",
    [
        (False, (-1, -1), (200, 300)),
        (True, (-1, -1), (200, 300)),
        (True, (-1, -1), (300, 200)),
        (False, (64, 32), (250, 250)),
        (True, (100, -1), (150, 400)),
    ],
)
def test_flags(dtype, operands, causal, window, seqlens):
    sq, sk = seqlens
    q, k, v, mask, bias = random_inputs(
        1, sq, sk, 2, 1, 128, dtype, "cuda",
        mask_shape=(1, 1, sq, sk) if operands in ("mask", "both") else None,
        bias_shape=(1, 2, sq, sk) if operands in ("bias", "both") else None,
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias, is_causal=causal, window_size=window)


@pytest.mark.parametrize("operands", ["none", "both"])
def test_softcap(operands):
    q, k, v, mask, bias = random_inputs(
        2, 150, 170, 2, 2, 64, torch.bfloat16, "cuda",
        mask_shape=(2, 2, 150, 170) if operands == "both" else None,
        bias_shape=(2, 1, 150, 170) if operands == "both" else None,
    )  # fmt: skip
    grads_and_check(q * 4, k * 4, v, mask, bias, softcap=5.0, softmax_scale=0.3)


def test_fully_masked_rows_give_zero_grads():
    b, h, sq, sk = 2, 2, 300, 500
    q, k, v, mask, bias = random_inputs(
        b, sq, sk, h, h, 64, torch.bfloat16, "cuda",
        mask_shape=(b, h, sq, sk), bias_shape=(b, h, sq, sk),
    )  # fmt: skip
    mask[:, :, 10:40] = False  # fully masked rows
    mask[:, :, :, 128:320] = False  # fully masked key blocks for every query block
    mask[0, 1] = False  # a whole head
    bias[:, :, 50:60] = float("-inf")  # rows masked through the bias
    got, _ = grads_and_check(q, k, v, mask, bias)
    dq, dk, dv, dbias = got
    for t in got:
        assert not t.isnan().any()
    assert torch.equal(dq[:, 10:40], torch.zeros_like(dq[:, 10:40]))
    assert torch.equal(dq[:, 50:60], torch.zeros_like(dq[:, 50:60]))
    assert torch.equal(dq[0, :, 1], torch.zeros_like(dq[0, :, 1]))
    assert torch.equal(dk[:, 128:320], torch.zeros_like(dk[:, 128:320]))
    assert torch.equal(dv[0, :, 1], torch.zeros_like(dv[0, :, 1]))
    assert torch.equal(dbias[:, :, 10:40], torch.zeros_like(dbias[:, :, 10:40]))
    assert torch.equal(dbias[:, :, 50:60], torch.zeros_like(dbias[:, :, 50:60]))


def test_block_sparse_mask():
    b, h, sq, sk = 1, 4, 512, 1024
    q, k, v, _, bias = random_inputs(
        b, sq, sk, h, h, 128, torch.bfloat16, "cuda", bias_shape=(b, h, 1, sk)
    )
    blocks = torch.rand(b, h, sq // 64, sk // 64, device="cuda") < 0.25
    mask = blocks.repeat_interleave(64, 2).repeat_interleave(64, 3)
    grads_and_check(q, k, v, mask, bias)


@pytest.fixture
def short_query_splits(monkeypatch):
    """Query-range splits every 64 rows (bwd_launch.QUERY_SPLIT_ROWS), so that short problems
    run them; the plans made meanwhile are dropped before and after."""
    from dmattn_cute.jit import cache
    from dmattn_cute.kernels import bwd_launch

    cache.clear_memory()
    monkeypatch.setattr(bwd_launch, "QUERY_SPLIT_ROWS", 64)
    yield
    cache.clear_memory()


# (Sq, Sk, H, Hkv, D, mask shape, bias shape, flags)
QUERY_SPLIT_CASES = {
    # a per-query-head row bias: its column sums come from several CTAs (fp32 buffer)
    "rows-bias-causal": (300, 200, 4, 2, 64, (2, 2, 300, 200), (2, 4, 1, 200),
                         {"is_causal": True}),
    # a narrow window: most shares of a key block's range hold no visible block
    "window-gqa-full-bias": (257, 300, 8, 2, 128, (2, 2, 257, 300), (2, 2, 257, 300),
                             {"window_size": (30, 10)}),
    "odd-lengths-key-bias": (65, 127, 2, 1, 96, (2, 1, 1, 127), (2, 1, 1, 127), {}),
}  # fmt: skip


@pytest.mark.parametrize("case", QUERY_SPLIT_CASES.values(), ids=QUERY_SPLIT_CASES.keys())
def test_query_range_splits(short_query_splits, case):
    sq, sk, h, hkv, d, mask_shape, bias_shape, flags = case
    q, k, v, mask, bias = random_inputs(
        2, sq, sk, h, hkv, d, torch.bfloat16, "cuda",
        mask_shape=mask_shape, bias_shape=bias_shape, mask_density=0.6,
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias, **flags)


def test_query_range_splits_with_crowded_key_columns(short_query_splits):
    """A few key columns visible to every query (as top-k blocks by a per-key score leave
    them), the rest only near the diagonal: the walks the split is for."""
    sq, sk = 1000, 513
    q, k, v, _, bias = random_inputs(
        1, sq, sk, 4, 2, 128, torch.float16, "cuda", bias_shape=(1, 2, 1, sk)
    )
    rows, cols = torch.arange(sq, device="cuda")[:, None], torch.arange(sk, device="cuda")[None]
    crowded = (cols // 128 == 1) | (cols // 128 == 3)
    mask = (crowded | ((rows // 2 - cols).abs() < 40)).expand(1, 2, sq, sk)
    grads_and_check(q, k, v, mask, bias)


def test_non_contiguous_qkv_and_mask():
    qkv = torch.randn(2, 180, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    mask = (torch.rand(2, 4, 260, 200, device="cuda") < 0.5)[:, :, 10:190, :180]
    bias = torch.randn(2, 4, 180, 200, device="cuda", dtype=torch.bfloat16).transpose(2, 3)
    grads_and_check(q, k, v, mask, bias[:, :, :180])


def test_bias_without_grad_gets_none():
    q, k, v, mask, bias = random_inputs(
        1, 100, 100, 2, 2, 64, torch.bfloat16, "cuda",
        mask_shape=(1, 2, 100, 100), bias_shape=(1, 2, 100, 100),
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias, bias_grad=False)


@pytest.mark.parametrize(
    "bias_shape",
    [(2, 2, 1, 1000), (1, 1, 1000, 1000), (1, 1, 1, 1000), (2, 8, 1, 1000), (2, 8, 1000, 1000)],
)
def test_deterministic_bitwise(bias_shape):
    """100 backward runs of a masked, biased GQA problem with a tail are bitwise equal (on
    sm_90a all but [1, 1, S, S] run the Hopper kernel's key-block order, the query-broadcast
    biases through per-head dbias rows summed by the launch; that one sums dbias over its
    broadcast dims in the mma.sync kernel)."""
    q, k, v, mask, bias = random_inputs(
        2, 1000, 1000, 8, 2, 64, torch.bfloat16, "cuda",
        mask_shape=(2, 2, 1000, 1000), bias_shape=bias_shape, mask_density=0.8,
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias, deterministic=True, is_causal=True)
    dout = torch.randn_like(q)
    first = None
    for _ in range(100):
        grads = rerun_grads(q, k, v, mask, bias, dout, deterministic=True, is_causal=True)
        if first is None:
            first = grads
        else:
            for name, a, g in zip(("dq", "dk", "dv", "dbias"), first, grads, strict=True):
                assert torch.equal(a, g), f"{name} differs between deterministic runs"


def test_backward_memory():
    """Peak extra memory of the backward for bias [B, Hkv, 1, Sk] at B2 H16 Hkv4 S8192: at
    most the fp32 dq accumulator plus a bias-sized fp32 buffer (and dpsum), beyond the
    gradients themselves."""
    b, h, hkv, s, d = 2, 16, 4, 8192, 128
    q, k, v, _, bias = random_inputs(
        b, s, s, h, hkv, d, torch.bfloat16, "cuda", bias_shape=(b, hkv, 1, s),
        requires_grad=True,
    )  # fmt: skip
    out = flash_dmattn_func(q, k, v, None, bias)
    dout = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v, bias))
    dq_acc = q.numel() * 4
    bias_fp32 = bias.numel() * 4
    dpsum = b * h * s * 4
    extra = peak - grads
    print(
        f"\nbackward peak {peak / 2**20:.1f} MiB: grads {grads / 2**20:.1f} MiB, extra "
        f"{extra / 2**20:.1f} MiB; dq fp32 accumulator {dq_acc / 2**20:.1f} MiB + bias-sized "
        f"fp32 {bias_fp32 / 2**20:.3f} MiB + dpsum {dpsum / 2**20:.3f} MiB"
    )
    assert extra <= dq_acc + bias_fp32 + dpsum + 2**20


def test_query_range_splits_with_key_expiry(short_query_splits):
    """Top-w expiry rows (the crowded columns of a per-key top-w) through split walks."""
    from dmattn_cute.topw import topw_expiry
    from tests.utils import expiry_grads_and_check

    q, k, v, _, bias = random_inputs(
        2, 400, 400, 4, 2, 128, torch.bfloat16, "cuda", bias_shape=(2, 2, 1, 400)
    )
    expiry = topw_expiry(bias[:, :, 0].float(), 48)
    expiry_grads_and_check(q, k, v, None, bias, expiry, is_causal=True)
