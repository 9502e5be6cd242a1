"""Forward benchmark: dmattn_cute against SDPA (flash, memory-efficient), FlexAttention and FA4.

On a GPU machine, from the repository root (after `source .device/activate.sh`):

    python3 -m bench.run --out DIR [--quick]

Every implementation runs in this process on the same inputs; each peer's output is compared
with ours before it is timed. Prints a Markdown table and writes it to DIR/bench_fwd.md.
torch and the kernels are imported inside `main`, so `--help` works on any machine.
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

BATCH, HEADS, HEADS_KV, HEAD_DIM = 2, 16, 4, 128
SEQLEN, QUICK_SEQLEN = 4096, 2048
# Sparse masks are drawn in blocks of our forward tile at D=128 (128 queries x 64 keys), so a
# block density p leaves the kernel a fraction of about p of its tiles to compute.
BLOCK_Q, BLOCK_K = 128, 64
REL_TOL = 2e-2
OURS = "dmattn_cute"

Call = Callable[[], "Tensor"]
# An implementation yields (note, call) candidates for a workload, best first: the runner
# takes the first whose first call succeeds. Yielding nothing means "feature not supported".
Builder = Callable[["Inputs"], Iterator[tuple[str, Call]]]


@dataclass(frozen=True)
class Workload:
    name: str
    causal: bool = False
    bias: bool = False
    mask_density: float | None = None  # block density of the bool mask; None: no mask

    @property
    def sparse(self) -> bool:
        return self.mask_density is not None and self.mask_density < 1.0


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
    """What one timed call runs; FLOPs are the forward's times `flop_factor`."""

    flop_factor: float
    wrap: Callable[[Call], Call]


def _no_grad(fn: Call) -> Call:
    import torch

    return torch.no_grad()(fn)


MODES = {"fwd": Mode(1.0, _no_grad)}


@dataclass
class Inputs:
    q: Tensor  # [B, S, H, D]
    k: Tensor  # [B, S, Hkv, D]
    v: Tensor
    mask: Tensor | None  # bool [B, Hkv, S, S]
    bias: Tensor | None  # [B, Hkv, 1, S]
    causal: bool

    @property
    def group(self) -> int:
        return self.q.shape[2] // self.k.shape[2]


def block_sparse_mask(density: float, seqlen: int) -> Tensor:
    """A bool [B, Hkv, S, S] mask of random BLOCK_Q x BLOCK_K blocks visible with `density`."""
    import torch

    nq, nk = seqlen // BLOCK_Q, seqlen // BLOCK_K
    blocks = torch.rand(BATCH, HEADS_KV, nq, nk, device="cuda") < density
    # The key block at each query block's first row stays visible: no row is fully masked.
    rows = torch.arange(nq, device="cuda")
    blocks[:, :, rows, rows * BLOCK_Q // BLOCK_K] = True
    return blocks.repeat_interleave(BLOCK_Q, 2).repeat_interleave(BLOCK_K, 3)


def make_inputs(w: Workload, seqlen: int) -> Inputs:
    import torch

    torch.manual_seed(0)  # every workload sees the same q/k/v and bias
    dt = torch.bfloat16
    q = torch.randn(BATCH, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=dt)
    k, v = (
        torch.randn(BATCH, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=dt) for _ in range(2)
    )
    bias = torch.randn(BATCH, HEADS_KV, 1, seqlen, device="cuda", dtype=dt) if w.bias else None
    mask = None if w.mask_density is None else block_sparse_mask(w.mask_density, seqlen)
    return Inputs(q, k, v, mask, bias, w.causal)


def ours(x: Inputs) -> Iterator[tuple[str, Call]]:
    from dmattn_cute.attention import flash_dmattn_func

    yield (
        "",
        lambda: flash_dmattn_func(
            x.q, x.k, x.v, attn_mask=x.mask, attn_bias=x.bias, is_causal=x.causal
        ),
    )


def sdpa_flash(x: Inputs) -> Iterator[tuple[str, Call]]:
    if x.mask is not None or x.bias is not None:
        return
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))

    def run(key: Tensor, value: Tensor, gqa: bool) -> Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, key, value, is_causal=x.causal, enable_gqa=gqa)
        return out.transpose(1, 2)

    yield "enable_gqa", lambda: run(k, v, True)
    kr, vr = (t.repeat_interleave(x.group, dim=1) for t in (k, v))
    yield "k/v repeated to H heads", lambda: run(kr, vr, False)


