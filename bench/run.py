"""Forward benchmark: dmattn_cute against SDPA (flash, memory-efficient), FlexAttention and FA4.

On a GPU machine, from the repository root (after `source .device/activate.sh`):

    python3 -m bench.run --out DIR [--quick]

Every implementation runs in this process on the same inputs; each peer's output is compared
with ours before it is timed. Prints a Markdown table and writes it to DIR/bench_fwd.md.
The kernels and the peers are imported when used, so `--help` works on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH, HEADS, HEADS_KV, HEAD_DIM = 2, 16, 4, 128
SEQLEN, QUICK_SEQLEN = 4096, 2048
# Sparse masks are drawn in blocks of our forward tile at D=128 (128 queries x 64 keys), so a
# block density p leaves the kernel about a fraction p of its tiles to compute.
BLOCK_Q, BLOCK_K = 128, 64
REL_TOL = 2e-2
OURS = "dmattn_cute"

Call = Callable[[], Tensor]


@dataclass(frozen=True)
class Workload:
    name: str
    causal: bool = False
    bias: bool = False
    mask_density: float | None = None  # block density of the bool mask; None: no mask


DENSE = Workload("dense")
BIAS_DENSE_MASK = Workload("bias + dense mask", bias=True, mask_density=1.0)
SPARSE_025 = Workload("bias + mask 0.25", bias=True, mask_density=0.25)
WORKLOADS = (
    DENSE,
    Workload("dense causal", causal=True),
    Workload("bias", bias=True),
    BIAS_DENSE_MASK,
    Workload("bias + mask 0.5", bias=True, mask_density=0.5),
    SPARSE_025,
    Workload("bias + mask 0.1", bias=True, mask_density=0.1),
)
QUICK_WORKLOADS = (DENSE, BIAS_DENSE_MASK, SPARSE_025)


@dataclass(frozen=True)
class Mode:
    """What one timed call runs; its FLOPs are the forward's times `flop_factor`."""

    flop_factor: float
    wrap: Callable[[Call], Call]


MODES = {"fwd": Mode(1.0, lambda call: torch.no_grad()(call))}


@dataclass
class Inputs:
    q: Tensor  # [B, S, H, D]
    k: Tensor  # [B, S, Hkv, D], as v
    v: Tensor
    mask: Tensor | None  # bool [B, Hkv, S, S]
    bias: Tensor | None  # [B, Hkv, 1, S]
    causal: bool

    @property
    def group(self) -> int:
        return self.q.shape[2] // self.k.shape[2]


def block_sparse_mask(density: float, seqlen: int) -> Tensor:
    """A bool [B, Hkv, S, S] mask of random BLOCK_Q x BLOCK_K blocks, each visible w.p. density."""
    nq, nk = seqlen // BLOCK_Q, seqlen // BLOCK_K
    blocks = torch.rand(BATCH, HEADS_KV, nq, nk, device="cuda") < density
    # The key block at each query block's first row stays visible: no row is fully masked.
    rows = torch.arange(nq, device="cuda")
    blocks[:, :, rows, rows * BLOCK_Q // BLOCK_K] = True
    return blocks.repeat_interleave(BLOCK_Q, 2).repeat_interleave(BLOCK_K, 3)


def make_inputs(w: Workload, seqlen: int) -> Inputs:
    torch.manual_seed(0)  # every workload sees the same q/k/v and bias
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(BATCH, seqlen, HEADS, HEAD_DIM, **kw)
    k, v = (torch.randn(BATCH, seqlen, HEADS_KV, HEAD_DIM, **kw) for _ in range(2))
    bias = torch.randn(BATCH, HEADS_KV, 1, seqlen, **kw) if w.bias else None
    mask = None if w.mask_density is None else block_sparse_mask(w.mask_density, seqlen)
    return Inputs(q, k, v, mask, bias, w.causal)


# Each implementation yields (note, call) candidates for a workload, best first; the runner
# keeps the first whose first call succeeds. Yielding nothing means "feature not supported".


def ours(x: Inputs) -> Iterator[tuple[str, Call]]:
    from dmattn_cute.attention import flash_dmattn_func

    yield "", lambda: flash_dmattn_func(x.q, x.k, x.v, x.mask, x.bias, is_causal=x.causal)


def sdpa_flash(x: Inputs) -> Iterator[tuple[str, Call]]:
    if x.mask is not None or x.bias is not None:
        return
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))

    def run(key: Tensor, value: Tensor, gqa: bool) -> Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(
                q, key, value, is_causal=x.causal, enable_gqa=gqa
            )
        return out.transpose(1, 2)

    yield "enable_gqa", lambda: run(k, v, True)
    kr, vr = (t.repeat_interleave(x.group, dim=1) for t in (k, v))
    yield "k/v repeated to H heads", lambda: run(kr, vr, False)


