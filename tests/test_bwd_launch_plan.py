"""The backward launch's plan cache (kernels/bwd_launch.py), on the CPU: kernels are replaced
by recorders, so what is checked is which variants and arguments a call launches, and when
the plan behind them is made again."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.jit import KERNELS_ENV, cache
from dmattn_cute.kernels import bwd_launch
from dmattn_cute.kernels.block_bits import BlockBitsSpec
from dmattn_cute.kernels.bwd import BwdSpec
from dmattn_cute.kernels.bwd_pre import BwdPreprocessSpec
from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec
from dmattn_cute.problem import make_problem

B, SQ, SK, H, HKV, D = 2, 300, 200, 4, 2, 64


def backward(
    mask, bias, bias_grad=True, deterministic=False, heads_kv=HKV, batch=B, causal=False, heads=H,
    one_storage=False,
):  # fmt: skip
    q = torch.randn(batch, SQ, heads, D, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, SK, heads_kv, D, dtype=torch.bfloat16) for _ in range(2))
    problem, mask4, bias4 = make_problem(
        q, k, v, mask, bias, None, causal, 0.0, (-1, -1), deterministic
    )
    out, dout = torch.randn_like(q), torch.randn_like(q)
    stats = torch.zeros(batch, heads, 2, SQ)
    return bwd_launch.flash_bwd(
        problem, dout, q, k, v, mask4, bias4, out, stats, bias_grad, one_storage=one_storage
    )


def kernels(launches):
    return [type(spec) for spec, _ in launches["calls"]]


def test_same_layouts_reuse_the_plan(launches) -> None:
    mask = torch.rand(B, HKV, SQ, SK) < 0.5
    bias = torch.randn(B, HKV, 1, SK, dtype=torch.bfloat16)
    backward(mask, bias)
    compiled_once = list(launches["compiled"])
    backward(mask.clone(), bias.clone())  # new tensors, same layouts
    # one plan: the preprocess, the backward and (made per call) the block-bits pre-pass
    assert [type(s) for s in compiled_once[:2]] == [BwdPreprocessSpec, Sm90BwdSpec]
    assert launches["compiled"][3:] == [compiled_once[2]]  # only the pre-pass looked up again
    once = [BwdPreprocessSpec, BlockBitsSpec, Sm90BwdSpec]
    assert kernels(launches) == once * 2
    # the second call's Hopper kernel: its own dpsum, written by its preprocess, and bits
    pre, bits, main = (args for _, args in launches["calls"][3:])
    assert main[5] is pre[2] and main[14].data_ptr() == bits[1].data_ptr()


def test_another_dbias_request_makes_another_plan(launches) -> None:
    bias = torch.randn(B, HKV, 1, SK, dtype=torch.bfloat16)
    dq, dk, dv, dbias = backward(None, bias, bias_grad=False)
    assert dbias is None
    dq, dk, dv, dbias = backward(None, bias, bias_grad=True)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    plain, with_dbias = (s for s in launches["compiled"] if isinstance(s, Sm90BwdSpec))
    assert plain.dbias is None and with_dbias.dbias is not None
    assert (dq.shape, dk.shape, dv.shape) == ((B, SQ, H, D), (B, SK, HKV, D), (B, SK, HKV, D))


def test_one_zeroed_allocation_holds_dq_and_the_fp32_dbias(launches) -> None:
    """A key bias's dbias is summed into a zeroed fp32 buffer: the one fill that zeroes the dq
    accumulator zeroes it too (one allocation), and it still starts 16-byte aligned."""
    bias = torch.randn(B, HKV, 1, SK, dtype=torch.bfloat16)
    *_, dbias = backward(None, bias)
    spec, args = launches["calls"][-1]
    dq_acc, dbias_buf = args[6], args[16]
    assert isinstance(spec, Sm90BwdSpec) and not spec.dbias.direct
    assert dq_acc.dtype == dbias_buf.dtype == torch.float32
    assert dq_acc.untyped_storage().data_ptr() == dbias_buf.untyped_storage().data_ptr()
    assert dbias_buf.data_ptr() % 16 == 0 and not dbias_buf.any()
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype


@pytest.mark.parametrize("one_storage", [False, True])
def test_fp32_sums_come_back_in_the_inputs_dtype(launches, monkeypatch, one_storage) -> None:
    """dq, the split dk / dv partial sums and a key bias's dbias are fp32 sums the caller gets
    in the inputs' dtype; one_storage (the eager path) casts them by one call, as views of
    one tensor."""
    recorder = bwd_launch.compiled

    def compiled(spec, arch):
        call = recorder(spec, arch)

        def run(*args):
            call(*args)
            if isinstance(spec, Sm90BwdSpec):  # the kernel's sums
                for t in (args[6], args[7], args[8], args[16]):
                    t.copy_(torch.randn_like(t))

        return run

    monkeypatch.setattr(bwd_launch, "compiled", compiled)
    bias = torch.randn(1, 1, 1, SK, dtype=torch.bfloat16)
    grads = backward(None, bias, heads_kv=1, batch=1, one_storage=one_storage)
    spec, args = launches["calls"][-1]
    assert spec.split_heads and not spec.dbias.direct
    for got, index in zip(grads, (6, 7, 8, 16), strict=True):
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        assert torch.equal(got, args[index].to(torch.bfloat16).view(got.shape))
    storages = {t.untyped_storage().data_ptr() for t in grads}
    assert len(storages) == (1 if one_storage else 4)


def test_heads_split_and_deterministic_rotation(launches) -> None:
    """B1 MQA: few CTAs, so the group's heads split (fp32 dk/dv partials); deterministic with
    no more key blocks than query blocks: the walks rotate."""
    backward(None, None, heads_kv=1, batch=1, deterministic=True)
    (spec, args) = launches["calls"][-1]
    assert isinstance(spec, Sm90BwdSpec) and spec.split_heads and spec.deterministic
    splits, query_splits, rotate = args[9], args[10], args[11]
    assert splits == 4 and query_splits == 1 and rotate == 1
    # dq and the dk / dv partial sums: zeroed fp32 parts of one allocation, 16-byte aligned
    accumulators = args[6:9]
    base = accumulators[0].untyped_storage().data_ptr()
    for t in accumulators:
        assert t.dtype == torch.float32 and t.is_contiguous() and not t.any()
        assert t.untyped_storage().data_ptr() == base and t.data_ptr() % 16 == 0
    assert [t.shape for t in accumulators] == [(1, SQ, H, D), (1, SK, 1, D), (1, SK, 1, D)]
    assert args[7].dtype == torch.float32 and args[18] is not None  # dk partials, dK/dV turns


def test_masked_long_walks_split_the_query_range(launches, monkeypatch) -> None:
    """With a mask, each key block's query range is split in shares of about
    QUERY_SPLIT_ROWS rows (fp32 dk/dv partials), and a per-query-head bias's column sums,
    which several CTAs then add into, go to an fp32 buffer instead of being stored. Not
    without a mask, nor deterministic."""
    monkeypatch.setattr(bwd_launch, "QUERY_SPLIT_ROWS", 128)
    mask = torch.rand(B, HKV, SQ, SK) < 0.5
    rows_bias = torch.randn(B, H, 1, SK, dtype=torch.bfloat16)
    *_, dbias = backward(mask, rows_bias)
    spec, args = launches["calls"][-1]
    assert isinstance(spec, Sm90BwdSpec) and spec.split_heads and args[10] == 3  # ceil(300/128)
    assert args[7].dtype == torch.float32 and not spec.dbias.direct
    assert args[16].dtype == torch.float32 and dbias.dtype == torch.bfloat16
    backward(None, rows_bias)
    spec, args = launches["calls"][-1]
    assert args[10] == 1 and spec.dbias.direct
    backward(mask, rows_bias, deterministic=True)
    spec, args = launches["calls"][-1]
    assert args[10] == 1 and spec.dbias.direct


def test_clearing_the_kernel_memory_clears_the_plans(launches) -> None:
    backward(None, None)
    cache.clear_memory()
    backward(None, None)
    assert [type(s) for s in launches["compiled"]] == [BwdPreprocessSpec, Sm90BwdSpec] * 2


def test_the_kernels_setting_makes_another_plan(launches, monkeypatch) -> None:
    """DMATTN_CUTE_KERNELS=mma_sync after a plan was made on sm_90a: the mma.sync backward
    runs, not the remembered Hopper plan."""
    backward(None, None)
    monkeypatch.setenv(KERNELS_ENV, "mma_sync")
    backward(None, None)
    assert kernels(launches) == [BwdPreprocessSpec, Sm90BwdSpec, BwdPreprocessSpec, BwdSpec]


def test_causal_walks_launch_longest_first(launches) -> None:
    """Under causal limits (not deterministic) the kernel takes a launch order (every (batch,
    kv head, key block) once; bwd_launch.walk_order), made once per problem; without limits,
    or deterministic, none."""
    backward(None, None, causal=True)
    spec, args = launches["calls"][-1]
    n_blocks = -(-SK // spec.tile.tile_n)
    assert spec.ordered and args[15].dtype == torch.int32
    assert sorted(args[15].tolist()) == list(range(B * HKV * n_blocks))
    backward(None, None, causal=True)
    assert launches["calls"][-1][1][15] is args[15]  # the same order tensor
    for causal, deterministic in ((False, False), (True, True)):
        backward(None, None, causal=causal, deterministic=deterministic)
        spec, args = launches["calls"][-1]
        assert not spec.ordered and args[15] is None


def test_mma_sync_split_sums_its_head_slots(launches, monkeypatch) -> None:
    """The mma.sync backward with split heads (few CTAs) gets fp32 dK/dV buffers of a head
    slot per (kv head, split), slot hk * splits + s, and its split count; the call returns
    each kv head's slots summed, in the input dtype."""
    monkeypatch.setenv(KERNELS_ENV, "mma_sync")
    record = bwd_launch.compiled

    def compiled(spec, arch):
        call = record(spec, arch)

        def fill(*args):  # a kernel that writes slot i with i + 1
            call(*args)
            if isinstance(spec, BwdSpec) and spec.split_heads:
                for slots in args[7:9]:
                    slots.copy_(torch.arange(1, slots.shape[2] + 1).view(1, 1, -1, 1))

        return fill

    monkeypatch.setattr(bwd_launch, "compiled", compiled)
    _, dk, dv, _ = backward(None, None, batch=1, heads=4 * HKV)
    spec, args = launches["calls"][-1]
    assert isinstance(spec, BwdSpec) and spec.split_heads
    splits = args[9]
    assert splits == 4  # the whole group: 4 CTAs are far from a wave
    assert args[7].shape == (1, SK, HKV * splits, D) and args[7].dtype == torch.float32
    for grad in (dk, dv):
        assert grad.shape == (1, SK, HKV, D) and grad.dtype == torch.bfloat16
        for hk in range(HKV):
            total = sum(range(hk * splits + 1, (hk + 1) * splits + 1))
            assert torch.equal(grad[:, :, hk], torch.full_like(grad[:, :, hk], total))
