"""attention_ref against a naive per-row formulation, its gradients, and the test helpers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from dmattn_cute.reference import attention_ref
from tests.utils import check_close, random_inputs

BATCH, SEQLEN_Q, SEQLEN_K, HEADS, HEADS_KV, HEAD_DIM = 2, 3, 5, 4, 2, 8
F64 = torch.float64
NEG_INF = float("-inf")

# Every [Bm, Hm, Qm, Km] that SPEC.md allows for a mask or bias of the problem above.
BROADCAST_SHAPES = list(
    itertools.product((1, BATCH), (1, HEADS_KV, HEADS), (1, SEQLEN_Q), (1, SEQLEN_K))
)
FULL_SHAPE = (BATCH, HEADS, SEQLEN_Q, SEQLEN_K)


def _read(t: Tensor, heads: int, b: int, h: int, hk: int, i: int, j: int) -> Tensor:
    """Element (b, h, i, j) of a 4-D broadcast mask/bias; a head dim of size Hkv reads hk."""
    bm, hm, qm, km = t.shape
    head = 0 if hm == 1 else h if hm == heads else hk
    return t[b if bm > 1 else 0, head, i if qm > 1 else 0, j if km > 1 else 0]


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    window: tuple[int, int] = (-1, -1),
) -> tuple[Tensor, Tensor]:
    """Row by row: list the visible keys by index arithmetic, softmax over that subset only.

    Returns out [B, Sq, H, D] and lse [B, H, Sq] in float64.
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if mask is not None and mask.dim() == 3:
        mask = mask[:, :, None, :]
    if bias is not None and bias.dim() == 3:
        bias = bias[:, :, None, :]
    left, right = window
    out = torch.zeros(batch, seqlen_q, heads, head_dim, dtype=F64)
    lse = torch.full((batch, heads, seqlen_q), NEG_INF, dtype=F64)
    for b, h, i in itertools.product(range(batch), range(heads), range(seqlen_q)):
        hk = h * heads_kv // heads
        diag = i + seqlen_k - seqlen_q
        keys, scores = [], []
        for j in range(seqlen_k):
            if is_causal and j > diag:
                continue
            if (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
                continue
            if mask is not None and not _read(mask, heads, b, h, hk, i, j):
                continue
            s = scale * float(torch.dot(q[b, i, h].double(), k[b, j, hk].double()))
            if softcap > 0:
                s = softcap * math.tanh(s / softcap)
            if bias is not None:
                s += float(_read(bias, heads, b, h, hk, i, j))
            if s != NEG_INF:
                keys.append(j)
                scores.append(s)
        if keys:
            s = torch.tensor(scores, dtype=F64)
            out[b, i, h] = torch.softmax(s, dim=0) @ v[b, keys, hk].double()
            lse[b, h, i] = torch.logsumexp(s, dim=0)
    return out, lse


def assert_matches_naive(q, k, v, mask=None, bias=None, scale=None, **kwargs) -> tuple:
    """attention_ref in float64 equals naive_attention; returns the reference's (out, lse)."""
    out, lse = attention_ref(q, k, v, mask, bias, scale, compute_dtype=F64, **kwargs)
    window = kwargs.pop("window_size", (-1, -1))
    out_naive, lse_naive = naive_attention(q, k, v, mask, bias, scale, window=window, **kwargs)
    assert out.dtype == F64 and lse.dtype == F64
    # Both in float64 (u = 2^-53 ~ 1e-16): the same sums in another order, and exp/log of
    # scores of size ~1, differ by ~1e-15; 1e-10 catches any wrong term, never rounding.
    torch.testing.assert_close(out, out_naive, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_naive, rtol=1e-10, atol=1e-12)
    return out, lse


def inputs(
    seed: int,
    heads_kv: int = HEADS_KV,
    seqlen_q: int = SEQLEN_Q,
    seqlen_k: int = SEQLEN_K,
    **kwargs,
) -> tuple:
    """random_inputs in float64 on CPU for the module's problem size, seeded."""
    generator = torch.Generator().manual_seed(seed)
    return random_inputs(
        BATCH,
        seqlen_q,
        seqlen_k,
        HEADS,
        heads_kv,
        HEAD_DIM,
        F64,
        "cpu",
        generator=generator,
        **kwargs,
    )


@pytest.mark.parametrize("mask_shape", BROADCAST_SHAPES)
def test_mask_broadcast(mask_shape):
    q, k, v, mask, bias = inputs(0, mask_shape=mask_shape, bias_shape=FULL_SHAPE, mask_density=0.7)
    assert_matches_naive(q, k, v, mask, bias)


@pytest.mark.parametrize("bias_shape", BROADCAST_SHAPES)
def test_bias_broadcast(bias_shape):
    q, k, v, mask, bias = inputs(1, mask_shape=FULL_SHAPE, bias_shape=bias_shape, mask_density=0.8)
    assert_matches_naive(q, k, v, mask, bias)


@pytest.mark.parametrize(
    "mask_shape, bias_shape",
    [
        ((BATCH, HEADS, SEQLEN_K), (BATCH, HEADS, SEQLEN_K)),
        ((1, HEADS_KV, SEQLEN_K), (BATCH, 1, 1)),
        ((BATCH, 1, 1), (1, HEADS_KV, SEQLEN_K)),
        ((1, 1, SEQLEN_K), (BATCH, HEADS_KV, SEQLEN_K)),
    ],
)
def test_3d_mask_and_bias_mean_one_query(mask_shape, bias_shape):
    q, k, v, mask, bias = inputs(2, mask_shape=mask_shape, bias_shape=bias_shape, mask_density=0.7)
    out, lse = assert_matches_naive(q, k, v, mask, bias)
    out_4d, lse_4d = attention_ref(q, k, v, mask.unsqueeze(2), bias.unsqueeze(2), compute_dtype=F64)
    assert torch.equal(out, out_4d) and torch.equal(lse, lse_4d)


@pytest.mark.parametrize(
    "mask_base, bias_base",
    [
        ((1, 1, 1, SEQLEN_K), (BATCH, 1, SEQLEN_Q, 1)),
        ((BATCH, HEADS_KV, 1, SEQLEN_K), (1, HEADS_KV, SEQLEN_Q, SEQLEN_K)),
        ((1, HEADS, SEQLEN_Q, 1), (1, 1, 1, 1)),
    ],
)
def test_expanded_views(mask_base, bias_base):
    q, k, v, mask, bias = inputs(3, mask_shape=mask_base, bias_shape=bias_base, mask_density=0.7)
    expanded_shape = (BATCH, mask_base[1], SEQLEN_Q, SEQLEN_K)
    mask_view = mask.expand(expanded_shape)
    bias_view = bias.expand((BATCH, bias_base[1], SEQLEN_Q, SEQLEN_K))
    assert 0 in mask_view.stride() and 0 in bias_view.stride()
    out, lse = assert_matches_naive(q, k, v, mask_view, bias_view)
    out_plain, lse_plain = attention_ref(q, k, v, mask, bias, compute_dtype=F64)
    assert torch.equal(out, out_plain) and torch.equal(lse, lse_plain)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "window", [(-1, -1), (0, 0), (1, 0), (0, 1), (2, -1), (-1, 1), (0, -1), (-1, 0), (1, 2)]
)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(3, 5), (5, 3), (4, 4), (1, 5)])
def test_causal_and_window_bottom_right(is_causal, window, seqlen_q, seqlen_k):
    q, k, v, _, bias = inputs(
        4, seqlen_q=seqlen_q, seqlen_k=seqlen_k, bias_shape=(BATCH, HEADS, seqlen_q, seqlen_k)
    )
    assert_matches_naive(q, k, v, None, bias, is_causal=is_causal, window_size=window)


