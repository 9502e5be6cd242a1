"""Where a short call's time goes: GPU time of the kernels one forward launches (torch.profiler)
next to the benchmark's timing (which includes any host gap before the launch) and the CPU
time to enqueue one call. A row whose benchmark time is far above its kernel time is
host-bound.

    python3 -m bench.kernel_time [--impls ours flex ...] [--only REGEX] [--per-kernel]

--per-kernel also lists each kernel's mean GPU time per call (the profiler's names, cut).

Workloads: the decode suite and the sparse suite's random-block masks at densities 0.1 and
0.05, causal and not.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench.peers import PEERS, Unsupported
from bench.run import host_ms, make_timer
from bench.workloads import SUITES, make_inputs

CALLS = 20


def workloads() -> list:
    sparse = [w for w in SUITES["sparse"]() if w.mask == "blocks" and w.density in (0.1, 0.05)]
    return SUITES["decode"]() + sparse


def kernel_ms(fn) -> tuple[float, list[tuple[str, float]]]:
    """Summed GPU time of the kernels one call launches, averaged over CALLS calls, and
    (name, ms per call) of each kernel, longest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    kernels = sorted(
        ((e.key, e.device_time_total / CALLS / 1e3) for e in prof.key_averages()
         if e.device_time_total > 0),
        key=lambda kv: -kv[1],
    )  # fmt: skip
    return sum(ms for _, ms in kernels), kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.kernel_time", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--impls", nargs="+", choices=tuple(PEERS), default=["ours", "flex"])
    parser.add_argument("--only", metavar="REGEX", help="workloads whose name matches REGEX")
    parser.add_argument("--per-kernel", action="store_true", help="each kernel's time too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.kernel_time: needs a CUDA GPU")
    _, timer = make_timer()
    print(f"{torch.cuda.get_device_name()}: ms per forward call")
    print(f"{'workload':50s} {'impl':8s} {'bench':>8s} {'kernels':>8s} {'host':>8s}")
    for w in workloads():
        if args.only and not re.search(args.only, w.name):
            continue
        x = make_inputs(w, "cuda")
        for name in args.impls:
            try:
                call = next(PEERS[name](x))[1]
                fn = torch.no_grad()(call)
                kernel_total, kernels = kernel_ms(fn)
                row = (timer(fn), kernel_total, host_ms(fn))
            except (Unsupported, StopIteration, RuntimeError) as e:
                print(f"{w.name:50s} {name:8s} not run: {str(e).splitlines()[0][:60]}")
                continue
            print(f"{w.name:50s} {name:8s} " + " ".join(f"{v:8.3f}" for v in row), flush=True)
            if args.per_kernel:
                for kernel, ms in kernels:
                    print(f"    {ms:8.4f}  {kernel[:100]}")
        del x
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
