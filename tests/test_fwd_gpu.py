"""Forward kernel vs the float32 reference on the GPU (SPEC.md's tolerance rule).

Every run poisons out, lse and the softmax stats with random finite garbage before the
launch, so an element the kernel fails to write shows up as a failure.
"""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.reference import attention_ref
from tests.utils import SEQLENS, broadcast_shapes, check_close, forward_and_check, random_inputs

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_seqlens_mask_and_bias(seqlen_q, seqlen_k):
    b, h = 2, 2
    q, k, v, mask, bias = random_inputs(
        b,
        seqlen_q,
        seqlen_k,
        h,
        h,
        64,
        torch.bfloat16,
        "cuda",
        mask_shape=(b, h, seqlen_q, seqlen_k),
        bias_shape=(b, h, seqlen_q, seqlen_k),
    )
    forward_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 80, 96, 128, 160, 192, 256])
def test_head_dims(head_dim, dtype):
    q, k, v, mask, bias = random_inputs(
        2,
        129,
        200,
        4,
        2,
        head_dim,
        dtype,
        "cuda",
        mask_shape=(2, 2, 129, 200),
        bias_shape=(2, 4, 1, 200),
    )
    forward_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("heads,heads_kv", [(1, 1), (4, 4), (8, 2), (8, 1)])
def test_gqa(heads, heads_kv):
    q, k, v, mask, bias = random_inputs(
        2,
        100,
        300,
        heads,
        heads_kv,
        128,
        torch.bfloat16,
        "cuda",
        mask_shape=(2, heads_kv, 100, 300),
        bias_shape=(2, heads, 100, 300),
    )
    forward_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("shape", broadcast_shapes(2, 2, 4, 70, 130))
def test_mask_broadcast(shape):
    q, k, v, mask, bias = random_inputs(
        2,
        70,
        130,
        4,
        2,
        64,
        torch.float16,
        "cuda",
        mask_shape=shape,
        bias_shape=(2, 4, 70, 130),
        mask_density=0.7,
    )
    forward_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("shape", broadcast_shapes(2, 2, 4, 70, 130))
def test_bias_broadcast(shape):
    q, k, v, mask, bias = random_inputs(
        2,
        70,
        130,
        4,
        2,
        64,
        torch.bfloat16,
        "cuda",
        mask_shape=(2, 2, 70, 130),
        bias_shape=shape,
        mask_density=0.7,
    )
    forward_and_check(q, k, v, mask, bias)


def test_three_dim_mask_and_fp32_bias():
    q, k, v, _, _ = random_inputs(2, 90, 150, 4, 2, 64, torch.bfloat16, "cuda")
    mask = torch.rand(2, 2, 150, device="cuda") < 0.6
    bias = torch.randn(2, 4, 150, device="cuda", dtype=torch.float32)
    forward_and_check(q, k, v, mask, bias)


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
        (False, (0, 0), (130, 130)),
    ],
)
def test_flags(dtype, operands, causal, window, seqlens):
    sq, sk = seqlens
    q, k, v, mask, bias = random_inputs(
        1,
        sq,
        sk,
        2,
        1,
        128,
        dtype,
        "cuda",
        mask_shape=(1, 1, sq, sk) if operands in ("mask", "both") else None,
        bias_shape=(1, 2, sq, sk) if operands in ("bias", "both") else None,
    )
    forward_and_check(q, k, v, mask, bias, causal=causal, window=window)


@pytest.mark.parametrize("operands", ["none", "both"])
def test_softcap(operands):
    q, k, v, mask, bias = random_inputs(
        2,
        150,
        170,
        2,
        2,
        64,
        torch.bfloat16,
        "cuda",
        mask_shape=(2, 2, 150, 170) if operands == "both" else None,
        bias_shape=(2, 1, 150, 170) if operands == "both" else None,
    )
    forward_and_check(q * 4, k * 4, v, mask, bias, softcap=5.0, scale=0.3)


def test_fully_masked_rows_and_tiles():
    b, h, sq, sk = 2, 2, 300, 500
    q, k, v, mask, bias = random_inputs(
        b,
        sq,
        sk,
        h,
        h,
        64,
        torch.bfloat16,
        "cuda",
        mask_shape=(b, h, sq, sk),
        bias_shape=(b, h, sq, sk),
    )
    mask[:, :, 10:40] = False  # fully masked rows
    mask[:, :, :, 128:320] = False  # fully masked key blocks for every query block
    mask[0, 1] = False  # a whole head
    bias[:, :, 50:60] = float("-inf")  # rows masked through the bias
    out, lse, _, _ = forward_and_check(q, k, v, mask, bias)
    assert torch.equal(out[:, 10:40], torch.zeros_like(out[:, 10:40]))
    assert torch.isneginf(lse[:, :, 10:40]).all() and torch.isneginf(lse[0, 1]).all()
    assert torch.isneginf(lse[:, :, 50:60]).all()


