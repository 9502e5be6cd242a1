"""One block-bits pre-pass for a forward and its backward (kernels/paired_bits.py): with
recorder kernels (CPU), one pre-pass launch writes both kernels' bits; on the GPU the paired
eager path equals the ops, which run a pre-pass per kernel (the bits themselves against their
definition: tests/test_block_bits_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.kernels import bwd_launch, fwd_launch
from dmattn_cute.kernels.block_bits import BlockBitsSpec
from dmattn_cute.kernels.key_bias_terms import KeyBiasTermsSpec
from dmattn_cute.kernels.paired_bits import paired_bits
from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
from dmattn_cute.ops import eager_attention
from dmattn_cute.problem import make_problem
from tests.utils import random_inputs


def test_one_pre_pass_serves_both_kernels(launches) -> None:
    q, k, v, mask, bias = random_inputs(
        2, 300, 520, 4, 2, 128, torch.bfloat16, "cpu", mask_shape=(2, 2, 300, 520),
        bias_shape=(2, 2, 1, 520),
    )  # fmt: skip
    problem, mask4, bias4 = make_problem(q, k, v, mask, bias, None, False, 0.0, (-1, -1), False)
    forward_bits, backward_bits = paired_bits(problem, mask4, bias4, True, "sm_90a", q.device)
    out, _, stats = fwd_launch.flash_fwd(problem, q, k, v, mask4, bias4, bits=forward_bits)
    bwd_launch.flash_bwd(
        problem, torch.randn_like(q), q, k, v, mask4, bias4, out, stats, True, bits=backward_bits
    )
    kinds = [type(spec) for spec, _ in launches["calls"]]
    # one pre-pass (at the backward's 64-row tiles, writing the forward's 128-row bits too),
    # the bias row's terms, the forward, the preprocess, the backward
    assert kinds.count(BlockBitsSpec) == 1 and kinds[0] is BlockBitsSpec
    assert kinds[1] is KeyBiasTermsSpec
    (bits_spec, bits_args), (fwd_spec, fwd_args) = launches["calls"][0], launches["calls"][2]
    bwd_spec, bwd_args = launches["calls"][-1]
    assert isinstance(fwd_spec, Sm90FwdSpec) and isinstance(bwd_spec, Sm90BwdSpec)
    assert (bits_spec.tile_m, bits_spec.tile_n) == (bwd_spec.tile.tile_m, bwd_spec.tile.tile_n)
    assert bits_spec.coarse_rows * bits_spec.tile_m == fwd_spec.tile.tile_m
    assert bits_args[2] is forward_bits and fwd_args[8].data_ptr() == forward_bits.data_ptr()
    assert bits_args[1].data_ptr() == backward_bits.data_ptr() and bwd_args[14] is backward_bits
    assert forward_bits.shape[2] == -(-300 // fwd_spec.tile.tile_m)
    assert backward_bits.shape[2] == -(-300 // bwd_spec.tile.tile_m)


def test_bits_of_another_tile_are_refused(launches) -> None:
    q, k, v, mask, _ = random_inputs(
        1, 300, 520, 2, 2, 64, torch.bfloat16, "cpu", mask_shape=(1, 2, 300, 520)
    )
    problem, mask4, _ = make_problem(q, k, v, mask, None, None, False, 0.0, (-1, -1), False)
    wrong = torch.zeros(1, 2, 5, 5, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits: expected"):
        fwd_launch.flash_fwd(problem, q, k, v, mask4, None, bits=wrong)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("seqlen_q", [300, 320])
def test_eager_path_with_paired_bits_matches_the_ops(seqlen_q) -> None:
    """On CUDA the eager path derives the forward's bits from the backward's; the ops run a
    pre-pass per kernel. Deterministic: outputs and gradients are bitwise equal."""
    from dmattn_cute import flash_dmattn_func
    from dmattn_cute.ops import attention_bwd, attention_fwd

    seqlen_k = 520
    q, k, v, _, bias = random_inputs(
        2, seqlen_q, seqlen_k, 4, 2, 128, torch.bfloat16, "cuda", bias_shape=(2, 4, 1, seqlen_k),
        requires_grad=True,
    )  # fmt: skip
    blocks = torch.rand(2, 2, seqlen_q // 64 + 1, seqlen_k // 128 + 1, device="cuda") < 0.6
    mask = blocks.repeat_interleave(64, 2)[:, :, :seqlen_q].repeat_interleave(128, 3)
    mask = mask[..., :seqlen_k] & (torch.rand(2, 2, seqlen_q, seqlen_k, device="cuda") > 2e-5)
    problem, mask4, bias4 = make_problem(q, k, v, mask, bias, None, False, 0.0, (-1, -1), True)
    assert paired_bits(problem, mask4, bias4, True, "sm_90a", q.device) is not None  # paired
    dout = torch.randn_like(q)
    out = flash_dmattn_func(q, k, v, mask, bias, deterministic=True)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    flags = (128**-0.5, False, 0.0, -1, -1, True)
    op_out, _, stats = attention_fwd(q, k, v, mask, bias, *flags)
    op_grads = attention_bwd(dout, q, k, v, mask, bias, op_out, stats, *flags, True)
    assert torch.equal(out, op_out)
    for got, want in zip(grads, op_grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.sm90
def test_no_grad_calls_pair_nothing(monkeypatch) -> None:
    """Under torch.no_grad no backward follows: the forward runs its own pre-pass (the
    autograd.Function still reports needs_input_grad there; the call's grad mode decides)."""
    from dmattn_cute import flash_dmattn_func, ops

    def refuse(*args):
        raise AssertionError("paired bits under no_grad")

    monkeypatch.setattr(ops, "paired_bits", refuse)
    q, k, v, mask, _ = random_inputs(
        1, 300, 520, 2, 2, 64, torch.bfloat16, "cuda", mask_shape=(1, 2, 300, 520),
        requires_grad=True,
    )  # fmt: skip
    with torch.no_grad():
        out = flash_dmattn_func(q, k, v, mask)
    assert out.isfinite().all()


def test_an_unrecorded_call_runs_the_forward_alone(launches) -> None:
    """eager_attention: under no_grad, the forward and its own pre-pass at its tiles (no
    autograd.Function, nothing recorded); with an input that needs a gradient, the pre-pass
    at the backward's tiles, paired."""
    q, k, v, mask, bias = random_inputs(
        2, 300, 520, 4, 2, 128, torch.bfloat16, "cpu", mask_shape=(2, 2, 300, 520),
        bias_shape=(2, 2, 1, 520),
    )  # fmt: skip
    problem, _, _ = make_problem(q, k, v, mask, bias, None, False, 0.0, (-1, -1), False)
    q.requires_grad_()
    with torch.no_grad():
        out, _ = eager_attention(problem, q, k, v, mask, bias, None, None)
    assert out.grad_fn is None
    # (the bias row's terms pre-pass first)
    (terms_spec, _), (bits_spec, _), (fwd_spec, _) = launches["calls"]
    assert isinstance(bits_spec, BlockBitsSpec) and isinstance(fwd_spec, Sm90FwdSpec)
    assert isinstance(terms_spec, KeyBiasTermsSpec)
    assert (bits_spec.tile_m, bits_spec.tile_n) == (fwd_spec.tile.tile_m, fwd_spec.tile.tile_n)

    launches["calls"].clear()
    out, _ = eager_attention(problem, q, k, v, mask, bias, None, None)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
    (bits_spec, _), _, (fwd_spec, _) = launches["calls"]
    assert bits_spec.tile_m < fwd_spec.tile.tile_m  # the backward's 64-row tiles
