"""Forward + backward calls of a sparse-suite workload, for Nsight Compute or a host profile.

    ncu --clock-control none -k regex:FlashBwd -c 1 --section SpeedOfLight \\
        python3 -m bench.profile [--density D] [--blocks128] [--bias key|full]
    python3 -m bench.profile --host [--fwd] [--density D] [--blocks128 [--block-mask]] [--causal]
    python3 -m bench.profile --host --decode SK [--blocks128] [--kvcache]

Without --density: no mask, and the bias --bias names (none by default). With it: the sparse suite's random-block mask of that
density (bench/workloads.py; --blocks128: 128 x 128 blocks, --block-mask: given as a block
mask, as the bench's ours_block_mask) and a bias [B, Hkv, 1, S] with its gradient. Calls run
as the bench times them: --fwd without autograd, else forward + torch.autograd.grad. --host:
where the CPU time of one call goes (cProfile over many calls, and torch.profiler's CPU and
GPU time per op and kernel), for the rows the bench marks host-bound. --decode: the decode
suite's workload at that key length (one query per row, density 0.25), by
flash_dmattn_func or (--kvcache) flash_dmattn_with_kvcache.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats

import torch

from bench.workloads import Workload, make_inputs
from dmattn_cute import flash_dmattn_func


def host_profile(call, calls: int = 200) -> None:
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    print(f"cProfile, {calls} calls: per call, the top functions by own time and total time")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(40)

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(20):
            call()
        torch.cuda.synchronize()
    print("torch.profiler, 20 calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20))


def decode_call(seqlen_k: int, blocks128: bool, kvcache: bool):
    """One decode-suite call (one query per row, density 0.25) at that key length."""
    mask = "blocks128" if blocks128 else "blocks"
    x = make_inputs(Workload("decode", 8, 1, seqlen_k, bias="key", mask=mask, density=0.25), "cuda")
    if kvcache:
        from dmattn_cute import flash_dmattn_with_kvcache

        return functools.partial(
            flash_dmattn_with_kvcache, x.q, x.k, x.v, attn_mask=x.mask, attn_bias=x.bias
        )
    return functools.partial(flash_dmattn_func, x.q, x.k, x.v, x.mask, x.bias)


def training_call(args, parser: argparse.ArgumentParser):
    """One S4096 call as the bench times it: forward alone (--fwd) or forward + backward."""
    if args.density is not None:
        mask = "blocks128" if args.blocks128 else "blocks"
        w = Workload("sparse", 2, 4096, 4096, causal=args.causal, bias="key", mask=mask,
                     density=args.density)  # fmt: skip
    else:
        w = Workload("bias", 2, 4096, 4096, causal=args.causal, bias=args.bias)
    x = make_inputs(w, "cuda", grad=not args.fwd)
    if args.block_mask and x.blocks is None:
        parser.error("--block-mask needs --density and --blocks128")
    if args.bias and args.density is not None:
        parser.error("--bias is for calls without --density (those have a key bias)")
    masks = {"block_mask": x.blocks} if args.block_mask else {"attn_mask": x.mask}

    def forward() -> torch.Tensor:
        return flash_dmattn_func(x.q, x.k, x.v, attn_bias=x.bias, is_causal=w.causal, **masks)

    if args.fwd:
        return torch.no_grad()(forward)
    dout = torch.randn(x.q.shape, device=x.q.device, dtype=x.q.dtype)
    return lambda: torch.autograd.grad(forward(), x.leaves, dout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--density", type=float)
    parser.add_argument("--blocks128", action="store_true")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--block-mask", action="store_true")
    parser.add_argument("--bias", choices=("key", "full"))
    parser.add_argument("--fwd", action="store_true")
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--decode", type=int, metavar="SK")
    parser.add_argument("--kvcache", action="store_true")
    args = parser.parse_args()
    if args.decode is not None:
        call = decode_call(args.decode, args.blocks128, args.kvcache)
    else:
        call = training_call(args, parser)
    if args.host:
        host_profile(call)
    else:
        for _ in range(2):
            call()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
