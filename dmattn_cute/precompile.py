"""Offline compile of the kernels into the disk cache; no GPU needed.

    python -m dmattn_cute.precompile --arch sm_89 [--head-dims 64 128] [--dtypes bf16 fp16]
        [--cache-dir DIR] [--softcap] [--deterministic] [--decode [--paged]] [--jobs N] [--list]

The variants are those that the common call patterns below run (with --decode, also the
decode steps of flash_dmattn_with_kvcache; with --paged too, those steps on a paged cache,
which SM90 reads in place), found by planning each call on meta tensors
through the same code the launches use, so a GPU of that architecture later loads every one
of them from the cache with zero compiles. Other calls (odd key lengths, other broadcast
shapes, ...) compile on first use and are cached then.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

from dmattn_cute.block_mask import BLOCK, expand_block_mask
from dmattn_cute.decode import chunk_operands, decode_splits
from dmattn_cute.jit import cache
from dmattn_cute.jit.arch import SUPPORTED_ARCHS, hopper_kernels
from dmattn_cute.kernels.bwd import BwdSpec
from dmattn_cute.kernels.bwd_launch import backward_variants, preprocess_spec, sm_count
from dmattn_cute.kernels.combine_launch import combine_spec
from dmattn_cute.kernels.fwd_launch import forward_variants
from dmattn_cute.kernels.key_bias_terms import terms_spec
from dmattn_cute.kernels.launch import operand_view
from dmattn_cute.kernels.paired_bits import paired_bits_spec
from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
from dmattn_cute.problem import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, broadcast_view, make_problem

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_HEAD_DIMS = (64, 128)
# Sizes the variants are planned at: a batch > 1 and key lengths that are multiples of 64,
# so masks and biases get their widest vector loads (what training shapes get).
BATCH, SEQLEN = 2, 1024

# mask / bias layouts: "kv" [B, Hkv, Sq, Sk], "full" [B, H, Sq, Sk], "key" bias [B, Hkv, Sk]
# (one value per key, shared by all queries, as DynamicMaskAttention builds it), "expiry"
# key_expiry [B, Hkv, Sk] int32 (top-w rows, dmattn_cute/topw.py), "blocks" block_mask [B,
# Hkv, Sq / BLOCK, Sk / BLOCK] (as create_block_mask builds it from a per-key bias).
OPERANDS = {
    "dense": (None, None),
    "mask": ("kv", None),
    "key-bias": (None, "key"),
    "mask+key-bias": ("kv", "key"),
    "full-bias": (None, "full"),
    "full-mask+full-bias": ("full", "full"),
    "expiry+key-bias": ("expiry", "key"),
    "block-mask+key-bias": ("blocks", "key"),
}
# Heads (H, Hkv): with a per-kv-head bias, MHA writes dbias directly and GQA sums into it.
HEADS = ((8, 8), (8, 2))


@dataclass(frozen=True)
class CallPattern:
    """One kind of flash_dmattn_func call; `inputs` builds its tensors."""

    dtype: str
    head_dim: int
    operands: str
    heads: tuple[int, int]
    is_causal: bool
    softcap: float = 0.0
    deterministic: bool = False

    def inputs(self, device: str | torch.device = "meta", seqlen: int = SEQLEN):
        """q, k, v, attn_mask (a block mask where its kind is "blocks"), attn_bias (random
        unless on the meta device)."""
        dtype, (heads, heads_kv) = DTYPES[self.dtype], self.heads
        mask_kind, bias_kind = OPERANDS[self.operands]
        meta = torch.device(device).type == "meta"
        make = torch.empty if meta else torch.randn

        def make_layout(kind: str, dtype: torch.dtype) -> torch.Tensor:
            blocks = -(-seqlen // BLOCK)
            shape = {
                "kv": (BATCH, heads_kv, seqlen, seqlen),
                "full": (BATCH, heads, seqlen, seqlen),
                "key": (BATCH, heads_kv, seqlen),
                "expiry": (BATCH, heads_kv, seqlen),
                "blocks": (BATCH, heads_kv, blocks, blocks),
            }[kind]
            if kind == "expiry":
                return (
                    torch.empty(shape, device=device, dtype=torch.int32)
                    if meta
                    else torch.randint(0, seqlen + 1, shape, device=device, dtype=torch.int32)
                )
            if dtype == torch.bool:
                return (
                    torch.empty(shape, device=device, dtype=dtype)
                    if meta
                    else (torch.rand(shape, device=device) > 0.5)
                )
            return make(shape, device=device, dtype=dtype)

        q = make(BATCH, seqlen, heads, self.head_dim, device=device, dtype=dtype)
        k = make(BATCH, seqlen, heads_kv, self.head_dim, device=device, dtype=dtype)
        v = make(BATCH, seqlen, heads_kv, self.head_dim, device=device, dtype=dtype)
        mask = None if mask_kind is None else make_layout(mask_kind, torch.bool)
        bias = None if bias_kind is None else make_layout(bias_kind, dtype)
        return q, k, v, mask, bias

    def options(self) -> dict:
        return {
            "is_causal": self.is_causal,
            "softcap": self.softcap,
            "deterministic": self.deterministic,
        }

    def __str__(self) -> str:
        flags = [f"H{self.heads[0]}/{self.heads[1]}"]
        flags += [name for name, on in (("causal", self.is_causal),
                                        ("softcap", self.softcap > 0),
                                        ("deterministic", self.deterministic)) if on]  # fmt: skip
        return f"{self.dtype} d{self.head_dim} {self.operands} {' '.join(flags)}"


# Decode steps through flash_dmattn_with_kvcache (one query per row, its one-launch chunked
# path): mask rows [B, Hm, 1, Sk] with Hm 1 (the per-row cache lengths alone) or Hkv (a mask
# of the caller's, or both), and the per-key bias [B, Hkv, 1, Sk].
DECODE_OPERANDS = {
    "dense": (None, False),
    "lengths": (1, False),
    "mask": ("kv", False),
    "key-bias": (None, True),
    "lengths+key-bias": (1, True),
    "mask+key-bias": ("kv", True),
}
# A cache length whose chunks (a power-of-two count) keep 16-byte aligned mask/bias rows.
DECODE_CACHE = 8192


@dataclass(frozen=True)
class DecodePattern:
    """One kind of decode step (flash_dmattn_with_kvcache with Sq = 1, the whole cache in one
    launch of chunks; dmattn_cute/decode.py): its forward, block bits and combine kernels."""

    dtype: str
    head_dim: int
    operands: str
    heads: tuple[int, int]
    softcap: float = 0.0
    paged: bool = False  # the cache in pages, read in place where the kernel can

    def kernels(self, arch: str, device: str = "meta") -> list[tuple[str, object]]:
        """(kind, spec) of every kernel the step runs on `arch`, planned on tensors of
        `device` laid out by decode.chunk_operands, as the step lays them out."""
        dtype, (heads, heads_kv) = DTYPES[self.dtype], self.heads
        mask_heads, has_bias = DECODE_OPERANDS[self.operands]
        make = torch.empty if torch.device(device).type == "meta" else torch.randn
        q = make(BATCH, 1, heads, self.head_dim, device=device, dtype=dtype)
        k, v = (make(BATCH, DECODE_CACHE, heads_kv, self.head_dim, device=device, dtype=dtype)
                for _ in range(2))  # fmt: skip
        mask = None
        if mask_heads is not None:
            rows = (BATCH, heads_kv if mask_heads == "kv" else 1, 1, DECODE_CACHE)
            mask = torch.ones(rows, dtype=torch.bool, device=device)
        bias = (
            make(BATCH, heads_kv, 1, DECODE_CACHE, device=device, dtype=dtype) if has_bias else None
        )
        splits = decode_splits(BATCH, heads_kv, DECODE_CACHE, sm_count(q.device, arch))
        operands = chunk_operands(q, k, v, mask, bias, splits, "batch")  # a contiguous cache
        kernels = planned_kernels(
            arch, *operands, softcap=self.softcap, backward=False, paged=self.paged
        )  # fmt: skip
        return kernels + [("combine", combine_spec(dtype, self.head_dim))]

    def __str__(self) -> str:
        flags = [f"H{self.heads[0]}/{self.heads[1]}"] + (["softcap"] if self.softcap else [])
        flags += ["paged"] if self.paged else []
        return f"decode {self.dtype} d{self.head_dim} {self.operands} {' '.join(flags)}"


def decode_patterns(
    dtypes=tuple(DTYPES), head_dims=DEFAULT_HEAD_DIMS, softcap=False, paged=False
) -> list[DecodePattern]:
    """The decode steps precompiled with --decode (and with --paged, on paged caches too)."""
    softcaps = (0.0, 30.0) if softcap else (0.0,)
    return [
        DecodePattern(dtype, head_dim, operands, heads, cap, kind)
        for dtype in dtypes
        for head_dim in head_dims
        for operands in DECODE_OPERANDS
        for heads in HEADS
        for cap in softcaps
        for kind in ((False, True) if paged else (False,))
    ]


def call_patterns(
    dtypes=tuple(DTYPES), head_dims=DEFAULT_HEAD_DIMS, softcap=False, deterministic=False
) -> list[CallPattern]:
    """The call patterns precompiled by default (plus softcap / deterministic when asked)."""
    softcaps = (0.0, 30.0) if softcap else (0.0,)
    dets = (False, True) if deterministic else (False,)
    return [
        CallPattern(dtype, head_dim, operands, heads, causal, cap, det)
        for dtype in dtypes
        for head_dim in head_dims
        for operands in OPERANDS
        for heads in HEADS
        for causal in (False, True)
        for cap in softcaps
        for det in dets
    ]


def kernel_specs(
    pattern: CallPattern | DecodePattern, arch: str, device: str = "meta"
) -> list[tuple[str, object]]:
    """(kind, spec) of every kernel a call of `pattern` runs, forward and backward, planned on
    tensors of `device`."""
    if isinstance(pattern, DecodePattern):
        return pattern.kernels(arch, device)
    q, k, v, mask, bias = pattern.inputs(device)
    if OPERANDS[pattern.operands][0] == "blocks":
        kernels = planned_kernels(arch, q, k, v, None, bias, block_mask=mask, **pattern.options())
    else:
        kernels = planned_kernels(arch, q, k, v, mask, bias, **pattern.options())
    for kind, spec in list(kernels):
        backward = isinstance(spec, (BwdSpec, Sm90BwdSpec))
        if backward and spec.can_split_heads and q.shape[2] > k.shape[2]:
            # whether a group's heads are split over CTAs depends on the sizes of the call
            kernels.append((kind, dataclasses.replace(spec, split_heads=not spec.split_heads)))
    return kernels


def planned_kernels(
    arch: str, q, k, v, mask, bias, is_causal=False, softcap=0.0, deterministic=False,
    backward=True, eager=False, block_mask=None, paged=False,
) -> list[tuple[str, object]]:  # fmt: skip
    """(kind, spec) of every kernel a flash_dmattn_func call on these tensors runs on `arch`
    (its backward too, if `backward`), planned by the launches' own code. An int32 `mask` is
    a key_expiry: the Hopper kernels' mask operand, an element mask elsewhere. With `eager`,
    those of the eager path alone, whose forward and backward may share one block-bits
    pre-pass (kernels/paired_bits.py) in place of their own; otherwise also those of the
    torch ops' path, where each kernel runs its own. A `block_mask` is read as bits where
    the eager path does so; the torch ops' path runs on its element mask. `paged`: k, v read
    from a page pool by the forward (a decode step on a paged cache; SM90 only, elsewhere the
    pages are gathered and the step runs as on a contiguous cache)."""
    expiry = mask is not None and mask.dtype in (torch.int32, torch.int64)
    problem, mask4, bias4 = make_problem(
        q, k, v, None if expiry else mask, bias, None, is_causal, softcap, (-1, -1),
        deterministic,
    )  # fmt: skip
    if expiry:
        mask4 = broadcast_view(mask)
        if not hopper_kernels(arch):  # the element mask it becomes: [Be, He, Sq, Sk]
            rows = (*mask.shape[:2], problem.seqlen_q, problem.seqlen_k)
            mask4 = broadcast_view(torch.empty(rows, dtype=torch.bool, device=mask.device))
    # the eager path pairs the two kernels' pre-passes only without a block mask
    paired = None
    if backward and mask4 is not None and not expiry and block_mask is None:
        paired = paired_bits_spec(problem, mask4, bias4, bias is not None, arch, q.device)
    own_bits = not (eager and paired is not None)
    paged = paged and hopper_kernels(arch)
    fwd, bits = forward_variants(problem, mask4, bias4, arch, block_mask, paged)
    kernels = [("fwd", fwd)]
    if isinstance(fwd, Sm90FwdSpec) and fwd.tile.bias_terms:  # its bias row's pre-pass
        kernels.append(("terms", terms_spec(operand_view(bias4), problem.seqlen_k)))
    if bits is not None and own_bits:
        kernels.append(("bits", bits))
    if backward:
        grad = bias is not None
        bwd, bwd_bits = backward_variants(problem, mask4, bias4, grad, arch, q.device, block_mask)
        kernels += [("bwd_pre", preprocess_spec(problem.dtype, problem.head_dim)), ("bwd", bwd)]
        if bwd_bits is not None and own_bits:
            kernels.append(("bits", bwd_bits))
    if paired is not None:
        kernels.append(("bits", paired))
    if block_mask is not None and not eager:  # the ops' path: the element mask
        element = expand_block_mask(block_mask, q.shape[1], k.shape[1])
        if mask is not None:
            element = element & (mask if mask.dim() == 4 else mask.unsqueeze(2))
        options = {"is_causal": is_causal, "softcap": softcap, "deterministic": deterministic}
        kernels += planned_kernels(arch, q, k, v, element, bias, backward=backward, **options)
    return kernels


def variants(arch: str, patterns: list[CallPattern | DecodePattern]) -> list[tuple[str, object]]:
    """(label, spec) of each distinct kernel the patterns run on `arch`, in first-use order."""
    seen: dict[object, str] = {}
    for pattern in patterns:
        for kind, spec in kernel_specs(pattern, arch):
            seen.setdefault(spec, f"{kind} {pattern}")
    return [(label, spec) for spec, label in seen.items()]


def _compile_one(spec: object, arch: str) -> tuple[int, int]:
    """Compiles (or loads) one spec into the disk cache; (compiles, loads) it took."""
    compiles, loads = cache.compile_count(), cache.load_count()
    cache.compiled(spec, arch)
    return cache.compile_count() - compiles, cache.load_count() - loads


def default_jobs() -> int:
    """Processes to compile in: the CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Progress:
    """Progress of `total` steps on `stream`: on a terminal one line redrawn in place (carriage
    return, cut to the terminal's width so it never wraps), otherwise one plain line per step."""

    WIDTH = 30  # characters of the bar

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done = total, 0
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        count = f"{self.done:>{len(str(self.total))}}/{self.total}"
        if not self.tty:
            self.stream.write(f"{count} {label}\n")
        else:
            filled = self.WIDTH * self.done // self.total
            line = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {count} {label}"
            columns = shutil.get_terminal_size().columns
            # \r back to the line's start, the new text, \033[K clears what the last one left.
            self.stream.write(f"\r{line[: columns - 1]}\033[K")
            if self.done == self.total:
                self.stream.write("\n")
        self.stream.flush()


