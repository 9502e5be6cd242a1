"""Offline compiles of the kernels for every supported architecture (no GPU needed)."""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile

import pytest

from dmattn_cute.jit import SUPPORTED_ARCHS
from dmattn_cute.jit.arch import smem_capacity
from dmattn_cute.kernels.block_bits import BlockBitsSpec
from dmattn_cute.kernels.bwd import BwdSpec, DbiasSpec
from dmattn_cute.kernels.bwd_pre import BwdPreprocessSpec
from dmattn_cute.kernels.combine import CombineSpec
from dmattn_cute.kernels.config import smem_total
from dmattn_cute.kernels.fwd import FwdSpec, OperandSpec
from dmattn_cute.kernels.fwd_launch import forward_family
from dmattn_cute.kernels.key_bias_terms import KeyBiasTermsSpec
from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
from dmattn_cute.kernels.spec import dtype_bytes

pytestmark = [
    pytest.mark.compile,
    # A static loop the DSL finds too long to trace (it warns, then compiles slowly) fails here.
    pytest.mark.filterwarnings("error::cutlass.base_dsl.ast_helpers.DSLOptimizationWarning"),
]

FULL_MASK = OperandSpec("u8", ("d", "d", "d", "1"), 16)
KEY_BCAST_MASK = OperandSpec("u8", ("d", "0", "d", "0"), 1)
FULL_BIAS = OperandSpec("bf16", ("d", "d", "d", "1"), 8)
ROW_BIAS_FP32 = OperandSpec("fp32", ("d", "d", "0", "1"), 4)
UNALIGNED_BIAS = OperandSpec("bf16", ("0", "d", "d", "1"), 1)
# decode: a query-broadcast mask and bias row [B, Hkv, 1, Sk] (dmattn_cute/decode.py)
ROW_MASK = OperandSpec("u8", ("d", "d", "0", "1"), 16)
ROW_BIAS = OperandSpec("bf16", ("d", "d", "0", "1"), 8)

BWD_PRE_CASES = [
    pytest.param("fp16", 128, id="fp16-d128"),
    pytest.param("bf16", 40, id="bf16-d40"),
    pytest.param("bf16", 256, id="bf16-d256"),
]


def bwd_pre_ptx(target: str, dtype: str, head_dim: int) -> str:
    """PTX of the backward preprocess kernel compiled for ``target``. --keep-ptx writes the PTX
    into --dump-dir (which must exist); the compiled function's artifacts hold its text."""
    spec = BwdPreprocessSpec.build(dtype, head_dim)
    with tempfile.TemporaryDirectory() as dump_dir:
        kernel = spec.compile(target, f"--keep-ptx --dump-dir {dump_dir}")
        return kernel.artifacts.PTX


