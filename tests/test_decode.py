"""The packed, split decode path (dmattn_cute/decode.py): the group's query heads as rows and
the keys in chunks give flash_dmattn_func's result (out and lse), also where a chunk or a whole
row has no visible key. On CPU (the reference path) and, marked gpu, on CUDA."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.decode import chunk_fold, decode_splits, packable, packed_decode
from dmattn_cute.reference import attention_ref
from tests.utils import check_close, random_inputs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_heads", [2, 1])
@pytest.mark.parametrize("layout", ["contiguous", "heads-major"])
@pytest.mark.parametrize("splits", [1, 3, 7])  # 301 keys: 7 chunks run as one forward
def test_packed_split_decode_matches_reference(device, splits, layout, mask_heads):
    b, sk, h, hkv, d = 3, 301, 8, 2, 64
    q, k, v, mask, bias = random_inputs(
        b, 1, sk, h, hkv, d, torch.bfloat16, device,
        mask_shape=(b, mask_heads, 1, sk), bias_shape=(1, hkv, 1, sk), mask_density=0.6,
    )  # fmt: skip
    if layout == "heads-major":  # [B, Hkv, Sk, D] storage, as transformers' caches hold it
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    assert chunk_fold(k, v, splits) == (
        None if splits != 7 else {"contiguous": "batch", "heads-major": "heads"}[layout]
    )
    mask[0, :, :, :200] = False  # whole chunks without a visible key
    mask[1] = False  # a row that sees no key at all
    assert packable(q, k, (mask, bias))
    out, lse = packed_decode(q, k, v, mask, bias, None, 0.0, splits)
    ref, ref_lse = attention_ref(q, k, v, mask, bias, compute_dtype=torch.float32)
    lowp, _ = attention_ref(q, k, v, mask, bias)
    check_close("out", out, ref, lowp, q.dtype)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and lse[1].isneginf().all()
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_heads", [2, 1, None])
@pytest.mark.parametrize("bias_shape", [(1, 2, 1, 2048), (3, 2, 1, 1), None])
def test_split_decode_reads_the_operand_rows_in_place(monkeypatch, mask_heads, bias_shape):
    """The one forward gets the caller's queries, keys, values and mask/bias rows themselves
    (the same storage, no copies in chunk order) with key_chunks, and the result is the
    reference's, with whole chunks and a whole row without a visible key."""
    from dmattn_cute import decode
    from dmattn_cute.problem import broadcast_view

    calls = []
    forward = decode.flash_fwd
    monkeypatch.setattr(
        decode, "flash_fwd", lambda *a, **kw: calls.append((a, kw)) or forward(*a, **kw)
    )
    b, sk, h, hkv, d = 3, 2048, 8, 2, 128
    mask_shape = None if mask_heads is None else (b, mask_heads, 1, sk)
    q, k, v, mask, bias = random_inputs(
        b, 1, sk, h, hkv, d, torch.bfloat16, "cuda", mask_shape=mask_shape,
        bias_shape=bias_shape, mask_density=0.6,
    )  # fmt: skip
    if mask is not None:
        mask[0, :, :, :1024] = False  # whole chunks without a visible key
        mask[1] = False  # a row that sees no key at all
    mask4, bias4 = broadcast_view(mask), broadcast_view(bias)
    out, lse = packed_decode(q, k, v, mask4, bias4, None, 0.0, 4)
    ((args, kwargs),) = calls
    assert kwargs == {"key_chunks": 4, "block_table": None}
    queries = args[1]  # q's storage: one entry per row, read by every chunk of the row
    assert queries.shape == (b, h // hkv, hkv, d) and queries.data_ptr() == q.data_ptr()
    assert args[2] is k and args[3] is v  # whole rows: the kernel splits their key blocks
    for given, passed in zip((mask4, bias4), args[4:6], strict=True):
        if given is None:
            assert passed is None
        else:  # the same view of the same storage
            assert passed.data_ptr() == given.data_ptr()
            assert (passed.shape, passed.stride()) == (given.shape, given.stride())
    ref, ref_lse = attention_ref(q, k, v, mask, bias, compute_dtype=torch.float32)
    lowp, _ = attention_ref(q, k, v, mask, bias)
    check_close("out", out, ref, lowp, q.dtype)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)


