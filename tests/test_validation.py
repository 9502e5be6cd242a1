"""Input validation and mask/bias normalization (SPEC.md "Errors", "Shapes, broadcasting")."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.jit.arch import device_arch
from dmattn_cute.problem import broadcast_view, check_device, make_problem
from tests.utils import normalize_broadcast

B, SQ, SK, H, HKV, D = 2, 3, 5, 4, 2, 16
DTYPE = torch.bfloat16


def good_args() -> dict:
    """Valid flash_dmattn_func keyword arguments; each case below breaks one thing."""
    gen = torch.Generator().manual_seed(0)
    return {
        "query": torch.randn(B, SQ, H, D, generator=gen).to(DTYPE),
        "key": torch.randn(B, SK, HKV, D, generator=gen).to(DTYPE),
        "value": torch.randn(B, SK, HKV, D, generator=gen).to(DTYPE),
        "attn_mask": torch.rand(B, H, SQ, SK, generator=gen) < 0.5,
        "attn_bias": torch.randn(B, H, SQ, SK, generator=gen).to(DTYPE),
    }


def qkv(b=B, sq=SQ, sk=SK, h=H, hkv=HKV, d=D, dtype=DTYPE):
    """Fresh q, k, v of the given sizes."""
    return (
        torch.randn(b, sq, h, d).to(dtype),
        torch.randn(b, sk, hkv, d).to(dtype),
        torch.randn(b, sk, hkv, d).to(dtype),
    )


def with_qkv(**sizes):
    def change(args: dict) -> None:
        args["query"], args["key"], args["value"] = qkv(**sizes)

    return change


def setting(name: str, value):
    def change(args: dict) -> None:
        args[name] = value

    return change


def changed(name: str, fn):
    def change(args: dict) -> None:
        args[name] = fn(args[name])

    return change


META = torch.device("meta")

# (how the arguments are broken, error type, fragments the message must contain)
BAD_INPUTS = {
    "query_not_tensor": (setting("query", [[1.0]]), TypeError, ["query", "list"]),
    "key_not_tensor": (setting("key", None), TypeError, ["key", "NoneType"]),
    "query_rank_3": (changed("query", lambda t: t[0]), ValueError, ["query", "4-D", "3-D"]),
    "value_rank_5": (changed("value", lambda t: t[None]), ValueError, ["value", "5-D"]),
    "query_fp32": (
        with_qkv(dtype=torch.float32),
        TypeError,
        ["query", "got torch.float32", "cast with query.to(torch.bfloat16) or .half()"],
    ),
    "query_fp64": (with_qkv(dtype=torch.float64), TypeError, ["query", "float64", "cast with"]),
    "query_int": (with_qkv(dtype=torch.int32), TypeError, ["query", "torch.int32"]),
    "key_dtype_mismatch": (
        changed("key", lambda t: t.half()),
        TypeError,
        ["key", "torch.bfloat16", "torch.float16"],
    ),
    "value_device_mismatch": (
        changed("value", lambda t: t.to(META)),
        ValueError,
        ["value", "meta"],
    ),
    "mask_device_mismatch": (
        changed("attn_mask", lambda t: t.to(META)),
        ValueError,
        ["attn_mask", "meta"],
    ),
    "bias_device_mismatch": (
        changed("attn_bias", lambda t: t.to(META)),
        ValueError,
        ["attn_bias", "meta"],
    ),
    "key_batch_mismatch": (
        changed("key", lambda t: torch.cat([t, t[:1]])),
        ValueError,
        ["key", "batch", "B=2", "got 3"],
    ),
    "value_shape_mismatch": (
        changed("value", lambda t: t[:, :4]),
        ValueError,
        ["value", "(2, 5, 2, 16)", "(2, 4, 2, 16)"],
    ),
    "key_head_dim_mismatch": (
        changed("key", lambda t: t[..., :8]),
        ValueError,
        ["key", "head_dim", "D=16", "got 8"],
    ),
    "heads_not_multiple": (with_qkv(hkv=3), ValueError, ["query", "H=4", "Hkv=3"]),
    "head_dim_over_256": (with_qkv(d=264), ValueError, ["head_dim", "256", "got 264"]),
    "head_dim_not_multiple_of_8": (with_qkv(d=20), ValueError, ["head_dim", "got 20"]),
    "head_dim_zero": (with_qkv(d=0), ValueError, ["head_dim", "got 0"]),
    "seqlen_q_zero": (with_qkv(sq=0), ValueError, ["query", "Sq", "got 0"]),
    "seqlen_k_zero": (with_qkv(sk=0), ValueError, ["key", "Sk", "got 0"]),
    "batch_zero": (with_qkv(b=0), ValueError, ["query", "batch", "got 0"]),
    "query_last_dim_strided": (
        changed("query", lambda t: torch.cat([t, t], dim=-1)[..., ::2]),
        ValueError,
        ["query", "contiguous", "strides"],
    ),
    "value_last_dim_strided": (
        changed("value", lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)),
        ValueError,
        ["value", "contiguous"],
    ),
    "mask_not_tensor": (setting("attn_mask", [[True]]), TypeError, ["attn_mask", "list"]),
    "mask_float": (changed("attn_mask", lambda t: t.float()), TypeError, ["attn_mask", "float32"]),
    "mask_uint8": (changed("attn_mask", lambda t: t.to(torch.uint8)), TypeError, ["attn_mask"]),
    "mask_rank_2": (changed("attn_mask", lambda t: t[0, 0]), ValueError, ["attn_mask", "2-D"]),
    "mask_rank_5": (changed("attn_mask", lambda t: t[None]), ValueError, ["attn_mask", "5-D"]),
    "mask_batch_3": (
        setting("attn_mask", torch.ones(3, 1, 1, SK, dtype=torch.bool)),
        ValueError,
        ["attn_mask: expected dim 0 (batch) to be 1 or B=2, got 3"],
    ),
    "mask_heads_3": (
        setting("attn_mask", torch.ones(1, 3, 1, SK, dtype=torch.bool)),
        ValueError,
        ["attn_mask: expected dim 1 (heads) to be 1, Hkv=2 or H=4, got 3"],
    ),
    "mask_queries_2": (
        setting("attn_mask", torch.ones(1, 1, 2, SK, dtype=torch.bool)),
        ValueError,
        ["attn_mask: expected dim 2 (queries) to be 1 or Sq=3, got 2"],
    ),
    "mask_keys_4": (
        setting("attn_mask", torch.ones(1, 1, 1, 4, dtype=torch.bool)),
        ValueError,
        ["attn_mask: expected dim 3 (keys) to be 1 or Sk=5, got 4"],
    ),
    "mask_3d_keys_4": (
        setting("attn_mask", torch.ones(B, H, 4, dtype=torch.bool)),
        ValueError,
        ["attn_mask: expected dim 2 (keys) to be 1 or Sk=5, got 4"],
    ),
    "bias_not_tensor": (setting("attn_bias", 0.5), TypeError, ["attn_bias", "float"]),
    "bias_int": (changed("attn_bias", lambda t: t.long()), TypeError, ["attn_bias", "int64"]),
    "bias_bool": (changed("attn_bias", lambda t: t > 0), TypeError, ["attn_bias", "torch.bool"]),
    "bias_complex": (
        changed("attn_bias", lambda t: t.to(torch.complex64)),
        TypeError,
        ["attn_bias", "complex64"],
    ),
    "bias_fp16_with_bf16_query": (
        changed("attn_bias", lambda t: t.half()),
        TypeError,
        ["attn_bias", "torch.bfloat16", "torch.float32", "got torch.float16"],
    ),
    "bias_fp64": (
        changed("attn_bias", lambda t: t.double()),
        TypeError,
        ["attn_bias", "float64"],
    ),
    "bias_heads_3": (
        setting("attn_bias", torch.zeros(B, 3, SQ, SK, dtype=DTYPE)),
        ValueError,
        ["attn_bias: expected dim 1 (heads) to be 1, Hkv=2 or H=4, got 3"],
    ),
    "bias_batch_3": (
        setting("attn_bias", torch.zeros(3, H, SK, dtype=torch.float32)),
        ValueError,
        ["attn_bias: expected dim 0 (batch) to be 1 or B=2, got 3"],
    ),
    "bias_rank_1": (setting("attn_bias", torch.zeros(SK)), ValueError, ["attn_bias", "1-D"]),
    "window_left_below_-1": (
        setting("window_size", (-2, -1)),
        ValueError,
        ["window_size", "left", "got -2"],
    ),
    "window_right_below_-1": (
        setting("window_size", (0, -5)),
        ValueError,
        ["window_size", "right", "got -5"],
    ),
    "window_one_int": (setting("window_size", 3), TypeError, ["window_size", "pair", "3"]),
    "window_length_3": (setting("window_size", (1, 2, 3)), TypeError, ["window_size", "(1, 2, 3)"]),
    "window_float": (setting("window_size", (1.0, 2)), TypeError, ["window_size", "1.0"]),
    "window_bool": (setting("window_size", (True, 1)), TypeError, ["window_size", "True"]),
    "softcap_negative": (setting("softcap", -1.0), ValueError, ["softcap", "-1.0"]),
    "softcap_inf": (setting("softcap", math.inf), ValueError, ["softcap", "inf"]),
    "softcap_nan": (setting("softcap", math.nan), ValueError, ["softcap", "nan"]),
    "softcap_str": (setting("softcap", "1"), TypeError, ["softcap", "str"]),
    "scale_nan": (setting("softmax_scale", math.nan), ValueError, ["softmax_scale", "nan"]),
    "scale_inf": (setting("softmax_scale", -math.inf), ValueError, ["softmax_scale", "-inf"]),
    "scale_zero": (setting("softmax_scale", 0.0), ValueError, ["softmax_scale", "0.0"]),
    "scale_negative": (setting("softmax_scale", -0.5), ValueError, ["softmax_scale", "-0.5"]),
    "scale_tensor": (
        setting("softmax_scale", torch.tensor(0.5)),
        TypeError,
        ["softmax_scale", "Tensor"],
    ),
    "is_causal_int": (setting("is_causal", 1), TypeError, ["is_causal", "1"]),
    "deterministic_none": (setting("deterministic", None), TypeError, ["deterministic", "None"]),
    "return_lse_str": (setting("return_lse", "yes"), TypeError, ["return_lse", "'yes'"]),
}


@pytest.mark.parametrize("case", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_naming_argument(case):
    change, error, fragments = case
    args = good_args()
    change(args)
    with pytest.raises(error) as info:
        flash_dmattn_func(**args)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("case", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_after_a_validated_call(case):
    """check_problem remembers validated call signatures: a bad call that shares the tensors
    of a validated one (or its scalars' values, as 1 shares True's) is still refused."""
    change, error, fragments = case
    args = good_args()
    flash_dmattn_func(**args)  # validated; its signature is remembered
    flash_dmattn_func(**args)
    change(args)
    with pytest.raises(error) as info:
        flash_dmattn_func(**args)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_validated_signature_gives_the_same_problem():
    args = good_args()
    first, _, _ = make_problem(*args.values(), None, False, 0.0, (-1, -1), False)
    again, _, _ = make_problem(*args.values(), None, False, 0.0, (-1, -1), False)
    assert again is first
    # another stride pattern of the same shapes is validated anew
    args["attn_mask"] = args["attn_mask"].transpose(2, 3).contiguous().transpose(2, 3)
    other, _, _ = make_problem(*args.values(), None, False, 0.0, (-1, -1), False)
    assert other is not first and other == first


def broadcast_shapes(b, h, hkv, sq, sk):
    """Every mask/bias shape SPEC.md allows: 4-D [Bm, Hm, Qm, Km] and 3-D [Bm, Hm, Km]."""
    heads = sorted({1, hkv, h})
    four = itertools.product((1, b), heads, (1, sq), (1, sk))
    three = itertools.product((1, b), heads, (1, sk))
    return sorted(set(four)) + sorted(set(three))


SIZES = {  # (B, H, Hkv, Sq, Sk): GQA, MHA, MQA, decode
    "gqa": (2, 6, 3, 4, 5),
    "mha": (3, 2, 2, 7, 4),
    "mqa": (2, 4, 1, 3, 6),
    "decode": (2, 4, 2, 1, 9),
}
GOOD_SHAPES = [
    pytest.param(sizes, shape, bias_dtype, id=f"{name}-{'x'.join(map(str, shape))}-{bias_dtype}")
    for name, sizes in SIZES.items()
    for shape in broadcast_shapes(*sizes)
    for bias_dtype in (torch.float32, DTYPE)
]


@pytest.mark.parametrize(("sizes", "shape", "bias_dtype"), GOOD_SHAPES)
def test_broadcast_shapes_pass_as_views(sizes, shape, bias_dtype):
    b, h, hkv, sq, sk = sizes
    q, k, v = qkv(b=b, sq=sq, sk=sk, h=h, hkv=hkv)
    mask = torch.rand(shape) < 0.5
    bias = torch.randn(shape, dtype=bias_dtype)

    problem, mask_view, bias_view = make_problem(
        q, k, v, mask, bias, None, False, 0.0, (-1, -1), False
    )

    assert (problem.batch, problem.num_heads, problem.num_heads_kv) == (b, h, hkv)
    assert (problem.seqlen_q, problem.seqlen_k) == (sq, sk)
    shape4 = shape if len(shape) == 4 else (shape[0], shape[1], 1, shape[2])
    for given, view in ((mask, mask_view), (bias, bias_view)):
        assert view.shape == shape4
        assert view.dtype == given.dtype
        # A view of the same memory: nothing copied.
        assert view.data_ptr() == given.data_ptr()
        assert view.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
        assert all(st == 0 for n, st in zip(view.shape, view.stride(), strict=True) if n == 1)
        assert torch.equal(view, given.reshape(shape4))


@pytest.mark.parametrize(
    "make_view",
    [
        pytest.param(lambda: torch.randn(1, 1, 1, SK).expand(B, H, SQ, SK), id="expanded_all"),
        pytest.param(lambda: torch.randn(B, 1, SK).expand(B, HKV, SK), id="expanded_3d_heads"),
        pytest.param(lambda: torch.randn(B, H, SQ, 2 * SK)[..., ::2], id="strided_keys"),
        pytest.param(lambda: torch.randn(SK, SQ, H, B).permute(3, 2, 1, 0), id="permuted"),
        pytest.param(lambda: torch.randn(4, B, H, SQ, SK)[2], id="storage_offset"),
    ],
)
def test_strided_and_expanded_views_read_in_place(make_view):
    bias = make_view()
    view = normalize_broadcast(bias, "attn_bias", B, H, HKV, SQ, SK)
    expected = bias if bias.dim() == 4 else bias.unsqueeze(2)
    assert view.shape == expected.shape
    assert view.data_ptr() == bias.data_ptr()
    for size, got, given in zip(view.shape, view.stride(), expected.stride(), strict=True):
        assert got == (0 if size == 1 else given)
    assert torch.equal(view, expected)


def test_normalize_none_is_none():
    assert normalize_broadcast(None, "attn_mask", B, H, HKV, SQ, SK) is None


@pytest.mark.parametrize(
    ("softmax_scale", "softcap", "window_size", "expected_scale"),
    [
        (None, 0.0, (-1, -1), 1 / math.sqrt(D)),
        (0.25, 30, [3, 0], 0.25),
        (2, 0.5, (0, 7), 2.0),
    ],
)
def test_problem_fields(softmax_scale, softcap, window_size, expected_scale):
    q, k, v = qkv()
    problem, mask, bias = make_problem(
        q, k, v, None, None, softmax_scale, True, softcap, window_size, True
    )
    assert mask is None and bias is None
    assert problem.dtype == DTYPE and problem.head_dim == D
    assert problem.softmax_scale == pytest.approx(expected_scale)
    assert isinstance(problem.softmax_scale, float) and isinstance(problem.softcap, float)
    assert problem.softcap == softcap
    assert (problem.window_left, problem.window_right) == tuple(window_size)
    assert problem.is_causal and problem.deterministic
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.batch = 7


def test_packed_qkv_slices_pass():
    packed = torch.randn(B, SQ, H + 2 * HKV, D, dtype=DTYPE)
    q, k, v = packed[:, :, :H], packed[:, :, H : H + HKV], packed[:, :, H + HKV :]
    problem, _, _ = make_problem(q, k, v, None, None, None, False, 0.0, (-1, -1), False)
    assert problem.num_heads == H and problem.num_heads_kv == HKV


@pytest.fixture
def fresh_device_arch():
    """check_device caches each device's answer: start and end with none (a faked capability
    must not outlive its test)."""
    device_arch.cache_clear()
    yield
    device_arch.cache_clear()


@pytest.mark.parametrize(
    ("capability", "supported"),
    [
        ((7, 5), False),
        ((7, 0), False),
        ((6, 1), False),
        ((8, 0), True),
        ((8, 6), True),
        ((8, 9), True),
        ((9, 0), True),
    ],
)
def test_cuda_capability_check(monkeypatch, fresh_device_arch, capability, supported):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    device = torch.device("cuda", 0)
    if supported:
        check_device(device)
        return
    with pytest.raises(ValueError) as info:
        check_device(device)
    assert "query" in str(info.value)
    assert f"{capability[0]}.{capability[1]}" in str(info.value)


def test_cpu_device_skips_capability_check(monkeypatch):
    def no_cuda(device=None):
        raise AssertionError("the capability of a CPU tensor was queried")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_cuda)
    check_device(torch.device("cpu"))


def test_broadcast_view_views_only_where_strides_change() -> None:
    """broadcast_view gives every size-1 dim stride 0 (a view of the same storage), and passes
    a 4-D tensor that already has them unchanged (no view op per call)."""
    full = torch.randn(2, 3, 4, 5)
    assert broadcast_view(full) is full
    zeroed = torch.randn(2, 3, 1, 5).as_strided((2, 3, 1, 5), (15, 5, 0, 1))
    assert broadcast_view(zeroed) is zeroed
    for rows in (torch.randn(2, 3, 1, 5), torch.randn(2, 3, 5)):
        view = broadcast_view(rows)
        assert view.shape == (2, 3, 1, 5) and view.stride() == (15, 5, 0, 1)
        assert view.data_ptr() == rows.data_ptr()