@pytest.mark.parametrize(("dtype", "head_dim"), BWD_PRE_CASES)
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_bwd_pre_ptx_targets_the_arch(
    target: str, dtype: str, head_dim: int, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ptx = bwd_pre_ptx(target, dtype, head_dim)
    assert re.findall(r"^\.target (\S+)", ptx, flags=re.MULTILINE) == [target]
    assert os.listdir(tmp_path) == [], "compiling left files in the working directory"


@pytest.mark.parametrize(("dtype", "head_dim"), BWD_PRE_CASES)
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_bwd_pre_loads_128_bit_vectors(target: str, dtype: str, head_dim: int) -> None:
    loads = re.findall(r"\bld\.global\.\S+", bwd_pre_ptx(target, dtype, head_dim))
    assert loads and all(".v4.b32" in load for load in loads), loads


@pytest.mark.parametrize(("dtype", "head_dim"), [("bf16", 128), ("fp16", 40), ("bf16", 256)])
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_combine_compiles(target: str, dtype: str, head_dim: int) -> None:
    """The split-KV combine: one kernel, no shared memory, for every architecture."""
    with tempfile.TemporaryDirectory() as dump_dir:
        ptx = (
            CombineSpec.build(dtype, head_dim)
            .compile(target, f"--keep-ptx --dump-dir {dump_dir}")
            .artifacts.PTX
        )
    assert re.findall(r"^\.target (\S+)", ptx, flags=re.MULTILINE) == [target]
    assert ".shared" not in ptx


def fwd_spec_for(
    target: str,
    head_dim: int,
    dtype: str = "bf16",
    mask: OperandSpec | None = FULL_MASK,
    bias: OperandSpec | None = FULL_BIAS,
    has_window: bool = False,
    has_softcap: bool = False,
) -> FwdSpec | Sm90FwdSpec:
    """The forward variant the launch picks on `target` (the Hopper kernel on sm_90a)."""
    family = forward_family(target)
    return family.build(target, dtype, head_dim, mask, bias, has_window, has_softcap)


# In the compiled module's host code the launch config is a struct (grid, block, dynamic
# shared memory bytes, stream, attributes, count); the kernel's shared memory is stored to its
# third field as a constant.
_LAUNCH_SMEM_FIELD = re.compile(
    r"(%\d+) = llvm\.getelementptr %\d+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, "
    r"!llvm\.struct<\(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32\)>"
)


def launch_smem_bytes(kernel) -> int:
    """The dynamic shared memory a compiled kernel is launched with (the DSL sums the kernel's
    SmemAllocator allocations)."""
    ir = str(kernel.ir_module)
    (field,) = _LAUNCH_SMEM_FIELD.findall(ir)
    (value,) = re.findall(rf"llvm\.store (%\d+), {field} : i64", ir)
    (size,) = re.findall(rf"{value} = llvm\.mlir\.constant\((\d+) : i64\)", ir)
    return int(size)


def fwd_ptx(target: str, spec: FwdSpec | BwdSpec, options: str = "") -> str:
    """PTX of the kernel of `spec`, whose shared memory must be the spec's buffers (what the
    tile search sized it by); `options`: more cute.compile options."""
    with tempfile.TemporaryDirectory() as dump_dir:
        kernel = spec.compile(target, f"--keep-ptx --dump-dir {dump_dir} {options}")
        assert launch_smem_bytes(kernel) == spec.smem_bytes()
        return kernel.artifacts.PTX


# cute.compile option: the DSL prints ptxas's remarks (spills, and C7512 where ptxas found too
# few registers to keep a warpgroup's wgmmas in flight and serialized them)
PTXAS_REMARKS = "remarks{ptx}"


def check_wgmma_not_serialized(capfd) -> None:
    """The compiles since the last capture (with PTXAS_REMARKS) kept their wgmmas asynchronous."""
    printed = "".join(capfd.readouterr())
    assert "ptxas" in printed  # the remarks came through
    assert "C7512" not in printed, "ptxas serialized the wgmmas (too few registers)"


def check_mma_sync_ptx(target: str, ptx: str) -> None:
    assert re.findall(r"^\.target (\S+)", ptx, flags=re.MULTILINE) == [target]
    assert "mma.sync.aligned.m16n8k16" in ptx
    assert "cp.async" in ptx and "ldmatrix" in ptx


def check_fwd_ptx(target: str, ptx: str) -> None:
    """The forward on sm_90a: TMA loads and store, wgmma, the producer's registers handed to
    the consumers; elsewhere the mma.sync kernel."""
    if target != "sm_90a":
        check_mma_sync_ptx(target, ptx)
        return
    assert re.findall(r"^\.target (\S+)", ptx, flags=re.MULTILINE) == [target]
    assert "wgmma.mma_async.sync.aligned" in ptx
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "mma.sync" not in ptx and "ldmatrix" not in ptx


@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [
        (32, "bf16"),
        (40, "fp16"),
        (64, "bf16"),
        (80, "fp16"),
        (96, "bf16"),
        (128, "fp16"),
        (160, "bf16"),
        (192, "fp16"),
        (256, "bf16"),
    ],
)
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_fwd_head_dims_compile(target: str, head_dim: int, dtype: str, capfd) -> None:
    spec = fwd_spec_for(target, head_dim, dtype)
    assert spec.smem_bytes() <= smem_capacity(target)
    hopper = target == "sm_90a"
    check_fwd_ptx(target, fwd_ptx(target, spec, PTXAS_REMARKS if hopper else ""))
    if hopper:
        check_wgmma_not_serialized(capfd)


@pytest.mark.parametrize("has_softcap", [False, True])
@pytest.mark.parametrize("has_window", [False, True])
@pytest.mark.parametrize(
    "bias", [None, FULL_BIAS, ROW_BIAS_FP32], ids=["nobias", "bias", "rowbias32"]
)
@pytest.mark.parametrize("mask", [None, FULL_MASK], ids=["nomask", "mask"])
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_fwd_flag_combinations_compile(target, mask, bias, has_window, has_softcap, capfd) -> None:
    spec = fwd_spec_for(
        target, 128, mask=mask, bias=bias, has_window=has_window, has_softcap=has_softcap
    )
    ptx = fwd_ptx(target, spec, PTXAS_REMARKS if target == "sm_90a" else "")
    check_fwd_ptx(target, ptx)
    if target == "sm_90a":
        check_wgmma_not_serialized(capfd)
        # causal/window limits: the Hopper forward maps its launch position longest first,
        # through the grid's extents, unless it is persistent (the launch sorts its items)
        assert ("%nctaid.y" in ptx) == (has_window and not spec.persistent)


@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_fwd_unaligned_operands_compile(target: str) -> None:
    # Sk odd: mask bytes and bf16 bias rows allow only element-wide, synchronous loads.
    spec = fwd_spec_for(target, 64, mask=KEY_BCAST_MASK, bias=UNALIGNED_BIAS, has_window=True)
    check_fwd_ptx(target, fwd_ptx(target, spec))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_bias_by_tma_compiles(head_dim: int) -> None:
    """A 16-bit bias with aligned rows comes by TMA, its broadcast dims left out of the TMA
    view (here batch); with softcap it is read after the cap, through registers."""
    bias = OperandSpec("fp16", ("0", "d", "d", "1"), 8)
    spec = fwd_spec_for("sm_90a", head_dim, "fp16", FULL_MASK, bias, True, True)
    assert spec.bias.tma_tiles
    ptx = fwd_ptx("sm_90a", spec)
    check_fwd_ptx("sm_90a", ptx)
    # Q, K, V (4-D views) and the bias ((Sq, Sk, heads): batch dropped) by TMA
    assert set(re.findall(r"cp\.async\.bulk\.tensor\.\dd", ptx)) == {
        "cp.async.bulk.tensor.3d",
        "cp.async.bulk.tensor.4d",
    }
    # rows only 8-byte aligned: the bias comes by cp.async like the mask
    cp_bias = OperandSpec("fp16", ("0", "d", "d", "1"), 4)
    spec = fwd_spec_for("sm_90a", head_dim, "fp16", FULL_MASK, cp_bias, True, True)
    assert not spec.bias.tma_tiles
    ptx = fwd_ptx("sm_90a", spec)
    assert set(re.findall(r"cp\.async\.bulk\.tensor\.\dd", ptx)) == {"cp.async.bulk.tensor.4d"}


