"""Shared test helpers: random problem inputs and SPEC.md's tolerance rule."""

from __future__ import annotations

import torch
from torch import Tensor

from dmattn_cute import flash_dmattn_func
from dmattn_cute.kernels.fwd_launch import flash_fwd
from dmattn_cute.problem import broadcast_view, check_broadcast, make_problem
from dmattn_cute.reference import _per_query_head, _probabilities, attention_ref

# (Sq, Sk) pairs of the GPU tests: odd, tile-edge and long lengths, Sq != Sk, decode (Sq = 1).
SEQLENS = [
    (1, 1),
    (17, 63),
    (63, 65),
    (64, 64),
    (65, 127),
    (127, 128),
    (128, 129),
    (129, 255),
    (255, 17),
    (1000, 1000),
    (1, 4095),
    (4095, 1000),
    (64, 4096),
    (4096, 129),
]


def normalize_broadcast(
    t: Tensor | None,
    name: str,
    batch: int,
    heads: int,
    heads_kv: int,
    seqlen_q: int,
    seqlen_k: int,
) -> Tensor | None:
    """A mask/bias as a 4-D [Bm, Hm, Qm, Km] view of the same storage, or None for None.

    t: [Bm, Hm, Km] (Qm = 1) or [Bm, Hm, Qm, Km] with Bm in {1, B}, Hm in {1, Hkv, H},
    Qm in {1, Sq}, Km in {1, Sk}; any strides (expanded stride-0 views included).
    Raises ValueError naming `name` for a wrong rank or a dim that does not broadcast.
    """
    if t is None:
        return None
    check_broadcast(t, name, batch, heads, heads_kv, seqlen_q, seqlen_k)
    return broadcast_view(t)


def broadcast_shapes(b: int, hkv: int, h: int, sq: int, sk: int) -> list[tuple[int, ...]]:
    """Every [Bm, Hm, Qm, Km] a mask or bias may take for these sizes (SPEC.md)."""
    return [
        (bb, hh, qq, kk)
        for bb in (1, b)
        for hh in sorted({1, hkv, h})
        for qq in (1, sq)
        for kk in (1, sk)
    ]


# SPEC.md: relative error bound ||got - ref|| / ||ref|| per input dtype.
REL_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def check_close(
    name: str,
    got: Tensor,
    ref: Tensor,
    ref_lowp: Tensor,
    dtype: torch.dtype,
    budget: Tensor | None = None,
) -> None:
    """Assert SPEC.md's rule for one output of a kernel run in `dtype` (bf16 or fp16).

    got: the kernel's result; ref: the float32/float64 reference; ref_lowp: the same reference
    computed in `dtype`. All three have one shape. Passes when
    |got - ref| <= 2 * max|ref_lowp - ref| + 1e-5 + ulp(ref) elementwise (ulp of got's dtype,
    see below) and ||got - ref|| / ||ref|| is below
    REL_TOLERANCE[dtype] (when ||ref|| == 0, only the first bound applies). NaN in got fails; -inf in
    ref (lse of a fully masked row) must be -inf in got and is left out of the comparison.
    As in FlashAttention's tests, ref is first rounded to got's dtype: no kernel can be closer
    to the exact value than the rounding of its own output (a half ulp of a large fp16 dbias
    sum can exceed twice the low-precision reference's largest error), and the two roundings
    (got's and ref's) may fall on either side of a midpoint: one ulp of got's dtype is allowed
    on top (a bf16 dbias sum near 16-32 flipped by 0.125 on 0.7% of inputs, H100 2026-11-22).
    budget: an elementwise bound added to the max-error limit for an error source the
    low-precision reference lacks (see rowsum_identity_budget).
    Raises AssertionError naming `name`, the errors and their limits.
    """
    out_dtype = got.dtype
    ref = ref.detach().to(got.dtype)
    got, ref, ref_lowp = (t.detach().to(torch.float64) for t in (got, ref, ref_lowp))
    budget = torch.zeros_like(got) if budget is None else budget.detach().to(torch.float64)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not got.isnan().any(), f"{name}: {int(got.isnan().sum())} NaN values"
    ref_neg_inf = ref.isneginf()
    mismatched = int((got.isneginf() != ref_neg_inf).sum())
    assert mismatched == 0, f"{name}: {mismatched} positions differ in being -inf from ref"
    finite = ~ref_neg_inf
    got, ref, ref_lowp, budget = got[finite], ref[finite], ref_lowp[finite], budget[finite]
    if ref.numel() == 0:
        return

    err = (got - ref).abs()
    lowp_err = (ref_lowp - ref).abs().max().item()
    max_limit = 2 * lowp_err + 1e-5
    # Both got and the rounded ref are roundings of nearby values: where those straddle a
    # rounding midpoint of got's dtype they land one ulp apart however close they are.
    excess = (err - max_limit - ulp(ref, out_dtype) - budget).max().item()
    max_err = err.max().item()
    ref_norm = ref.norm().item()
    if ref_norm == 0:
        # e.g. dq of a single visible key: only the absolute bound applies
        assert excess <= 0, f"{name}: ref is all zero but max|got| = {max_err:.3e}"
        return
    rel_err = (got - ref).norm().item() / ref_norm
    rel_limit = REL_TOLERANCE[dtype]
    assert excess <= 0 and rel_err < rel_limit, (
        f"{name}: max abs err {max_err:.3e} (limit {max_limit:.3e} = 2 * lowp err "
        f"{lowp_err:.3e} + 1e-5, plus one ulp of the output dtype and the budget), rel err "
        f"{rel_err:.3e} "
        f"(limit {rel_limit:.1e})"
    )


def ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of `dtype` at each |x| (its smallest subnormal step at 0)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.abs())
    spacing = torch.ldexp(torch.full_like(x, info.eps / 2), exponent)  # 2^(e-1) * eps
    smallest = info.smallest_normal * info.eps
    return torch.where(x == 0, smallest, spacing.clamp_min(smallest))


def random_inputs(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    heads: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    mask_shape: tuple[int, ...] | None = None,
    bias_shape: tuple[int, ...] | None = None,
    mask_density: float = 0.5,
    bias_dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Random q [B, Sq, H, D], k and v [B, Sk, Hkv, D], mask and bias.

    mask: bool of `mask_shape` with P(True) = mask_density; bias: standard normal of
    `bias_shape` in `bias_dtype` (default `dtype`); each None when its shape is None.
    requires_grad applies to q, k, v and bias (all leaves). `generator` must live on `device`.
    """

    def normal(*shape: int, dtype: torch.dtype) -> Tensor:
        t = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    q = normal(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = normal(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    v = normal(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=generator, device=device) < mask_density
    bias = None
    if bias_shape is not None:
        bias = normal(*bias_shape, dtype=bias_dtype or dtype)
    return q, k, v, mask, bias


def leaves(tensors, dtype=None):
    return [
        None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(t.is_floating_point())
        for t in tensors
    ]


def rerun_grads(q, k, v, mask, bias, dout, **kwargs):
    """(dq, dk, dv, dbias) of one more forward + backward of flash_dmattn_func on fresh
    leaves, for comparing runs bit for bit."""
    q1, k1, v1 = leaves((q, k, v))
    b1 = bias.detach().clone().requires_grad_()
    flash_dmattn_func(q1, k1, v1, mask, b1, **kwargs).backward(dout)
    return q1.grad, k1.grad, v1.grad, b1.grad


def compact_mask_grads_and_check(q, k, v, mask, bias, dense, compact: dict, **kwargs):
    """Ours given a compact mask (`compact`: block_mask= or key_expiry=) and attn_mask vs the
    fp32 and low-precision references given `dense`, the element mask they stand for
    together; out and the gradients of q, k, v and bias checked."""
    dout = torch.randn_like(q)
    ref_kwargs = {name: value for name, value in kwargs.items() if name != "deterministic"}
    results = []
    for dtype, ours in ((None, True), (torch.float32, False), (None, False)):
        q1, k1, v1 = leaves((q, k, v), dtype)
        b1 = None if bias is None else leaves((bias,), dtype)[0]
        if ours:
            out = flash_dmattn_func(q1, k1, v1, mask, b1, **compact, **kwargs)
        else:
            compute = torch.float32 if dtype is not None else None
            out, _ = attention_ref(q1, k1, v1, dense, b1, compute_dtype=compute, **ref_kwargs)
        out.backward(dout.to(out.dtype))
        results.append([out, *(t.grad for t in (q1, k1, v1, b1) if t is not None)])
    for name, got, ref, lowp in zip(("out", "dq", "dk", "dv", "dbias"), *results, strict=False):
        check_close(name, got, ref, lowp.to(ref.dtype), q.dtype)


def expiry_grads_and_check(q, k, v, mask, bias, expiry, **kwargs):
    """compact_mask_grads_and_check of key_expiry, whose element mask is its definition (query
    i keeps key j while i + Sk - Sq < expiry[j]; causal, when asked, by the reference's
    is_causal) ANDed with attn_mask (one mask head, or as many as the expiry)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    rows = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
    dense = rows < expiry[..., None, :]  # written apart from with_key_expiry
    if mask is not None:
        dense = dense & mask
    compact_mask_grads_and_check(q, k, v, mask, bias, dense, {"key_expiry": expiry}, **kwargs)


def grads_and_check(
    q, k, v, mask=None, bias=None, *, bias_grad=True, bias_view=None, dout=None, **kwargs
):
    """Kernel gradients vs the fp32 and low-precision reference gradients; returns the kernel's
    (dq, dk, dv, dbias) and the fp32 reference's gradients.

    bias_view: the attention gets bias_view(leaf) (e.g. a slice or an expand() of the bias
    leaf); dbias is the leaf's gradient, for the kernel and the references alike. dout: the
    output gradient (default: standard normal).
    """
    view = bias_view or (lambda t: t)
    dout = torch.randn_like(q) if dout is None else dout
    q1, k1, v1 = leaves((q, k, v))
    b1 = None if bias is None else bias.detach().clone().requires_grad_(bias_grad)
    out = flash_dmattn_func(q1, k1, v1, mask, None if b1 is None else view(b1), **kwargs)
    if q.is_cuda:
        poison_cuda_allocator()
    out.backward(dout)
    got = [q1.grad, k1.grad, v1.grad, None if b1 is None else b1.grad]

    kwargs.pop("deterministic", None)
    refs = []
    for dtype in (torch.float32, None):
        q2, k2, v2 = leaves((q, k, v), dtype)
        b2 = None if bias is None else leaves((bias,), dtype)[0]
        compute = torch.float32 if dtype is not None else None
        b2_view = None if b2 is None else view(b2)
        out_ref, _ = attention_ref(q2, k2, v2, mask, b2_view, compute_dtype=compute, **kwargs)
        out_ref.backward(dout.to(out_ref.dtype))
        refs.append([q2.grad, k2.grad, v2.grad, None if b2 is None else b2.grad, out_ref])
    ref, lowp = refs
    budget = rowsum_identity_budget(q, k, v, mask, bias, view, dout, out, ref[4], **kwargs)
    for name, g, r, lp in zip(("dq", "dk", "dv"), got[:3], ref[:3], lowp[:3], strict=True):
        assert g.dtype == q.dtype and g.shape == r.shape, name
        check_close(name, g, r, lp, q.dtype, budget.get(name))
    if bias is not None and bias_grad:
        assert got[3].shape == bias.shape and got[3].dtype == bias.dtype
        if bias.shape[-1] == 1:
            # A key-broadcast bias shifts whole rows: its gradient is exactly 0 (the reference
            # shows rounding noise only).
            assert torch.equal(got[3], torch.zeros_like(got[3]))
            assert ref[3].abs().max() < 1e-3 * max(ref[0].abs().max().item(), 1.0)
        else:
            check_close("dbias", got[3], ref[3], lowp[3].float(), q.dtype, budget["dbias"])
    elif bias is not None:
        assert got[3] is None
    return got[:4], ref[:4]


def rowsum_identity_budget(q, k, v, mask, bias, view, dout, out, out_ref, **kwargs):
    """Elementwise error bounds that a flash backward adds on top of rounding, for dq, dk and
    dbias (dv has none).

    A flash backward takes dS = P (dP - D) with D = rowsum(dO * out) from the output it
    returned, rounded to the input dtype; autograd through the reference uses
    rowsum(P * dP) exactly. The kernel's D is off by dD = rowsum(dO * (out - out_ref)), and
    both dP and D carry float32 summation error, so |dS error| <= P (|dD| + both sums' error
    bounds), summed into dbias over its broadcast dims and multiplied into
    dq = scale dS K, dk = scale dS^T Q (softcap's derivative is at most 1). Invisible in most
    outputs, it dominates where the exact gradient is 0 (one visible key: dS = 0) and in
    dbias summed over many rows, which the low-precision reference does not model.
    """
    f32 = torch.float32
    opts = {key: kwargs.get(key, default) for key, default in _REF_DEFAULTS.items()}
    scale = opts["softmax_scale"] or q.shape[-1] ** -0.5
    bias_f32 = None if bias is None else view(bias.detach().to(f32))
    q4, k4, v4, probs, _, _ = _probabilities(
        q.detach(), k.detach(), v.detach(), mask, bias_f32, scale, opts["is_causal"],
        opts["softcap"], opts["window_size"], f32, f32,
    )  # fmt: skip
    do = dout.to(f32)
    out = out.detach().to(f32)
    d_err = (do * (out - out_ref.detach().to(f32))).sum(-1).abs()  # [B, Sq, H]
    # dP - D cancels where dS is small: both are float32 sums of D products, each off by at
    # most D * 2^-24 * (sum of |products|) (the classic bound for a dot product).
    do4, out4 = do.abs().transpose(1, 2), out.abs().transpose(1, 2)  # [B, H, Sq, D]
    gamma = q.shape[-1] * 2.0**-24
    sum_err = gamma * (do4 @ v4.abs().transpose(-1, -2) + (do4 * out4).sum(-1, keepdim=True))
    ds_err = probs * (d_err.transpose(1, 2).unsqueeze(-1) + sum_err)  # [B, H, Sq, Sk]
    heads, heads_kv = q.shape[2], k.shape[2]
    dk = (ds_err.transpose(-1, -2) @ q4.abs() * scale).transpose(1, 2)  # [B, Sk, H, D]
    dk = dk.unflatten(2, (heads_kv, heads // heads_kv)).sum(3)
    budget = {"dq": (ds_err @ k4.abs() * scale).transpose(1, 2), "dk": dk}
    if bias is not None:
        leaf = torch.zeros_like(bias, dtype=f32, requires_grad=True)
        spread = _per_query_head(view(leaf), heads) * ds_err
        (budget["dbias"],) = torch.autograd.grad(spread.sum(), leaf)
    return budget


_REF_DEFAULTS = {"softmax_scale": None, "is_causal": False, "softcap": 0.0, "window_size": (-1, -1)}


def garbage_like(t: Tensor) -> Tensor:
    """Random finite values of t's shape and dtype, far from any real output (|x| in [100, 1e4]):
    an element a kernel fails to write keeps one, whether or not the check looks for NaN."""
    magnitude = torch.empty(t.shape, device=t.device).uniform_(100.0, 1e4)
    sign = torch.randint(0, 2, t.shape, device=t.device) * 2 - 1
    return (magnitude * sign).to(t.dtype)


def poison_cuda_allocator(nbytes: int = 1 << 30) -> None:
    """Fill `nbytes` of the CUDA caching allocator's free memory with random finite values and
    release it: the next torch.empty outputs (dk, dv, dq, ...) start as garbage, not zeros."""
    block = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).uniform_(-1e4, 1e4)
    del block


def forward_and_check(
    q, k, v, mask=None, bias=None, *, scale=None, causal=False, softcap=0.0, window=(-1, -1)
):
    """Kernel (outputs poisoned) vs the fp32 and the low-precision reference."""
    problem, mask4, bias4 = make_problem(q, k, v, mask, bias, scale, causal, softcap, window, False)
    out = garbage_like(q)
    lse = garbage_like(torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device))
    stats = garbage_like(torch.empty(q.shape[0], q.shape[2], 2, q.shape[1], device=q.device))
    flash_fwd(problem, q, k, v, mask4, bias4, out=out, lse=lse, stats=stats)
    kwargs = {
        "softmax_scale": scale,
        "is_causal": causal,
        "softcap": softcap,
        "window_size": window,
    }
    out_ref, lse_ref = attention_ref(q, k, v, mask, bias, **kwargs)
    out_lowp, lse_lowp = attention_ref(q, k, v, mask, bias, compute_dtype=None, **kwargs)
    check_close("out", out, out_ref, out_lowp, q.dtype)
    check_close("lse", lse, lse_ref, lse_lowp.float(), q.dtype)
    return out, lse, out_ref, lse_ref


def launch_block_mask(
    head_dim, mask, block_mask, backward=False, causal=False, deterministic=False
):
    """The launch code's forward (or backward) of a B2 Sq300 Sk520 H4/2 call, no bias."""
    from dmattn_cute.kernels.bwd_launch import flash_bwd
    from dmattn_cute.kernels.fwd_launch import flash_fwd
    from dmattn_cute.problem import make_problem

    q, k, v, _, _ = random_inputs(2, 300, 520, 4, 2, head_dim, torch.bfloat16, "cpu")
    problem, mask4, _ = make_problem(
        q, k, v, mask, None, None, causal, 0.0, (-1, -1), deterministic
    )
    if not backward:
        return problem, flash_fwd(problem, q, k, v, mask4, None, block_mask=block_mask)
    out, stats = torch.randn_like(q), torch.zeros(2, 4, 2, 300)
    args = (problem, torch.randn_like(q), q, k, v, mask4, None, out, stats, False)
    return problem, flash_bwd(*args, block_mask=block_mask)
