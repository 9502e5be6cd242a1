"""The packed, split decode path (dmattn_cute/decode.py): the group's query heads as rows and
the keys in chunks give flash_dmattn_func's result (out and lse), also where a chunk or a whole
row has no visible key. On CPU (the reference path) and, marked gpu, on CUDA."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.decode import decode_splits, packable, packed_decode
from dmattn_cute.reference import attention_ref
from tests.utils import check_close, random_inputs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 3, 7])  # 301 keys: 7 chunks run as one batch
def test_packed_split_decode_matches_reference(device, splits):
    b, sk, h, hkv, d = 3, 301, 8, 2, 64
    q, k, v, mask, bias = random_inputs(
        b, 1, sk, h, hkv, d, torch.bfloat16, device,
        mask_shape=(b, hkv, 1, sk), bias_shape=(1, hkv, 1, sk), mask_density=0.6,
    )  # fmt: skip
    mask[0, :, :, :200] = False  # whole chunks without a visible key
    mask[1] = False  # a row that sees no key at all
    assert packable(q, k, (mask, bias))
    out, lse = packed_decode(q, k, v, mask, bias, None, 0.0, splits)
    ref, ref_lse = attention_ref(q, k, v, mask, bias, compute_dtype=torch.float32)
    lowp, _ = attention_ref(q, k, v, mask, bias)
    check_close("out", out, ref, lowp, q.dtype)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and lse[1].isneginf().all()
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)


def test_what_packs():
    q, k, _, _, _ = random_inputs(2, 1, 64, 8, 2, 32, torch.bfloat16, "cpu")
    per_head = torch.zeros(2, 8, 1, 64)
    assert packable(q, k, (None, torch.zeros(2, 2, 1, 64)))
    assert not packable(q, k, (None, per_head))  # per query head: not shared by a group
    q2, k2, _, _, _ = random_inputs(2, 2, 64, 8, 2, 32, torch.bfloat16, "cpu")
    assert not packable(q2, k2, (None, None))  # two queries per row


def test_splits_fill_the_gpu_with_long_enough_chunks():
    assert decode_splits(8, 4, 32768, 132) == 8  # up to 9 (2 x 132 CTAs / 32 pairs), dividing
    assert decode_splits(8, 4, 1000, 132) == 2  # chunks of at least 512 keys
    assert decode_splits(8, 4, 32771, 132) == 9  # a prime: no divisor, chunks in a loop
    assert decode_splits(64, 8, 4096, 132) == 1