def test_hopper_key_bias_row_by_tma_compiles() -> None:
    """A query-broadcast ([B, Hkv, 1, Sk]) 16-bit bias with aligned rows comes by TMA too: a box
    of one block's keys from the (Sk, heads, batch) view, on its own pipeline, with no
    cp.async tiles left when there is no mask; its smem stages are one row each, and one fp32
    row each that a producer warp converts them into (convert_row). (fp16: a bf16 forward
    takes the row as terms of Q K^T, test_hopper_key_bias_terms_compile.)"""
    bias = OperandSpec("fp16", ("d", "d", "0", "1"), 8)
    spec = fwd_spec_for("sm_90a", 128, "fp16", None, bias, False, False)
    assert spec.bias.tma_tiles and not spec.tile.bias_terms
    (buffer,) = [b for b in spec.smem_buffers() if b.name == "bias"]
    assert buffer.bytes == spec.tile.stages * -(-spec.tile.tile_n // 64) * 64 * 2
    (row,) = [b for b in spec.smem_buffers() if b.name == "bias_f32"]
    assert row.bytes == spec.tile.stages * spec.tile.tile_n * 4
    ptx = fwd_ptx("sm_90a", spec)
    check_fwd_ptx("sm_90a", ptx)
    assert set(re.findall(r"cp\.async\.bulk\.tensor\.\dd", ptx)) == {
        "cp.async.bulk.tensor.3d",
        "cp.async.bulk.tensor.4d",
    }
    assert "cp.async.ca.shared.global" not in ptx and "cp.async.cg.shared.global" not in ptx


def test_hopper_key_bias_terms_compile() -> None:
    """A bf16 forward with a [B, Hkv, 1, Sk] bias and no softcap reads the row as terms of
    Q K^T (kernels/key_bias_terms.py): their stages (16 bf16 per key) and the ones tile in
    smem, no bias row stages; the terms by TMA ((Sk, 16, heads, batch): 4-D) on K's barrier;
    one more wgmma k-step per Q K^T (9 at head dim 128, against 8 without a bias); without a
    mask the walk twice, with the bounded and the exact softmax, chosen by the moderate flags;
    the unmasked register split. With a mask too (one walk per form of its own, no flags),
    where the stages fit; a decode-sized call, a softcap or fp16 keep the row."""
    spec = fwd_spec_for("sm_90a", 128, "bf16", None, ROW_BIAS, False, False)
    tile = spec.tile
    assert tile.bias_terms and not tile.row_f32 and spec.persistent and spec.moderate_rows
    buffers = {b.name: b.bytes for b in spec.smem_buffers()}
    assert buffers["bias"] == tile.stages * tile.tile_n * 16 * 2
    assert buffers["ones"] == tile.tile_m * 16 * 2 and "bias_f32" not in buffers
    ptx = fwd_ptx("sm_90a", spec)
    check_fwd_ptx("sm_90a", ptx)
    assert set(re.findall(r"cp\.async\.bulk\.tensor\.\dd", ptx)) == {"cp.async.bulk.tensor.4d"}
    plain = fwd_ptx("sm_90a", fwd_spec_for("sm_90a", 128, "bf16", None, None, False, False))
    wgmmas = [len(re.findall(r"wgmma\.mma_async", text)) for text in (ptx, plain)]
    # two walks, each with one k-step more in its two Q K^T sites
    assert wgmmas[0] == 2 * (wgmmas[1] + 2)
    assert len(re.findall(r"vote\.sync\.all\.pred", ptx)) > len(
        re.findall(r"vote\.sync\.all\.pred", plain)
    )  # the flags' vote (and the exact walk's per-block one)
    found = set(re.findall(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx))
    assert found == {("dec", "24"), ("inc", "240")}
    masked = fwd_spec_for("sm_90a", 128, "bf16", FULL_MASK, ROW_BIAS, False, False)
    assert masked.tile.bias_terms and not masked.moderate_rows
    assert fwd_spec_for("sm_90a", 64, "bf16", None, ROW_BIAS, False, False).tile.tile_m == 192
    for dtype, softcap in (("fp16", False), ("bf16", True)):
        kept = fwd_spec_for("sm_90a", 128, dtype, None, ROW_BIAS, False, softcap)
        assert not kept.tile.bias_terms
    decode = Sm90FwdSpec.build(
        "sm_90a", "bf16", 128, None, ROW_BIAS, False, False, bias_terms=False
    )
    assert not decode.tile.bias_terms


def test_key_bias_terms_compile() -> None:
    """The terms pre-pass compiles offline for any bias dtype and stride pattern, with 16-byte
    stores of each key's row, a warp vote and one byte stored for the moderate flag of its 32
    keys, and (sm_90a) the dependent launch of the forward after it."""
    for dtype, strides, vec in (
        ("bf16", ("d", "d", "0", "1"), 8),
        ("fp32", ("0", "d", "0", "d"), 1),
    ):
        spec = KeyBiasTermsSpec(OperandSpec(dtype, strides, vec))
        with tempfile.TemporaryDirectory() as tmp:
            ptx = spec.compile("sm_90a", f"--keep-ptx --dump-dir {tmp}").artifacts.PTX
        assert ptx.count("st.global.v4.b32") == 2
        assert "vote.sync.all.pred" in ptx and "st.global.b8" in ptx
        assert "griddepcontrol.launch_dependents" in ptx


def test_hopper_dense_walk_register_split() -> None:
    """With mask tiles the forward sets its register split per walk: a dense walk (every key
    block full: no tile copies) the unmasked kernel's 24 / 240, a bits walk 40 / 232; without
    a mask one split."""

    def splits(ptx: str) -> set[tuple[str, int]]:
        found = re.findall(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx)
        return {(kind, int(n)) for kind, n in found}

    masked = fwd_spec_for("sm_90a", 128, "bf16", FULL_MASK, ROW_BIAS, False, False)
    assert splits(fwd_ptx("sm_90a", masked)) == {
        ("dec", 24),
        ("inc", 240),
        ("dec", 40),
        ("inc", 232),
    }
    plain = fwd_spec_for("sm_90a", 128, "bf16", None, ROW_BIAS, False, False)
    assert splits(fwd_ptx("sm_90a", plain)) == {("dec", 24), ("inc", 240)}


def test_hopper_register_splits_fit_the_launch_pool() -> None:
    """setmaxnreg moves registers between the warpgroups of a CTA: the consumers' increase
    waits until the producer's decrease has freed enough of what the launch gave (65536 per
    SM over the CTA's threads and CTAs, in steps of 8), so a split that needs more never
    starts (a producer at 32 beside two consumers at 240 hung the forward)."""
    from dmattn_cute.kernels.sm90 import bwd, fwd

    splits = [(wgs, regs) for (wgs, _), regs in fwd._REGISTERS.items()] + [(2, bwd._REGISTERS)]
    for wgs, (producer, consumer) in splits:
        threads = 128 * (1 + wgs)
        ctas = 2 if wgs == 1 else 1  # one consumer: two CTAs per SM
        launch = min(65536 // (threads * ctas) // 8 * 8, 255)
        assert producer % 8 == 0 and consumer % 8 == 0
        assert 128 * producer + 128 * wgs * consumer <= threads * launch, (wgs, producer)


def nvdisasm() -> str:
    """nvdisasm from the test extra's nvidia-cuda-nvdisasm wheel, else a CUDA toolkit's."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        found = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
        if found:
            return found[-1]
    path = shutil.which("nvdisasm")
    assert path, "nvdisasm not found: pip install -e '.[test]' installs it"
    return path


def hopper_sass(spec: Sm90FwdSpec) -> list[str]:
    """The SASS instructions of the cubin cute.compile builds for sm_90a (what runs)."""
    with tempfile.TemporaryDirectory() as dump_dir:
        cubin = spec.compile("sm_90a", f"--keep-cubin --dump-dir {dump_dir}").artifacts.CUBIN
        path = os.path.join(dump_dir, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run(
            [nvdisasm(), "-c", path], capture_output=True, text=True, check=True
        ).stdout
    return [op.strip() for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]+);", text)]


@pytest.mark.parametrize(
    ("head_dim", "mask"),
    [(128, None), (128, FULL_MASK), (256, None)],
    ids=["d128", "d128-mask", "d256"],
)
def test_hopper_forward_waits_for_pv_after_the_row_max(head_dim: int, mask) -> None:
    """Without a bias, two consumers wait for the previous block's P V after the row max
    (sm90/fwd.py's pv_wait_after_max): in every key-block loop the wait for all wgmmas
    (DEPBAR 0x0) that follows the wait for S (0x1) comes after the max's four shuffles and
    before any exponential. ptxas, left alone, hoists it above the shuffles."""
    spec = fwd_spec_for("sm_90a", head_dim, "bf16", mask, None)
    sass = hopper_sass(spec)
    waits_for_s = [i for i, op in enumerate(sass) if op == "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    assert len(waits_for_s) == (1 if mask is None else 2)  # a mask: a dense and a bits walk
    for start in waits_for_s:
        end = sass.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", start)
        between = sass[start:end]
        assert sum(op.startswith("SHFL.BFLY") for op in between) >= 4, between
        assert not any(op.startswith("MUFU.EX2") for op in between), between


@pytest.mark.parametrize("mask", [ROW_MASK, None], ids=["mask", "no-mask"])
def test_hopper_paged_forward_compiles(mask) -> None:
    """The forward that reads K and V from a page pool (a paged kv cache's decode step) builds
    for sm_90a with its TMA loads, in its decode tiling (with a mask) and its plain one."""
    spec = Sm90FwdSpec.build(
        "sm_90a", "bf16", 128, mask, ROW_BIAS, False, False, mask is not None, False, True
    )
    assert spec.paged
    check_fwd_ptx("sm_90a", fwd_ptx("sm_90a", spec))


def bwd_spec_for(
    target: str,
    head_dim: int,
    dtype: str = "bf16",
    mask: OperandSpec | None = FULL_MASK,
    bias: OperandSpec | None = FULL_BIAS,
    dbias: DbiasSpec | None = None,
    has_window: bool = False,
    has_softcap: bool = False,
    deterministic: bool = False,
    fold: tuple[bool, bool] = (False, False),
) -> BwdSpec:
    return BwdSpec.build(
        target, dtype, head_dim, mask, bias, dbias, has_window, has_softcap, deterministic, *fold
    )


DBIAS_DIRECT = DbiasSpec("bf16", ("d", "d", "d", "1"), False, True, True)
DBIAS_ROWS_ATOMIC = DbiasSpec("fp32", ("d", "d", "0", "1"), True, False, True)
DBIAS_SUM_RMW = DbiasSpec("fp32", ("0", "0", "d", "1"), False, False, False)


def check_bwd_ptx(target: str, spec: BwdSpec) -> str:
    ptx = fwd_ptx(target, spec)
    check_mma_sync_ptx(target, ptx)
    # dq is accumulated in fp32 global memory, in pairs of adjacent columns on sm_90
    pairs = "red.global.add.v2.f32" in ptx
    assert pairs == target.startswith("sm_90")
    assert pairs or re.search(r"\b(red|atom)\.global\.add\.f32", ptx)
    return ptx


@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [(32, "bf16"), (40, "fp16"), (64, "bf16"), (96, "fp16"), (128, "bf16"), (160, "fp16"),
     (192, "bf16"), (256, "fp16")],
)  # fmt: skip
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_bwd_head_dims_compile(target: str, head_dim: int, dtype: str) -> None:
    spec = bwd_spec_for(target, head_dim, dtype, dbias=DBIAS_DIRECT)
    assert spec.smem_bytes() <= smem_capacity(target)
    check_bwd_ptx(target, spec)


@pytest.mark.parametrize(
    ("mask", "bias", "dbias", "window", "softcap", "det", "fold"),
    [
        (None, None, None, False, False, False, (False, False)),
        (FULL_MASK, ROW_BIAS_FP32, DBIAS_ROWS_ATOMIC, True, False, False, (False, False)),
        (None, FULL_BIAS, None, False, True, False, (False, False)),
        (FULL_MASK, UNALIGNED_BIAS, DBIAS_SUM_RMW, True, True, True, (True, True)),
        (KEY_BCAST_MASK, None, None, True, False, True, (False, False)),
    ],
    ids=["plain", "rowbias-window", "bias-nograd-softcap", "deterministic-folded", "keymask"],
)
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_bwd_variants_compile(target, mask, bias, dbias, window, softcap, det, fold) -> None:
    spec = bwd_spec_for(target, 128, "fp16", mask, bias, dbias, window, softcap, det, fold)
    ptx = check_bwd_ptx(target, spec)
    if det:  # the dq turn counters are read with acquire and written with release semantics
        assert "ld.acquire.gpu" in ptx and "st.release.gpu" in ptx


DBIAS_SUM_ATOMIC = DbiasSpec("fp32", ("0", "d", "d", "1"), False, False, True)
DBIAS_DIRECT_ORDERED = DbiasSpec("bf16", ("d", "d", "d", "1"), False, True, False)


@pytest.mark.parametrize(
    ("head_dim", "dtype", "mask", "bias", "dbias", "window", "softcap", "split"),
    [(32, "bf16", None, None, None, False, False, True),
     (40, "fp16", FULL_MASK, None, None, True, False, False),
     (64, "bf16", None, None, None, False, True, True),
     (96, "fp16", FULL_MASK, ROW_BIAS_FP32, DBIAS_ROWS_ATOMIC, False, False, False),
     (128, "bf16", None, None, None, True, True, False),
     (128, "bf16", FULL_MASK, ROW_BIAS, DBIAS_ROWS_ATOMIC, True, False, False),
     (128, "fp16", FULL_MASK, FULL_BIAS, DBIAS_DIRECT, False, False, True),
     (128, "bf16", KEY_BCAST_MASK, UNALIGNED_BIAS, DBIAS_SUM_ATOMIC, True, True, False),
     (160, "bf16", None, FULL_BIAS, None, False, True, True),
     (192, "fp16", FULL_MASK, None, None, True, False, False),
     (256, "bf16", None, None, None, False, True, True),
     (256, "fp16", FULL_MASK, FULL_BIAS, DBIAS_DIRECT, True, False, False),
     (64, "bf16", None, None, None, True, False, "det"),
     (128, "bf16", None, None, None, False, False, "det-split"),
     (128, "fp16", FULL_MASK, FULL_BIAS, DBIAS_DIRECT_ORDERED, False, True, "det")],
)  # fmt: skip
def test_hopper_bwd_compiles(
    head_dim, dtype, mask, bias, dbias, window, softcap, split, capfd
) -> None:
    """The Hopper backward: Q/dO/K/V by TMA, five wgmma GEMMs, dQ added by a TMA reduce-add
    (no atomics), dK/dV stored by TMA (added by TMA reduce-add when a group's heads are split
    over CTAs), mask/bias tiles by cp.async, dbias stored or added by atomics, the producer's
    registers handed to the MMA warpgroups, enough for ptxas to keep the wgmmas in flight."""
    det = split in ("det", "det-split")  # a deterministic order
    split = split in (True, "det-split")
    spec = Sm90BwdSpec.build(
        "sm_90a", dtype, head_dim, mask, bias, dbias, window, softcap, split, det
    )
    assert spec.smem_bytes() <= smem_capacity("sm_90a")
    ptx = fwd_ptx("sm_90a", spec, PTXAS_REMARKS)
    check_wgmma_not_serialized(capfd)
    assert re.findall(r"^\.target (\S+)", ptx, flags=re.MULTILINE) == ["sm_90a"]
    assert "wgmma.mma_async.sync.aligned" in ptx
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.\S*\.add\.", ptx)
    # dK and dV: stored in the input dtype, or added as fp32 partial sums when split
    stores = re.findall(r"cp\.async\.bulk\.tensor\.\S*\.global\.shared::cta", ptx)
    assert bool(stores) != split
    atomics = re.search(r"\b(red|atom)\.global", ptx) is not None
    assert atomics == (dbias is not None and not dbias.direct)
    # mask/bias tiles by cp.async, but for copies under 4 bytes (plain loads and stores)
    tile_copies = re.search(r"cp\.async\.c[ag]\.shared\.global", ptx) is not None
    wide = [op for op in (mask, bias) if op is not None and op.vec * dtype_bytes(op.dtype) >= 4]
    assert tile_copies == bool(wide)
    # dq turn counters, read with acquire and written with release semantics
    assert ("ld.acquire.gpu" in ptx and "st.release.gpu" in ptx) == det
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "mma.sync" not in ptx and "ldmatrix" not in ptx
    # causal/window limits, not deterministic: the CTAs take their items from the launch's
    # order, through the grid's extents
    assert spec.ordered == (window and not det)
    assert ("%nctaid.y" in ptx) == spec.ordered
    # transposed scores (element-wise masks, a query-broadcast bias or none, no softcap, 64 x
    # 128 tiles of two stages): P^T and dS^T are register A operands (braces after the
    # accumulator's), dS goes to smem by stmatrix.trans
    transposed = (
        not softcap
        and (mask is None or mask.dtype not in ("i32", "i64"))
        and (bias is None or bias.row_broadcast)
        and (spec.tile.tile_n, spec.tile.stages) == (128, 2)
    )
    assert spec.tile.transposed == transposed
    assert bool(re.search(r"wgmma\.mma_async\S* \{[^}]*\}, \{", ptx)) == transposed
    assert ("stmatrix.sync.aligned.m8n8.x4.trans" in ptx) == transposed


# (mask, tile_m, tile_n, a regex of its loads in the PTX): 16-byte rows, a query-broadcast row
# (16 tiles per CTA), 4-byte words of a tile whose rows take 11 vectors, byte loads of a
# key-broadcast mask, and byte loads of tiles read by two warps each (their ballots meet in
# shared memory).
BITS_CASES = [
    pytest.param(FULL_MASK, 128, 128, r"v4\.b32", id="full-v16"),
    pytest.param(OperandSpec("u8", ("d", "d", "0", "1"), 16), 64, 128, r"v4\.b32",
                 id="rowbcast-v16"),
    pytest.param(OperandSpec("u8", ("0", "d", "d", "1"), 4), 128, 176, r"b32",
                 id="tile176-v4"),
    pytest.param(KEY_BCAST_MASK, 128, 80, r"[bsu]8", id="keybcast-v1"),
    pytest.param(OperandSpec("u8", ("d", "d", "0", "1"), 1), 64, 64, r"[bsu]8",
                 id="rowbcast-v1-two-warps"),
    pytest.param(ROW_MASK, 128, 64, r"v4\.b32", id="decode-rowbcast-v16"),
]  # fmt: skip


@pytest.mark.parametrize(("mask", "tile_m", "tile_n", "load"), BITS_CASES)
@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_block_bits_compile(target: str, mask: OperandSpec, tile_m: int, tile_n: int, load: str):
    spec = BlockBitsSpec(mask, tile_m, tile_n)
    with tempfile.TemporaryDirectory() as dump_dir:
        kernel = spec.compile(target, f"--keep-ptx --dump-dir {dump_dir}")
    ptx = kernel.artifacts.PTX
    assert launch_smem_bytes(kernel) == smem_total(spec.smem_buffers())
    assert re.findall(r"^\.target (\S+)", ptx, flags=re.MULTILINE) == [target]
    # the mask is read in the widest vectors its alignment allows, nothing else is loaded
    loads = re.findall(r"\bld\.global\.(\S+)", ptx)
    assert loads and all(re.fullmatch(load, width) for width in loads), loads
    # one byte per tile, its group combined by ballots
    assert re.findall(r"\bst\.global\.\S+", ptx) == ["st.global.b8"]
    assert "vote.sync.ballot.b32" in ptx


@pytest.mark.parametrize(
    ("mask", "tile_m", "tile_n", "rows"),
    [pytest.param(FULL_MASK, 64, 128, 2, id="full-v16-two-warps"),
     pytest.param(KEY_BCAST_MASK, 64, 80, 3, id="keybcast-v1")],
)  # fmt: skip
def test_paired_block_bits_compile(mask: OperandSpec, tile_m: int, tile_n: int, rows: int):
    """The pre-pass that also writes the bits of `rows` stacked tiles (the Hopper forward's,
    from the backward's pass): a byte per tile and round, ballots per round."""
    spec = BlockBitsSpec(mask, tile_m, tile_n, rows)
    with tempfile.TemporaryDirectory() as dump_dir:
        kernel = spec.compile("sm_90a", f"--keep-ptx --dump-dir {dump_dir}")
    ptx = kernel.artifacts.PTX
    assert launch_smem_bytes(kernel) == smem_total(spec.smem_buffers())
    assert set(re.findall(r"\bst\.global\.\S+", ptx)) == {"st.global.b8"}
    assert len(re.findall(r"\bst\.global\.\S+", ptx)) >= rows + 1
    assert len(re.findall(r"vote\.sync\.ballot\.b32", ptx)) == 2 * (rows + 1)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_hopper_short_query_forward_compiles(head_dim: int) -> None:
    """Decode (at most SHORT_QUERY_ROWS query rows): 64-key tiles with a query-broadcast mask
    and bias row, as packed decode calls run them; up to head dim 128 one consumer, and two
    CTAs per SM (registers and shared memory for both)."""
    spec = Sm90FwdSpec.build("sm_90a", "bf16", head_dim, ROW_MASK, ROW_BIAS, False, False, True)
    assert spec.tile.tile_n == 64
    two = head_dim <= 128
    assert spec.smem_bytes() <= smem_capacity("sm_90a") // (2 if two else 1)
    ptx = fwd_ptx("sm_90a", spec)
    check_fwd_ptx("sm_90a", ptx)
    assert re.findall(r"\.minnctapersm (\d+)", ptx) == ["2" if two else "1"]


# the key mask a block mask's bits pair with, widened by stride 0 (block_mask_launch.joint_mask)
BLOCK_KEY_MASK = OperandSpec("u8", ("0", "0", "0", "1"), 16)


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_block_mask_orders_compile(causal: bool, capfd) -> None:
    """With a block mask both Hopper kernels take their CTAs' items from the launch's order
    (launch_order), read through the grid's extents; a deterministic backward keeps grid
    order."""
    fwd = Sm90FwdSpec.build("sm_90a", "bf16", 128, BLOCK_KEY_MASK, ROW_BIAS, causal, False,
                            False, True)  # fmt: skip
    assert fwd.ordered
    ptx = fwd_ptx("sm_90a", fwd, PTXAS_REMARKS)
    check_fwd_ptx("sm_90a", ptx)
    check_wgmma_not_serialized(capfd)
    assert "%nctaid.y" in ptx
    for det in (False, True):
        bwd = Sm90BwdSpec.build("sm_90a", "bf16", 128, BLOCK_KEY_MASK, ROW_BIAS, None, causal,
                                False, True, det, True)  # fmt: skip
        assert bwd.ordered == (not det)
        assert ("%nctaid.y" in fwd_ptx("sm_90a", bwd)) == (not det)


def test_hopper_block_mask_alone_reads_no_mask_tile() -> None:
    """A block mask without attn_mask (blocks_full): every block the forward walks is full,
    so neither the producer's cp.async of mask tiles nor the consumers' mask branch is
    built; with attn_mask ANDed in (not blocks_full) both are."""
    args = ("sm_90a", "bf16", 128, BLOCK_KEY_MASK, ROW_BIAS, True, False, False, True)
    alone = Sm90FwdSpec.build(*args, blocks_full=True)
    ptx = fwd_ptx("sm_90a", alone)
    check_fwd_ptx("sm_90a", ptx)
    assert not re.search(r"cp\.async\.c[ag]\.shared\.global", ptx)
    with_mask = fwd_ptx("sm_90a", Sm90FwdSpec.build(*args))
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", with_mask)
    with pytest.raises(ValueError, match="blocks_full"):
        Sm90FwdSpec.build(*args[:-1], False, blocks_full=True)


EXPIRY = OperandSpec("i32", ("d", "d", "0", "1"), 4)  # key_expiry rows (kernels/expiry_launch.py)


@pytest.mark.parametrize("row_bias", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_expiry_rows_compile(causal: bool, row_bias: bool) -> None:
    """key_expiry as the Hopper kernels' mask operand: one int32 row per key block by
    cp.async, kept while the score's row is below it; the forward with or without a row bias,
    the split backward with its dbias added into fp32."""
    bias = ROW_BIAS_FP32 if row_bias else None
    dbias = DBIAS_ROWS_ATOMIC if row_bias else None
    fwd = Sm90FwdSpec.build("sm_90a", "bf16", 128, EXPIRY, bias, causal, False)
    check_fwd_ptx("sm_90a", fwd_ptx("sm_90a", fwd))
    bwd = Sm90BwdSpec.build("sm_90a", "bf16", 128, EXPIRY, bias, dbias, causal, False, True)
    assert bwd.smem_bytes() <= smem_capacity("sm_90a")
    ptx = fwd_ptx("sm_90a", bwd)
    assert "wgmma.mma_async.sync.aligned" in ptx
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx)


HOPPER_MASKS = {
    "no-mask": None, "mask": FULL_MASK, "row-mask": ROW_MASK, "key-mask": KEY_BCAST_MASK,
    "expiry": EXPIRY,
}  # fmt: skip
# each bias kind with the gradient buffer a launch gives it (dbias_plan)
HOPPER_BIASES = {
    "no-bias": (None, None),
    "bias": (FULL_BIAS, DBIAS_DIRECT),
    "row-bias": (ROW_BIAS, DBIAS_ROWS_ATOMIC),
    "row-bias-fp32": (ROW_BIAS_FP32, DBIAS_ROWS_ATOMIC),
    "unaligned-bias": (UNALIGNED_BIAS, DBIAS_SUM_ATOMIC),
}


@pytest.mark.parametrize("bias_kind", HOPPER_BIASES)
@pytest.mark.parametrize("mask_kind", HOPPER_MASKS)
def test_hopper_operand_kinds_trace(mask_kind: str, bias_kind: str) -> None:
    """Every mask kind with every bias kind traces and compiles in both Hopper kernels (a
    branch of the score code that only one pairing reaches fails here, not at a user's first
    call on a GPU)."""
    mask, (bias, dbias) = HOPPER_MASKS[mask_kind], HOPPER_BIASES[bias_kind]
    fwd = Sm90FwdSpec.build("sm_90a", "bf16", 128, mask, bias, False, False)
    check_fwd_ptx("sm_90a", fwd_ptx("sm_90a", fwd))
    bwd = Sm90BwdSpec.build("sm_90a", "bf16", 128, mask, bias, dbias, False, False, True)
    assert bwd.smem_bytes() <= smem_capacity("sm_90a")
    assert "wgmma.mma_async.sync.aligned" in fwd_ptx("sm_90a", bwd)


@pytest.mark.parametrize(
    ("dbias", "det"), [(DBIAS_ROWS_ATOMIC, False), (DBIAS_DIRECT, True), (None, True)]
)
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_bwd_split_heads_compiles(target, dbias, det) -> None:
    """The mma.sync backward with split heads stores fp32 dK/dV partial sums from registers,
    two adjacent columns a store (no smem staging, whose copies store 16 bytes)."""
    bias = ROW_BIAS_FP32 if dbias is DBIAS_ROWS_ATOMIC else FULL_BIAS
    spec = BwdSpec.build(target, "bf16", 128, FULL_MASK, bias, dbias, True, False, det,
                         split_heads=True)  # fmt: skip
    assert spec.split_heads
    ptx = check_bwd_ptx(target, spec)
    assert "st.global.v2.b32" in ptx and "st.global.v4.b32" not in ptx


def test_bwd_split_heads_refuses_shared_deterministic_sums() -> None:
    assert not bwd_spec_for("sm_80", 64, dbias=DBIAS_SUM_RMW, deterministic=True).can_split_heads
    with pytest.raises(ValueError, match="split_heads"):
        BwdSpec.build("sm_80", "bf16", 64, FULL_MASK, FULL_BIAS, DBIAS_SUM_RMW, False, False,
                      True, split_heads=True)  # fmt: skip
    assert bwd_spec_for("sm_80", 64, dbias=DBIAS_DIRECT, deterministic=True).can_split_heads


# a deterministic query-broadcast bias's dbias: an fp32 row per (batch, query head)
DBIAS_SLOTS = DbiasSpec("fp32", ("d", "d", "0", "1"), True, True, False, per_head=True)
KV_ROW_BIAS = OperandSpec("bf16", ("d", "d", "0", "1"), 8)  # [B, Hkv, 1, Sk]


@pytest.mark.parametrize("target", [*SUPPORTED_ARCHS, "hopper"])
def test_bwd_dbias_slots_compile(target) -> None:
    """Both backwards write a per-head slot dbias (indexed by the query head)."""
    if target == "hopper":
        spec = Sm90BwdSpec.build("sm_90a", "bf16", 128, FULL_MASK, KV_ROW_BIAS, DBIAS_SLOTS,
                                 False, False, True)  # fmt: skip
        assert "wgmma.mma_async.sync.aligned" in fwd_ptx("sm_90a", spec)
    else:
        spec = bwd_spec_for(target, 128, "bf16", FULL_MASK, KV_ROW_BIAS, DBIAS_SLOTS,
                            deterministic=True)  # fmt: skip
        check_bwd_ptx(target, spec)
    assert DBIAS_SLOTS.head(5, 4) == 5 and DBIAS_ROWS_ATOMIC.head(5, 4) == 1
