"""DynamicMaskAttention: bad constructor arguments raise at construction, naming the argument;
the dtypes the layer accepts run (bf16/fp16 directly, float32 weights under autocast)."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.modules import DynamicMaskAttention

GOOD = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "keep": 8, "dtype": torch.bfloat16}

# (changed arguments, error type, fragments the message must contain)
BAD_ARGS = {
    "dtype_fp64": ({"dtype": torch.float64}, TypeError, ["dtype", "torch.float64"]),
    "dtype_int": ({"dtype": torch.int32}, TypeError, ["dtype", "torch.int32"]),
    "hidden_size_zero": ({"hidden_size": 0}, ValueError, ["hidden_size", "got 0"]),
    "hidden_size_float": ({"hidden_size": 64.0}, TypeError, ["hidden_size", "64.0"]),
    "num_heads_zero": ({"num_heads": 0}, ValueError, ["num_heads", "got 0"]),
    "num_kv_heads_zero": ({"num_kv_heads": 0}, ValueError, ["num_kv_heads", "got 0"]),
    "num_heads_not_multiple": ({"num_kv_heads": 3}, ValueError, ["num_heads", "num_kv_heads=3"]),
    "derived_head_dim_not_multiple_of_8": (
        {"hidden_size": 80, "num_heads": 8, "num_kv_heads": 4},
        ValueError,
        ["hidden_size/num_heads", "head_dim", "80/8 = 10"],
    ),
    "hidden_size_not_divisible": (
        {"hidden_size": 100, "num_heads": 3, "num_kv_heads": 1},
        ValueError,
        ["hidden_size/num_heads", "100/3"],
    ),
    "derived_head_dim_over_256": (
        {"hidden_size": 1024, "num_heads": 2, "num_kv_heads": 1},
        ValueError,
        ["hidden_size/num_heads", "512", "256"],
    ),
    "head_dim_not_multiple_of_8": ({"head_dim": 20}, ValueError, ["head_dim", "got 20"]),
    "head_dim_over_256": ({"head_dim": 264}, ValueError, ["head_dim", "256", "got 264"]),
    "head_dim_zero": ({"head_dim": 0}, ValueError, ["head_dim", "got 0"]),
    "keep_zero": ({"keep": 0}, ValueError, ["keep", "got 0"]),
    "keep_negative": ({"keep": -5}, ValueError, ["keep", "got -5"]),
    "keep_float": ({"keep": 0.5}, TypeError, ["keep", "0.5"]),
    "keep_bool": ({"keep": True}, TypeError, ["keep", "True"]),
    "is_causal_int": ({"is_causal": 1}, TypeError, ["is_causal", "1"]),
}


@pytest.mark.parametrize("case", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_constructor_argument_raises_naming_it(case):
    changes, error, fragments = case
    with pytest.raises(error) as info:
        DynamicMaskAttention(**{**GOOD, **changes})
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_default_dtype_float64_is_named_at_construction():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match=r"dtype: .*got None \(torch's default dtype"):
            DynamicMaskAttention(64, 4)
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"dtype": torch.float16, "keep": None},
        {"num_kv_heads": None, "head_dim": 24, "is_causal": False},
        {"hidden_size": 48, "num_heads": 2, "num_kv_heads": 1, "keep": 1000},
    ],
    ids=["gqa_topk", "fp16_no_mask", "mha_explicit_head_dim", "keep_over_seqlen"],
)
def test_good_arguments_build_a_layer_that_runs(changes):
    args = {**GOOD, **changes}
    layer = DynamicMaskAttention(**args)
    x = torch.randn(2, 12, args["hidden_size"], dtype=args["dtype"])
    out = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert not out.isnan().any()


def test_float32_weights_run_under_autocast_and_name_the_fix_without_it():
    layer = DynamicMaskAttention(64, 4, 2, keep=8)  # float32 master weights
    x = torch.randn(2, 12, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert layer.bias_proj.weight.grad.abs().sum() > 0  # learned through dbias

    with pytest.raises(TypeError) as info:
        layer(x)
    message = str(info.value)
    for fragment in ("DynamicMaskAttention", "torch.float32", "dtype=torch.bfloat16", "autocast"):
        assert fragment in message, f"{fragment!r} not in {message!r}"
