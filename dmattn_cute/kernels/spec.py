"""What every kernel family's spec is built from: dtype names, the compile-time facts of a mask
or bias operand, and the stand-in arguments of an offline compile.

No torch here: specs are built and compiled from names and stride patterns alone; the torch
side of a launch (kernels/launch.py) derives them from tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
from cutlass import cute

from .config import SmemOperand

# Element types by the names specs use.
DTYPES = {
    "bf16": cutlass.BFloat16,
    "fp16": cutlass.Float16,
    "fp32": cutlass.Float32,
    "u8": cutlass.Uint8,
    "i32": cutlass.Int32,
    "i64": cutlass.Int64,
}
LOG2E = math.log2(math.e)


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of the dtype named `dtype`."""
    return DTYPES[dtype].width // 8


@dataclass(frozen=True)
class OperandSpec:
    """Compile-time facts of a mask or bias tensor (a 4-D [Bm, Hm, Qm, Km] view).

    strides: per dim "0" (broadcast), "1" (unit) or "d" (any other stride, a runtime value).
    vec: elements per load along the keys, the widest the strides and alignment allow.
    """

    dtype: str
    strides: tuple[str, str, str, str]
    vec: int

    @property
    def row_broadcast(self) -> bool:
        return self.strides[2] == "0"

    @property
    def tma_tiles(self) -> bool:
        """Its (rows, keys) tiles, or the one row of a query-broadcast operand, can be TMA boxes
        (the Hopper forward): 16-bit elements (a 32-bit tile would leave no room for two
        stages), unit key stride, 16-byte aligned base and strides (vec of 8)."""
        return dtype_bytes(self.dtype) == 2 and self.strides[3] == "1" and self.vec == 8

    def smem(self, tma: bool = False) -> SmemOperand:
        """Its tiles' shared memory: padded rows for cp.async, or (tma) TMA boxes."""
        return SmemOperand(dtype_bytes(self.dtype), self.row_broadcast, tma)

    def fake(self):
        """The operand as an offline compile sees it: its stride pattern, dynamic strides and
        base aligned to `vec` elements (what launch.operand_spec found)."""
        return fake_tensor(self.dtype, self.strides, self.vec * dtype_bytes(self.dtype), self.vec)


def fake_tensor(dtype: str, strides: tuple[str, ...], align: int, stride_div: int = 1):
    """A compile-time stand-in for a gmem tensor: dynamic extents, the given stride pattern
    ("0", "1" or "d" per dim, as OperandSpec's), `align` bytes of base alignment and dynamic
    strides that are multiples of `stride_div` elements.

    The compiled function checks each tensor it is called with against this pattern. Give
    every argument its own fake: a shared one would make the call require equal shapes and
    strides of all the tensors passed for it.
    """
    stride = [{"0": 0, "1": 1}.get(kind) for kind in strides]
    stride = [cute.sym_int64(divisibility=stride_div) if s is None else s for s in stride]
    shape = [cute.sym_int32() for _ in strides]
    return cute.runtime.make_fake_tensor(
        DTYPES[dtype], tuple(shape), tuple(stride), assumed_align=align
    )


def fake_rows(dtype: str):
    """A [B, S, H, D] q/k/v-like tensor with 16-byte aligned rows: base and strides multiples
    of 16 bytes, D contiguous (what launch.qkv_view guarantees)."""
    return fake_tensor(dtype, ("d", "d", "d", "1"), 16, stride_div=16 // dtype_bytes(dtype))


def env_stream():
    """The compile-time stream argument: at call time TVM-FFI passes the caller's current
    torch stream (it is not an argument of the compiled function)."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
