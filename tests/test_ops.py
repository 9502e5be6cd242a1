"""The torch.library ops: opcheck, fake (meta) shapes, and torch.compile(fullgraph=True) of a
model that calls flash_dmattn_func. CPU runs the ops' reference path; CUDA runs the kernels
(eager calls through ops.EagerAttention, which must agree with the ops)."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dmattn_cute import flash_dmattn_func
from dmattn_cute.modules import DynamicMaskAttention
from dmattn_cute.ops import EagerAttention, attention_bwd, attention_fwd
from dmattn_cute.reference import attention_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
B, SQ, SK, H, HKV, D = 2, 37, 45, 4, 2, 32

# (mask shape, bias shape): none, each alone, 3-D, broadcast and full shapes.
OPERANDS = [
    (None, None),
    ((B, HKV, SQ, SK), None),
    (None, (B, HKV, 1, SK)),
    ((1, H, SQ, SK), (B, 1, SQ, SK)),
    ((B, 1, SK), (1, HKV, SK)),
]


def _inputs(device, mask_shape, bias_shape, dtype=torch.bfloat16, grad=True):
    q = torch.randn(B, SQ, H, D, device=device, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, SK, HKV, D, device=device, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, SK, HKV, D, device=device, dtype=dtype, requires_grad=grad)
    mask = bias = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, device=device) > 0.3
    if bias_shape is not None:
        bias = torch.randn(bias_shape, device=device, dtype=dtype, requires_grad=grad)
    return q, k, v, mask, bias


def _flags(is_causal=False, softcap=0.0, window=(-1, -1), deterministic=False):
    return (D**-0.5, is_causal, softcap, *window, deterministic)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("mask_shape", "bias_shape"), OPERANDS)
@pytest.mark.parametrize(
    "flags",
    [_flags(), _flags(is_causal=True), _flags(softcap=5.0, window=(8, 3), deterministic=True)],
    ids=["plain", "causal", "softcap-window-det"],
)
def test_opcheck_fwd(device, mask_shape, bias_shape, flags) -> None:
    q, k, v, mask, bias = _inputs(device, mask_shape, bias_shape)
    torch.library.opcheck(attention_fwd, (q, k, v, mask, bias, *flags))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("mask_shape", "bias_shape"), OPERANDS)
@pytest.mark.parametrize("bias_grad", [True, False])
def test_opcheck_bwd(device, mask_shape, bias_shape, bias_grad) -> None:
    q, k, v, mask, bias = _inputs(device, mask_shape, bias_shape, grad=False)
    flags = _flags(is_causal=True)
    out, _, stats = attention_fwd(q, k, v, mask, bias, *flags)
    dout = torch.randn_like(out)
    torch.library.opcheck(attention_bwd, (dout, q, k, v, mask, bias, out, stats, *flags, bias_grad))


@pytest.mark.parametrize(("mask_shape", "bias_shape"), OPERANDS)
@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
def test_fake_shapes(mask_shape, bias_shape, bias_dtype) -> None:
    """Under FakeTensorMode nothing runs; outputs and gradients get their exact metadata."""
    with FakeTensorMode():
        q, k, v, mask, bias = _inputs("cpu", mask_shape, bias_shape, torch.float16)
        if bias is not None:
            bias = bias.detach().to(bias_dtype).requires_grad_()
        out, lse = flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)
        assert (out.shape, out.dtype, out.is_contiguous()) == (q.shape, q.dtype, True)
        assert (lse.shape, lse.dtype) == ((B, H, SQ), torch.float32)
        assert not lse.requires_grad
        leaves = [q, k, v] + ([bias] if bias is not None else [])
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    for leaf, grad in zip(leaves, grads, strict=True):
        assert (grad.shape, grad.dtype) == (leaf.shape, leaf.dtype)


@pytest.mark.parametrize("bias_grad", [True, False])
def test_fake_bwd_returns_empty_dbias_when_not_asked(bias_grad) -> None:
    with FakeTensorMode():
        q, k, v, mask, bias = _inputs("cpu", None, (1, HKV, SK), grad=False)
        out, _, stats = attention_fwd(q, k, v, mask, bias, *_flags())
        dq, dk, dv, dbias = attention_bwd(
            out, q, k, v, mask, bias, out, stats, *_flags(), bias_grad
        )
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dbias.shape == (bias.shape if bias_grad else (0,))


def _model_and_data(device, seed=0):
    torch.manual_seed(seed)
    hidden, seqlen = 64, 48
    model = nn_model(hidden, device)
    x = torch.randn(2, seqlen, hidden, device=device, dtype=torch.bfloat16)
    target = torch.randn(2, seqlen, hidden, device=device, dtype=torch.bfloat16)
    return model, x, target


def nn_model(hidden, device):
    return DynamicMaskAttention(
        hidden, num_heads=4, num_kv_heads=2, keep=16, device=device, dtype=torch.bfloat16
    )


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_module_has_no_graph_break_and_matches_eager(device) -> None:
    model, x, _ = _model_and_data(device)
    eager_out = model(x)
    eager_grads = torch.autograd.grad(eager_out.float().square().mean(), list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break raises
    out = compiled(x)
    grads = torch.autograd.grad(out.float().square().mean(), list(model.parameters()))
    # Same ops, same kernels: on CPU the two agree bitwise. Inductor may evaluate the bias's
    # bf16 elementwise chain (softplus, exp, mul) in float32 without eager's roundings, a few
    # bf16 ulps (2^-8 relative each) carried to out and the gradients: ~5 ulps allowed for out,
    # ~12 for the gradients, which add a backward's matmuls on top.
    torch.testing.assert_close(out, eager_out, atol=2e-2, rtol=2e-2)
    for grad, eager in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(grad, eager, atol=2e-2, rtol=5e-2)
    assert model.bias_proj.weight.grad is None  # autograd.grad leaves .grad alone
    assert grads[-1].abs().sum() > 0  # the bias source learns through dbias


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_module_trains(device) -> None:
    model, x, target = _model_and_data(device, seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = (compiled(x).float() - target.float()).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"\n{device} losses: {[round(v, 4) for v in losses]}")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert all(b <= a * 1.05 for a, b in itertools.pairwise(losses))


@pytest.mark.gpu
def test_kernels_run_on_the_current_stream() -> None:
    """Kernels are launched on torch's current stream: here q is written on a side stream
    after a long sleep; a launch on any other stream would read q before the write."""
    q_new, k, v, mask, bias = _inputs("cuda", (B, HKV, SQ, SK), (B, HKV, 1, SK), grad=False)
    q = torch.zeros_like(q_new)
    dout = torch.randn_like(q_new)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        q.copy_(q_new)
        leaf = q.requires_grad_()
        out = flash_dmattn_func(leaf, k, v, mask, bias, is_causal=True)
        (dq,) = torch.autograd.grad(out, leaf, dout)
    side.synchronize()
    ref_q = q_new.detach().float().requires_grad_()
    ref = attention_ref(ref_q, k.float(), v.float(), mask, bias.float(), is_causal=True)[0]
    (ref_dq,) = torch.autograd.grad(ref, ref_q, dout.float())
    # Loose on purpose: a launch on another stream reads q = 0, an O(1) error; bf16 kernels
    # stay within SPEC's 2e-2 relative of the float32 reference (dq: a backward's matmuls more).
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dq.float(), ref_dq, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("mask_shape", "bias_shape"), OPERANDS)
def test_unrecorded_calls_run_the_forward_alone(mask_shape, bias_shape) -> None:
    """Under no_grad, or with no input that needs a gradient, the eager path launches the
    forward without the autograd.Function (and the mask's own pre-pass, not the one paired
    with a backward): the same out and lse, bitwise, and nothing recorded."""
    q, k, v, mask, bias = _inputs("cuda", mask_shape, bias_shape)
    out, lse = flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)
    assert out.grad_fn is not None
    with torch.no_grad():
        calls = [flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)]
    detached = [t if t is None else t.detach() for t in (q, k, v, bias)]
    calls.append(flash_dmattn_func(*detached[:3], mask, detached[3], is_causal=True,
                                   return_lse=True))  # fmt: skip
    for got_out, got_lse in calls:
        assert got_out.grad_fn is None and not got_out.requires_grad
        assert torch.equal(got_out, out) and torch.equal(got_lse, lse)


@pytest.mark.gpu
@pytest.mark.parametrize(("mask_shape", "bias_shape"), OPERANDS)
def test_eager_path_matches_the_ops(mask_shape, bias_shape) -> None:
    """Eager CUDA calls run EagerAttention, torch.compile runs the ops: the same kernels, so
    with a deterministic backward the outputs and gradients are bitwise equal."""
    q, k, v, mask, bias = _inputs("cuda", mask_shape, bias_shape)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    dout = torch.randn_like(q)
    out, lse = flash_dmattn_func(
        q, k, v, mask, bias, is_causal=True, deterministic=True, return_lse=True
    )
    assert type(out.grad_fn).__name__ == f"{EagerAttention.__name__}Backward"
    grads = torch.autograd.grad(out, leaves, dout)
    op_out, op_lse, stats = attention_fwd(q, k, v, mask, bias, *_flags(True, deterministic=True))
    op_grads = attention_bwd(
        dout, q, k, v, mask, bias, op_out, stats, *_flags(True, deterministic=True), True
    )
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse)
    for got, want in zip(grads, op_grads, strict=False):
        assert torch.equal(got, want)
