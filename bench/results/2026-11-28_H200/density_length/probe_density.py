"""Forward time against density and sequence length (sparse suite's blocks128 workloads, key
bias, B * S = 8192 tokens at S4096, then B1): ours with the bool mask, ours given the block
mask, and FlexAttention, each row timed as bench.run times it (one process)."""

import json
import sys

from bench.run import make_timer, run_workload
from bench.workloads import Workload

_, timer = make_timer()
impls = sys.argv[1:] or ["ours", "ours_block_mask", "flex"]
for seqlen, batch in ((4096, 2), (8192, 1), (16384, 1)):
    for density in (1.0, 0.25, 0.05):
        w = Workload("sparse", batch, seqlen, seqlen, 128, bias="key", mask="blocks128",
                     density=density)  # fmt: skip
        for rec in run_workload(w, "fwd", timer, impls):
            keep = ("workload", "batch", "impl", "ms", "tflops", "skipped")
            print(json.dumps({k: rec[k] for k in keep if k in rec}), flush=True)