def precompile(
    arch: str, patterns: list[CallPattern | DecodePattern], jobs: int = 1, progress: bool = True
) -> dict[str, int]:
    """Fills the disk cache with every variant of `patterns` on `arch`.

    Returns counts: variants, compiled (new entries), cached (entries that were there)."""
    return compile_variants(arch, variants(arch, patterns), jobs, progress)


def compile_variants(
    arch: str, todo: list[tuple[str, object]], jobs: int = 1, progress: bool = True
) -> dict[str, int]:
    """Fills the disk cache with the (label, spec) variants `todo` on `arch`; counts as
    precompile's."""
    if cache.cache_dir() is None:
        raise ValueError(f"the disk cache is off (${cache.CACHE_ENV}); nothing to fill")
    bar = Progress(len(todo)) if progress else None
    compiled = cached = 0
    jobs = min(jobs, len(todo))
    if jobs <= 1:
        results = (_compile_one(spec, arch) for _, spec in todo)
        executor = None
    else:
        # Separate processes: the DSL allows one compile at a time per process.
        executor = ProcessPoolExecutor(jobs, mp_context=get_context("spawn"))
        results = executor.map(_compile_one, [s for _, s in todo], [arch] * len(todo))
    try:
        for (label, _), (new, loaded) in zip(todo, results, strict=True):
            compiled += new
            cached += loaded
            if bar:
                bar.step(label)
    finally:
        if executor is not None:
            executor.shutdown()
    return {"variants": len(todo), "compiled": compiled, "cached": cached}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI's arguments (exits with usage on bad ones)."""
    parser = argparse.ArgumentParser(
        prog="python -m dmattn_cute.precompile",
        description="Compile dmattn_cute's kernels for a GPU architecture into the disk cache "
        "(no GPU needed). Loading them later on a GPU of that architecture takes milliseconds.",
    )
    parser.add_argument("--arch", required=True, choices=SUPPORTED_ARCHS)
    parser.add_argument(
        "--head-dims", type=int, nargs="+", default=list(DEFAULT_HEAD_DIMS), metavar="D"
    )
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help=f"cache directory (default: ${cache.CACHE_ENV}, else the user cache dir)",
    )
    parser.add_argument("--softcap", action="store_true", help="also softcap variants")
    parser.add_argument(
        "--deterministic", action="store_true", help="also deterministic backward variants"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        metavar="N",
        help="compile in N processes (default: the CPU count, here %(default)s)",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="also the decode steps of flash_dmattn_with_kvcache (one query per row)",
    )
    parser.add_argument(
        "--paged",
        action="store_true",
        help="with --decode: also those steps on a paged cache (block_table)",
    )
    parser.add_argument("--list", action="store_true", help="list the variants, compile none")
    args = parser.parse_args(argv)
    if args.paged and not args.decode:
        parser.error("--paged: only with --decode")
    if args.jobs < 1:
        parser.error(f"--jobs: expected N >= 1, got {args.jobs}")
    for head_dim in args.head_dims:
        if not (0 < head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0):
            parser.error(
                f"--head-dims: expected multiples of {HEAD_DIM_MULTIPLE} in "
                f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}], got {head_dim}"
            )
    return args


def patterns_of(args: argparse.Namespace) -> list[CallPattern | DecodePattern]:
    """The call patterns the parsed arguments select."""
    patterns: list[CallPattern | DecodePattern] = call_patterns(
        args.dtypes, args.head_dims, args.softcap, args.deterministic
    )
    if args.decode:
        patterns += decode_patterns(args.dtypes, args.head_dims, args.softcap, args.paged)
    return patterns


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cache_dir is not None:
        os.environ[cache.CACHE_ENV] = str(args.cache_dir)

    patterns = patterns_of(args)
    if args.list:
        listed = variants(args.arch, patterns)
        for label, spec in listed:
            print(f"{label}: {spec}")
        print(f"{len(listed)} kernel variants for {args.arch}")
        return 0
    start = time.perf_counter()
    counts = precompile(args.arch, patterns, args.jobs)
    print(
        f"{args.arch}: {counts['variants']} kernel variants, {counts['compiled']} compiled, "
        f"{counts['cached']} already cached, in {time.perf_counter() - start:.1f} s -> "
        f"{cache.cache_dir()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
