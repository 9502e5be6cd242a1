"""Benchmark: dmattn_cute against SDPA (flash, memory-efficient, math), FlexAttention,
FlashAttention 2/4 and flash-dmattn, all in this process on the same inputs.

    python3 -m bench.run --out DIR [--quick] [--suites dense bias sparse decode]
                         [--modes fwd bwd fwdbwd] [--graph] [--list]  # on a GPU machine

Modes: fwd times the forward; bwd the backward alone (dq, dk, dv, and dbias where there is a
bias, from a retained graph); fwdbwd both. Before timing, each peer's output is compared with
ours; a peer whose output differs (relative error above REL_TOL) is reported, not timed.
Writes DIR/results.json (every measurement) and DIR/results.md (tables); `python3 -m
bench.report` turns results into the README's tables and plots. The kernels and the peers are
imported when first used, so --help and --list work without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.peers import OURS, PEERS, Unsupported
from bench.workloads import SUITES, Inputs, Workload, make_inputs, quick_workloads

MODES = ("fwd", "bwd", "fwdbwd")
# Backward GEMMs are 2.5 forwards: fwd 1, bwd 2.5, fwd+bwd 3.5.
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
REL_TOL = {"bf16": 2e-2, "fp16": 1e-2}


def error_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def peer_forward(result: dict, prefix: str, make_call, ours: torch.Tensor) -> None:
    """Into `result`: a peer's forward (make_call() builds its call) against our output
    `ours`, as {prefix}_rel_err and {prefix}_fwd_ms (events_median); or {prefix}_fwd_error
    where it does not build or run (a peer may not fit), which is reported, not fatal. For the
    one-shape scripts (bench.long_context, bench.varlen)."""
    try:
        call = make_call()
        with torch.no_grad():
            theirs = call().float()
        ours = ours.float()
        result[f"{prefix}_rel_err"] = ((theirs - ours).norm() / ours.norm()).item()
        result[f"{prefix}_fwd_ms"] = events_median(call)
    except (RuntimeError, ImportError, ValueError) as err:
        result[f"{prefix}_fwd_error"] = error_line(err)


def write_result(result: dict, out: str | None, filename: str) -> None:
    """Print a one-shape script's result as JSON, and write it to out/filename if out."""
    print(json.dumps(result, indent=1))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, filename), "w") as f:
            json.dump(result, f, indent=1)


def timed_call(call, x: Inputs, mode: str):
    """The callable that one timed iteration runs in `mode`, and the forward output where
    that callable does not return it (bwd)."""
    if mode == "fwd":
        return torch.no_grad()(call), None
    dout = torch.randn_like(x.q)
    if mode == "bwd":
        out = call()

        def backward():
            return torch.autograd.grad(out, x.leaves, dout, retain_graph=True)[0]

        return backward, out.detach()

    def forward_backward():
        out = call()
        torch.autograd.grad(out, x.leaves, dout)
        return out.detach()

    return forward_backward, None


def make_timer():
    try:
        from triton.testing import do_bench
    except ImportError:
        return "CUDA events, median of 30 after 5 warm-ups", events_median
    return "triton.testing.do_bench(warmup=25, rep=100), median", functools.partial(
        do_bench, warmup=25, rep=100, return_mode="median"
    )


# Read before each graph replay (graph_ms): more than L2, left clean (nothing to write back
# during the timed call, unlike do_bench's zero_ flush).
FLUSH_BYTES = 256 << 20


