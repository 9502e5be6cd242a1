"""flash_dmattn_varlen_func: each packed sequence attends only to itself, equal to the reference
run on that sequence alone (outputs, lse and the gradients of q, k, v and the bias), with the
mask and bias per key token or per sequence, runs of equal lengths batched into one call, and
packed self-attention as one call over all tokens (Hopper). On CPU (the reference path)
and, marked gpu, on CUDA (the kernels)."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute import flash_dmattn_varlen_func
from dmattn_cute.reference import attention_ref
from tests.utils import check_close

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
H, HKV, D = 4, 2, 32


def packed(device, lens_q, lens_k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape):
        t = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        return t.requires_grad_()

    q, k, v = normal(sum(lens_q), H, D), normal(sum(lens_k), HKV, D), normal(sum(lens_k), HKV, D)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q.to(device), cu_k.to(device), gen


def per_sequence_reference(q, k, v, lens_q, lens_k, masks, biases, compute_dtype, **options):
    """out [total_q, H, D] and lse [H, total_q]: the reference on each sequence alone."""
    outs, lses = [], []
    q_parts, k_parts, v_parts = q.split(lens_q), k.split(lens_k), v.split(lens_k)
    for i, (qi, ki, vi) in enumerate(zip(q_parts, k_parts, v_parts, strict=True)):
        if qi.shape[0] == 0:
            continue
        if ki.shape[0] == 0:
            outs.append(qi * 0)
            lses.append(torch.full((H, qi.shape[0]), float("-inf"), device=q.device))
            continue
        m = None if masks[i] is None else masks[i][None]
        b = None if biases[i] is None else biases[i][None]
        out, lse = attention_ref(
            qi[None], ki[None], vi[None], m, b, compute_dtype=compute_dtype, **options
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


CASES = {
    "plain": {"lens_q": [5, 17, 1, 9], "lens_k": [5, 17, 1, 9]},
    "causal-sq-ne-sk": {"lens_q": [3, 8, 12], "lens_k": [7, 8, 30], "is_causal": True},
    "window-softcap": {"lens_q": [10, 20], "lens_k": [10, 25], "window_size": (4, 2),
                       "softcap": 3.0},
    "key-bias-key-mask": {"lens_q": [6, 11, 4], "lens_k": [9, 11, 16], "key_mask": True,
                          "key_bias": True, "is_causal": True},
    "per-sequence-operands": {"lens_q": [6, 2, 9], "lens_k": [9, 13, 9], "seq_mask": True,
                              "seq_bias": True},
    "empty-and-keyless-sequences": {"lens_q": [4, 0, 3, 5], "lens_k": [6, 3, 0, 5],
                                    "is_causal": True},
    "runs-of-equal-lengths": {"lens_q": [8, 8, 8, 5, 5, 3], "lens_k": [8, 8, 8, 5, 5, 7],
                              "key_mask": True, "key_bias": True, "is_causal": True},
    "runs-empty-and-keyless": {"lens_q": [0, 0, 4, 4, 6, 6], "lens_k": [3, 3, 0, 0, 9, 9]},
    "runs-per-sequence-operands": {"lens_q": [6, 6, 6], "lens_k": [9, 9, 9], "seq_bias": True},
    # causal, equal lengths: one call over all tokens on the Hopper kernels (key_expiry)
    "causal-documents": {"lens_q": [37, 130, 1, 0, 200, 64], "lens_k": [37, 130, 1, 0, 200, 64],
                         "key_mask": True, "key_bias": True, "is_causal": True},
    "documents-not-causal": {"lens_q": [37, 130, 1, 0, 200, 64], "lens_k": [37, 130, 1, 0, 200, 64],
                             "key_mask": True, "key_bias": True},
    "causal-documents-window-softcap": {"lens_q": [50, 129, 77], "lens_k": [50, 129, 77],
                                        "key_bias": True, "is_causal": True,
                                        "window_size": (16, -1), "softcap": 3.0},
}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_sequence_attends_to_itself(case, device):
    lens_q, lens_k = case["lens_q"], case["lens_k"]
    q, k, v, cu_q, cu_k, gen = packed(device, lens_q, lens_k)
    n = len(lens_q)
    mask = bias = None
    masks, biases = [None] * n, [None] * n
    if case.get("key_mask"):
        mask = torch.rand(HKV, sum(lens_k), generator=gen, device=device) < 0.7
        masks = list(mask.split(lens_k, dim=1))
    if case.get("seq_mask"):
        mask = [torch.rand(1, sq, sk, generator=gen, device=device) < 0.7
                for sq, sk in zip(lens_q, lens_k, strict=True)]  # fmt: skip
        masks = mask
    if case.get("key_bias"):
        bias = torch.randn(H, sum(lens_k), generator=gen, device=device, dtype=q.dtype)
        bias.requires_grad_()
        biases = list(bias.split(lens_k, dim=1))
    if case.get("seq_bias"):
        bias = [torch.randn(HKV, sq, sk, generator=gen, device=device, dtype=q.dtype)
                .requires_grad_() for sq, sk in zip(lens_q, lens_k, strict=True)]  # fmt: skip
        biases = bias
    options = {key: case[key] for key in ("is_causal", "window_size", "softcap") if key in case}
    out, lse = flash_dmattn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), attn_mask=mask, attn_bias=bias,
        return_lse=True, **options,
    )  # fmt: skip
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])

    leaves = [q, k, v] + ([bias] if isinstance(bias, torch.Tensor) else list(bias or []))
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    ref, ref_lse = per_sequence_reference(
        q, k, v, lens_q, lens_k, masks, biases, torch.float32, **options
    )
    want = torch.autograd.grad(ref, leaves, dout.float(), allow_unused=True)
    lowp, _ = per_sequence_reference(q, k, v, lens_q, lens_k, masks, biases, None, **options)
    check_close("out", out, ref, lowp, q.dtype)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want, strict=False):
        w = torch.zeros_like(g) if w is None else w
        rel = ((g.float() - w).norm() / w.norm().clamp_min(1e-6)).item()
        assert rel < 2e-2, f"{name}: rel err {rel:.3e}"


BAD = {
    "cu-not-from-zero": ({"cu_q": [1, 5, 9]}, ValueError, "cu_seqlens_q: expected non-decreasing"),
    "cu-decreasing": ({"cu_k": [0, 6, 4]}, ValueError, "with a decrease"),
    "cu-count": ({"cu_k": [0, 9], "max_k": 9}, ValueError, "cu_seqlens_k: expected 3 entries"),
    "max-too-small": ({"max_q": 3}, ValueError, "max_seqlen_q: expected at least"),
    "key-bias-length": ({"bias": "short"}, ValueError, "attn_bias: expected a per-key-token"),
    "bias-heads": ({"bias": "heads"}, ValueError, r"sequence 0: attn_bias: expected dim 1"),
    "rank": ({"q2d": True}, ValueError, "q: expected a 3-D packed tensor"),
}  # fmt: skip


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_bad_input_raises(bad):
    changes, error, message = bad
    q, k, v, cu_q, cu_k, _ = packed("cpu", [4, 5], [4, 5])
    args = {"cu_q": cu_q, "cu_k": cu_k, "max_q": 5, "max_k": 5, "bias": None}
    args.update(changes)
    for key in ("cu_q", "cu_k"):
        if isinstance(args[key], list):
            args[key] = torch.tensor(args[key], dtype=torch.int32)
    if args["bias"] == "short":
        args["bias"] = torch.zeros(H, 8)
    elif args["bias"] == "heads":
        args["bias"] = [torch.zeros(3, 4, 4), torch.zeros(3, 5, 5)]
    if changes.get("q2d"):
        q = q[:, 0]
    with pytest.raises(error, match=message):
        flash_dmattn_varlen_func(
            q, k, v, args["cu_q"], args["cu_k"], args["max_q"], args["max_k"],
            attn_bias=args["bias"],
        )  # fmt: skip


def test_runs_of_equal_lengths_are_one_call(monkeypatch):
    """Consecutive sequences of equal (Sq, Sk) run as one batched call; per-sequence operands
    keep one call per sequence."""
    from dmattn_cute import varlen

    calls = []
    real = varlen.flash_dmattn_func

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(varlen, "flash_dmattn_func", counted)
    lens = [8, 8, 8, 5, 5, 3]
    q, k, v, cu_q, cu_k, _ = packed("cpu", lens, lens)
    bias = torch.randn(H, sum(lens), dtype=q.dtype)
    flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, attn_bias=bias)
    assert calls == [3, 2, 1]
    calls.clear()
    per_sequence = list(bias.split(lens, dim=1))
    flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, attn_bias=per_sequence)
    assert calls == [1] * 6


@pytest.mark.gpu
def test_documents_are_one_call_on_hopper(monkeypatch):
    """Packed self-attention (equal query and key lengths) with per-key-token operands runs
    as one call over all tokens, each key kept for its own sequence's rows (an expiry at its
    end, causal; else a key range), where the Hopper kernels run; runs of equal lengths
    elsewhere, and when the lengths differ."""
    from dmattn_cute import varlen
    from dmattn_cute.jit.arch import hopper_kernels, target_arch

    calls = []
    real = varlen.flash_dmattn_func

    def counted(q, *args, **kwargs):
        calls.append((q.shape[0], kwargs.get("key_expiry") is not None))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(varlen, "flash_dmattn_func", counted)
    lens = [5, 9, 9, 3]
    q, k, v, cu_q, cu_k, gen = packed("cuda", lens, lens)
    mask = torch.rand(HKV, sum(lens), generator=gen, device="cuda") < 0.7
    flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, attn_mask=mask, is_causal=True)
    runs = [(1, False), (2, False), (1, False)]
    assert calls == ([(1, True)] if hopper_kernels(target_arch(q.device)) else runs)
    calls.clear()
    flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, attn_mask=mask)  # not causal: ranges
    assert calls == ([(1, True)] if hopper_kernels(target_arch(q.device)) else runs)
    calls.clear()
    lens_k = [6, 9, 9, 3]
    q, k, v, cu_q, cu_k, _ = packed("cuda", lens, lens_k)
    flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, is_causal=True)
    assert calls == runs


def test_cu_seqlens_read_once_and_again_after_a_change():
    """The host copy of a cu_seqlens tensor is remembered for the tensor (every layer of a step
    passes the same one), and an in-place change is seen."""
    from dmattn_cute import varlen

    lens = [5, 9, 3]
    q, k, v, cu_q, cu_k, _ = packed("cpu", lens, lens)
    varlen._BOUNDS.clear()
    flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 9, 9)
    flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 9, 9)
    assert len(varlen._BOUNDS) == 2  # one entry per tensor, not per call
    cu_k[1] = 15  # in place: 0, 15, 14, 17
    with pytest.raises(ValueError, match="cu_seqlens_k: .* with a decrease"):
        flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 9, 9)
