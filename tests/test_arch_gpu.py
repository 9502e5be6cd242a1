"""Per-architecture GPU tests: each runs only on a GPU of its arch (marker sm80/86/89/90) and
checks that the kernels picked for that arch fit it and compute the right thing."""

import pytest
import torch

from dmattn_cute.jit import smem_capacity, target_arch
from dmattn_cute.kernels.bwd_launch import backward_spec_of
from dmattn_cute.kernels.fwd_launch import forward_spec_of
from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
from dmattn_cute.problem import make_problem
from tests.utils import grads_and_check, random_inputs

ARCHS = [
    pytest.param("sm_80", marks=pytest.mark.sm80),
    pytest.param("sm_86", marks=pytest.mark.sm86),
    pytest.param("sm_89", marks=pytest.mark.sm89),
    pytest.param("sm_90a", marks=pytest.mark.sm90),
]
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_arch_kernels_fit_and_match_reference(arch: str, head_dim: int) -> None:
    """The heaviest shared-memory case (full mask and bias, causal, GQA) on this arch."""
    assert target_arch() == arch
    b, sq, sk, h, hkv = 2, 257, 383, 4, 2
    q, k, v, mask, bias = random_inputs(
        b, sq, sk, h, hkv, head_dim, torch.bfloat16, "cuda", (b, h, sq, sk), (b, h, sq, sk)
    )
    problem, mask4, bias4 = make_problem(q, k, v, mask, bias, None, True, 0.0, (-1, -1), False)
    fwd = forward_spec_of(problem, mask4, bias4, arch)
    bwd = backward_spec_of(problem, mask4, bias4, True, arch)
    assert fwd.smem_bytes() <= smem_capacity(arch)
    assert bwd.smem_bytes() <= smem_capacity(arch)
    # Hopper runs its wgmma backward (dq by TMA reduce-add); elsewhere dq partial sums are
    # single-float atomics (paired red.global.add.v2.f32 exist only on sm_90).
    assert isinstance(bwd, Sm90BwdSpec) == (arch == "sm_90a")
    assert arch == "sm_90a" or not bwd.vector_atomics
    grads_and_check(q, k, v, mask, bias, is_causal=True)
