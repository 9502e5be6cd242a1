"""What the benchmark runs: workloads (shapes, mask, bias), grouped in suites, and their inputs.

Suites (bf16 unless said):
- dense: no mask or bias, causal and not, D 64/128/256, S 1k..16k at 16k tokens per batch;
  fp16 at S=4k.
- bias: a trainable bias [B, Hkv, 1, Sk] or [B, H, Sq, Sk] with its gradient, dense mask; bf16
  and fp16; and the same shape with no bias and with the [B, Hkv, 1, Sk] bias alone.
- sparse: bias [B, Hkv, 1, Sk] and a mask of density 1.0/0.5/0.25/0.1/0.05, either random
  blocks of 128 queries x 64 keys, random blocks of 128 x 128 (also given to ours as a block
  mask, built outside the timing as FlexAttention's BlockMask is), or the top-W keys of each
  query by the bias (flash-dmattn's dynamic mask, W = density * Sk), causal and not.
- decode: Sq = 1, Sk 4k..512k, bias and a random 64-key block mask of density 0.25.
- heads: no mask or bias, B1 H32 S4k D128 with 32, 8 and 1 kv heads (MHA, GQA, MQA), in
  default and in deterministic mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

HEADS, HEADS_KV = 16, 4  # unless a workload says otherwise
TOKENS = 16384  # batch * seqlen of the dense sweep
BLOCK_Q, BLOCK_K = 128, 64  # random block masks: 128 queries x 64 keys
BLOCK_SIZES = {"blocks": (BLOCK_Q, BLOCK_K), "blocks128": (128, 128)}
DENSITIES = (1.0, 0.5, 0.25, 0.1, 0.05)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Workload:
    """One attention shape and its operands.

    bias: None, "key" ([B, Hkv, 1, Sk], one value per key) or "full" ([B, H, Sq, Sk]).
    mask: None, "dense" (all True), "blocks" (random BLOCK_Q x BLOCK_K blocks, a fraction
    `density` of them visible on average: random_blocks), "blocks128" (the same, 128 x 128)
    or "topk" (the round(density * Sk) keys of largest bias per query).
    deterministic: the backward runs in deterministic mode (ours only).
    heads_major_kv: k and v are [B, Sk, Hkv, D] views of [B, Hkv, Sk, D] storage, as
    transformers' caches hold them (their decode steps call flash_dmattn_func on those).
    """

    suite: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int = 128
    dtype: str = "bf16"
    causal: bool = False
    bias: str | None = None
    mask: str | None = None
    density: float = 1.0
    heads: int = HEADS
    heads_kv: int = HEADS_KV
    deterministic: bool = False
    heads_major_kv: bool = False

    @property
    def name(self) -> str:
        parts = [f"S{self.seqlen_q}" if self.seqlen_q == self.seqlen_k
                 else f"Sq{self.seqlen_q} Sk{self.seqlen_k}", f"D{self.head_dim}", self.dtype]  # fmt: skip
        if self.bias:
            parts.append(f"bias {self.bias}")
        if self.mask:
            parts.append(
                f"mask {self.mask}" + (f" {self.density:g}" if self.mask != "dense" else "")
            )
        if self.causal:
            parts.append("causal")
        if (self.heads, self.heads_kv) != (HEADS, HEADS_KV):
            parts.append(f"H{self.heads}/{self.heads_kv}")
        if self.deterministic:
            parts.append("deterministic")
        if self.heads_major_kv:
            parts.append("kv heads-major")
        return " ".join(parts)

    def flops(self) -> float:
        """Dense-equivalent forward FLOPs (QK^T and PV), halved under a square causal mask."""
        dense = 4.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
        return dense / 2 if self.causal and self.seqlen_q == self.seqlen_k else dense


def dense_suite() -> list[Workload]:
    sweep = [
        Workload("dense", TOKENS // s, s, s, d, causal=causal)
        for d in (64, 128, 256)
        for causal in (False, True)
        for s in (1024, 2048, 4096, 8192, 16384)
    ]
    fp16 = [Workload("dense", 4, 4096, 4096, 128, "fp16", c) for c in (False, True)]
    return sweep + fp16


def bias_suite() -> list[Workload]:
    # the no-bias and bias-only runs price the bias itself on the same shape
    baselines = [
        Workload("bias", 2, 4096, 4096, 128),
        Workload("bias", 2, 4096, 4096, 128, bias="key"),
    ]
    masked = [
        Workload("bias", 2, 4096, 4096, 128, dtype, bias=bias, mask="dense")
        for dtype in DTYPES
        for bias in ("key", "full")
    ]
    # a query-broadcast bias's dbias is a sum over the rows: deterministic mode orders it
    ordered = Workload("bias", 2, 4096, 4096, 128, bias="key", mask="dense", deterministic=True)
    return [*baselines, *masked, ordered]


def sparse_suite() -> list[Workload]:
    return [
        Workload("sparse", 2, 4096, 4096, 128, causal=causal, bias="key", mask=kind, density=p)
        for kind in ("blocks", "blocks128", "topk")
        for causal in (False, True)
        for p in DENSITIES
    ]


def decode_suite() -> list[Workload]:
    # 64-key blocks (BLOCK_K), finer than the Hopper forward's 128-key tiles, and 128-key
    # blocks that those tiles skip exactly
    return [
        Workload("decode", 8, 1, sk, 128, bias="key", mask="blocks", density=0.25)
        for sk in (4096, 32768, 131072, 524288)
    ] + [
        Workload("decode", 8, 1, sk, 128, bias="key", mask="blocks128", density=0.25)
        for sk in (32768, 131072)
    ] + [
        # the plain call on transformers' cache layout (their generate's decode steps)
        Workload("decode", 8, 1, sk, 128, bias="key", mask="blocks", density=0.25,
                 heads_major_kv=True)
        for sk in (4096, 32768)
    ]  # fmt: skip


def heads_suite() -> list[Workload]:
    return [
        Workload("heads", 1, 4096, 4096, 128, heads=32, heads_kv=hkv, deterministic=det)
        for det in (False, True)
        for hkv in (32, 8, 1)
    ]


SUITES = {
    "dense": dense_suite,
    "bias": bias_suite,
    "sparse": sparse_suite,
    "decode": decode_suite,
    "heads": heads_suite,
}


def quick_workloads() -> list[Workload]:
    """A run of under two minutes: one workload of each kind at S=2k."""
    return [
        Workload("dense", 8, 2048, 2048, 128),
        Workload("dense", 8, 2048, 2048, 128, causal=True),
        Workload("bias", 8, 2048, 2048, 128, bias="key", mask="dense"),
        Workload("sparse", 8, 2048, 2048, 128, bias="key", mask="blocks", density=0.25),
        Workload("sparse", 8, 2048, 2048, 128, bias="key", mask="topk", density=0.25),
        Workload("decode", 8, 1, 32768, 128, bias="key", mask="blocks", density=0.25),
    ]


@dataclass
class Inputs:
    q: Tensor  # [B, Sq, H, D]
    k: Tensor  # [B, Sk, Hkv, D], as v
    v: Tensor
    mask: Tensor | None  # bool [B, Hkv, Sq, Sk]
    bias: Tensor | None  # [B, Hkv, 1, Sk] or [B, H, Sq, Sk]
    causal: bool
    deterministic: bool = False
    blocks: Tensor | None = None  # "blocks128": the mask as 128 x 128 blocks [B, Hkv, Mq, Mk]

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.q.shape[2] // self.k.shape[2]

    @property
    def leaves(self) -> list[Tensor]:
        return [t for t in (self.q, self.k, self.v, self.bias) if t is not None]


def random_blocks(w: Workload, device: str) -> Tensor:
    """bool [B, Hkv, Mq, Mk] of the workload's blocks (BLOCK_SIZES): in every query block one
    key block (on the diagonal, or the last one for Sq < the block's queries) stays visible,
    and each other one is visible with the probability that makes `density` the expected
    fraction of visible blocks, the kept one included (a row of nk blocks holds density * nk
    of them on average; drawing every block w.p. density and then keeping one would hold
    density + (1 - density) / nk: 0.273 at density 0.25 and S4096)."""
    block_q, block_k = BLOCK_SIZES[w.mask]
    nq, nk = -(-w.seqlen_q // block_q), -(-w.seqlen_k // block_k)
    others = 1.0 if nk == 1 else max(0.0, (w.density * nk - 1) / (nk - 1))
    blocks = torch.rand(w.batch, w.heads_kv, nq, nk, device=device) < others
    rows = torch.arange(nq, device=device)
    diagonal = torch.clamp((rows * block_q + (w.seqlen_k - w.seqlen_q)) // block_k, 0, nk - 1)
    blocks[:, :, rows, diagonal] = True
    return blocks


def block_mask(w: Workload, device: str, blocks: Tensor | None = None) -> Tensor:
    """The element mask of random_blocks (or of `blocks`)."""
    block_q, block_k = BLOCK_SIZES[w.mask]
    blocks = random_blocks(w, device) if blocks is None else blocks
    mask = blocks.repeat_interleave(block_q, 2).repeat_interleave(block_k, 3)
    return mask[:, :, : w.seqlen_q, : w.seqlen_k]


def make_inputs(w: Workload, device: str = "cuda", grad: bool = False) -> Inputs:
    """Inputs of `w`, the same for every implementation (seeded)."""
    from dmattn_cute import create_mask

    torch.manual_seed(0)
    kw = {"device": device, "dtype": DTYPES[w.dtype]}
    q = torch.randn(w.batch, w.seqlen_q, w.heads, w.head_dim, **kw)
    k, v = (torch.randn(w.batch, w.seqlen_k, w.heads_kv, w.head_dim, **kw) for _ in range(2))
    if w.heads_major_kv:
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    bias = None
    if w.bias == "key":
        bias = torch.randn(w.batch, w.heads_kv, 1, w.seqlen_k, **kw)
    elif w.bias == "full":
        bias = torch.randn(w.batch, w.heads, w.seqlen_q, w.seqlen_k, **kw)
    mask = None
    shape = (w.batch, w.heads_kv, w.seqlen_q, w.seqlen_k)
    if w.mask == "dense":
        mask = torch.ones(shape, dtype=torch.bool, device=device)
    blocks = None
    if w.mask == "blocks128":
        blocks = random_blocks(w, device)
    if w.mask in BLOCK_SIZES:
        mask = block_mask(w, device, blocks)
    elif w.mask == "topk":
        if w.bias != "key":
            raise ValueError(f"{w.name}: top-k masks are built from a per-key bias")
        scores = bias.expand(shape)
        keep = max(1, round(w.density * w.seqlen_k))
        mask = create_mask(scores, keep, is_causal=w.causal)
    for t in (q, k, v, bias):
        if t is not None:
            t.requires_grad_(grad)
    return Inputs(q, k, v, mask, bias, w.causal, w.deterministic, blocks)


__all__ = ["SUITES", "Inputs", "Workload", "make_inputs", "quick_workloads"]
