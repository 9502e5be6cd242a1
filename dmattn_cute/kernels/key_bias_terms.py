"""Key bias terms: a query-broadcast bias [Bm, Hm, 1, Sk] as one more k-step of the Hopper
forward's Q K^T.

For every key, bias * (1 / scale) rounded toward zero (as Scores rounds a bias: a finfo.min
bias stays finite) is split into three bf16 terms whose sum is that fp32 value to within
2^-21 of it (relative): hi and mid are its leading bits truncated to bf16 (truncation never
overflows), lo the rest, also truncated. The forward multiplies a (tile_m, 16) tile of ones
in columns 0-2 (and zeros) by the (tile_n, 16) tile of a key block's terms, one wgmma k-step
added to Q K^T, so S = Q K^T + bias / scale comes out of the GEMM and no consumer thread adds
the bias (FlashFwdSm90's bias_terms). An infinite bias is hi alone (mid = lo = 0): -inf
masks its key.

terms[bt, ht, key, 0:16] (bf16, written as 8 int32 words: word 0 = hi | mid << 16, word 1 =
lo, the rest 0), with Bt, Ht 1 on the bias's broadcast dims.

The pre-pass also flags every 32 keys whose biases are all moderate (MODERATE_BIAS: -inf or
|bias| <= 709, so |bias * log2 e| <= 1024) with a byte 1 (else 0), four to an int32 word per
128 keys (MODERATE_WORD where all four are set): a forward whose item reads only flagged keys
takes the bounded softmax (as without a bias: one FMA per score), and the exact one (the max
subtracted before scaling) otherwise, e.g. over a finfo.min padding bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass import cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..jit.arch import compile_options, dependent_launch
from ..jit.cache import compiled
from .launch import operand_spec
from .spec import OperandSpec, dtype_bytes, env_stream, fake_tensor
from .utils import mul_rz

NUM_THREADS = 128  # keys per CTA: one flags word
TERMS = 16  # columns of a terms row: one k16 step of the GEMM
WORDS = TERMS // 2
MODERATE_BIAS = 709.0  # the largest |bias| flagged moderate: |bias * log2 e| <= 1024
MODERATE_WORD = 0x01010101  # a flags word whose 128 keys are all moderate


@dataclass(frozen=True)
class KeyBiasTermsSpec:
    """One terms kernel variant (the compile-cache key): the bias view's stride pattern and
    dtype (any float dtype, any strides; read one element per key)."""

    bias: OperandSpec

    def __post_init__(self) -> None:
        if not self.bias.row_broadcast:
            raise ValueError("key bias terms: expected a query-broadcast bias [Bm, Hm, 1, Sk]")

    def example_args(self) -> list:
        """KeyBiasTerms's arguments for an offline compile."""
        flags = fake_tensor("u8", ("d", "d", "1"), 4, 4)  # written one byte per 32 keys
        return [self.bias.fake(), terms_fake(self.bias), flags, 1.0, env_stream()]

    def compile(self, arch: str, extra_options: str = ""):
        """cute.compile of this variant for `arch` (no GPU needed)."""
        return cute.compile(
            KeyBiasTerms(dependent_launch(arch)), *self.example_args(),
            options=compile_options(arch, extra_options),
        )  # fmt: skip


def _rows(bias: OperandSpec) -> tuple[str, str]:
    """The stride kinds of the batch and head dims of what the pre-pass writes for `bias`:
    stride 0 where the bias broadcasts (each row computed once)."""
    return tuple("0" if bias.strides[d] == "0" else "d" for d in (0, 1))


