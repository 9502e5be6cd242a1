"""The SM80-family (mma.sync) kernels on a Hopper GPU: with DMATTN_CUTE_KERNELS=mma_sync an
sm_90a device runs them instead of the wgmma kernels, so the kernels SM80/86/89 run are tested
on the H100/H200 machines too. The forward and backward tests below are those of
test_fwd_gpu.py and test_bwd_gpu.py (the ones that exercise the kernels' features), collected
again here under that setting."""

from __future__ import annotations

import pytest

from tests import test_bwd_gpu, test_fwd_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.usefixtures("mma_sync_kernels")]


def test_the_setting_picks_the_mma_sync_kernels():
    import torch

    from dmattn_cute.jit import target_arch
    from dmattn_cute.kernels.bwd import BwdSpec
    from dmattn_cute.kernels.bwd_launch import backward_spec_of
    from dmattn_cute.kernels.fwd import FwdSpec
    from dmattn_cute.kernels.fwd_launch import forward_spec_of
    from dmattn_cute.problem import make_problem
    from tests.utils import random_inputs

    q, k, v, _, _ = random_inputs(1, 64, 64, 2, 1, 64, torch.bfloat16, "cuda")
    problem, mask4, bias4 = make_problem(q, k, v, None, None, None, False, 0.0, (-1, -1), False)
    assert isinstance(forward_spec_of(problem, mask4, bias4, target_arch()), FwdSpec)
    assert isinstance(backward_spec_of(problem, mask4, bias4, False, target_arch()), BwdSpec)


test_fwd_seqlens = test_fwd_gpu.test_seqlens_mask_and_bias
test_fwd_head_dims = test_fwd_gpu.test_head_dims
test_fwd_flags = test_fwd_gpu.test_flags
test_fwd_fully_masked = test_fwd_gpu.test_fully_masked_rows_and_tiles
test_bwd_seqlens = test_bwd_gpu.test_seqlens_mask_and_bias
test_bwd_head_dims = test_bwd_gpu.test_head_dims
test_bwd_gqa = test_bwd_gpu.test_gqa
test_bwd_dbias_broadcast = test_bwd_gpu.test_dbias_broadcast
test_bwd_flags = test_bwd_gpu.test_flags
test_bwd_softcap = test_bwd_gpu.test_softcap
test_bwd_fully_masked = test_bwd_gpu.test_fully_masked_rows_give_zero_grads
