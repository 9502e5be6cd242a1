"""Forward and backward on the inputs that broke them before: query blocks that see no key,
finfo.min padding biases, sliced and expand()ed operands, softcap with fp16 or a window,
deterministic runs longer than one scan window, and a seeded random matrix of all of it.

Forward outputs are poisoned with random finite garbage before the launch, and so is the
allocator's free memory before the backward (tests/utils.py), so an unwritten element fails.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.reference import attention_ref
from tests.utils import (
    broadcast_shapes,
    check_close,
    forward_and_check,
    garbage_like,
    grads_and_check,
    leaves,
    random_inputs,
    ulp,
)

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]

# ---- the seeded random matrix -------------------------------------------------------------

SEQLEN_CHOICES = [1, 17, 63, 64, 65, 127, 128, 129, 255, 1000, 4095]
HEAD_DIM_CHOICES = [32, 40, 64, 80, 96, 128, 160, 192, 256]
HEAD_CHOICES = [(1, 1), (4, 4), (8, 2), (8, 1)]
# The float32 reference materializes a few [B, H, Sq, Sk] tensors: keep each under ~1 GB.
MAX_SCORES = 1 << 27


def draw_case(index: int) -> dict:
    """One random problem, the same for a given index on every run."""
    rng = random.Random(20261123 + index)
    sq, sk = rng.choice(SEQLEN_CHOICES), rng.choice(SEQLEN_CHOICES)
    h, hkv = rng.choice(HEAD_CHOICES)
    b = rng.choice([1, 2])
    while b * h * sq * sk > MAX_SCORES:
        b, h, hkv = (1, h, hkv) if b > 1 else (b, max(h // 2, 1), 1)
    dtype = rng.choice(DTYPES)
    shapes = broadcast_shapes(b, hkv, h, sq, sk)
    mask_shape = rng.choice([None, *shapes])
    bias_shape = rng.choice([None, *shapes])
    if bias_shape is not None and bias_shape[2] == 1 and rng.random() < 0.3:
        bias_shape = (bias_shape[0], bias_shape[1], bias_shape[3])  # 3-D: Qm = 1
    window = (-1, -1)
    if rng.random() < 0.25:
        window = (rng.choice([-1, 0, 50, 300]), rng.choice([-1, 0, 20, 200]))
    return {
        "sizes": (b, sq, sk, h, hkv, rng.choice(HEAD_DIM_CHOICES)),
        "dtype": dtype,
        "mask_shape": mask_shape,
        "mask_blocks": rng.random() < 0.5,  # 64x64 blocks of True/False: skipped tiles
        "mask_density": rng.choice([0.1, 0.5, 0.9]),
        "bias_shape": bias_shape,
        "bias_dtype": rng.choice([dtype, torch.float32]),
        "bias_grad": rng.random() < 0.8,
        "options": {
            "is_causal": rng.random() < 0.3,
            "window_size": window,
            "softcap": rng.choice([0.0, 0.0, 0.0, 5.0, 30.0]),
            "softmax_scale": rng.choice([None, None, 0.05, 0.3]),
            "deterministic": rng.random() < 0.2,
        },
    }


def case_id(case: dict) -> str:
    b, sq, sk, h, hkv, d = case["sizes"]
    opts = case["options"]
    flags = [name for name in ("is_causal", "deterministic") if opts[name]]
    flags += [f"window{opts['window_size']}"] if opts["window_size"] != (-1, -1) else []
    flags += [f"softcap{opts['softcap']:g}"] if opts["softcap"] else []
    mask = "x".join(map(str, case["mask_shape"])) if case["mask_shape"] else "none"
    bias = "x".join(map(str, case["bias_shape"])) if case["bias_shape"] else "none"
    dtype = str(case["dtype"]).removeprefix("torch.")
    return f"b{b}-q{sq}-k{sk}-h{h}/{hkv}-d{d}-{dtype}-mask{mask}-bias{bias}-" + "-".join(flags)


RANDOM_CASES = [draw_case(i) for i in range(64)]


def block_mask(shape: tuple[int, ...], density: float) -> torch.Tensor:
    """A bool mask of `shape` made of 64x64 all-True / all-False blocks (last two dims)."""
    *lead, rows, cols = shape
    blocks = torch.rand(*lead, -(-rows // 64), -(-cols // 64), device="cuda") < density
    full = blocks.repeat_interleave(64, -2).repeat_interleave(64, -1)
    return full[..., :rows, :cols].contiguous()


@pytest.mark.parametrize("case", RANDOM_CASES, ids=[case_id(c) for c in RANDOM_CASES])
def test_random_matrix(case):
    b, sq, sk, h, hkv, d = case["sizes"]
    q, k, v, mask, bias = random_inputs(
        b, sq, sk, h, hkv, d, case["dtype"], "cuda", mask_shape=case["mask_shape"],
        bias_shape=case["bias_shape"], mask_density=case["mask_density"],
        bias_dtype=case["bias_dtype"],
    )  # fmt: skip
    if mask is not None and case["mask_blocks"]:
        mask = block_mask(mask.shape, case["mask_density"])
    opts = case["options"]
    forward_and_check(
        q, k, v, mask, bias, scale=opts["softmax_scale"], causal=opts["is_causal"],
        softcap=opts["softcap"], window=opts["window_size"],
    )  # fmt: skip
    grads_and_check(q, k, v, mask, bias, bias_grad=case["bias_grad"], **opts)


# ---- query blocks that see no key ---------------------------------------------------------


@pytest.mark.parametrize(
    "sizes,dtype",
    [
        ((1, 4095, 64, 8, 1, 256), torch.bfloat16),
        ((1, 4095, 128, 1, 1, 40), torch.float16),
        ((1, 255, 65, 8, 1, 128), torch.float16),
        ((2, 400, 200, 4, 2, 64), torch.bfloat16),
        ((1, 600, 100, 2, 2, 192), torch.float16),
    ],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x),
)
def test_causal_query_blocks_without_keys(sizes, dtype):
    """Causal with Sq - Sk >= the query tile: the first Sq - Sk rows see no key at all."""
    b, sq, sk, h, hkv, d = sizes
    q, k, v, _, _ = random_inputs(b, sq, sk, h, hkv, d, dtype, "cuda")
    out, lse, _, _ = forward_and_check(q, k, v, causal=True)
    empty = sq - sk
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert bool(lse[:, :, :empty].isneginf().all())
    dq, *_ = grads_and_check(q, k, v, is_causal=True)[0]
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mask_hides_whole_query_blocks(head_dim):
    b, h, sq, sk = 1, 2, 400, 300
    q, k, v, mask, bias = random_inputs(
        b, sq, sk, h, h, head_dim, torch.bfloat16, "cuda", mask_shape=(b, h, sq, sk),
        bias_shape=(b, 1, 1, sk),
    )  # fmt: skip
    mask[:, :, 128:320] = False  # whole query tiles of every tile size
    out, lse, _, _ = forward_and_check(q, k, v, mask, bias)
    assert torch.equal(out[:, 128:320], torch.zeros_like(out[:, 128:320]))
    assert bool(lse[:, :, 128:320].isneginf().all())
    grads_and_check(q, k, v, mask, bias)


# ---- finfo.min padding biases -------------------------------------------------------------


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("bias_dtype", ["query", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_finfo_min_bias(dtype, bias_dtype, softcap):
    """torch.finfo(bias dtype).min is a finite bias: keys with it get weight 0 next to ordinary
    keys, -inf still masks, and a row made only of it is a softmax of its scores plus that
    value, rounded in float32: for bf16/fp32 (-3.4e38) q.k vanishes in the rounding and the
    row averages its visible values uniformly, as the float32 reference does."""
    b, h, sq, sk = 2, 2, 200, 300
    bias_dt = dtype if bias_dtype == "query" else torch.float32
    q, k, v, mask, bias = random_inputs(
        b, sq, sk, h, h, 64, dtype, "cuda", mask_shape=(b, 1, sq, sk), mask_density=0.8,
        bias_shape=(b, h, sq, sk), bias_dtype=bias_dt,
    )  # fmt: skip
    pad = torch.finfo(bias_dt).min
    padded_rows = slice(20, 50)
    bias[:, :, padded_rows] = pad
    bias[:, :, :, 250:] = pad  # padded keys
    bias[0, 1, 100:110, :70] = float("-inf")
    kwargs = {"softcap": softcap}
    out, lse = flash_dmattn_func(q, k, v, mask, bias, return_lse=True, **kwargs)
    ref, ref_lse = attention_ref(q, k, v, mask, bias, **kwargs)
    lowp, lowp_lse = attention_ref(q, k, v, mask, bias, compute_dtype=None, **kwargs)
    rows = torch.ones(sq, dtype=torch.bool, device="cuda")
    rows[padded_rows] = False
    check_close("out", out[:, rows], ref[:, rows], lowp[:, rows], dtype)
    check_close("lse", lse[:, :, rows], ref_lse[:, :, rows], lowp_lse.float()[:, :, rows], dtype)
    dout = torch.randn_like(q)
    if abs(pad) > 1e30:
        check_close("out", out[:, ~rows], ref[:, ~rows], lowp[:, ~rows], dtype)
        # Clamped to the float32 range once divided by softmax_scale: huge, finite, but not
        # the reference's value.
        assert bool(lse[:, :, ~rows].isfinite().all()) and bool((lse[:, :, ~rows] < -1e30).all())
    else:
        # fp16's -65504 keeps q.k: the kernel rounds a padded score at 65504 / scale
        # (accumulator units), the reference at 65504; each probability may move by the two
        # spacings together, out by that times max|v| and twice (the row sum), lse by as much.
        scale = 64**-0.5
        spacing = ulp_f32(abs(pad) / scale) * scale + ulp_f32(abs(pad))
        if softcap:
            spacing = 2 * ulp_f32(abs(pad))  # capped scores get the bias in natural units
        out_err = (out[:, ~rows].float() - ref[:, ~rows].float()).abs().max().item()
        assert out_err <= 2 * math.expm1(spacing) * v.abs().max().item() + 1e-3, out_err
        lse_err = (lse[:, :, ~rows] - ref_lse[:, :, ~rows]).abs().max().item()
        assert lse_err <= 2 * spacing, lse_err
        dout[:, padded_rows] = 0  # those rows then take no part in any gradient
    grads_and_check(q, k, v, mask, bias, dout=dout, **kwargs)


@pytest.mark.parametrize(
    ("dtype", "bias_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.bfloat16, torch.float32)],
)  # fmt: skip
def test_finfo_min_row_bias(dtype, bias_dtype):
    """A row bias [B, H, 1, Sk] with finfo.min padding keys, -inf keys, and one (batch, head)
    padded whole (its rows average their visible values uniformly): the Hopper forward forms
    these scores in log2 units (Scores.log2_units), and the backward rebuilds P from the
    stats it stores, converted to accumulator units."""
    b, h, sq, sk = 2, 2, 200, 300
    q, k, v, mask, bias = random_inputs(
        b, sq, sk, h, h, 64, dtype, "cuda", mask_shape=(b, 1, sq, sk), mask_density=0.8,
        bias_shape=(b, h, 1, sk), bias_dtype=bias_dtype,
    )  # fmt: skip
    pad = torch.finfo(bias_dtype).min
    bias[:, :, :, 250:] = pad  # padded keys
    bias[0, 1, :, :70] = float("-inf")
    bias[1, 0] = pad  # every key of these rows
    out, lse = flash_dmattn_func(q, k, v, mask, bias, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, mask, bias)
    lowp, lowp_lse = attention_ref(q, k, v, mask, bias, compute_dtype=None)
    check_close("out", out, ref, lowp, dtype)
    lse_rows = torch.ones(b, h, dtype=torch.bool, device="cuda")
    lse_rows[1, 0] = False
    check_close("lse", lse[lse_rows], ref_lse[lse_rows], lowp_lse.float()[lse_rows], dtype)
    # the padded rows' lse: huge and finite (clamped in float32), not the reference's value
    assert bool(lse[1, 0].isfinite().all()) and bool((lse[1, 0] < -1e30).all())
    grads_and_check(q, k, v, mask, bias)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_moderate_and_immoderate_key_bias_rows(head_dim):
    """A bf16 forward with a key bias [B, H, 1, Sk] and no mask: the Hopper kernel takes the
    bias as terms of Q K^T and walks an item whose keys' biases are all moderate (-inf or
    |bias| <= 709: the terms' flags) with the bounded softmax, any other with the exact one.
    In one launch: a row with a -1e4 stretch, a row offset by -5000, a row of finfo.min (where
    the bounded form's shift max * scale_log2 rounds by far more than 1: wrong flags fail
    here) and a moderate row; D64 walks per CTA, D128 in persistent CTAs."""
    b, h, sq, sk = 2, 2, 300, 1000
    q, k, v, _, bias = random_inputs(
        b, sq, sk, h, h, head_dim, torch.bfloat16, "cuda", bias_shape=(b, h, 1, sk),
        bias_dtype=torch.float32,
    )  # fmt: skip
    bias[0, 0, :, 100:300] = -1e4
    bias[0, 1] -= 5000
    bias[1, 0] = torch.finfo(torch.float32).min
    out, lse = flash_dmattn_func(q, k, v, None, bias, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, None, bias)
    lowp, lowp_lse = attention_ref(q, k, v, None, bias, compute_dtype=None)
    check_close("out", out, ref, lowp, torch.bfloat16)
    rows = torch.ones(b, h, dtype=torch.bool, device="cuda")
    rows[1, 0] = False  # (its lse: huge and finite, clamped in float32)
    check_close("lse", lse[rows], ref_lse[rows], lowp_lse.float()[rows], torch.bfloat16)
    assert bool(lse[1, 0].isfinite().all()) and bool((lse[1, 0] < -1e30).all())
    grads_and_check(q, k, v, None, bias)


def ulp_f32(x: float) -> float:
    """The float32 spacing at x."""
    return ulp(torch.tensor([x], dtype=torch.float64), torch.float32).item()


# ---- operand layouts ----------------------------------------------------------------------


def test_odd_keys_from_an_aligned_slice():
    """Sk = 4095 read from 16-byte aligned rows of a 4096-wide buffer (no copy)."""
    b, h, sq, sk = 1, 4, 300, 4095
    q, k, v, _, _ = random_inputs(b, sq, sk, h, 2, 128, torch.bfloat16, "cuda")
    mask = (torch.rand(b, 2, sq, 4096, device="cuda") < 0.7)[..., :sk]
    bias_buffer = torch.randn(b, h, sq, 4096, device="cuda", dtype=torch.bfloat16)
    forward_and_check(q, k, v, mask, bias_buffer[..., :sk], causal=True)
    grads_and_check(q, k, v, mask, bias_buffer, bias_view=lambda t: t[..., :sk], is_causal=True)


def test_expanded_mask_and_bias():
    b, h, hkv, sq, sk = 2, 4, 2, 300, 500
    q, k, v, _, _ = random_inputs(b, sq, sk, h, hkv, 64, torch.float16, "cuda")
    mask = (torch.rand(b, hkv, 1, sk, device="cuda") < 0.6).expand(b, hkv, sq, sk)
    bias_row = torch.randn(b, h, 1, sk, device="cuda", dtype=torch.float16)
    forward_and_check(q, k, v, mask, bias_row.expand(b, h, sq, sk))
    grads_and_check(q, k, v, mask, bias_row, bias_view=lambda t: t.expand(b, h, sq, sk))


def test_expanded_bias_gradient_needs_no_attention_sized_buffer():
    """dbias of bias_row.expand(B, H, S, S) is reduced in the kernel: forward + backward peak
    memory stays far below one [B, H, S, S] bf16 tensor (256 MiB here)."""
    b, h, s, d = 1, 8, 4096, 64
    q, k, v, _, _ = random_inputs(b, s, s, h, h, d, torch.bfloat16, "cuda", requires_grad=True)
    bias_row = torch.randn(b, h, 1, s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = flash_dmattn_func(q, k, v, None, bias_row.expand(b, h, s, s), is_causal=True)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    attention_bytes = b * h * s * s * 2
    print(f"\npeak {peak / 2**20:.1f} MiB, attention-sized bf16 {attention_bytes / 2**20:.0f} MiB")
    assert peak < attention_bytes / 4
    assert bias_row.grad.shape == bias_row.shape and bool(bias_row.grad.abs().sum() > 0)


# ---- softcap combinations, deterministic over several scan windows -----------------------


@pytest.mark.parametrize(
    "dtype,window",
    [(torch.float16, (-1, -1)), (torch.bfloat16, (100, 30)), (torch.float16, (0, 64))],
)
def test_softcap_fp16_and_window(dtype, window):
    q, k, v, mask, bias = random_inputs(
        2, 333, 257, 4, 2, 96, dtype, "cuda", mask_shape=(2, 2, 333, 257),
        bias_shape=(1, 4, 333, 257), mask_density=0.7,
    )  # fmt: skip
    q, k = q * 3, k * 3  # scores well into the cap
    forward_and_check(q, k, v, mask, bias, softcap=10.0, window=window)
    grads_and_check(q, k, v, mask, bias, softcap=10.0, window_size=window)


@pytest.mark.parametrize("bias_shape", [(1, 4, 2100, 300), (1, 1, 1, 300)])
def test_deterministic_longer_than_a_scan_window(bias_shape):
    """Sq = 2100 > 31 blocks x 64 rows: the backward's mask scan spans several windows."""
    sq, sk = 2100, 300
    q, k, v, mask, bias = random_inputs(
        1, sq, sk, 4, 2, 64, torch.bfloat16, "cuda", mask_shape=(1, 2, sq, sk),
        bias_shape=bias_shape, mask_density=0.6,
    )  # fmt: skip
    mask[:, :, 500:1300] = False  # whole scan-window stretches skipped
    first, _ = grads_and_check(q, k, v, mask, bias, deterministic=True)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(3):
        q1, k1, v1 = leaves((q, k, v))
        b1 = bias.detach().clone().requires_grad_()
        flash_dmattn_func(q1, k1, v1, mask, b1, deterministic=True).backward(dout)
        runs.append((q1.grad, k1.grad, v1.grad, b1.grad))
    for run in runs[1:]:
        for name, a, g in zip(("dq", "dk", "dv", "dbias"), runs[0], run, strict=True):
            assert torch.equal(a, g), f"{name} differs between deterministic runs"
    assert first[0].shape == q.shape


def test_garbage_poison_is_finite_and_far_from_outputs():
    t = garbage_like(torch.empty(1000, device="cuda", dtype=torch.bfloat16))
    assert bool(t.isfinite().all()) and bool((t.abs() >= 99).all())