def sdpa_efficient(x: Inputs) -> Iterator[tuple[str, Call]]:
    if x.bias is None:
        return
    q = x.q.transpose(1, 2)
    k, v = (t.transpose(1, 2).repeat_interleave(x.group, dim=1) for t in (x.k, x.v))
    b, hkv, _, s = x.bias.shape
    additive = x.bias.expand(b, hkv, s, s)
    if x.mask is not None:
        additive = torch.where(x.mask, additive, float("-inf"))
    additive = additive.repeat_interleave(x.group, dim=1)  # [B, H, S, S], built once

    def run() -> Tensor:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, additive, is_causal=x.causal)
        return out.transpose(1, 2)

    yield "float mask [B,H,S,S], k/v repeated", run


_flex_compiled: list[Callable] = []


def flex(x: Inputs) -> Iterator[tuple[str, Call]]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not _flex_compiled:
        # Each workload's score_mod and BlockMask is one more compiled variant.
        torch._dynamo.config.recompile_limit = 64
        _flex_compiled.append(torch.compile(flex_attention, dynamic=False))
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
    group, bias, mask = x.group, x.bias, x.mask
    b, h, s = q.shape[:3]

    def add_bias(score, b_idx, h_idx, q_idx, kv_idx):
        return score + bias[b_idx, h_idx // group, 0, kv_idx]

    def read_mask(b_idx, h_idx, q_idx, kv_idx):
        return mask[b_idx, h_idx // group, q_idx, kv_idx]

    def run(block_mask) -> Tensor:
        score_mod = None if bias is None else add_bias
        out = _flex_compiled[0](q, k, v, score_mod, block_mask, enable_gqa=True)
        return out.transpose(1, 2)

    if x.causal:
        causal = create_block_mask(lambda _b, _h, i, j: i >= j, None, None, s, s, "cuda")
        yield "causal BlockMask 128x128", lambda: run(causal)
    elif mask is None:
        yield "", lambda: run(None)
    else:
        # Our tile first (its kernel needs BLOCK_N to divide 64), else FlexAttention's default.
        for size in ((BLOCK_Q, BLOCK_K), (128, 128)):
            block_mask = create_block_mask(read_mask, b, h, s, s, "cuda", BLOCK_SIZE=size)
            yield f"BlockMask {size[0]}x{size[1]}", lambda bm=block_mask: run(bm)


def fa4(x: Inputs) -> Iterator[tuple[str, Call]]:
    if x.mask is not None or x.bias is not None:
        return
    from flash_attn.cute import flash_attn_func

    def run() -> Tensor:
        out = flash_attn_func(x.q, x.k, x.v, causal=x.causal)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) in 4.0.0b36

    yield "", run


IMPLS = {OURS: ours, "sdpa-flash": sdpa_flash, "sdpa-efficient": sdpa_efficient, "flex": flex,
         "fa4": fa4}  # fmt: skip


@dataclass
class Row:
    workload: str
    impl: str
    ms: float
    first_s: float  # the first call: compiles and warm-up
    peak_mib: float
    max_diff: float | None  # vs ours
    rel: float | None
    note: str
    tflops: float = 0.0  # dense-equivalent
    exec_tflops: float | None = None  # executed tiles only: ours, sparse rows
    speedup: float | None = None  # this row's time / ours


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def make_timer() -> tuple[str, Callable[[Call], float]]:
    try:
        from triton.testing import do_bench
    except ImportError:
        return "CUDA events, median of 30 after 5 warm-ups", events_median
    timer = lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    return "triton.testing.do_bench(warmup=25, rep=100, median)", timer


def events_median(fn: Call) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(30):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn: Call) -> float:
    """Memory one call allocates beyond what is live before it (its output included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_impl(
    name: str, w: Workload, x: Inputs, ref: Tensor | None, mode: Mode, timer, errors: list[str]
) -> tuple[Row, Tensor] | None:
    """First call, comparison with `ref`, peak memory and timing of the first working candidate.

    None when the implementation does not run the workload; why, if it failed, is in `errors`.
    """
    # Broad excepts: one peer failing (compile error, OOM, missing package) must not end the run.
    try:
        for note, call in IMPLS[name](x):
            fn = mode.wrap(call)
            try:
                start = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - start
            except Exception as e:  # noqa: BLE001
                errors.append(f"{note or 'call'}: {_error(e)}")
                torch.cuda.empty_cache()
                continue
            max_diff = rel = None
            if ref is not None:
                diff = out.float() - ref.float()
                max_diff = diff.abs().max().item()
                rel = (diff.norm() / ref.float().norm()).item()
            flag = "MISMATCH" if rel is not None and rel > REL_TOL else ""
            note = "; ".join(t for t in (flag, note, *errors) if t)
            row = Row(w.name, name, timer(fn), first_s, peak_mib(fn), max_diff, rel, note)
            return row, out
    except Exception as e:  # noqa: BLE001
        errors.append(_error(e))
        torch.cuda.empty_cache()
    return None


def our_tile(x: Inputs) -> tuple[int, int]:
    """Our forward tile for a mask + row-broadcast bias problem (as `fwd_spec` picks it)."""
    from dmattn_cute.jit.arch import target_arch
    from dmattn_cute.kernels.config import SmemOperand, fwd_tile, padded_head_dim

    mask, bias = SmemOperand(1, False), SmemOperand(x.bias.element_size(), True)
    tile = fwd_tile(target_arch(x.q.device), padded_head_dim(HEAD_DIM), 2, mask, bias)
    return tile.tile_m, tile.tile_n


def executed_flops(x: Inputs, tile_m: int, tile_n: int) -> float:
    """Forward FLOPs of the tiles with at least one visible key (the ones our kernel runs)."""
    b, hkv, sq, sk = x.mask.shape
    tiles = x.mask.view(b, hkv, sq // tile_m, tile_m, sk // tile_n, tile_n).any(5).any(3)
    return 4.0 * int(tiles.sum()) * x.group * tile_m * tile_n * HEAD_DIM


def bench_workload(
    w: Workload, seqlen: int, impls: list[str], mode: Mode, timer, notes: list[str]
) -> list[Row]:
    x = make_inputs(w, seqlen)
    flops = mode.flop_factor * 4.0 * BATCH * HEADS * seqlen * seqlen * HEAD_DIM
    flops *= 0.5 if w.causal else 1.0
    exec_flops = None
    if w.mask_density is not None and w.mask_density < 1.0:
        tile_m, tile_n = our_tile(x)
        exec_flops = mode.flop_factor * executed_flops(x, tile_m, tile_n)
        notes.append(
            f"{w.name}: element density {x.mask.float().mean().item():.3f}; our tile "
            f"{tile_m}x{tile_n} runs {exec_flops / flops:.3f} of the dense FLOPs"
        )
    rows: list[Row] = []
    ref = ours_ms = None
    for name in impls:
        errors: list[str] = []
        done = run_impl(name, w, x, ref, mode, timer, errors)
        if done is None:
            notes.extend(f"{w.name}: {name} failed: {e}" for e in errors)
            continue
        row, out = done
        row.tflops = flops / row.ms * 1e-9
        if name == OURS:
            ref, ours_ms = out, row.ms
            if exec_flops is not None:
                row.exec_tflops = exec_flops / row.ms * 1e-9
        del out
        row.speedup = None if ours_ms is None else row.ms / ours_ms
        print(format_row(row), flush=True)
        rows.append(row)
    del x, ref
    torch.cuda.empty_cache()
    return rows


COLUMNS = ("workload", "impl", "ms", "TFLOP/s (dense-eq)", "TFLOP/s (executed)",
           "ours speedup", "first call s", "peak MiB", "max diff vs ours", "rel err",
           "note")  # fmt: skip


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_row(r: Row) -> str:
    cells = (r.workload, r.impl, _num(r.ms, ".3f"), _num(r.tflops, ".1f"),
             _num(r.exec_tflops, ".1f"), _num(r.speedup, ".2f"), _num(r.first_s, ".2f"),
             _num(r.peak_mib, ".0f"), _num(r.max_diff, ".2e"), _num(r.rel, ".2e"),
             r.note)  # fmt: skip
    return "| " + " | ".join(cells) + " |"


# The targets: (label, numerator row, denominator row, target, the ratio must be <=).
TARGETS = (
    ("no-bias dense, sdpa-flash time / ours (= TFLOP/s ratio)", (DENSE.name, "sdpa-flash"),
     (DENSE.name, OURS), 0.9, False),
    ("ours, bias + dense mask time / no-bias dense time", (BIAS_DENSE_MASK.name, OURS),
     (DENSE.name, OURS), 1.2, True),
    ("ours, block density 0.25 time / bias + dense mask time", (SPARSE_025.name, OURS),
     (BIAS_DENSE_MASK.name, OURS), 0.35, True),
)  # fmt: skip


def summary(rows: list[Row]) -> list[str]:
    ms = {(r.workload, r.impl): r.ms for r in rows}
    lines = []
    for label, num, den, target, at_most in TARGETS:
        if num not in ms or den not in ms:
            lines.append(f"- {label}: not measured")
            continue
        ratio = ms[num] / ms[den]
        ok = ratio <= target if at_most else ratio >= target
        op = "<=" if at_most else ">="
        lines.append(f"- {label}: {ratio:.3f} (target {op} {target}) {'PASS' if ok else 'MISS'}")
    return lines


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as e:  # noqa: BLE001 -- a missing optional package is reported, not fatal
        return f"unavailable ({_error(e)})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_<mode>.md")
    quick = ", ".join(w.name for w in QUICK_WORKLOADS)
    parser.add_argument("--quick", action="store_true", help=f"S={QUICK_SEQLEN}, only {quick}")
    parser.add_argument("--mode", choices=sorted(MODES), default="fwd", help="what is timed")
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help=f"comma-separated peers ({OURS} always runs)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.run: needs a CUDA GPU (torch.cuda.is_available() is False)")
    impls = [OURS] + [n for n in IMPLS if n != OURS and n in args.impls.split(",")]
    mode = MODES[args.mode]
    seqlen = QUICK_SEQLEN if args.quick else SEQLEN
    timer_name, timer = make_timer()
    now = datetime.datetime.now(datetime.timezone.utc)
    header = [
        f"# dmattn_cute benchmark: {args.mode}",
        "",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- date (UTC): {now:%Y-%m-%d %H:%M}",
        f"- torch {torch.__version__}, cutlass DSL {_version('cutlass')}, "
        + f"triton {_version('triton')}",
        f"- command: `{shlex.join(['python3', '-m', 'bench.run', *sys.argv[1:]])}`",
        f"- B={BATCH} H={HEADS} Hkv={HEADS_KV} S={seqlen} D={HEAD_DIM} bf16; bias [B,Hkv,1,S] "
        + f"random normal; masks bool [B,Hkv,S,S] of random {BLOCK_Q}x{BLOCK_K} (queries x "
        + "keys) blocks, each query block's diagonal block always visible",
        f"- timing: {timer_name}; the first call (compiles, warm-up) is reported apart",
        "- ours speedup: this row's time / ours (> 1: ours is faster)",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    print("\n".join(header), flush=True)
    rows: list[Row] = []
    notes: list[str] = []
    for w in QUICK_WORKLOADS if args.quick else WORKLOADS:
        rows += bench_workload(w, seqlen, impls, mode, timer, notes)
    footer = ["", "## Targets", "", *summary(rows), "", "## Notes", ""]
    footer += [f"- {n}" for n in notes]
    print("\n".join(footer), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_{args.mode}.md"
    path.write_text("\n".join(header + [format_row(r) for r in rows] + footer) + "\n")
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
