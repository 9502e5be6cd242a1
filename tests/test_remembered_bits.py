"""A mask's block bits remembered with the mask (kernels/block_bits_launch.remembered_bits): the
layers of a step that pass one attn_mask run one pre-pass. With recorder kernels (CPU): the
pre-pass launches of repeated forwards, backwards and paired calls, and what makes them run
again (an in-place change, another tensor, another view of it). On the GPU: results after an
in-place change, and a CUDA graph whose replays read the mask they find."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.kernels import bwd_launch, fwd_launch
from dmattn_cute.kernels.block_bits import BlockBitsSpec
from dmattn_cute.kernels.paired_bits import paired_bits
from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec
from dmattn_cute.problem import make_problem
from dmattn_cute.reference import attention_ref
from tests.utils import check_close, random_inputs


def _scans(launches) -> list[tuple]:
    """The pre-pass launches recorded so far: (spec, its mask view, its bits)."""
    return [(s, a[0], a[1]) for s, a in launches["calls"] if isinstance(s, BlockBitsSpec)]


def _inputs(mask_shape=(2, 2, 300, 520)):
    return random_inputs(
        2, 300, 520, 4, 2, 128, torch.bfloat16, "cpu", mask_shape=mask_shape,
        bias_shape=(2, 2, 1, 520),
    )  # fmt: skip


def _check_out(out, q, k, v, mask, bias) -> None:
    """out against the float32 reference for what the mask holds now (SPEC's rule)."""
    ref, _ = attention_ref(q, k, v, mask, bias, compute_dtype=torch.float32)
    lowp, _ = attention_ref(q, k, v, mask, bias)
    check_close("out", out, ref, lowp, q.dtype)


def _forward(q, k, v, mask, bias):
    """One layer's forward: the call validates and views its operands anew, as every call."""
    problem, mask4, bias4 = make_problem(q, k, v, mask, bias, None, False, 0.0, (-1, -1), False)
    return fwd_launch.flash_fwd(problem, q, k, v, mask4, bias4)


def test_forwards_of_one_mask_scan_it_once(launches) -> None:
    q, k, v, mask, bias = _inputs()
    for _ in range(3):
        _forward(q, k, v, mask, bias)
    ((_, view, bits),) = _scans(launches)
    forwards = [a for s, a in launches["calls"] if isinstance(s, Sm90FwdSpec)]
    assert len(forwards) == 3
    assert all(a[8].data_ptr() == bits.data_ptr() for a in forwards)  # the one scan's bits
    assert view.data_ptr() == mask.data_ptr()  # read in place


def _flip_one(mask):
    mask[0, 0, 0, 0] = ~mask[0, 0, 0, 0]
    return mask


def _flip_through_a_view(mask):
    mask[1:].logical_not_()
    return mask


@pytest.mark.parametrize(
    "change",
    [_flip_one, _flip_through_a_view, torch.clone, lambda mask: mask[:, :1]],
    ids=["in-place", "in-place-through-a-view", "an-equal-clone", "another-view"],
)
def test_a_changed_or_other_mask_is_scanned_again(launches, change) -> None:
    q, k, v, mask, bias = _inputs()
    _forward(q, k, v, mask, bias)
    _forward(q, k, v, change(mask), bias)
    assert len(_scans(launches)) == 2


def test_backwards_and_paired_calls_share_the_mask_s_bits(launches) -> None:
    """flash_bwd's own pre-pass and the eager path's paired one (one launch for a forward and
    its backward) are remembered too: a second layer's fwd+bwd scans nothing."""
    q, k, v, mask, bias = _inputs()
    dout = torch.randn_like(q)
    for _ in range(2):
        problem, mask4, bias4 = make_problem(q, k, v, mask, bias, None, False, 0.0, (-1, -1), False)
        fwd_bits, bwd_bits = paired_bits(problem, mask4, bias4, True, "sm_90a", q.device)
        out, _, stats = fwd_launch.flash_fwd(problem, q, k, v, mask4, bias4, bits=fwd_bits)
        bwd_launch.flash_bwd(
            problem, dout, q, k, v, mask4, bias4, out, stats, True, bits=bwd_bits
        )  # fmt: skip
    assert len(_scans(launches)) == 1
    for _ in range(2):  # the op path: the backward's own pre-pass, at the backward's tiles
        bwd_launch.flash_bwd(problem, dout, q, k, v, mask4, bias4, out, stats, True)
    scans = _scans(launches)
    assert len(scans) == 2 and scans[1][0].coarse_rows == 1


def test_bits_given_or_of_an_inference_mask_are_not_remembered(launches) -> None:
    q, k, v, mask, bias = _inputs()
    with torch.inference_mode():
        frozen = mask.clone()  # an inference tensor has no version counter
    for _ in range(2):
        _forward(q, k, v, frozen, bias)
    assert len(_scans(launches)) == 2


@pytest.mark.gpu
@pytest.mark.sm90
def test_in_place_changes_reach_the_kernels() -> None:
    """Calls on one mask tensor before and after in-place changes (of the tensor, and of its
    storage through a view) give the reference's result for what the mask then holds."""
    from dmattn_cute import flash_dmattn_func

    q, k, v, mask, bias = random_inputs(
        2, 300, 520, 4, 2, 128, torch.bfloat16, "cuda", mask_shape=(2, 2, 300, 520),
        bias_shape=(2, 2, 1, 520),
    )  # fmt: skip
    changes = [
        lambda: None,
        lambda: mask[:, :, :, 128:].fill_(False),  # whole tiles empty
        lambda: mask.view(-1)[: mask.numel() // 2].fill_(True),  # whole tiles full
        lambda: mask.copy_(torch.rand_like(mask, dtype=torch.float32) < 0.3),
    ]
    for change in changes:
        change()
        for _ in range(2):
            _check_out(flash_dmattn_func(q, k, v, mask, bias), q, k, v, mask, bias)


@pytest.mark.gpu
@pytest.mark.sm90
def test_a_graph_reads_the_mask_each_replay_holds() -> None:
    """A forward captured after eager calls on the same mask (its bits remembered) runs the
    pre-pass in the graph: a replay after the mask changed in place reads the new mask."""
    from dmattn_cute import flash_dmattn_func

    q, k, v, mask, bias = random_inputs(
        2, 300, 520, 4, 2, 128, torch.bfloat16, "cuda", mask_shape=(2, 2, 300, 520),
        bias_shape=(2, 2, 1, 520),
    )  # fmt: skip

    def step():
        with torch.no_grad():
            return flash_dmattn_func(q, k, v, mask, bias)

    step()
    step()  # remembered
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out = step()
    torch.cuda.current_stream().wait_stream(side)
    for density in (0.05, 0.9):
        mask.copy_(torch.rand(mask.shape, device="cuda") < density)
        mask[:, :, :, :128] = False  # a whole key tile turns empty
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_out(out, q, k, v, mask, bias)


@pytest.mark.gpu
@pytest.mark.sm90
def test_graphs_keep_the_launch_items_they_capture() -> None:
    """The persistent forward's items (launch_order.grid_items) under CUDA graphs: a batch
    first seen inside a capture gets items the graph makes at its replays, not remembered (an
    eager call before the first replay would read them unfilled); items a graph took from the
    memo stay its own when the memo is emptied and the allocator hands memory out again."""
    from dmattn_cute import flash_dmattn_func
    from dmattn_cute.kernels import launch_order

    q, k, v, _, bias = random_inputs(
        2, 1000, 777, 4, 2, 128, torch.bfloat16, "cuda", bias_shape=(2, 2, 1, 777)
    )

    def call(n):  # batch n: its own items, one kernel for both
        with torch.no_grad():
            return flash_dmattn_func(q[:n], k[:n], v[:n], None, bias[:n])

    call(1)  # compiled; batch 1's items remembered
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        outs = {n: call(n) for n in (1, 2)}
    torch.cuda.current_stream().wait_stream(side)
    _check_out(call(2), q, k, v, None, bias)  # before any replay
    launch_order._GRID_ITEMS.clear()
    junk = [torch.full((1 << 16,), -7, dtype=torch.int32, device="cuda") for _ in range(64)]
    for out in outs.values():
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for n, out in outs.items():
        _check_out(out, q[:n], k[:n], v[:n], None, bias[:n])
    del junk