def test_block_sparse_mask_matches_reference():
    b, h, sq, sk = 1, 4, 512, 1024
    q, k, v, _, bias = random_inputs(
        b, sq, sk, h, h, 128, torch.bfloat16, "cuda", bias_shape=(b, h, 1, sk)
    )
    blocks = torch.rand(b, h, sq // 64, sk // 64, device="cuda") < 0.25
    mask = blocks.repeat_interleave(64, 2).repeat_interleave(64, 3)
    forward_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_long_runs_of_empty_key_blocks(head_dim, causal):
    """Visible key blocks far apart (runs of more than 32 empty blocks: the Hopper walk
    searches the block bits 32 at a time), query blocks with none, odd lengths."""
    b, h, sq, sk = 2, 4, 333, 9001
    q, k, v, _, bias = random_inputs(
        b, sq, sk, h, 2, head_dim, torch.bfloat16, "cuda", bias_shape=(b, 2, 1, sk)
    )
    keep = torch.rand(b, 2, -(-sq // 64), -(-sk // 64), device="cuda") < 0.03
    keep[:, :, :, -1] = True  # the tail block (the walk starts there)
    keep[:, 1, 2] = False  # query rows that see no key at all
    mask = keep.repeat_interleave(64, 2).repeat_interleave(64, 3)[:, :, :sq, :sk]
    out, lse, _, _ = forward_and_check(q, k, v, mask, bias, causal=causal)
    if not causal:
        rows = slice(128, 192)
        assert torch.equal(out[:, rows, 2:], torch.zeros_like(out[:, rows, 2:]))
        assert torch.isneginf(lse[:, 2:, rows]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_all_true_mask_with_partial_tiles(causal):
    """An all-True mask but for partial tiles in a few query blocks: those CTAs walk the
    masked loop and every other one the loop without a mask (the Hopper forward's all_full);
    a walk of more than 32 key blocks, a partial tail tile, rows that see only the last keys
    (none under causal)."""
    b, h, sq, sk = 2, 4, 700, 4500
    q, k, v, _, bias = random_inputs(
        b, sq, sk, h, 2, 128, torch.bfloat16, "cuda", bias_shape=(b, 2, 1, sk)
    )
    mask = torch.ones(b, 2, sq, sk, dtype=torch.bool, device="cuda")
    mask[0, 1, 300:340, 64:128] = False  # half a key block in one query block
    mask[1, 0, 650:, 4400:] = False  # part of the tail tile
    mask[1, 1, :5, :4000] = False
    forward_and_check(q, k, v, mask, bias, causal=causal)


def test_non_contiguous_qkv_and_mask():
    qkv = torch.randn(2, 180, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    mask = (torch.rand(2, 4, 260, 200, device="cuda") < 0.5)[:, :, 10:190, :180]
    bias = torch.randn(2, 4, 180, 200, device="cuda", dtype=torch.bfloat16).transpose(2, 3)
    forward_and_check(q, k, v, mask, bias[:, :, :180])


def test_public_api_on_cuda():
    q, k, v, mask, bias = random_inputs(
        2,
        77,
        99,
        4,
        2,
        64,
        torch.float16,
        "cuda",
        mask_shape=(2, 1, 77, 99),
        bias_shape=(1, 4, 77, 99),
    )
    out, lse = flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, mask, bias, is_causal=True)
    lowp, lowp_lse = attention_ref(q, k, v, mask, bias, is_causal=True, compute_dtype=None)
    check_close("out", out, ref, lowp, q.dtype)
    check_close("lse", lse, ref_lse, lowp_lse.float(), q.dtype)


@pytest.mark.parametrize("ctas", [1, 3, 7])
@pytest.mark.parametrize(
    ("head_dim", "dtype", "bias_shape", "limits"),
    [
        (128, torch.bfloat16, None, {}),
        (128, torch.float16, (2, 2, 1, 777), {"causal": True}),
        (96, torch.bfloat16, (1, 1, 1, 777), {"window": (200, 50)}),
        (64, torch.bfloat16, (2, 4, 1000, 777), {}),  # a full bias: its tiles by TMA
    ],
)
def test_persistent_ctas_take_many_items(ctas, head_dim, dtype, bias_shape, limits, monkeypatch):
    """The Hopper forward without a mask is persistent: with the launch told there are
    `ctas` SMs, every CTA walks many items in turn, longest first under causal / window
    limits (Sq != Sk, key tails, GQA, a key bias per kv head or broadcast, a full bias, rows
    with no key under the window); outputs poisoned."""
    from dmattn_cute.kernels import fwd_launch

    monkeypatch.setattr(fwd_launch, "sm_count", lambda device, arch: ctas)
    q, k, v, _, bias = random_inputs(
        2, 1000, 777, 4, 2, head_dim, dtype, "cuda", bias_shape=bias_shape
    )
    forward_and_check(q, k, v, None, bias, **limits)
