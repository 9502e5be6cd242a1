"""Benchmark: dmattn_cute against SDPA (flash, memory-efficient), FlexAttention and FA4.

    python3 -m bench.run --out DIR [--quick] [--mode fwd|fwdbwd]   # GPU machine, repo root

fwd times the forward; fwdbwd times forward + backward (out.backward(dout)), with the bias
gradient wherever the workload has a bias.

All implementations run in this process on the same inputs; each peer's output is compared with
ours. Prints a Markdown table and writes it to DIR/bench_<mode>.md. The kernels and the peers
are imported when first used, so `--help` works on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
GROUP = HEADS // HEADS_KV
SEQLEN, QUICK_SEQLEN = 4096, 2048
# Sparse masks are drawn in 128 x 128 blocks, a multiple of our forward (128 x 64) and
# backward (64 x 128) tiles at D=128: a block density p leaves both about a fraction p of
# their tiles to compute.
BLOCK_Q, BLOCK_K = 128, 128
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


@dataclass
class Inputs:
    q: Tensor  # [B, S, H, D]
    k: Tensor  # [B, S, Hkv, D], as v
    v: Tensor
    mask: Tensor | None  # bool [B, Hkv, S, S]
    bias: Tensor | None  # [B, Hkv, 1, S]
    causal: bool
    grad: bool  # q, k, v and bias require grad (fwdbwd)


def forward_only(call: Call, x: Inputs) -> Call:
    return torch.no_grad()(call)


def forward_backward(call: Call, x: Inputs) -> Call:
    """out = call(); out.backward(dout): dq, dk, dv and dbias (fresh .grad each call)."""
    dout = torch.randn_like(x.q)
    leaves = [t for t in (x.q, x.k, x.v, x.bias) if t is not None]

    def run() -> Tensor:
        for t in leaves:
            t.grad = None
        out = call()
        out.backward(dout)
        return out.detach()

    return run


@dataclass(frozen=True)
class Mode:
    """What one timed call runs; its FLOPs are the forward's times `flop_factor` (the
    backward's five GEMMs are 2.5 forwards)."""

    flop_factor: float
    wrap: Callable[[Call, Inputs], Call]
    grad: bool


MODES = {
    "fwd": Mode(1.0, forward_only, False),
    "fwdbwd": Mode(3.5, forward_backward, True),
}


def block_sparse_mask(density: float, seqlen: int) -> Tensor:
    """A bool [B, Hkv, S, S] mask of random BLOCK_Q x BLOCK_K blocks, each visible w.p. density."""
    nq, nk = seqlen // BLOCK_Q, seqlen // BLOCK_K
    blocks = torch.rand(BATCH, HEADS_KV, nq, nk, device="cuda") < density
    # The key block at each query block's first row stays visible: no row is fully masked.
    rows = torch.arange(nq, device="cuda")
    blocks[:, :, rows, rows * BLOCK_Q // BLOCK_K] = True
    return blocks.repeat_interleave(BLOCK_Q, 2).repeat_interleave(BLOCK_K, 3)


def make_inputs(w: Workload, seqlen: int, grad: bool) -> Inputs:
    torch.manual_seed(0)  # every workload sees the same q/k/v and bias
    kw = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": grad}
    q = torch.randn(BATCH, seqlen, HEADS, HEAD_DIM, **kw)
    k, v = (torch.randn(BATCH, seqlen, HEADS_KV, HEAD_DIM, **kw) for _ in range(2))
    bias = torch.randn(BATCH, HEADS_KV, 1, seqlen, **kw) if w.bias else None
    mask = None if w.mask_density is None else block_sparse_mask(w.mask_density, seqlen)
    return Inputs(q, k, v, mask, bias, w.causal, grad)


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
            out = F.scaled_dot_product_attention(q, key, value, is_causal=x.causal, enable_gqa=gqa)
        return out.transpose(1, 2)

    yield "enable_gqa", lambda: run(k, v, True)
    kr, vr = (t.repeat_interleave(GROUP, dim=1) for t in (k, v))
    yield "k/v repeated to H heads", lambda: run(kr, vr, False)


def sdpa_efficient(x: Inputs) -> Iterator[tuple[str, Call]]:
    if x.bias is None:
        return

    def additive() -> Tensor:
        """The bias and mask as one float [B, H, S, S] mask (differentiable in the bias)."""
        add = x.bias.expand(-1, -1, x.q.shape[1], -1)
        if x.mask is not None:
            add = torch.where(x.mask, add, float("-inf"))
        return add.repeat_interleave(GROUP, dim=1)

    fixed = None if x.grad else additive()  # forward only: built once, outside the timing

    def run() -> Tensor:
        q = x.q.transpose(1, 2)
        k, v = (t.transpose(1, 2).repeat_interleave(GROUP, dim=1) for t in (x.k, x.v))
        add = additive() if fixed is None else fixed
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, add, is_causal=x.causal)
        return out.transpose(1, 2)

    note = "float mask [B,H,S,S], k/v repeated"
    yield note + (" (built in the timed call, for dbias)" if x.grad else ""), run


_flex: list[Callable] = []  # torch.compile(flex_attention), made once


