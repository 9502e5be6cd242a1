"""The implementations the benchmark compares, each as a builder: Inputs -> (note, call)
candidates, best first. The runner keeps the first candidate whose first call succeeds;
yielding nothing means the implementation does not support the workload (it is listed as
skipped, with the reason, in the results).

Peers compute what ours computes: the bias is added to the scores (with its gradient where
the mode has a backward) and masked-out keys get no weight.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.workloads import Inputs

Call = Callable[[], Tensor]
Candidates = Iterator[tuple[str, Call]]
# SDPA's math backend materializes fp32 scores and probabilities: only where they fit easily.
MATH_MAX_SCORES = 2**30


class Unsupported(Exception):
    """The implementation cannot run this workload (the message says why)."""


def ours(x: Inputs) -> Candidates:
    from dmattn_cute import flash_dmattn_func

    yield (
        "",
        lambda: flash_dmattn_func(
            x.q, x.k, x.v, x.mask, x.bias, is_causal=x.causal, deterministic=x.deterministic
        ),
    )


def ours_block_mask(x: Inputs) -> Candidates:
    """Ours given the mask as 128 x 128 blocks (block_mask=, built outside the timing, as
    FlexAttention's BlockMask is): no mask read, no block-bits pre-pass."""
    from dmattn_cute import flash_dmattn_func

    if x.blocks is None:
        raise Unsupported("the mask is not made of 128 x 128 blocks")
    yield (
        "",
        lambda: flash_dmattn_func(
            x.q,
            x.k,
            x.v,
            None,
            x.bias,
            is_causal=x.causal,
            deterministic=x.deterministic,
            block_mask=x.blocks,
        ),
    )


def _peer(x: Inputs) -> None:
    """Raise Unsupported for what no peer runs: our deterministic mode."""
    if x.deterministic:
        raise Unsupported("deterministic mode is ours")


def ours_kvcache(x: Inputs) -> Candidates:
    """Ours through flash_dmattn_with_kvcache (k, v as a full cache): its decode path packs a
    group's heads and splits the keys (one query per row only)."""
    from dmattn_cute import flash_dmattn_with_kvcache

    if x.q.shape[1] != 1 or x.q.requires_grad:
        raise Unsupported("one query per row, no gradient (the kv-cache API's decode path)")
    _peer(x)
    yield (
        "",
        lambda: flash_dmattn_with_kvcache(
            x.q, x.k, x.v, attn_mask=x.mask, attn_bias=x.bias, is_causal=x.causal
        ),
    )


def ours_kvcache_graph(x: Inputs) -> Candidates:
    """ours_kvcache replayed from a CUDA graph (captured after a warm-up call): the GPU time of
    the decode path without its host time, as a serving loop that captures decode steps sees
    it (an int cache length: nothing in the call reads the device)."""
    from dmattn_cute import flash_dmattn_with_kvcache

    if x.q.shape[1] != 1 or x.q.requires_grad:
        raise Unsupported("one query per row, no gradient (the kv-cache API's decode path)")
    _peer(x)

    def call() -> Tensor:
        return flash_dmattn_with_kvcache(
            x.q, x.k, x.v, attn_mask=x.mask, attn_bias=x.bias, is_causal=x.causal
        )

    call()  # compiles and plans outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()

    def replay() -> Tensor:
        graph.replay()
        return out

    yield "CUDA graph", replay


def _heads_first(*tensors: Tensor) -> list[Tensor]:
    return [t.transpose(1, 2) for t in tensors]


def _sdpa_causal(x: Inputs) -> bool:
    # SDPA's is_causal is top-left aligned; ours is bottom-right. They agree for Sq == Sk.
    if x.causal and x.q.shape[1] != x.k.shape[1]:
        raise Unsupported("is_causal with Sq != Sk is top-left aligned in SDPA")
    return x.causal


def _sdpa_unmasked(x: Inputs, backend: SDPBackend) -> Candidates:
    """SDPA on a workload without mask or bias: causal flag and GQA left to SDPA."""
    causal = _sdpa_causal(x)
    q, k, v = _heads_first(x.q, x.k, x.v)

    def run() -> Tensor:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return out.transpose(1, 2)

    yield "enable_gqa", run


def sdpa_flash(x: Inputs) -> Candidates:
    _peer(x)
    if x.mask is not None or x.bias is not None:
        raise Unsupported("no mask or bias in the flash backend")
    yield from _sdpa_unmasked(x, SDPBackend.FLASH_ATTENTION)


def _additive(x: Inputs) -> Tensor | None:
    """Bias and mask (and causal band) as one float mask [B, H, Sq, Sk], differentiable in
    the bias."""
    b, sq, h, sk = *x.q.shape[:3], x.k.shape[1]
    add = None
    if x.bias is not None:
        bias = x.bias if x.bias.shape[1] == h else x.bias.repeat_interleave(x.group, dim=1)
        add = bias.expand(b, h, sq, sk)
    visible = None
    if x.mask is not None:
        visible = x.mask.repeat_interleave(x.group, dim=1)
    if x.causal:
        rows = torch.arange(sq, device=x.q.device)[:, None] + (sk - sq)
        band = torch.arange(sk, device=x.q.device)[None, :] <= rows
        visible = band if visible is None else visible & band
    if visible is not None:
        base = add if add is not None else torch.zeros((), dtype=x.q.dtype, device=x.q.device)
        add = torch.where(visible, base, float("-inf"))
    return add


def sdpa_efficient(x: Inputs, backend=SDPBackend.EFFICIENT_ATTENTION) -> Candidates:
    _peer(x)
    if x.bias is None and x.mask is None:
        raise Unsupported("dense attention: the flash backend is the peer")
    q, k, v = _heads_first(x.q, x.k, x.v)
    grad = x.q.requires_grad
    fixed = None if grad else _additive(x)  # forward only: built once, outside the timing

    def run() -> Tensor:
        kr, vr = (t.repeat_interleave(x.group, dim=1) for t in (k, v))
        add = _additive(x) if fixed is None else fixed
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, kr, vr, add)
        return out.transpose(1, 2)

    note = "float mask [B,H,Sq,Sk] (bias, mask, causal), k/v repeated"
    yield note + (" (built in the timed call, for dbias)" if grad else ""), run