def graph_ms(fn, reps: int = 60) -> float:
    """GPU time of one call of fn: captured once in a CUDA graph and replayed `reps` times,
    each replay after a read of FLUSH_BYTES (a cold L2 with clean lines), timed by CUDA events
    around the replay alone; the median. No host time is in it: the time of rows whose
    benchmark time is host-bound (bench.report's †). fn has run before (warm-up, compile)."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        flush.sum(dtype=torch.int32)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def events_median(fn) -> float:
    for _ in range(5):
        fn()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(30)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


GPU_STATE_QUERY = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"


def gpu_state() -> str | None:
    """nvidia-smi's SM and memory clocks (MHz), temperature, power and active throttle
    reasons, as one CSV line (None where nvidia-smi cannot say): taken after each timing, so
    that a time that moves between runs can be told from a clock that moved."""
    try:
        index = torch.cuda.current_device()
        line = subprocess.run(
            ["nvidia-smi", f"--id={index}", f"--query-gpu={GPU_STATE_QUERY}",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return line or None


def host_ms(fn, calls: int = 20, warmup: int = 5) -> float:
    """CPU time to enqueue one call: where it nears the GPU time, the row is host-bound. After
    `warmup` calls, so that first-call work (the caching allocator growing, memoized plans)
    is not counted: without them a row read 1.45 ms of host time for a 0.98 ms median."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def peak_mib(fn) -> float:
    """Memory one call allocates beyond what is live before it (its outputs included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def executed_fraction(w: Workload, x: Inputs, mode: str) -> float | None:
    """Fraction of the dense-equivalent work in the tiles our kernels run (tiles with a visible
    key under the mask and causal band); None without a sparse mask."""
    if x.mask is None or w.mask == "dense":
        return None
    from dmattn_cute.jit import target_arch
    from dmattn_cute.precompile import planned_kernels

    # The tiles the launches pick, planned by the launches' own code.
    kernels = dict(
        planned_kernels(target_arch(x.q.device), x.q, x.k, x.v, x.mask, x.bias, w.causal)
    )
    fwd, bwd = kernels["fwd"].tile, kernels["bwd"].tile
    visible = x.mask
    sq, sk = w.seqlen_q, w.seqlen_k
    if w.causal:
        rows = torch.arange(sq, device=visible.device)[:, None] + (sk - sq)
        visible = visible & (torch.arange(sk, device=visible.device)[None, :] <= rows)

    def fraction(tm: int, tn: int) -> float:
        pq, pk = -sq % tm, -sk % tn
        padded = torch.nn.functional.pad(visible, (0, pk, 0, pq))
        b, h = padded.shape[:2]
        tiles = padded.view(b, h, (sq + pq) // tm, tm, (sk + pk) // tn, tn).any(5).any(3)
        # A tile computes its real rows and columns only (predicated tails, e.g. Sq = 1).
        rows = (sq - torch.arange(0, sq, tm, device=tiles.device)).clamp(max=tm)
        cols = (sk - torch.arange(0, sk, tn, device=tiles.device)).clamp(max=tn)
        executed = (tiles.double() * rows[:, None] * cols[None, :]).sum().item()
        return executed / (b * h * sq * sk / (2 if w.causal and sq == sk else 1))

    f_fwd, f_bwd = fraction(fwd.tile_m, fwd.tile_n), fraction(bwd.tile_m, bwd.tile_n)
    return {"fwd": f_fwd, "bwd": f_bwd, "fwdbwd": (f_fwd + 2.5 * f_bwd) / 3.5}[mode]


def our_variants(
    runs: list[tuple[Workload, str]], device: str, arch: str
) -> list[tuple[str, object]]:
    """(label, spec) of each distinct kernel our runs launch, planned on their inputs."""
    from dmattn_cute.precompile import planned_kernels

    backward: dict[Workload, bool] = {}
    for w, mode in runs:
        backward[w] = backward.get(w, False) or mode != "fwd"
    todo: dict[object, str] = {}
    for w, bwd in backward.items():
        x = make_inputs(w, device)
        for kind, spec in planned_kernels(
            arch,
            x.q,
            x.k,
            x.v,
            x.mask,
            x.bias,
            w.causal,
            deterministic=w.deterministic,
            backward=bwd,
        ):
            todo.setdefault(spec, f"{kind} {w.name}")
    return [(label, spec) for spec, label in todo.items()]


def compile_ours(runs: list[tuple[Workload, str]], jobs: int) -> dict:
    """Compiles our kernels for every run into the disk cache, `jobs` processes at a time, as a
    user would precompile them; the first calls then load them. What it did is reported."""
    from dmattn_cute.jit import cache, target_arch
    from dmattn_cute.precompile import compile_variants

    if cache.cache_dir() is None:
        return {"skipped": f"the disk cache is off (${cache.CACHE_ENV})"}
    start = time.perf_counter()
    arch = target_arch(torch.device("cuda"))
    todo = our_variants(runs, "cuda", arch)
    jobs = max(1, min(jobs, len(todo)))
    counts = compile_variants(arch, todo, jobs, progress=False)
    return {**counts, "jobs": jobs, "seconds": round(time.perf_counter() - start, 1)}


def run_workload(
    w: Workload, mode: str, timer, impls: list[str], graph: bool = False
) -> list[dict]:
    """Measurements of `w` in `mode` for each implementation, ours first; with `graph`, also
    graph_ms of ours (each of our variants, whose calls are capturable) and, in the fwd mode,
    of each peer (a failed capture is recorded as graph_error; not a peer's backward: a failed
    capture of FlexAttention's left torch's generator unusable)."""
    x = make_inputs(w, "cuda", grad=mode != "fwd")
    flops = FLOP_FACTOR[mode] * w.flops()
    fraction = executed_fraction(w, x, mode)
    density = None if x.mask is None else x.mask.float().mean().item()
    records, ref = [], None
    for name in impls:
        rec = {"workload": w.name, **asdict(w), "mode": mode, "impl": name,
               "mask_element_density": density}  # fmt: skip
        records.append(rec)
        try:
            candidates = PEERS[name](x)
            for note, call in candidates:
                try:
                    start = time.perf_counter()
                    fn, out = timed_call(call, x, mode)
                    first = fn()
                    torch.cuda.synchronize()
                    rec["first_call_s"] = time.perf_counter() - start
                    rec["note"] = note
                    break
                except Exception as e:  # noqa: BLE001 -- a failing candidate is reported
                    rec.setdefault("errors", []).append(f"{note or 'call'}: {error_line(e)}")
                    torch.cuda.empty_cache()
            else:
                rec.setdefault("skipped", "no candidate ran")
                continue
        except Unsupported as e:
            rec["skipped"] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 -- e.g. a peer's setup failing: reported
            rec["skipped"] = error_line(e)
            torch.cuda.empty_cache()
            continue
        out = first if out is None else out
        if name == OURS:
            ref = out.float()
        elif ref is not None:
            diff = out.float() - ref
            rec["max_diff"] = diff.abs().max().item()
            rec["rel_err"] = (diff.norm() / ref.norm()).item()
            if not rec["rel_err"] <= REL_TOL[w.dtype]:
                rec["skipped"] = f"output differs from ours: rel err {rec['rel_err']:.2e}"
                continue
        del out, first
        rec["ms"] = timer(fn)
        rec["gpu_state"] = gpu_state()
        rec["host_ms"] = host_ms(fn)
        rec["peak_mib"] = peak_mib(fn)
        # Not the bwd mode: its backward runs on the stream its forward ran on, outside the
        # capture (the legacy stream, which a capture may not depend on).
        if graph and name.startswith(OURS) and mode != "bwd":
            rec["graph_ms"] = graph_ms(fn)
        elif graph and mode == "fwd":  # a peer's GPU time, where its do_bench is host-bound
            try:
                rec["graph_ms"] = graph_ms(fn)
            except Exception as e:  # noqa: BLE001 -- reported with the row
                rec["graph_error"] = error_line(e)
        rec["tflops"] = flops / rec["ms"] * 1e-9
        if fraction is not None and name == OURS:
            rec["executed_tflops"] = fraction * flops / rec["ms"] * 1e-9
        print(_progress(rec), flush=True)
    del x, ref
    torch.cuda.empty_cache()
    ours_ms = records[0].get("ms")
    for rec in records:
        if ours_ms is not None and "ms" in rec:
            rec["speedup"] = rec["ms"] / ours_ms
    return records


def _progress(rec: dict) -> str:
    graph = f" (graph {rec['graph_ms']:.3f} ms)" if "graph_ms" in rec else ""
    if "graph_error" in rec:
        graph = f" (graph: {rec['graph_error']})"
    return (f"{rec['suite']:7s} {rec['mode']:6s} {rec['workload']:45s} {rec['impl']:15s} "
            f"{rec['ms']:9.3f} ms {rec['tflops']:7.1f} TFLOP/s{graph}")  # fmt: skip


def environment(timer_name: str, argv: list[str]) -> dict:
    def version(module: str) -> str:
        try:
            return __import__(module).__version__
        except Exception as e:  # noqa: BLE001 -- a missing optional package is reported
            return f"unavailable ({error_line(e)})"

    return {
        "gpu": torch.cuda.get_device_name(),
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "versions": {m: version(m) for m in ("torch", "cutlass", "tvm_ffi", "triton")},
        "python": platform.python_version(),
        "command": shlex.join(["python3", "-m", "bench.run", *argv]),
        "timer": timer_name,
    }


def selected(args) -> list[tuple[Workload, str]]:
    workloads = quick_workloads() if args.quick else [
        w for suite in args.suites for w in SUITES[suite]()
    ]  # fmt: skip
    if args.only:
        workloads = [w for w in workloads if re.search(args.only, w.name)]
    modes = ("fwd", "fwdbwd") if args.quick else args.modes
    # Decode has no backward.
    return [(w, m) for w in workloads for m in modes if w.suite != "decode" or m == "fwd"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, help="folder for results.json and results.md")
    parser.add_argument("--quick", action="store_true",
                        help="one workload of each kind at S=2k, fwd and fwdbwd (< 2 minutes)")  # fmt: skip
    parser.add_argument("--suites", nargs="+", choices=tuple(SUITES), default=list(SUITES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--only", metavar="REGEX", help="workloads whose name matches REGEX")
    parser.add_argument("--impls", nargs="+", choices=tuple(PEERS), default=list(PEERS),
                        help="implementations to run (ours is always first)")  # fmt: skip
    parser.add_argument("--compile-jobs", type=int, default=min(16, os.cpu_count() or 1),
                        help="processes that compile our kernels before timing (0: each "
                        "compiles in its first call, as the peers' do)")  # fmt: skip
    parser.add_argument("--graph", action="store_true",
                        help="also time our fwd and fwdbwd calls, and the peers' fwd calls, "
                        "by CUDA graph replay (graph_ms: GPU time, no host time)")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list the runs, measure nothing")
    args = parser.parse_args(argv)
    runs = selected(args)
    if args.list:
        for w, mode in runs:
            print(f"{w.suite:7s} {mode:6s} {w.name}")
        print(f"{len(runs)} runs")
        return 0
    if args.out is None:
        parser.error("--out is required unless --list")
    if not torch.cuda.is_available():
        sys.exit("bench.run: needs a CUDA GPU (torch.cuda.is_available() is False)")
    impls = [OURS] + [name for name in args.impls if name != OURS]
    timer_name, timer = make_timer()
    env = environment(timer_name, argv)
    if args.compile_jobs > 0:
        env["ours_compile"] = compile_ours(runs, args.compile_jobs)
    print(json.dumps(env, indent=1), flush=True)
    records = []
    results = {"environment": env, "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for w, mode in runs:
        records += run_workload(w, mode, timer, impls, args.graph)
        env["wall_s"] = round(time.perf_counter() - start, 1)
        # Written after every workload: a run cut short keeps what it measured.
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    from bench.report import markdown

    (args.out / "results.md").write_text(markdown([results]))
    print(f"{len(records)} measurements in {env['wall_s']} s; wrote {args.out}/results.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