def terms_fake(bias: OperandSpec, dtype: str = "i32"):
    """The terms tensor as the kernels that read it see it offline: [Bt, Ht, Sk, 32 bytes] of
    `dtype` (the pre-pass writes int32 words, the forward reads bf16), 32-byte rows."""
    return fake_tensor(dtype, (*_rows(bias), "d", "1"), 16, 32 // dtype_bytes(dtype))


def moderate_fake(bias: OperandSpec):
    """The moderate flags as the forward reads them offline: int32 words [Bt, Ht, Sk / 128]
    (rounded up)."""
    return fake_tensor("i32", (*_rows(bias), "1"), 4)


@dsl_user_op
def _reinterpret(a, to: type, *, loc=None, ip=None):
    """The 32 bits of `a` as `to`: cutlass.Int32 (from an fp32) or cutlass.Float32 (from an
    int32)."""
    to_int = to is cutlass.Int32
    value = (cutlass.Float32 if to_int else cutlass.Int32)(a).ir_value(loc=loc, ip=ip)
    return to(
        llvm.inline_asm(
            T.i32() if to_int else T.f32(),
            [value],
            "mov.b32 $0, $1;",
            "=r,f" if to_int else "=f,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


_HIGH = -65536  # 0xFFFF0000: the bits of an fp32 that a bf16 keeps


class KeyBiasTerms:
    """One thread per key (CTAs of NUM_THREADS keys, per bias batch x head): one load, the
    split, one 32-byte row stored; each warp's vote on its 32 keys, one flag byte. On Hopper
    (`dependent`) the forward after it may launch at once: it waits in griddepcontrol before
    reading gmem."""

    def __init__(self, dependent: bool) -> None:
        self.dependent = dependent

    @cute.jit
    def __call__(
        self,
        mBias: cute.Tensor,  # [Bm, Hm, 1, Sk]
        mTerms: cute.Tensor,  # [Bt, Ht, Sk, WORDS] int32
        mFlags: cute.Tensor,  # [Bt, Ht, 4 x ceil(Sk / 128)] uint8
        bias_scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        grid = (cute.ceil_div(mTerms.shape[2], NUM_THREADS), mTerms.shape[1], mTerms.shape[0])
        self.kernel(mBias, mTerms, mFlags, bias_scale).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mBias: cute.Tensor, mTerms: cute.Tensor, mFlags: cute.Tensor,
        bias_scale: cutlass.Float32,
    ):  # fmt: skip
        if cutlass.const_expr(self.dependent):
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        key = n * NUM_THREADS + tidx
        moderate = cutlass.Boolean(True)  # (keys past Sk too: their flags pad the last word)
        if key < mTerms.shape[2]:
            bias = cutlass.Float32(mBias[b, h, 0, key])
            moderate = (bias == -cutlass.Float32.inf) | (
                (bias <= MODERATE_BIAS) & (bias >= -MODERATE_BIAS)
            )
            value = mul_rz(bias, bias_scale)
            hi = _reinterpret(value, cutlass.Int32) & _HIGH
            rest = value - _reinterpret(hi, cutlass.Float32)
            if rest != rest:  # noqa: PLR0124 (an infinity, or NaN, is hi alone)
                rest = cutlass.Float32(0.0)
            mid = _reinterpret(rest, cutlass.Int32) & _HIGH
            lo = _reinterpret(rest - _reinterpret(mid, cutlass.Float32), cutlass.Int32) & _HIGH
            row = cute.make_rmem_tensor((WORDS,), cutlass.Int32)
            row.fill(0)
            row[0] = ((hi >> 16) & 0xFFFF) | mid
            row[1] = (lo >> 16) & 0xFFFF
            words = mTerms[b, h, key, None].iterator  # 32-byte aligned: two 16-byte stores
            cute.autovec_copy(row, cute.make_tensor(words, cute.make_layout(WORDS)))
        flag = cutlass.Uint8(1) if cute.arch.vote_all_sync(moderate) else cutlass.Uint8(0)
        if cute.arch.lane_idx() == 0:
            mFlags[b, h, tidx // 32 + n * (NUM_THREADS // 32)] = flag


def terms_source(bias: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """What the pre-pass reads of a bias kernel view [Bm, Hm, 1, Km]: the view, or with Km = 1
    (a bias broadcast over the keys too) its expansion to all seqlen_k keys."""
    return bias.expand(*bias.shape[:3], seqlen_k) if bias.shape[3] == 1 else bias


def terms_spec(bias: torch.Tensor, seqlen_k: int) -> KeyBiasTermsSpec:
    """The variant for a bias kernel view [Bm, Hm, 1, Km] (launch.operand_view)."""
    source = terms_source(bias, seqlen_k)
    return KeyBiasTermsSpec(operand_spec(source, source.shape[3]))


def key_bias_terms(
    bias: torch.Tensor, bias_scale: float, arch: str, seqlen_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The terms and moderate flags of a bias kernel view [Bm, Hm, 1, Km] for the forward:
    bf16 [Bm, Hm, Sk, TERMS] (Sk: Km, or seqlen_k where Km = 1) and int32 [Bm, Hm, Sk / 128
    rounded up] (byte i of word w: keys 128 w + 32 i .. + 31, 1 where all are moderate; bytes
    past Sk 1), stride 0 on the bias's broadcast dims (each computed once)."""
    return launch_terms(compiled(terms_spec(bias, seqlen_k), arch), bias, bias_scale, seqlen_k)


def launch_terms(
    kernel, bias: torch.Tensor, bias_scale: float, seqlen_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """key_bias_terms by the compiled pre-pass of terms_spec(bias, seqlen_k) (the forward
    launch's plan holds it)."""
    bias = terms_source(bias, seqlen_k)
    shape, stride = bias.shape, bias.stride()
    written = (1 if stride[0] == 0 else shape[0], 1 if stride[1] == 0 else shape[1])  # rows
    keys, device = shape[3], bias.device
    words = torch.empty((*written, keys, WORDS), dtype=torch.int32, device=device)
    flags = torch.empty((*written, -(-keys // NUM_THREADS)), dtype=torch.int32, device=device)
    kernel(bias, words, flags.view(torch.uint8), bias_scale)
    terms = words.view(torch.bfloat16)
    rows = shape[:2]
    if rows == written:  # no broadcast row: no view op per call
        return terms, flags
    return terms.expand(*rows, *terms.shape[2:]), flags.expand(*rows, flags.shape[2])
