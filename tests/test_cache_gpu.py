"""Kernels precompiled on a CPU-only process load on the GPU with zero compiles."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmattn_cute import flash_dmattn_func, precompile
from dmattn_cute.jit import cache, target_arch
from tests.test_block_mask import element_mask
from tests.utils import compact_mask_grads_and_check, expiry_grads_and_check, grads_and_check

pytestmark = pytest.mark.gpu


def precompile_without_gpu(arch: str, cache_dir: Path, *args: str) -> str:
    """Run `python -m dmattn_cute.precompile` for `arch` into `cache_dir` where no GPU is
    visible, as in a docker build; its stdout."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("DMATTN_CUTE_ARCH", None)
    result = subprocess.run(
        [sys.executable, "-m", "dmattn_cute.precompile", "--arch", arch,
         "--cache-dir", str(cache_dir), *args],
        env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def planned(arch: str, pattern, backward: bool) -> list:
    """precompile.planned_kernels of the eager path for a pattern's call at S = 256."""
    q, k, v, mask, bias = pattern.inputs("cuda", seqlen=256)
    options = {**pattern.options(), "backward": backward, "eager": True}
    if precompile.OPERANDS[pattern.operands][0] == "blocks":
        return precompile.planned_kernels(arch, q, k, v, None, bias, block_mask=mask, **options)
    return precompile.planned_kernels(arch, q, k, v, mask, bias, **options)


def test_precompiled_kernels_load_with_zero_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    arch = target_arch()
    stdout = precompile_without_gpu(arch, tmp_path, "--head-dims", "64", "--dtypes", "bf16")

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    cache.clear_memory()
    compiles, loads = cache.compile_count(), cache.load_count()
    patterns = precompile.call_patterns(["bf16"], [64])
    for pattern in patterns:
        q, k, v, mask, bias = pattern.inputs("cuda", seqlen=256)
        if precompile.OPERANDS[pattern.operands][0] == "blocks":
            # precompile's "blocks" operand: a block mask
            dense = element_mask(mask, 256, 256)
            compact_mask_grads_and_check(q, k, v, None, bias, dense, {"block_mask": mask},
                                         **pattern.options())  # fmt: skip
            out = flash_dmattn_func(q, k, v, None, bias, block_mask=mask, **pattern.options())
        elif mask is not None and mask.dtype == torch.int32:
            # precompile's "expiry" operand: top-w expiry rows, passed as key_expiry
            expiry_grads_and_check(q, k, v, None, bias, mask, **pattern.options())
            out = flash_dmattn_func(q, k, v, None, bias, key_expiry=mask, **pattern.options())
        else:
            grads_and_check(q, k, v, mask, bias, **pattern.options())
            out = flash_dmattn_func(q, k, v, mask, bias, **pattern.options())
        assert out.isfinite().all()
    loaded = cache.load_count() - loads
    # what the calls ran, on the eager path: a forward and backward (the Hopper backward's
    # heads split or not, by the sizes of the call), then a forward alone; all precompiled
    ran = {
        spec
        for pattern in patterns
        for backward in (True, False)
        for _, spec in planned(arch, pattern, backward)
    }
    with capsys.disabled():
        print(
            f"\n{torch.cuda.get_device_name()} ({arch}): {stdout}\n"
            f"{len(patterns)} call patterns, fwd + bwd: {cache.compile_count() - compiles} "
            f"compiles, {loaded} kernels loaded from the precompiled cache"
        )
    assert cache.compile_count() == compiles
    assert loaded == len(ran)
    assert ran <= {spec for _, spec in precompile.variants(arch, patterns)}
    cache.clear_memory()


def test_precompiled_decode_steps_load_with_zero_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """precompile --decode, then a decode step of each pattern through the kv-cache API:
    the forward, block bits and combine kernels all come from the cache."""
    from dmattn_cute import flash_dmattn_with_kvcache

    precompile_without_gpu(target_arch(), tmp_path, "--head-dims", "128", "--dtypes", "bf16",
                           "--decode")  # fmt: skip

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    cache.clear_memory()
    compiles = cache.compile_count()
    batch, sk = precompile.BATCH, precompile.DECODE_CACHE
    for pattern in precompile.decode_patterns(["bf16"], [128]):
        heads, heads_kv = pattern.heads
        mask_heads, has_bias = precompile.DECODE_OPERANDS[pattern.operands]
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        q = torch.randn(batch, 1, heads, 128, **kw)
        k_cache, v_cache = (torch.randn(batch, sk, heads_kv, 128, **kw) for _ in range(2))
        bias = torch.randn(batch, heads_kv, 1, sk, **kw) if has_bias else None
        mask = lengths = None
        if mask_heads == 1:  # the cache lengths become the mask rows [B, 1, 1, Sk]
            lengths = torch.tensor([sk - 1000, sk - 7], device="cuda", dtype=torch.int32)
        elif mask_heads == "kv":
            mask = torch.rand(batch, heads_kv, 1, sk, device="cuda") < 0.5
        out = flash_dmattn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, attn_mask=mask, attn_bias=bias,
            softcap=pattern.softcap,
        )  # fmt: skip
        assert out.isfinite().all(), str(pattern)
    assert cache.compile_count() == compiles
    cache.clear_memory()