def flex(x: Inputs) -> Iterator[tuple[str, Call]]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not _flex:
        # Each workload's score_mod and BlockMask is one more compiled variant.
        torch._dynamo.config.recompile_limit = 64
        _flex.append(torch.compile(flex_attention, dynamic=False))
    bias, mask, s = x.bias, x.mask, x.q.shape[1]

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h // GROUP, 0, kv_idx]

    def run(block_mask) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
        score_mod = None if bias is None else add_bias
        return _flex[0](q, k, v, score_mod, block_mask, enable_gqa=True).transpose(1, 2)

    if x.causal:
        causal = create_block_mask(lambda _b, _h, i, j: i >= j, None, None, s, s, "cuda")
        yield "causal BlockMask 128x128", lambda: run(causal)
    elif mask is None:
        yield "", lambda: run(None)
    else:
        for size in ((BLOCK_Q, BLOCK_K),):
            block_mask = create_block_mask(
                lambda b, h, i, j: mask[b, h // GROUP, i, j], BATCH, HEADS, s, s, "cuda", size
            )
            yield f"BlockMask {size[0]}x{size[1]}", lambda bm=block_mask: run(bm)


def fa4(x: Inputs) -> Iterator[tuple[str, Call]]:
    if x.mask is not None or x.bias is not None:
        return
    from flash_attn.cute import flash_attn_func

    # flash_attn_func returns (out, lse) in 4.0.0b36.
    yield "", lambda: flash_attn_func(x.q, x.k, x.v, causal=x.causal)[0]


IMPLS = {OURS: ours} | {f.__name__: f for f in (sdpa_flash, sdpa_efficient, flex, fa4)}


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def make_timer() -> tuple[str, Callable[[Call], float]]:
    try:
        from triton.testing import do_bench
    except ImportError:
        return "CUDA events, median of 30 after 5 warm-ups", events_median
    timer = functools.partial(do_bench, warmup=25, rep=100, return_mode="median")
    return "triton.testing.do_bench(warmup=25, rep=100), median", timer


def events_median(fn: Call) -> float:
    for _ in range(5):
        fn()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(30)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def host_ms(fn: Call, calls: int = 20) -> float:
    """CPU time to enqueue one call (no synchronization inside the loop): when it exceeds the
    GPU time, the timed ms measure the host, not the kernels."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def peak_mib(fn: Call) -> float:
    """Memory one call allocates beyond what is live before it (its output included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(
    candidates: Iterator[tuple[str, Call]], x: Inputs, mode: Mode, timer, errors: list[str]
) -> tuple[Tensor, float, float, float, float, str] | None:
    """(first output, ms, first-call s, host ms, peak MiB, note) of the first candidate that
    runs."""
    # Broad excepts: one peer failing (compile error, OOM, missing package) must not end the run.
    try:
        for note, call in candidates:
            fn = mode.wrap(call, x)
            try:
                start = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - start
            except Exception as e:  # noqa: BLE001
                errors.append(f"{note or 'call'}: {_error(e)}")
                torch.cuda.empty_cache()
                continue
            return out, timer(fn), first_s, host_ms(fn), peak_mib(fn), note
    except Exception as e:  # noqa: BLE001
        errors.append(_error(e))
        torch.cuda.empty_cache()
    return None


def executed_flops(x: Inputs) -> tuple[float, str]:
    """FLOPs of the tiles our kernel runs (those with a visible key), and that tile's size."""
    from dmattn_cute.jit.arch import target_arch
    from dmattn_cute.kernels.config import SmemOperand, fwd_tile, padded_head_dim

    # As `FwdSpec.build` tiles a bool mask and a row-broadcast bias.
    operands = SmemOperand(1, False), SmemOperand(x.bias.element_size(), True)
    tile = fwd_tile(target_arch(x.q.device), padded_head_dim(HEAD_DIM), 2, *operands)
    tm, tn = tile.tile_m, tile.tile_n
    b, hkv, sq, sk = x.mask.shape
    tiles = x.mask.view(b, hkv, sq // tm, tm, sk // tn, tn).any(5).any(3)
    return 4.0 * int(tiles.sum()) * GROUP * tm * tn * HEAD_DIM, f"{tm}x{tn}"


def bench_workload(
    w: Workload, seqlen: int, mode: Mode, timer, times: dict, notes: list[str]
) -> list[str]:
    """The table rows of `w`, ours first; records times[workload, impl] = ms."""
    x = make_inputs(w, seqlen, mode.grad)
    flops = mode.flop_factor * 4.0 * BATCH * HEADS * seqlen**2 * HEAD_DIM / (2 if w.causal else 1)
    exec_flops = None
    if w.mask_density is not None and w.mask_density < 1.0 and not mode.grad:
        exec_flops, tile = executed_flops(x)
        exec_flops *= mode.flop_factor
        density = x.mask.float().mean().item()
        notes.append(f"{w.name}: element density {density:.3f}, our tile {tile}")
    lines, ref = [], None
    for name, builder in IMPLS.items():
        errors: list[str] = []
        got = measure(builder(x), x, mode, timer, errors)
        notes.extend(f"{w.name}: {name}: {e}" for e in errors)
        if got is None:
            continue
        out, ms, first_s, host, peak, note = got
        max_diff = rel = exec_tflops = None
        if name == OURS:
            ref = out
            exec_tflops = None if exec_flops is None else exec_flops / ms * 1e-9
        elif ref is not None:
            diff = out.float() - ref.float()
            max_diff, rel = diff.abs().max().item(), (diff.norm() / ref.float().norm()).item()
            note = "; ".join(t for t in ("" if rel <= REL_TOL else "MISMATCH", note) if t)
        del out
        times[w.name, name] = ms
        ours_ms = times.get((w.name, OURS))
        speedup = None if ours_ms is None else ms / ours_ms
        values = (w.name, name, ms, flops / ms * 1e-9, exec_tflops, speedup, first_s, host, peak)
        lines.append(table_row((*values, max_diff, rel, note)))
        print(lines[-1], flush=True)
    del x, ref
    torch.cuda.empty_cache()
    return lines


# Column title -> format of that value in a row (None prints as "-").
COLUMNS = {
    "workload": "",
    "impl": "",
    "ms": ".3f",
    "TFLOP/s (dense-eq)": ".1f",
    "TFLOP/s (executed)": ".1f",
    "ours speedup": ".2f",
    "first call s": ".2f",
    "host ms": ".3f",
    "peak MiB": ".0f",
    "max diff vs ours": ".2e",
    "rel err": ".2e",
    "note": "",
}


def table_row(values: tuple) -> str:
    pairs = zip(values, COLUMNS.values(), strict=True)
    return "| " + " | ".join("-" if v is None else format(v, f) for v, f in pairs) + " |"


def summary(ms: dict, mode: str) -> list[str]:
    """The issues' targets, PASS/MISS where both rows of a ratio ran."""
    dense, full, sparse = DENSE.name, BIAS_DENSE_MASK.name, SPARSE_025.name
    checks = (  # label, numerator row, denominator row, comparison, target
        ("dense: ours / sdpa_flash TFLOP/s", (dense, "sdpa_flash"), (dense, OURS), ">=", 0.9),
        ("ours: bias + dense mask / dense time", (full, OURS), (dense, OURS), "<=", 1.2),
        ("ours: mask 0.25 / dense mask time (+bias)", (sparse, OURS), (full, OURS), "<=", 0.35),
    )
    if mode == "fwdbwd":
        checks = (
            ("dense: ours / sdpa_flash speed", (dense, "sdpa_flash"), (dense, OURS), ">=", 0.85),
            ("bias + dense mask: ours / sdpa_efficient speed", (full, "sdpa_efficient"),
             (full, OURS), ">=", 1.5),
            ("bias + dense mask: ours / flex speed", (full, "flex"), (full, OURS), ">=", 1.0),
            ("ours: mask 0.25 / dense mask time (+bias)", (sparse, OURS), (full, OURS), "<=", 0.4),
        )  # fmt: skip
    lines = []
    for label, num, den, op, target in checks:
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
    except Exception as e:  # noqa: BLE001 -- a missing optional package is reported, not fatal
        return f"unavailable ({_error(e)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_<mode>.md")
    quick = ", ".join(w.name for w in QUICK_WORKLOADS)
    parser.add_argument("--quick", action="store_true", help=f"S={QUICK_SEQLEN}, only {quick}")
    parser.add_argument("--mode", choices=sorted(MODES), default="fwd", help="what is timed")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.run: needs a CUDA GPU (torch.cuda.is_available() is False)")
    seqlen = QUICK_SEQLEN if args.quick else SEQLEN
    timer_name, timer = make_timer()
    versions = f"cutlass DSL {_version('cutlass')}, triton {_version('triton')}"
    header = [
        f"# dmattn_cute benchmark: {args.mode}",
        "",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        f"- torch {torch.__version__}, {versions}",
        f"- command: `{shlex.join(['python3', '-m', 'bench.run', *sys.argv[1:]])}`",
        f"- B={BATCH} H={HEADS} Hkv={HEADS_KV} S={seqlen} D={HEAD_DIM} bf16, bias [B,Hkv,1,S]",
        f"- masks: bool [B,Hkv,S,S], random {BLOCK_Q}x{BLOCK_K} (query x key) blocks, diagonal on",
        "- fwdbwd: forward + out.backward(dout); dq, dk, dv, and dbias where there is a bias",
        f"- timing: {timer_name}; the first call (compiles, warm-up) is reported apart",
        "- ours speedup: this row's time / ours (> 1: ours is faster)",
        "- host ms: CPU time to enqueue one call; where it nears ms the row is host-bound",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    print("\n".join(header), flush=True)
    lines, times, notes = [], {}, []
    for w in QUICK_WORKLOADS if args.quick else WORKLOADS:
        lines += bench_workload(w, seqlen, MODES[args.mode], timer, times, notes)
    footer = ["", "## Targets", "", *summary(times, args.mode), "", "## Notes", ""]
    footer += [f"- {n}" for n in notes]
    print("\n".join(footer), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_{args.mode}.md"
    path.write_text("\n".join(header + lines + footer) + "\n")
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