@pytest.mark.parametrize("softcap", [0.5, 3.0])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_softcap_and_scale(softcap, scale):
    q, k, v, mask, bias = inputs(
        5, mask_shape=FULL_SHAPE, bias_shape=(1, HEADS, 1, SEQLEN_K), mask_density=0.8
    )
    out, _ = assert_matches_naive(q, k, v, mask, bias, scale, softcap=softcap)
    out_uncapped, _ = attention_ref(q, k, v, mask, bias, scale, compute_dtype=F64)
    assert not torch.allclose(out, out_uncapped)


@pytest.mark.parametrize("heads_kv", [HEADS, 2, 1])
@pytest.mark.parametrize("seqlen_q", [1, SEQLEN_Q])
def test_gqa_mqa_and_group_shared_mask_bias(heads_kv, seqlen_q):
    shape = (BATCH, heads_kv, seqlen_q, SEQLEN_K)
    q, k, v, mask, bias = inputs(
        6,
        heads_kv=heads_kv,
        seqlen_q=seqlen_q,
        mask_shape=shape,
        bias_shape=shape,
        mask_density=0.7,
    )
    assert_matches_naive(q, k, v, mask, bias)


def _fully_masked(case: str) -> tuple:
    """Inputs plus a bool [B, H, Sq] marking rows that see no key, for each way to get one."""
    q, k, v, mask, bias = inputs(7, mask_shape=FULL_SHAPE, bias_shape=FULL_SHAPE, mask_density=1.0)
    empty = torch.zeros(BATCH, HEADS, SEQLEN_Q, dtype=torch.bool)
    kwargs = {}
    if case == "mask":
        mask[0, 1, 2] = False
        mask[1, :, 0] = False
        empty[0, 1, 2] = empty[1, :, 0] = True
    elif case == "bias":
        bias[1, 3, 1] = NEG_INF
        bias[0, 0, 0, ::2] = NEG_INF
        mask[0, 0, 0, 1::2] = False
        empty[1, 3, 1] = empty[0, 0, 0] = True
    else:
        # Causal with Sq = 5 > Sk = 3: query i sees keys j <= i - 2, so rows 0 and 1 see none.
        q, k, v = torch.cat([q, q[:, :2]], dim=1), k[:, :3], v[:, :3]
        mask = bias = None
        empty = torch.zeros(BATCH, HEADS, SEQLEN_Q + 2, dtype=torch.bool)
        empty[:, :, :2] = True
        kwargs["is_causal"] = True
    return q, k, v, mask, bias, empty, kwargs


