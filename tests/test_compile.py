"""Offline compiles of the kernels for every supported architecture (no GPU needed)."""

import os
import re
import tempfile

import pytest
import torch

from dmattn_cute.jit import SUPPORTED_ARCHS
from dmattn_cute.kernels.bwd_pre import BwdPreprocessSpec

pytestmark = pytest.mark.compile

BWD_PRE_CASES = [
    pytest.param(torch.float16, 128, id="fp16-d128"),
    pytest.param(torch.bfloat16, 40, id="bf16-d40"),
    pytest.param(torch.bfloat16, 256, id="bf16-d256"),
]


def bwd_pre_ptx(target: str, dtype: torch.dtype, head_dim: int) -> str:
    """PTX of the backward preprocess kernel compiled for ``target``. --keep-ptx writes the PTX
    into --dump-dir (which must exist); the compiled function's artifacts hold its text."""
    spec = BwdPreprocessSpec.for_problem(dtype, head_dim)
    with tempfile.TemporaryDirectory() as dump_dir:
        kernel = spec.compile(target, f"--keep-ptx --dump-dir {dump_dir}")
        return kernel.artifacts.PTX


@pytest.mark.parametrize(("dtype", "head_dim"), BWD_PRE_CASES)
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_bwd_pre_ptx_targets_the_arch(
    target: str, dtype: torch.dtype, head_dim: int, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ptx = bwd_pre_ptx(target, dtype, head_dim)
    assert re.findall(r"^\.target (\S+)", ptx, flags=re.MULTILINE) == [target]
    assert os.listdir(tmp_path) == [], "compiling left files in the working directory"


@pytest.mark.parametrize(("dtype", "head_dim"), BWD_PRE_CASES)
@pytest.mark.parametrize("target", SUPPORTED_ARCHS)
def test_bwd_pre_loads_128_bit_vectors(target: str, dtype: torch.dtype, head_dim: int) -> None:
    loads = re.findall(r"\bld\.global\.\S+", bwd_pre_ptx(target, dtype, head_dim))
    assert loads and all(".v4.b32" in load for load in loads), loads
