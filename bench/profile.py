"""Two forward + backward calls of a sparse-suite workload, for Nsight Compute.

    ncu --clock-control none -k regex:FlashBwd -c 1 --section SpeedOfLight \\
        python3 -m bench.profile [DENSITY]

Without DENSITY: no mask, no bias. With it: the sparse suite's random-block mask of that
density (bench/workloads.py) and a bias [B, Hkv, 1, S] with its gradient.
"""

from __future__ import annotations

import sys

import torch

from bench.workloads import Workload, make_inputs
from dmattn_cute import flash_dmattn_func


def main() -> None:
    if len(sys.argv) > 1:
        w = Workload("sparse", 2, 4096, 4096, bias="key", mask="blocks", density=float(sys.argv[1]))
    else:
        w = Workload("dense", 2, 4096, 4096)
    x = make_inputs(w, "cuda", grad=True)
    for _ in range(2):
        out = flash_dmattn_func(x.q, x.k, x.v, x.mask, x.bias)
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