@pytest.mark.parametrize("case", ["mask", "bias", "causal"])
def test_fully_masked_rows_give_zero_out_and_neg_inf_lse(case):
    q, k, v, mask, bias, empty, kwargs = _fully_masked(case)
    out, lse = assert_matches_naive(q, k, v, mask, bias, **kwargs)
    assert torch.all(out.transpose(1, 2)[empty] == 0)
    assert torch.all(lse[empty] == NEG_INF)
    assert torch.isfinite(lse[~empty]).all() and not out.isnan().any()


@pytest.mark.parametrize("case", ["mask", "bias", "causal"])
@pytest.mark.parametrize("compute_dtype", [torch.float32, F64])
def test_fully_masked_rows_get_exactly_zero_gradients(case, compute_dtype):
    q, k, v, mask, bias, empty, kwargs = _fully_masked(case)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    out, _ = attention_ref(q, k, v, mask, bias, compute_dtype=compute_dtype, **kwargs)
    out.backward(torch.randn_like(out))
    assert not any(t.grad.isnan().any() for t in leaves)
    assert torch.all(q.grad.transpose(1, 2)[empty] == 0)
    assert q.grad.abs().sum() > 0
    if bias is not None:
        assert torch.all(bias.grad[empty] == 0)


def test_neg_inf_bias_entries_act_as_masked():
    q, k, v, _, bias = inputs(8, bias_shape=FULL_SHAPE)
    hidden = torch.rand(FULL_SHAPE, generator=torch.Generator().manual_seed(9)) < 0.3
    out, lse = assert_matches_naive(q, k, v, None, bias.masked_fill(hidden, NEG_INF))
    out_masked, lse_masked = attention_ref(q, k, v, ~hidden, bias, compute_dtype=F64)
    # exp(-inf) is exactly 0 and the masked path drops the same terms: float64 sums of ~5
    # terms of size <= 1 that differ at most in their last bits (~1e-16 each).
    torch.testing.assert_close(out, out_masked, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, lse_masked, rtol=0, atol=1e-14)


# empty: index of the mask set to False, leaving rows with no visible key.
@pytest.mark.parametrize(
    "mask_shape, empty, bias_shape, kwargs",
    [
        (None, None, (1, 1, 1, 4), {}),
        ((2, 4, 3, 4), (0, 1, 2), (2, 2, 1, 4), {"is_causal": True}),
        ((1, 2, 4), (0, 1), (2, 2, 4), {"softcap": 1.5, "window_size": (1, 1)}),
        ((2, 1, 3, 1), (0, 0, 1), (2, 4, 3, 4), {"softcap": 0.8}),
    ],
)
def test_gradcheck(mask_shape, empty, bias_shape, kwargs):
    generator = torch.Generator().manual_seed(10)
    q, k, v, mask, bias = random_inputs(
        2,
        3,
        4,
        4,
        2,
        4,
        F64,
        "cpu",
        mask_shape,
        bias_shape,
        mask_density=0.8,
        requires_grad=True,
        generator=generator,
    )
    if mask is not None:
        mask[empty] = False

    def out_of(q, k, v, bias):
        return attention_ref(q, k, v, mask, bias, compute_dtype=F64, **kwargs)[0]

    assert torch.autograd.gradcheck(out_of, (q, k, v, bias))