def sdpa_math(x: Inputs) -> Candidates:
    _peer(x)
    b, sq, h, sk = *x.q.shape[:3], x.k.shape[1]
    if b * h * sq * sk > MATH_MAX_SCORES:
        raise Unsupported(f"scores [B,H,Sq,Sk] of {b * h * sq * sk:.2e} elements")
    if x.bias is None and x.mask is None:
        yield from _sdpa_unmasked(x, SDPBackend.MATH)
    else:
        yield from sdpa_efficient(x, SDPBackend.MATH)


_flex: list[Callable] = []  # torch.compile(flex_attention), made once


def flex(x: Inputs) -> Candidates:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _peer(x)
    if not _flex:
        # Each workload's score_mod and BlockMask is one more compiled variant.
        torch._dynamo.config.recompile_limit = 256
        torch._dynamo.config.cache_size_limit = 256
        # The bwd mode times backward() alone on a retained graph, which compiled backwards
        # with donated buffers refuse.
        torch._functorch.config.donated_buffer = False
        _flex.append(torch.compile(flex_attention, dynamic=False))
    b, sq, heads, sk = *x.q.shape[:3], x.k.shape[1]
    bias, mask, offset, group = x.bias, x.mask, sk - sq, x.group

    def add_key_bias(score, bb, h, q_idx, kv_idx):
        return score + bias[bb, h // group, 0, kv_idx]

    def add_full_bias(score, bb, h, q_idx, kv_idx):
        return score + bias[bb, h, q_idx, kv_idx]

    score_mod = None
    if bias is not None:
        score_mod = add_key_bias if bias.shape[2] == 1 else add_full_bias

    def visible(bb, h, q_idx, kv_idx):
        keep = mask[bb, h // group, q_idx, kv_idx] if mask is not None else q_idx >= 0
        return keep & (kv_idx <= q_idx + offset) if x.causal else keep

    block_mask = None
    note = ""
    if mask is not None or x.causal:
        block_mask = create_block_mask(visible, b, heads, sq, sk, x.q.device.type)
        note = "BlockMask (default 128x128 blocks, built outside the timing)"
    q, k, v = _heads_first(x.q, x.k, x.v)

    def run() -> Tensor:
        return _flex[0](q, k, v, score_mod, block_mask, enable_gqa=True).transpose(1, 2)

    yield note, run


def flash_attn(x: Inputs) -> Candidates:
    """FlashAttention 2 (flash_attn), when installed: no mask or bias."""
    _peer(x)
    if importlib.util.find_spec("flash_attn_2_cuda") is None:
        raise Unsupported("flash-attn 2 is not installed")
    if x.mask is not None or x.bias is not None:
        raise Unsupported("no mask or bias")
    from flash_attn import flash_attn_func

    yield "", lambda: flash_attn_func(x.q, x.k, x.v, causal=x.causal)


def fa4(x: Inputs) -> Candidates:
    """FlashAttention 4 (flash_attn.cute), when importable: no mask or bias."""
    _peer(x)
    if importlib.util.find_spec("flash_attn") is None:
        raise Unsupported("flash_attn.cute is not installed")
    if x.mask is not None or x.bias is not None:
        raise Unsupported("no mask or bias")
    from flash_attn.cute import flash_attn_func

    # flash_attn.cute's flash_attn_func returns (out, lse).
    yield "", lambda: flash_attn_func(x.q, x.k, x.v, causal=x.causal)[0]


def flash_dmattn(x: Inputs) -> Candidates:
    """flash-dmattn (the CUDA C++ implementation), when installed."""
    _peer(x)
    if importlib.util.find_spec("flash_dmattn") is None:
        raise Unsupported("flash-dmattn is not installed")
    from flash_dmattn import flash_dmattn_func

    yield (
        "",
        lambda: flash_dmattn_func(
            x.q, x.k, x.v, attn_mask=x.mask, attn_bias=x.bias, is_causal=x.causal
        ),
    )


PEERS = {
    f.__name__: f
    for f in (
        ours,
        ours_block_mask,
        ours_kvcache,
        ours_kvcache_graph,
        sdpa_flash,
        sdpa_efficient,
        sdpa_math,
        flex,
        flash_attn,
        fa4,
        flash_dmattn,
    )
}
OURS = "ours"

__all__ = ["OURS", "PEERS", "Unsupported"]
