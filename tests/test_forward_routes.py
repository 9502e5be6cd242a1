"""Routed forwards (kernels/fwd_launch.py's forward_route and run_route, attention.py's
routed eager calls), on the CPU with the kernels replaced by recorders (conftest's
`launches`): a call on its route launches what flash_fwd's general path launches, a
repeated call is neither planned nor validated again, and a call no route serves takes the
general path."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute import attention
from dmattn_cute.jit import KERNELS_ENV
from dmattn_cute.kernels import fwd_launch
from dmattn_cute.kernels.block_bits import BlockBitsSpec
from dmattn_cute.kernels.fwd import FwdSpec
from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
from dmattn_cute.problem import make_problem

B, SQ, SK, H, HKV, D = 2, 300, 200, 4, 2, 64


def inputs(bias: str | None = None, mask: str | None = None):
    q = torch.randn(B, SQ, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, SK, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    rows = {None: None, "key": (B, H, 1, SK), "full": (B, H, SQ, SK)}[bias]
    bias = None if rows is None else torch.randn(rows, dtype=torch.bfloat16)
    shape = {None: None, "mask": (1, HKV, SQ, SK), "blocks": (B, HKV, -(-SQ // 128), 2)}[mask]
    mask = None if shape is None else torch.rand(shape) < 0.5
    return q, k, v, bias, mask


def described(arg):
    if isinstance(arg, torch.Tensor):
        return tuple(arg.shape), arg.stride(), arg.dtype
    return arg


CASES = {
    "no mask, no bias": (None, None, False),
    "key bias": ("key", None, False),
    "full bias, causal": ("full", None, True),
    "mask and key bias": ("key", "mask", False),
    "block mask and key bias": ("key", "blocks", False),
    "block mask, causal": (None, "blocks", True),
}


@pytest.mark.parametrize("kernels", ["hopper", "mma_sync"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_routed_call_launches_what_the_general_path_does(launches, monkeypatch, case, kernels):
    """The same call by flash_fwd's general path (an `out` given) and on its route: the same
    kernels (but the mask's pre-pass, whose bits the route finds remembered), arguments of
    the same shapes, strides and dtypes, the same q, k, v and the same remembered bits and
    items (a block mask's, a mask's pre-pass bits)."""
    if kernels == "mma_sync":
        monkeypatch.setenv(KERNELS_ENV, "mma_sync")
    bias_kind, mask_kind, causal = CASES[case]
    q, k, v, bias, mask = inputs(bias_kind, mask_kind)
    attn_mask, block_mask = (None, mask) if mask_kind == "blocks" else (mask, None)
    problem, mask4, bias4 = make_problem(
        q, k, v, attn_mask, bias, None, causal, 0.0, (-1, -1), False
    )
    out = torch.empty_like(q)
    fwd_launch.flash_fwd(problem, q, k, v, mask4, bias4, out=out, block_mask=block_mask)
    general = list(launches["calls"])
    launches["calls"].clear()
    routed = fwd_launch.forward_route(problem, q, k, v, mask4, bias4, block_mask)
    if kernels == "mma_sync" and mask_kind == "blocks":  # materialized per call: no route
        assert routed is None
        return
    assert routed is not None
    fwd_launch.flash_fwd(problem, q, k, v, mask4, bias4, block_mask=block_mask)
    # (the mask's pre-pass ran once: its bits are remembered with the mask)
    general = [call for call in general if not isinstance(call[0], BlockBitsSpec)]
    assert [spec for spec, _ in launches["calls"]] == [spec for spec, _ in general]
    family = FwdSpec if kernels == "mma_sync" else Sm90FwdSpec
    assert isinstance(general[-1][0], family)
    for (_, args), (_, want) in zip(launches["calls"], general, strict=True):
        assert [described(a) for a in args] == [described(a) for a in want]
    args, want = launches["calls"][-1][1], general[-1][1]
    for i in (0, 1, 2) + ((8, 9) if family is Sm90FwdSpec else ()):
        if isinstance(want[i], torch.Tensor):
            assert args[i].data_ptr() == want[i].data_ptr(), f"argument {i}"
    if block_mask is not None:  # bits and items are remembered with the block mask
        assert args[8] is not None and args[9] is not None


def test_a_repeated_call_is_planned_once(launches, monkeypatch) -> None:
    """New tensors of the same layouts: one route, one plan; both calls launch alike."""
    made = []
    route = fwd_launch._route
    monkeypatch.setattr(fwd_launch, "_route", lambda *a: made.append(a) or route(*a))
    for _ in range(2):
        q, k, v, bias, mask = inputs("key", "blocks")
        problem, _, bias4 = make_problem(q, k, v, None, bias, None, False, 0.0, (-1, -1), False)
        fwd_launch.flash_fwd(problem, q, k, v, None, bias4, block_mask=mask)
    assert len(made) == 1
    # the forward and the terms pre-pass, compiled once, launched twice
    assert len(launches["compiled"]) == 2 and len(launches["calls"]) == 4


def test_a_misaligned_query_takes_the_general_path(launches) -> None:
    """A q that is not 16-byte aligned is copied by the general path (qkv_view): no route."""
    _, k, v, _, _ = inputs()
    q = torch.randn(B * SQ * H * D + 1, dtype=torch.bfloat16)[1:].view(B, SQ, H, D)
    problem, _, _ = make_problem(q, k, v, None, None, None, False, 0.0, (-1, -1), False)
    assert fwd_launch.forward_route(problem, q, k, v, None, None) is None
    fwd_launch.flash_fwd(problem, q, k, v, None, None)
    launched = launches["calls"][-1][1][0]
    assert launched.data_ptr() != q.data_ptr() and launched.data_ptr() % 16 == 0
    assert torch.equal(launched, q)


@pytest.fixture
def eager(launches, monkeypatch):
    """flash_dmattn_func's eager CUDA path on CPU tensors (kernels recorded), with its
    check_problem calls counted."""
    from dmattn_cute import problem as problem_module

    monkeypatch.setattr(attention, "eager_cuda", lambda query: True)
    monkeypatch.setattr(problem_module, "check_device", lambda device: None)
    checked = []
    check = attention.check_problem
    monkeypatch.setattr(attention, "check_problem", lambda *a: checked.append(a) or check(*a))
    attention._ROUTED.clear()
    yield launches, checked
    attention._ROUTED.clear()


def test_a_repeated_eager_call_is_not_validated_again(eager) -> None:
    launches, checked = eager
    for _ in range(3):
        q, k, v, bias, blocks = inputs("key", "blocks")
        attention.flash_dmattn_func(q, k, v, None, bias, block_mask=blocks)
    assert len(checked) == 1
    assert len(launches["calls"]) == 6  # terms and forward, each call
    # another layout (a causal call) is validated, then routed too
    attention.flash_dmattn_func(q, k, v, None, bias, is_causal=True, block_mask=blocks)
    attention.flash_dmattn_func(q, k, v, None, bias, is_causal=True, block_mask=blocks)
    assert len(checked) == 2


def test_bad_input_after_a_routed_call_still_raises(eager) -> None:
    launches, _ = eager
    q, k, v, bias, blocks = inputs("key", "blocks")
    for _ in range(2):
        attention.flash_dmattn_func(q, k, v, None, bias, block_mask=blocks)
    calls = len(launches["calls"])
    with pytest.raises(TypeError, match="attn_bias"):
        attention.flash_dmattn_func(q, k, v, None, bias.double(), block_mask=blocks)
    with pytest.raises(ValueError, match="block_mask"):
        attention.flash_dmattn_func(q, k, v, None, bias, block_mask=blocks[:, :, :1, :1])
    with pytest.raises(TypeError, match="return_lse"):
        attention.flash_dmattn_func(q, k, v, None, bias, return_lse=1, block_mask=blocks)
    with pytest.raises(TypeError, match="softcap"):
        attention.flash_dmattn_func(q, k, v, None, bias, softcap=[0.0], block_mask=blocks)
    assert len(launches["calls"]) == calls


def test_calls_autograd_records_are_not_routed(eager) -> None:
    """A call with an input that needs a gradient runs EagerAttention, validated each time;
    the same layouts under no_grad are routed."""
    _, checked = eager
    q, k, v, bias, _ = inputs("key")
    bias.requires_grad_(True)
    for _ in range(2):
        attention.flash_dmattn_func(q, k, v, None, bias)
    assert len(checked) == 2 and not attention._ROUTED
    with torch.no_grad():
        for _ in range(2):
            attention.flash_dmattn_func(q, k, v, None, bias)
    assert len(checked) == 3 and len(attention._ROUTED) == 1


ROUTED_GPU_CASES = {
    "key bias": ("key", None, False),
    "mask and full bias, causal": ("full", "mask", True),
    "block mask and key bias": ("key", "blocks", False),
    "block mask, causal": (None, "blocks", True),
}


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", list(ROUTED_GPU_CASES))
def test_routed_calls_match_the_reference(case) -> None:
    """Eager no-grad calls on their route (the second and third of a layout; the allocator's
    free memory poisoned before each, so an unwritten output element shows) against the
    float32 reference, each with fresh inputs."""
    from dmattn_cute.block_mask import expand_block_mask
    from dmattn_cute.reference import attention_ref
    from tests.utils import check_close, poison_cuda_allocator

    bias_kind, mask_kind, causal = ROUTED_GPU_CASES[case]
    attention._ROUTED.clear()
    for _ in range(3):
        q, k, v, bias, mask = (
            None if t is None else t.cuda() for t in inputs(bias_kind, mask_kind)
        )
        attn_mask, block_mask = (None, mask) if mask_kind == "blocks" else (mask, None)
        poison_cuda_allocator()
        with torch.no_grad():
            out, lse = attention.flash_dmattn_func(
                q, k, v, attn_mask, bias, is_causal=causal, return_lse=True, block_mask=block_mask
            )
        element = attn_mask if block_mask is None else expand_block_mask(block_mask, SQ, SK)
        want = attention_ref(q, k, v, element, bias, is_causal=causal)
        lowp = attention_ref(q, k, v, element, bias, is_causal=causal, compute_dtype=None)
        check_close("out", out, want[0], lowp[0], q.dtype)
        check_close("lse", lse, want[1], lowp[1].float(), q.dtype)
    assert len(attention._ROUTED) == 1