@pytest.mark.parametrize("bias_shape", [(2, 2, 3, 4), (1, 4, 4), (2, 1, 3, 1)])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_bias_gradient_keeps_bias_shape_and_dtype(bias_shape, bias_dtype):
    q, k, v, _, bias = random_inputs(
        2,
        3,
        4,
        4,
        2,
        8,
        torch.bfloat16,
        "cpu",
        bias_shape=bias_shape,
        bias_dtype=bias_dtype,
        requires_grad=True,
    )
    out, _ = attention_ref(q, k, v, None, bias, compute_dtype=F64)
    out.sum().backward()
    assert bias.grad.shape == bias.shape and bias.grad.dtype == bias_dtype
    assert q.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_low_precision_reference_computes_in_input_dtype(dtype, atol):
    generator = torch.Generator().manual_seed(11)
    q, k, v, mask, bias = random_inputs(
        1,
        32,
        64,
        2,
        1,
        32,
        dtype,
        "cpu",
        (1, 2, 32, 64),
        (1, 1, 32, 64),
        bias_dtype=torch.float32,
        generator=generator,
    )
    out_lowp, lse_lowp = attention_ref(q, k, v, mask, bias, compute_dtype=None)
    out, lse = attention_ref(q, k, v, mask, bias)
    assert out_lowp.dtype == dtype and lse_lowp.dtype == torch.float32
    assert out.dtype == torch.float32
    # q @ k^T and p @ v rounded to the dtype (u = 2^-8 bf16, 2^-11 fp16) on outputs of size
    # <= ~2: over 200 seeds the error stayed below 1.8e-2 (bf16) / 1.9e-3 (fp16) for out and
    # 1.1e-2 / 1.2e-3 for lse; atol is about twice that, and the last assert proves the
    # computation is not float32.
    torch.testing.assert_close(out_lowp.float(), out, rtol=0, atol=atol)
    torch.testing.assert_close(lse_lowp, lse, rtol=0, atol=atol)
    assert not torch.equal(out_lowp, out.to(dtype))


def _check_close_case(case: str) -> tuple[Tensor, Tensor, Tensor]:
    """(got, ref, ref_lowp) for check_close, named by what got does."""
    generator = torch.Generator().manual_seed(12)
    ref = torch.randn(4, 64, generator=generator)
    ref_lowp = ref.to(torch.bfloat16).float()
    got = ref + 0.5 * (ref_lowp - ref)
    if case == "lse_neg_inf":
        ref[0, :3] = ref_lowp[0, :3] = got[0, :3] = NEG_INF
    elif case == "all_zero":
        ref.zero_()
        ref_lowp.zero_()
        got.zero_()
    elif case == "spike":
        got[1, 7] += 0.5
    elif case == "nan":
        got[2, 5] = float("nan")
    elif case == "lost_neg_inf":
        ref[0, :3] = ref_lowp[0, :3] = NEG_INF
        got[0, :3] = 0.0
    elif case == "nonzero_on_zero_ref":
        ref.zero_()
        ref_lowp.zero_()
        got[3, 3] = 1e-3
    return got, ref, ref_lowp


@pytest.mark.parametrize("case", ["close", "lse_neg_inf", "all_zero"])
def test_check_close_passes(case):
    check_close("out", *_check_close_case(case), torch.bfloat16)


@pytest.mark.parametrize("case", ["spike", "nan", "lost_neg_inf", "nonzero_on_zero_ref"])
def test_check_close_fails(case):
    with pytest.raises(AssertionError, match=r"^dq: "):
        check_close("dq", *_check_close_case(case), torch.bfloat16)


def test_check_close_relative_bound_depends_on_dtype():
    generator = torch.Generator().manual_seed(13)
    ref = torch.randn(256, generator=generator)
    got = ref * 1.01  # relative error 1e-2: inside bf16's 2e-2, outside fp16's 5e-3
    ref_lowp = ref * 1.02
    check_close("out", got, ref, ref_lowp, torch.bfloat16)
    with pytest.raises(AssertionError, match="rel err"):
        check_close("out", got, ref, ref_lowp, torch.float16)


def test_random_inputs_shapes_dtypes_and_density():
    q, k, v, mask, bias = random_inputs(
        2,
        3,
        50,
        4,
        2,
        8,
        torch.bfloat16,
        "cpu",
        mask_shape=(2, 1, 3, 50),
        bias_shape=(1, 4, 50),
        mask_density=0.25,
        bias_dtype=torch.float32,
        requires_grad=True,
    )
    assert q.shape == (2, 3, 4, 8) and k.shape == v.shape == (2, 50, 2, 8)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 3, 50)
    assert bias.dtype == torch.float32 and bias.shape == (1, 4, 50)
    assert all(t.requires_grad and t.is_leaf for t in (q, k, v, bias))
    assert 0.1 < mask.float().mean().item() < 0.4
    assert random_inputs(1, 1, 1, 1, 1, 8, F64, "cpu")[3:] == (None, None)