def sdpa_efficient(x: Inputs) -> Iterator[tuple[str, Call]]:
    if x.bias is None:
        return
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = x.q.transpose(1, 2)
    k, v = (t.transpose(1, 2).repeat_interleave(x.group, dim=1) for t in (x.k, x.v))
    b, hkv, _, s = x.bias.shape
    additive = x.bias.expand(b, hkv, s, s)
    if x.mask is not None:
        additive = torch.where(x.mask, additive, float("-inf"))
    additive = additive.repeat_interleave(x.group, dim=1)  # [B, H, S, S], built once

    def run() -> Tensor:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, is_causal=x.causal)
        return out.transpose(1, 2)

    yield "float mask [B,H,S,S], k/v repeated", run


_flex_compiled: list[Callable] = []


def flex(x: Inputs) -> Iterator[tuple[str, Call]]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not _flex_compiled:
        # One score_mod/BlockMask block size per workload: more variants than the default.
        torch._dynamo.config.recompile_limit = 64
        _flex_compiled.append(torch.compile(flex_attention, dynamic=False))
    compiled = _flex_compiled[0]
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
    group, bias, mask = x.group, x.bias, x.mask
    b, h, s = q.shape[0], q.shape[1], q.shape[2]

    def add_bias(score, b_idx, h_idx, q_idx, kv_idx):
        return score + bias[b_idx, h_idx // group, 0, kv_idx]

    def run(block_mask) -> Tensor:
        out = compiled(
            q,
            k,
            v,
            score_mod=None if bias is None else add_bias,
            block_mask=block_mask,
            enable_gqa=True,
        )
        return out.transpose(1, 2)

    if x.causal:
        causal = create_block_mask(
            lambda b_idx, h_idx, q_idx, kv_idx: q_idx >= kv_idx, None, None, s, s, device=q.device
        )
        yield "causal BlockMask 128", lambda: run(causal)
    elif mask is None:
        yield "", lambda: run(None)
    else:

        def read_mask(b_idx, h_idx, q_idx, kv_idx):
            return mask[b_idx, h_idx // group, q_idx, kv_idx]

        # Our tile first (FlexAttention's kernel needs BLOCK_N | 64), else its default 128.
        for size in ((BLOCK_Q, BLOCK_K), (128, 128)):
            block_mask = create_block_mask(read_mask, b, h, s, s, device=q.device, BLOCK_SIZE=size)
            yield f"BlockMask {size[0]}x{size[1]}", lambda bm=block_mask: run(bm)


def fa4(x: Inputs) -> Iterator[tuple[str, Call]]:
    if x.mask is not None or x.bias is not None:
        return
    from flash_attn.cute import flash_attn_func

    def run() -> Tensor:
        out = flash_attn_func(x.q, x.k, x.v, causal=x.causal)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) in 4.0.0b36

    yield "", run


IMPLS: dict[str, Builder] = {
    OURS: ours,
    "sdpa-flash": sdpa_flash,
    "sdpa-efficient": sdpa_efficient,
    "flex": flex,
    "fa4": fa4,
}


@dataclass
class Measured:
    out: Tensor
    ms: float
    first_s: float
    peak_mib: float
    max_diff: float | None
    rel: float | None
    note: str


@dataclass
class Row:
    workload: str
    impl: str
    ms: float
    tflops: float
    exec_tflops: float | None
    speedup: float | None  # this row's time / ours
    first_s: float
    peak_mib: float
    max_diff: float | None
    rel: float | None
    note: str


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def make_timer() -> tuple[str, Callable[[Call], float]]:
    import torch

    try:
        from triton.testing import do_bench
    except ImportError:

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

        return "CUDA events, median of 30 after 5 warm-ups", events_median
    return (
        "triton.testing.do_bench(warmup=25, rep=100, median)",
        lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median"),
    )


def peak_mib(fn: Call) -> float:
    """Memory one call allocates beyond what is live before it (its output included)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_impl(
    name: str, x: Inputs, ref: Tensor | None, mode: Mode, timer, failures: list[str]
) -> Measured | None:
    """First call, comparison with `ref`, peak memory and timing of the first working candidate.

    None when the implementation does not run the workload; why, if it failed, is in `failures`.
    """
    import torch

    try:
        for note, call in IMPLS[name](x):
            fn = mode.wrap(call)
            try:
                start = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - start
            except Exception as e:  # a failed candidate falls through to the next one
                failures.append(f"{note or 'call'}: {_error(e)}")
                torch.cuda.empty_cache()
                continue
            max_diff = rel = None
            if ref is not None:
                diff = out.float() - ref.float()
                max_diff = diff.abs().max().item()
                rel = (diff.norm() / ref.float().norm()).item()
                del diff
            flagged = "MISMATCH" if rel is not None and rel > REL_TOL else ""
            text = "; ".join(t for t in (flagged, note, *failures) if t)
            return Measured(out, timer(fn), first_s, peak_mib(fn), max_diff, rel, text)
    except Exception as e:  # import errors, OOM while building a peer's inputs, ...
        failures.append(_error(e))
        torch.cuda.empty_cache()
    return None


def executed_flops(x: Inputs, tile_m: int, tile_n: int) -> float:
    """Forward FLOPs of the tiles with at least one visible key (the ones our kernel runs)."""
    b, hkv, sq, sk = x.mask.shape
    tiles = x.mask.view(b, hkv, sq // tile_m, tile_m, sk // tile_n, tile_n).any(5).any(3)
    return 4.0 * int(tiles.sum()) * x.group * tile_m * tile_n * HEAD_DIM


def our_tile(x: Inputs) -> tuple[int, int]:
    """Our forward tile for a mask + row-broadcast bias problem (as `fwd_spec` picks it)."""
    from dmattn_cute.jit.arch import target_arch
    from dmattn_cute.kernels.config import SmemOperand, fwd_tile, padded_head_dim

    tile = fwd_tile(
        target_arch(x.q.device),
        padded_head_dim(HEAD_DIM),
        x.q.element_size(),
        SmemOperand(1, row_broadcast=False),
        SmemOperand(x.bias.element_size(), row_broadcast=True),
    )
    return tile.tile_m, tile.tile_n


def bench_workload(
    w: Workload, seqlen: int, impls: list[str], mode: Mode, timer, notes: list[str]
) -> list[Row]:
    import torch

    x = make_inputs(w, seqlen)
    flops = mode.flop_factor * 4.0 * BATCH * HEADS * seqlen * seqlen * HEAD_DIM
    flops *= 0.5 if w.causal else 1.0
    exec_flops = None
    if w.sparse:
        tile_m, tile_n = our_tile(x)
        exec_flops = mode.flop_factor * executed_flops(x, tile_m, tile_n)
        density = x.mask.float().mean().item()
        notes.append(
            f"{w.name}: element density {density:.3f}, our tile {tile_m}x{tile_n}, "
            f"executed {exec_flops / flops:.3f} of the dense FLOPs"
        )
    rows: list[Row] = []
    ref = ours_ms = None
    for name in impls:
        failures: list[str] = []
        m = run_impl(name, x, ref, mode, timer, failures)
        if m is None:
            if failures:
                notes.append(f"{w.name}, {name} failed: " + "; ".join(failures))
            continue
        exec_tflops = None
        if name == OURS:
            ref, ours_ms = m.out, m.ms
            exec_tflops = None if exec_flops is None else exec_flops / m.ms * 1e-9
        row = Row(
            w.name,
            name,
            m.ms,
            flops / m.ms * 1e-9,
            exec_tflops,
            None if ours_ms is None else m.ms / ours_ms,
            m.first_s,
            m.peak_mib,
            m.max_diff,
            m.rel,
            m.note,
        )
        del m
        print(format_row(row), flush=True)
        rows.append(row)
    del x, ref
    torch.cuda.empty_cache()
    return rows


COLUMNS = (
    "workload",
    "impl",
    "ms",
    "TFLOP/s (dense-eq)",
    "TFLOP/s (executed)",
    "ours speedup",
    "first call s",
    "peak MiB",
    "max diff vs ours",
    "rel err",
    "note",
)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_row(r: Row) -> str:
    cells = (
        r.workload,
        r.impl,
        _num(r.ms, ".3f"),
        _num(r.tflops, ".1f"),
        _num(r.exec_tflops, ".1f"),
        _num(r.speedup, ".2f") + ("x" if r.speedup else ""),
        _num(r.first_s, ".2f"),
        _num(r.peak_mib, ".0f"),
        _num(r.max_diff, ".2e"),
        _num(r.rel, ".2e"),
        r.note,
    )
    return "| " + " | ".join(cells) + " |"


def summary(rows: list[Row]) -> list[str]:
    """The issue's three targets, PASS/MISS where both rows ran."""
    ms = {(r.workload, r.impl): r.ms for r in rows}
    checks = (
        (
            "no-bias dense: ours TFLOP/s / sdpa-flash TFLOP/s",
            ">=",
            0.9,
            (DENSE.name, "sdpa-flash"),
            (DENSE.name, OURS),
        ),
        (
            "bias + dense mask time / no-bias dense time (ours)",
            "<=",
            1.2,
            (BIAS_DENSE_MASK.name, OURS),
            (DENSE.name, OURS),
        ),
        (
            "block density 0.25 time / bias + dense mask time (ours)",
            "<=",
            0.35,
            (SPARSE_025.name, OURS),
            (BIAS_DENSE_MASK.name, OURS),
        ),
    )
    lines = []
    for label, op, target, num, den in checks:
        if num not in ms or den not in ms:
            lines.append(f"- {label}: not measured")
            continue
        ratio = ms[num] / ms[den]
        ok = ratio >= target if op == ">=" else ratio <= target
        lines.append(f"- {label}: {ratio:.3f} (target {op} {target}) {'PASS' if ok else 'MISS'}")
    return lines


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as e:  # a missing optional package is reported, not fatal
        return f"unavailable ({_error(e)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_<mode>.md")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"S={QUICK_SEQLEN} and only: " + ", ".join(w.name for w in QUICK_WORKLOADS),
    )
    parser.add_argument("--mode", choices=sorted(MODES), default="fwd", help="what is timed")
    parser.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help=f"comma-separated subset of {','.join(IMPLS)} ({OURS} always runs)",
    )
    args = parser.parse_args(argv)
    impls = [OURS] + [n for n in IMPLS if n != OURS and n in args.impls.split(",")]

    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    mode = MODES[args.mode]
    seqlen = QUICK_SEQLEN if args.quick else SEQLEN
    timer_name, timer = make_timer()
    command = shlex.join(["python3", "-m", "bench.run", *sys.argv[1:]])
    header = [
        f"# dmattn_cute benchmark: {args.mode}",
        "",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        f"- torch {torch.__version__}, cutlass DSL {_version('cutlass')}, "
        f"triton {_version('triton')}",
        f"- command: `{command}`",
        f"- shape: B={BATCH} H={HEADS} Hkv={HEADS_KV} S={seqlen} D={HEAD_DIM} bf16; "
        f"bias [B,Hkv,1,S]; mask bool [B,Hkv,S,S] of random {BLOCK_Q}x{BLOCK_K} "
        "(queries x keys) blocks, the block at each query block's diagonal always visible",
        f"- timing: {timer_name}; first call (compile + warm-up) reported separately",
        "- ours speedup: the row's time / ours (>1: ours is faster)",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    print("\n".join(header), flush=True)
    rows: list[Row] = []
    notes: list[str] = []
    for w in QUICK_WORKLOADS if args.quick else WORKLOADS:
        rows += bench_workload(w, seqlen, impls, mode, timer, notes)
    footer = ["", "## Targets", "", *summary(rows), "", "## Notes", "", *(f"- {n}" for n in notes)]
    print("\n".join(footer), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_{args.mode}.md"
    path.write_text("\n".join(header + [format_row(r) for r in rows] + footer) + "\n")
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