def test_key_chunks_refusals():
    """What fwd_launch.flash_fwd's key_chunks refuses, before any launch: batch entries that are
    not whole rows of chunks, and mask/bias rows of another batch."""
    import dataclasses

    from dmattn_cute.kernels.fwd_launch import key_chunks_refusal
    from dmattn_cute.kernels.launch import operand_view
    from dmattn_cute.problem import make_problem

    def refusal(batch, chunks, mask_shape, bias_shape=None, seqlen_k=2048):
        q = torch.empty(2, 4, 2, 64, dtype=torch.bfloat16, device="meta")
        k = torch.empty(2, seqlen_k, 2, 64, dtype=torch.bfloat16, device="meta")
        problem, _, _ = make_problem(q, k, k, None, None, None, False, 0.0, (-1, -1), False)
        problem = dataclasses.replace(problem, batch=batch)
        mask, bias = (
            None if shape is None else torch.empty(shape, dtype=dtype, device="meta")
            for shape, dtype in ((mask_shape, torch.bool), (bias_shape, torch.bfloat16))
        )
        return key_chunks_refusal(problem, operand_view(mask), operand_view(bias), chunks)

    assert refusal(8, 4, (2, 2, 1, 2048)) is None
    assert refusal(8, 4, (1, 1, 1, 2048), (2, 2, 1, 1)) is None
    # any key count, and a bias with a row per query (read by TMA on Hopper)
    assert refusal(8, 4, (2, 2, 1, 2001), (2, 2, 4, 2001), seqlen_k=2001) is None
    assert "does not divide the batch 6" in refusal(6, 4, (2, 2, 1, 2048))
    assert "mask: expected [1 or 2, Hm, Qm, Km]" in refusal(8, 4, (8, 2, 1, 2048))
    assert "bias: expected" in refusal(8, 4, None, (8, 2, 1, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_k", [8192, 262144])
@pytest.mark.parametrize("kernels", ["default", "mma_sync"])
def test_key_chunks_split_the_visible_blocks(monkeypatch, kernels, seqlen_k):
    """flash_fwd's key_chunks: a row's chunks cover its keys once (no gaps, no overlaps); on
    the Hopper kernel (block bits) and rows of at most masking.CHUNK_BALANCE_MAX_BLOCKS key
    tiles they hold as many visible blocks each (within one tile), also where the visible
    keys crowd one end of the row; else (the mma.sync kernel, longer rows) they are equal key
    ranges. Seen through the chunks' lse: with q = 0 every score is 0, and a chunk's lse is
    the log of its visible keys (-inf for none)."""
    import dataclasses

    from dmattn_cute.jit import KERNELS_ENV
    from dmattn_cute.kernels import masking
    from dmattn_cute.kernels.fwd_launch import flash_fwd
    from dmattn_cute.problem import broadcast_view, make_problem

    if kernels == "mma_sync":
        monkeypatch.setenv(KERNELS_ENV, "mma_sync")
    rows, sk, hkv, group, d, chunks = 3, seqlen_k, 2, 4, 64, 8
    q = torch.zeros(rows, group, hkv, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(rows, sk, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in "kv")
    mask = torch.zeros(rows, hkv, 1, sk, dtype=torch.bool, device="cuda")
    blocks = mask.view(rows, hkv, 1, sk // 128, 128)
    blocks[0, :, :, :24] = True  # 24 blocks of 128 keys, all in the first 3 of 8 key ranges
    blocks[1, 0, :, ::3] = True  # spread over the row
    blocks[1, 1, :, -5:] = True  # 5 blocks at the end: 3 chunks without any
    problem, _, _ = make_problem(q, k, v, None, None, None, False, 0.0, (-1, -1), False)
    problem = dataclasses.replace(problem, batch=rows * chunks)
    out = torch.full((rows * chunks, group, hkv, d), float("nan"), dtype=q.dtype, device="cuda")
    _, lse, _ = flash_fwd(problem, q, k, v, broadcast_view(mask), None, out, key_chunks=chunks)
    keys = lse.view(rows, chunks, hkv, group).exp().round()  # visible keys of each chunk
    assert torch.equal(keys, keys[..., :1].expand_as(keys))  # the same for a group's heads
    keys = keys[..., 0]
    assert torch.equal(keys.sum(1), mask.sum(-1)[..., 0].float())
    assert not out.isnan().any()
    equal_ranges = mask.view(rows, hkv, chunks, sk // chunks).sum(-1).transpose(1, 2).float()
    # more key tiles than balanced, whether they are 64 or 128 keys wide
    if kernels == "mma_sync" or seqlen_k > masking.CHUNK_BALANCE_MAX_BLOCKS * 128:
        assert torch.equal(keys, equal_ranges)
    else:
        spread = keys.amax(1) - keys.amin(1)
        assert (spread <= 128).all(), keys
        assert not torch.equal(keys, equal_ranges)


def test_what_packs():
    q, k, _, _, _ = random_inputs(2, 1, 64, 8, 2, 32, torch.bfloat16, "cpu")
    per_head = torch.zeros(2, 8, 1, 64)
    assert packable(q, k, (None, torch.zeros(2, 2, 1, 64)))
    assert not packable(q, k, (None, per_head))  # per query head: not shared by a group
    q2, k2, _, _, _ = random_inputs(2, 2, 64, 8, 2, 32, torch.bfloat16, "cpu")
    assert not packable(q2, k2, (None, None))  # two queries per row


def test_splits_fill_the_gpu_with_long_enough_chunks():
    assert decode_splits(8, 4, 32768, 132) == 8  # up to 9 (2 x 132 CTAs / 32 pairs), dividing
    assert decode_splits(8, 4, 1000, 132) == 2  # chunks of at least 512 keys
    assert decode_splits(8, 4, 32771, 132) == 9  # a prime: no divisor, chunks in a loop
    assert decode_splits(64, 8, 4096, 132) == 1


def _step(q, k, v, mask=None, bias=None, window=(-1, -1)):
    from dmattn_cute.decode import decode_step
    from dmattn_cute.problem import make_problem

    problem, _, _ = make_problem(q, k, v, mask, bias, None, True, 0.0, window, False)
    return decode_step(problem, q, k, v, mask, bias)


def test_plain_decode_steps_run_packed_where_alike(monkeypatch):
    """flash_dmattn_func's decode route (decode.decode_step; eager CUDA calls take it):
    one query per row with nothing to record, folded chunks or a packed group, no left
    window, enough keys; its result is the reference's. Run here on CPU tensors (the
    reference forward per chunk)."""
    from dmattn_cute import decode

    b, sk, h, hkv, d = 2, 2048, 8, 2, 64
    q, k, v, mask, bias = random_inputs(
        b, 1, sk, h, hkv, d, torch.bfloat16, "cpu", mask_shape=(b, 1, 1, sk), bias_shape=(b, hkv, sk)
    )  # fmt: skip
    assert _step(q, k, v, mask, bias) is None  # fewer keys than PLAIN_DECODE_MIN_KEYS
    monkeypatch.setattr(decode, "PLAIN_DECODE_MIN_KEYS", sk)
    heads_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)]
    for keys, values in ((k, v), heads_major):
        out, lse = _step(q, keys, values, mask, bias)
        ref, ref_lse = attention_ref(q, k, v, mask, bias, compute_dtype=torch.float32)
        lowp, _ = attention_ref(q, k, v, mask, bias)
        check_close("out", out, ref, lowp, q.dtype)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    assert _step(q, k, v, mask, bias, window=(100, -1)) is None  # a left window limits keys
    assert _step(q, k, v, mask, bias, window=(sk - 1, -1)) is not None  # ... this one does not
    q2, k2, v2, _, _ = random_inputs(b, 2, sk, h, hkv, d, torch.bfloat16, "cpu")
    assert _step(q2, k2, v2) is None  # two queries per row
    per_head = torch.rand(b, h, 1, sk) < 0.5
    assert _step(q, k, v, per_head) is None  # a mask per query head: not shared by a group
    strided = [
        t[:, :, :1] for t in random_inputs(b, 1, sk, h, 2 * hkv, d, torch.bfloat16, "cpu")[1:3]
    ]
    assert _step(q[:, :, :4], *strided) is None  # a sliced cache: chunks not foldable
    with torch.enable_grad():
        assert _step(q.requires_grad_(), k, v) is None  # autograd records the call


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("layout", ["contiguous", "heads-major"])
def test_plain_decode_call_on_cuda(monkeypatch, layout, heads):
    """flash_dmattn_func with one query per row under no_grad, as transformers' decode steps
    call it: eager with fewer keys than PLAIN_DECODE_MIN_KEYS, one plain launch; with enough
    keys, and captured into a CUDA graph, packed and split (the combine kernel runs). Every
    way gives the reference's result."""
    from dmattn_cute import decode, flash_dmattn_func

    merged = []
    combine = decode.combine_splits
    monkeypatch.setattr(decode, "combine_splits", lambda *a: merged.append(1) or combine(*a))
    (h, hkv), b, sk, d = heads, 2, 4096, 128
    q, k, v, mask, bias = random_inputs(
        b, 1, sk, h, hkv, d, torch.bfloat16, "cuda", mask_shape=(b, 1, 1, sk), bias_shape=(b, hkv, sk)
    )  # fmt: skip
    if layout == "heads-major":
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    ref, ref_lse = attention_ref(q, k, v, mask, bias, compute_dtype=torch.float32)
    lowp, _ = attention_ref(q, k, v, mask, bias)

    def step():
        with torch.no_grad():
            return flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)

    def check(out, lse):
        check_close("out", out, ref, lowp, q.dtype)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)

    check(*step())
    assert merged == []  # fewer keys than PLAIN_DECODE_MIN_KEYS: one launch
    with monkeypatch.context() as patch:
        patch.setattr(decode, "PLAIN_DECODE_MIN_KEYS", sk)
        check(*step())  # (also compiles the packed path's kernels before the capture)
    assert merged == [1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out, lse = step()
    assert merged == [1, 1]  # captured: packed
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out, lse)
