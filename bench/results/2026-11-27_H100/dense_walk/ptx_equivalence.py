import sys, os, glob
from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
from dmattn_cute.kernels.spec import OperandSpec
RB = OperandSpec("bf16", ("d", "d", "0", "1"), 8)
M = OperandSpec("u8", ("d", "d", "d", "1"), 16)
KM = OperandSpec("u8", ("0", "0", "0", "1"), 16)
FB = OperandSpec("bf16", ("d", "d", "d", "1"), 8)
cases = {
    "mask_rowbias": dict(mask=M, bias=RB),
    "mask_fullbias_window": dict(mask=M, bias=FB, has_window=True),
    "keymask_ordered": dict(mask=KM, bias=RB, block_mask=True),
    "decode": dict(mask=OperandSpec("u8", ("d", "d", "0", "1"), 16), bias=RB, short_queries=True),
    "nomask": dict(mask=None, bias=RB),
}
out = sys.argv[1]
for name, c in cases.items():
    c = dict(c)
    spec = Sm90FwdSpec.build("sm_90a", "bf16", 128, c.pop("mask"), c.pop("bias"), c.pop("has_window", False), False, **c)
    d = f"{out}/{name}"; os.makedirs(d, exist_ok=True)
    spec.compile("sm_90a", f"--keep-ptx --dump-dir {d}")
    print(name, "ok", flush=True)
