"""The precompile CLI and the Docker image's build step (CPU: offline compiles only)."""

import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmattn_cute import precompile
from dmattn_cute.jit import KERNELS_ENV, cache, smem_capacity
from dmattn_cute.kernels.bwd import BwdSpec
from dmattn_cute.kernels.bwd_launch import backward_spec_of
from dmattn_cute.kernels.fwd import FwdSpec
from dmattn_cute.kernels.fwd_launch import forward_family
from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
from dmattn_cute.problem import make_problem
from tests.utils import random_inputs

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _dockerfile_precompile() -> tuple[list[str], str]:
    """The precompile command of the Dockerfile's RUN step (argv after -m) and its ENV cache."""
    text = DOCKERFILE.read_text()
    runs = re.findall(r"^RUN (python -m dmattn_cute\.precompile .*)$", text, re.MULTILINE)
    assert len(runs) == 1, "the Dockerfile must RUN the precompile CLI once"
    env = re.search(r"DMATTN_CUTE_CACHE_DIR=(\S+)", text)
    assert env, "the Dockerfile must set DMATTN_CUTE_CACHE_DIR for run time"
    return shlex.split(runs[0])[3:], env.group(1)


def _run_cli(args: list[str], cache_dir: Path) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as in a docker build: no GPU
    result = subprocess.run(
        [sys.executable, "-m", "dmattn_cute.precompile", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "/" in result.stderr  # the progress bar
    return result.stdout


def test_dockerfile_uses_the_cli_for_sm89() -> None:
    args, env_cache = _dockerfile_precompile()
    assert args[args.index("--arch") + 1] == "sm_89"
    # The image's run-time cache is where the build step wrote.
    assert args[args.index("--cache-dir") + 1] == env_cache


@pytest.mark.compile
def test_dockerfile_step_fills_the_cache_then_hits_it(tmp_path: Path) -> None:
    """Runs the Dockerfile's precompile step (into a temp dir), then again: no compiles."""
    args, _ = _dockerfile_precompile()
    args[args.index("--cache-dir") + 1] = str(tmp_path)
    first = _run_cli(args, tmp_path)
    patterns = precompile.patterns_of(precompile.parse_args(args))
    total = len(precompile.variants("sm_89", patterns))
    assert f"sm_89: {total} kernel variants, {total} compiled, 0 already cached" in first
    assert len(list(tmp_path.rglob("*.o"))) == total
    print(f"\n{first.strip()}")

    second = _run_cli(args, tmp_path)
    assert f"sm_89: {total} kernel variants, 0 compiled, {total} already cached" in second
    print(second.strip())


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_variants_are_what_real_calls_plan(arch: str) -> None:
    """Planning on meta tensors gives the specs that real tensors of the pattern give."""
    for pattern in precompile.call_patterns(["bf16"], [64], softcap=True, deterministic=True):
        meta = precompile.kernel_specs(pattern, arch)
        real = precompile.kernel_specs(pattern, arch, device="cpu")
        assert meta == real, str(pattern)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_decode_variants_are_what_real_tensors_plan(arch: str) -> None:
    """The decode steps' variants: planned alike on meta and real tensors, each with the
    combine kernel; on sm_90a the masked ones take 64-key tiles."""
    for pattern in precompile.decode_patterns(["bf16"], [64], softcap=True):
        meta = precompile.kernel_specs(pattern, arch)
        assert meta == precompile.kernel_specs(pattern, arch, device="cpu"), str(pattern)
        assert [kind for kind, _ in meta][-1] == "combine"
        if arch == "sm_90a" and precompile.DECODE_OPERANDS[pattern.operands][0] is not None:
            assert meta[0][1].tile.tile_n == 64


def test_decode_variants_are_what_the_launch_plans(launches) -> None:
    """The decode step's forward and block bits, as fwd_launch plans them on the operands the
    step passes (decode.chunk_operands, real CPU tensors), are the listed variants."""
    from dmattn_cute.decode import chunk_operands
    from dmattn_cute.kernels import fwd_launch
    from dmattn_cute.problem import make_problem

    for pattern in precompile.decode_patterns(["bf16"], [128]):
        heads, heads_kv = pattern.heads
        mask_heads, has_bias = precompile.DECODE_OPERANDS[pattern.operands]
        batch, sk = precompile.BATCH, precompile.DECODE_CACHE
        q = torch.randn(batch, 1, heads, 128, dtype=torch.bfloat16)
        k, v = (torch.randn(batch, sk, heads_kv, 128, dtype=torch.bfloat16) for _ in range(2))
        rows = None if mask_heads is None else (heads_kv if mask_heads == "kv" else 1)
        mask = None if rows is None else torch.rand(batch, rows, 1, sk) < 0.5
        bias = torch.randn(batch, heads_kv, 1, sk, dtype=torch.bfloat16) if has_bias else None
        operands = chunk_operands(q, k, v, mask, bias, 16, "batch")
        problem, mask4, bias4 = make_problem(*operands, None, False, 0.0, (-1, -1), False)
        launches["calls"].clear()
        fwd_launch.flash_fwd(problem, *operands[:3], mask4, bias4)
        listed = {spec for _, spec in pattern.kernels("sm_90a")}
        assert {spec for spec, _ in launches["calls"]} <= listed, str(pattern)


def test_decode_steps_launch_listed_variants(launches, monkeypatch) -> None:
    """A kv-cache decode step of each pattern, run as on the GPU (decode's eager CUDA path on
    CPU tensors, the launches recorded: the mask/bias rows read in place with key_chunks,
    as the API builds them), launches only the variants precompile --decode lists."""
    from dmattn_cute import decode, flash_dmattn_with_kvcache

    monkeypatch.setattr(decode, "eager_cuda", lambda q: True)
    batch, sk = precompile.BATCH, precompile.DECODE_CACHE
    for pattern in precompile.decode_patterns(["bf16"], [128]):
        heads, heads_kv = pattern.heads
        mask_heads, has_bias = precompile.DECODE_OPERANDS[pattern.operands]
        q = torch.randn(batch, 1, heads, 128, dtype=torch.bfloat16)
        k, v = (torch.randn(batch, sk, heads_kv, 128, dtype=torch.bfloat16) for _ in range(2))
        bias = torch.randn(batch, heads_kv, 1, sk, dtype=torch.bfloat16) if has_bias else None
        mask = lengths = None
        if mask_heads == 1:  # the cache lengths become the mask rows [B, 1, 1, Sk]
            lengths = torch.tensor([sk - 1000, sk - 7], dtype=torch.int32)
        elif mask_heads == "kv":
            mask = torch.rand(batch, heads_kv, 1, sk) < 0.5
        launches["calls"].clear()
        flash_dmattn_with_kvcache(
            q, k, v, cache_seqlens=lengths, attn_mask=mask, attn_bias=bias,
            softcap=pattern.softcap,
        )  # fmt: skip
        launched = {spec for spec, _ in launches["calls"]}
        listed = {spec for _, spec in pattern.kernels("sm_90a")}
        assert launched and launched <= listed, str(pattern)
        forward = [args for spec, args in launches["calls"] if "Fwd" in type(spec).__name__]
        assert forward[0][-1] > 1, str(pattern)  # key_chunks: the rows read in place
        # and the queries: a view of q (one entry per row, not per chunk)
        assert forward[0][0].shape[0] == batch and forward[0][0].data_ptr() == q.data_ptr()


def test_paged_decode_steps_launch_listed_variants(launches, monkeypatch) -> None:
    """A kv-cache decode step on a paged cache (pages of 128 keys, shuffled), run as on the
    GPU, reads the pool in place on sm_90a with the variants precompile --decode --paged
    lists; off Hopper a paged step gathers its pages and runs the contiguous step's kernels."""
    from dmattn_cute import decode, flash_dmattn_with_kvcache

    monkeypatch.setattr(decode, "eager_cuda", lambda q: True)
    batch, sk, page = precompile.BATCH, precompile.DECODE_CACHE, 128
    patterns = precompile.decode_patterns(["bf16"], [128], paged=True)
    assert {p.paged for p in patterns} == {False, True}
    for pattern in (p for p in patterns if p.paged):
        heads, heads_kv = pattern.heads
        mask_heads, has_bias = precompile.DECODE_OPERANDS[pattern.operands]
        q = torch.randn(batch, 1, heads, 128, dtype=torch.bfloat16)
        pool = [torch.randn(batch * sk // page, page, heads_kv, 128, dtype=torch.bfloat16)
                for _ in range(2)]  # fmt: skip
        table = torch.randperm(batch * sk // page, dtype=torch.int32).view(batch, sk // page)
        bias = torch.randn(batch, heads_kv, 1, sk, dtype=torch.bfloat16) if has_bias else None
        mask = lengths = None
        if mask_heads == 1:
            lengths = torch.tensor([sk - 1000, sk - 7], dtype=torch.int32)
        elif mask_heads == "kv":
            mask = torch.rand(batch, heads_kv, 1, sk) < 0.5
        launches["calls"].clear()
        flash_dmattn_with_kvcache(
            q, *pool, cache_seqlens=lengths, attn_mask=mask, attn_bias=bias,
            softcap=pattern.softcap, block_table=table,
        )  # fmt: skip
        launched = {spec for spec, _ in launches["calls"]}
        listed = {spec for _, spec in pattern.kernels("sm_90a")}
        assert launched and launched <= listed, str(pattern)
        ((spec, args),) = [c for c in launches["calls"] if "Fwd" in type(c[0]).__name__]
        assert spec.paged and args[1] is pool[0] and args[2] is pool[1] and args[10] is table
        contiguous = dataclasses.replace(pattern, paged=False)
        assert pattern.kernels("sm_89") == contiguous.kernels("sm_89")
    with pytest.raises(SystemExit):
        precompile.parse_args(["--arch", "sm_90a", "--paged"])


def test_default_variants_cover_every_pattern_and_kernel() -> None:
    patterns = precompile.call_patterns()
    labels = [label for label, _ in precompile.variants("sm_89", patterns)]
    assert {label.split()[0] for label in labels} == {"fwd", "bwd_pre", "bwd"}
    for dtype in ("bf16", "fp16"):
        for head_dim in precompile.DEFAULT_HEAD_DIMS:
            for operands in precompile.OPERANDS:
                if operands not in ("expiry+key-bias", "block-mask+key-bias"):  # below
                    assert any(f"{dtype} d{head_dim} {operands} " in label for label in labels)
    specs = [spec for _, spec in precompile.variants("sm_89", patterns)]
    assert len(specs) == len(set(specs))
    # An expiry is an element mask off Hopper: the variants of a mask; on sm_90a its own.
    expiry = [p for p in patterns if p.operands == "expiry+key-bias"]
    assert {spec for _, spec in precompile.variants("sm_89", expiry)} <= set(specs)
    hopper = precompile.variants("sm_90a", expiry)
    assert hopper and all(spec.mask.dtype == "i32" for _, spec in hopper if hasattr(spec, "mask"))
    # A block mask is an element mask off Hopper too; on sm_90a its bits and launch order.
    blocks = [p for p in patterns if p.operands == "block-mask+key-bias"]
    assert {spec for _, spec in precompile.variants("sm_89", blocks)} <= set(specs)
    kernels = [spec for _, spec in precompile.variants("sm_90a", blocks)]
    assert any(isinstance(spec, Sm90FwdSpec) and spec.ordered for spec in kernels)
    assert any(isinstance(spec, Sm90BwdSpec) and spec.ordered for spec in kernels)


def test_block_mask_calls_launch_listed_variants(launches, monkeypatch) -> None:
    """An eager forward + backward of each block-mask pattern, run as on the GPU (the eager
    CUDA path on CPU tensors, launches recorded), compiles only variants precompile lists:
    on sm_90a the kernels that read the block mask as bits in its launch order."""
    from dmattn_cute import attention, flash_dmattn_func

    monkeypatch.setattr(attention, "eager_cuda", lambda q: True)
    patterns = [p for p in precompile.call_patterns(["bf16"], [128])
                if p.operands == "block-mask+key-bias"]  # fmt: skip
    for pattern in patterns:
        q, k, v, block_mask, bias = (
            t.requires_grad_(t.is_floating_point()) for t in pattern.inputs("cpu")
        )
        launches["compiled"].clear()
        out = flash_dmattn_func(q, k, v, attn_bias=bias, block_mask=block_mask,
                                **pattern.options())  # fmt: skip
        out.sum().backward()
        compiled = set(launches["compiled"])
        listed = {spec for _, spec in precompile.variants("sm_90a", [pattern])}
        assert compiled and compiled <= listed, str(pattern)
        assert all(spec.ordered for spec in compiled if hasattr(spec, "ordered"))
        # no attn_mask: the forward's visible blocks are all full
        assert any(getattr(spec, "blocks_full", False) for spec in compiled), str(pattern)


@pytest.mark.parametrize("operands", ["key-bias", "mask+key-bias", "expiry+key-bias"])
def test_key_bias_calls_launch_listed_variants(launches, monkeypatch, operands) -> None:
    """An eager forward + backward of each bf16 pattern with a key bias, run as on the GPU
    (launches recorded on CPU tensors), compiles only variants precompile lists: on sm_90a
    the forward that reads the bias row as terms of Q K^T and the terms pre-pass."""
    from dmattn_cute import attention, flash_dmattn_func
    from dmattn_cute.kernels.key_bias_terms import KeyBiasTermsSpec

    monkeypatch.setattr(attention, "eager_cuda", lambda q: True)
    patterns = [p for p in precompile.call_patterns(["bf16"], [128]) if p.operands == operands]
    for pattern in patterns:
        q, k, v, mask, bias = (
            t if t is None else t.requires_grad_(t.is_floating_point())
            for t in pattern.inputs("cpu")
        )
        launches["compiled"].clear()
        masks = {}  # an int32 "mask" is a key expiry (precompile.planned_kernels)
        if mask is not None:
            masks = {"key_expiry" if mask.dtype == torch.int32 else "attn_mask": mask}
        out = flash_dmattn_func(q, k, v, attn_bias=bias, **masks, **pattern.options())
        out.sum().backward()
        compiled = set(launches["compiled"])
        listed = {spec for _, spec in precompile.variants("sm_90a", [pattern])}
        assert compiled and compiled <= listed, str(pattern)
        assert any(isinstance(spec, KeyBiasTermsSpec) for spec in compiled), str(pattern)


def test_list_and_bad_arguments(tmp_path: Path, capsys) -> None:
    assert (
        precompile.main(["--arch", "sm_86", "--head-dims", "96", "--dtypes", "fp16", "--list"]) == 0
    )
    *lines, count = capsys.readouterr().out.strip().splitlines()
    assert lines and all(" fp16 d96 " in line for line in lines)
    assert count == f"{len(lines)} kernel variants for sm_86"
    with pytest.raises(SystemExit):
        precompile.main(["--arch", "sm_75"])
    with pytest.raises(SystemExit):
        precompile.main(["--arch", "sm_89", "--head-dims", "12"])
    with pytest.raises(SystemExit):
        precompile.main(["--arch", "sm_89", "--jobs", "0"])


def test_jobs_default_to_the_cpu_count() -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert precompile.parse_args(["--arch", "sm_89"]).jobs == cpus
    assert precompile.parse_args(["--arch", "sm_89", "--jobs", "3"]).jobs == 3


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


LABELS = ["fwd bf16 d64 dense H8/8", "bwd bf16 d128 full-mask+full-bias H8/2 causal", "bwd_pre"]


def test_progress_redraws_one_line_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "60")  # narrower than the longest line: cut, never wrapped
    stream = _Terminal()
    bar = precompile.Progress(len(LABELS), stream)
    for label in LABELS:
        bar.step(label)
    text = stream.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1  # one line, ended once at the end
    draws = text.removesuffix("\n").split("\r")
    assert draws[0] == "" and len(draws) == 1 + len(LABELS)
    for done, (draw, label) in enumerate(zip(draws[1:], LABELS, strict=True), start=1):
        assert draw.endswith("\033[K")  # clears what a longer previous draw left
        line = draw.removesuffix("\033[K")
        assert len(line) <= 59 and f" {done}/{len(LABELS)} " in line
        assert (label in line) == (len(line) < 59), line
    assert draws[-1].startswith("[" + "#" * precompile.Progress.WIDTH + "]")


def test_progress_prints_plain_lines_elsewhere() -> None:
    stream = io.StringIO()
    bar = precompile.Progress(len(LABELS), stream)
    for label in LABELS:
        bar.step(label)
    assert stream.getvalue().splitlines() == [
        f"{done}/{len(LABELS)} {label}" for done, label in enumerate(LABELS, start=1)
    ]
    assert "\r" not in stream.getvalue() and "\033" not in stream.getvalue()


def test_precompile_refuses_a_disabled_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    with pytest.raises(ValueError, match="disk cache is off"):
        precompile.precompile("sm_89", precompile.call_patterns(["bf16"], [64]))


def test_pattern_inputs_match_their_description() -> None:
    pattern = precompile.CallPattern("fp16", 96, "mask+key-bias", (8, 2), True)
    q, k, v, mask, bias = pattern.inputs("cpu", 128)
    assert q.shape == (2, 128, 8, 96) and k.shape == v.shape == (2, 128, 2, 96)
    assert q.dtype == torch.float16 and mask.dtype == torch.bool
    assert mask.shape == (2, 2, 128, 128) and bias.shape == (2, 2, 128)


def test_hopper_plans_the_mask_block_bits() -> None:
    """On sm_90a a call with a mask runs the block-bits pre-pass first, and a bf16 call with
    a key bias the terms pre-pass: precompiled too."""
    patterns = precompile.call_patterns(["bf16"], [128])
    labels = [label for label, _ in precompile.variants("sm_90a", patterns)]
    assert {label.split()[0] for label in labels} == {"fwd", "bits", "bwd_pre", "bwd", "terms"}
    assert all("mask" in label for label in labels if label.startswith("bits"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a"])
def test_forward_family_per_arch(arch: str) -> None:
    """Hopper runs the warp-specialized forward; SM80/86/89 keep the mma.sync one."""
    assert forward_family(arch) is (Sm90FwdSpec if arch == "sm_90a" else FwdSpec)
    pattern = precompile.call_patterns(["bf16"], [64])[0]
    (fwd,) = [spec for kind, spec in precompile.kernel_specs(pattern, arch) if kind == "fwd"]
    assert isinstance(fwd, forward_family(arch))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a"])
@pytest.mark.parametrize("case", ["dense", "mask", "bias", "deterministic"])
def test_backward_kernel_per_arch(arch: str, case: str) -> None:
    """Hopper runs the warp-specialized backward (deterministic too: no dbias sums here);
    every call on SM80/86/89 the mma.sync one."""
    q, k, v, _, _ = random_inputs(2, 100, 140, 4, 2, 64, torch.bfloat16, "cpu")
    mask = torch.ones(2, 2, 100, 140, dtype=torch.bool) if case == "mask" else None
    bias = torch.zeros(2, 2, 100, 140) if case == "bias" else None
    det = case == "deterministic"
    problem, mask4, bias4 = make_problem(q, k, v, mask, bias, None, True, 0.0, (-1, -1), det)
    spec = backward_spec_of(problem, mask4, bias4, bias is not None, arch)
    hopper = arch == "sm_90a"
    assert isinstance(spec, Sm90BwdSpec if hopper else BwdSpec)
    assert spec.smem_bytes() <= smem_capacity(arch)


def test_kernels_setting_picks_the_mma_sync_families(monkeypatch: pytest.MonkeyPatch) -> None:
    """DMATTN_CUTE_KERNELS=mma_sync: sm_90a plans the mma.sync forward and backward; any other
    value is refused."""
    q, k, v, _, _ = random_inputs(2, 100, 140, 4, 2, 64, torch.bfloat16, "cpu")
    problem, mask4, bias4 = make_problem(q, k, v, None, None, None, True, 0.0, (-1, -1), False)
    monkeypatch.setenv(KERNELS_ENV, "mma_sync")
    assert forward_family("sm_90a") is FwdSpec
    assert isinstance(backward_spec_of(problem, mask4, bias4, False, "sm_90a"), BwdSpec)
    monkeypatch.setenv(KERNELS_ENV, "wgmma")
    with pytest.raises(ValueError, match="DMATTN_CUTE_KERNELS: expected unset or 'mma_sync'"):
        forward_family("sm_90a")
    monkeypatch.delenv(KERNELS_ENV)
    assert forward_family("sm_90a") is Sm90FwdSpec
