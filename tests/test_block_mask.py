"""Block masks (dmattn_cute/block_mask.py): flash_dmattn_func(block_mask=...) against the
reference with the element mask a block mask stands for (built here by indexing), its
validation, create_block_mask against a brute force, and the kernel bits of
kernels/block_mask_launch.py against the tiles of the element mask. On CPU (the ops'
reference path) and, marked gpu, on CUDA (the Hopper kernels' bits, or the element mask)."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute import create_block_mask, flash_dmattn_func
from dmattn_cute.block_mask import BLOCK, block_counts, visible_blocks
from dmattn_cute.kernels.block_mask_launch import block_bits, joint_mask
from dmattn_cute.kernels.masking import FULL, VISIBLE
from dmattn_cute.problem import Problem, broadcast_view
from dmattn_cute.reference import visible_mask
from tests.utils import compact_mask_grads_and_check, launch_block_mask, random_inputs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def element_mask(block_mask, seqlen_q, seqlen_k):
    """block_mask[b, h, i // BLOCK, j // BLOCK] (row 0 when Mq = 1), by gathering."""
    rows = torch.arange(seqlen_q, device=block_mask.device) // BLOCK
    cols = torch.arange(seqlen_k, device=block_mask.device) // BLOCK
    if block_mask.shape[2] == 1:
        return block_mask[:, :, :, cols]
    return block_mask[:, :, rows][:, :, :, cols]


def random_block_mask(shape, density, device, generator=None):
    return torch.rand(shape, generator=generator, device=device) < density


def attention_and_grads(q, k, v, mask, bias, block_mask, **kwargs):
    """Ours with block_mask vs the fp32 and low-precision references with the element mask
    (ANDed with mask); outputs and the gradients of q, k, v and bias checked."""
    sq, sk = q.shape[1], k.shape[1]
    dense = element_mask(block_mask, sq, sk)
    if mask is not None:
        m4 = mask.unsqueeze(2) if mask.dim() == 3 else mask
        group = q.shape[2] // k.shape[2]
        heads = max(m4.shape[1], dense.shape[1])
        m4, dense = (
            t.repeat_interleave(group, 1) if 1 < t.shape[1] < heads else t for t in (m4, dense)
        )
        dense = m4 & dense
    compact_mask_grads_and_check(q, k, v, mask, bias, dense, {"block_mask": block_mask}, **kwargs)


CASES = {
    "causal-tails": {"sq": 300, "sk": 520, "block": (2, 1, 3, 5), "is_causal": True},
    "gqa-heads-bias": {"sq": 257, "sk": 257, "block": (1, 4, 3, 3), "bias": (2, 4, 1, 257)},
    "query-broadcast-with-mask": {"sq": 200, "sk": 384, "block": (2, 2, 1, 3),
                                  "mask": (2, 1, 200, 384)},
    "kv-mask-per-head-blocks": {"sq": 129, "sk": 300, "block": (2, 4, 2, 3),
                                "mask": (1, 2, 1, 300), "bias": (1, 4, 129, 300)},
    "window-softcap": {"sq": 256, "sk": 256, "block": (2, 2, 2, 2), "window_size": (100, 20),
                       "softcap": 5.0},
}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_the_reference_with_the_element_mask(case, device) -> None:
    batch, heads, heads_kv, head_dim = 2, 4, 2, 64
    q, k, v, mask, bias = random_inputs(
        batch, case["sq"], case["sk"], heads, heads_kv, head_dim, torch.bfloat16, device,
        mask_shape=case.get("mask"), bias_shape=case.get("bias"), mask_density=0.7,
    )  # fmt: skip
    block_mask = random_block_mask(case["block"], 0.6, device)
    block_mask[0, 0, 0] = False  # a query block row with no visible key block
    kwargs = {key: case[key] for key in ("is_causal", "window_size", "softcap") if key in case}
    attention_and_grads(q, k, v, mask, bias, block_mask, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_head_dims_and_deterministic_on_gpu(head_dim, deterministic) -> None:
    """D64/128: the Hopper kernels read the bits (on sm_90a); D256's forward key tiles (80)
    do not nest in blocks and a deterministic sum of a broadcast bias's gradient runs the
    mma.sync backward: both on the element mask."""
    q, k, v, _, bias = random_inputs(
        1, 640, 700, 4, 1, head_dim, torch.float16, "cuda", bias_shape=(1, 1, 1, 700)
    )
    block_mask = random_block_mask((1, 4, 5, 6), 0.5, "cuda")
    attention_and_grads(
        q, k, v, None, bias, block_mask, is_causal=True, deterministic=deterministic
    )


@pytest.mark.gpu
@pytest.mark.parametrize("ctas", [1, 3, 7])
@pytest.mark.parametrize(
    ("head_dim", "dtype", "bias_shape", "causal"),
    [
        (64, torch.bfloat16, None, False),
        (128, torch.float16, (2, 2, 1, 700), True),
        (128, torch.bfloat16, (2, 1, 1, 700), False),
    ],
)
def test_persistent_ctas_take_many_items(ctas, head_dim, dtype, bias_shape, causal, monkeypatch):
    """A block mask alone on a Hopper forward whose CTAs each walk many items in turn (the
    launch told there are `ctas` SMs): rows with no, some and every key block visible (the
    dense walk) follow one another in a CTA; key tails, causal limits, a key bias."""
    from dmattn_cute.kernels import fwd_launch

    monkeypatch.setattr(fwd_launch, "sm_count", lambda device, arch: ctas)
    q, k, v, _, bias = random_inputs(
        2, 650, 700, 4, 2, head_dim, dtype, "cuda", bias_shape=bias_shape
    )
    block_mask = random_block_mask((2, 2, 6, 6), 0.5, "cuda")
    block_mask[0, 0, 1] = False  # no visible key block
    block_mask[1, :, 2:4] = True  # every key block visible
    attention_and_grads(q, k, v, None, bias, block_mask, is_causal=causal)


@pytest.mark.parametrize(
    ("shape", "dtype", "error", "match"),
    [
        ((2, 2, 3, 5), torch.float32, TypeError, "block_mask: expected dtype torch.bool"),
        ((2, 2, 3, 4), torch.bool, ValueError, r"Mk = 5 \(ceil\(Sk / 128\)\)"),
        ((2, 3, 3, 5), torch.bool, ValueError, r"Hm in \{1, 2, 4\}"),
        ((2, 2, 2, 5), torch.bool, ValueError, r"Mq in \{1, 3\}"),
        ((2, 2, 5), torch.bool, ValueError, "expected \\[Bm, Hm, Mq, Mk\\]"),
    ],
)
def test_bad_block_masks_raise(shape, dtype, error, match) -> None:
    q, k, v, _, _ = random_inputs(2, 300, 520, 4, 2, 32, torch.bfloat16, "cpu")
    with pytest.raises(error, match=match):
        flash_dmattn_func(q, k, v, block_mask=torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize(
    ("sq", "sk", "causal", "window"),
    [
        (300, 300, True, (-1, -1)),
        (100, 700, True, (-1, -1)),
        (700, 100, True, (-1, -1)),
        (500, 520, False, (130, 0)),
        (500, 520, False, (-1, 5)),
        (500, 520, True, (300, 40)),
        (129, 1000, False, (0, 0)),
    ],
)
@pytest.mark.parametrize("blocks", [(BLOCK, BLOCK), (64, 128), (128, 64)])
def test_visible_blocks_are_the_blocks_of_the_visible_mask(sq, sk, causal, window, blocks) -> None:
    element = visible_mask(None, 1, 1, sq, sk, causal, window)[0, 0]
    block_q, block_k = blocks
    m_blocks, n_blocks = -(-sq // block_q), -(-sk // block_k)
    pad = torch.zeros(m_blocks * block_q, n_blocks * block_k, dtype=torch.bool)
    pad[:sq, :sk] = element
    expected = pad.view(m_blocks, block_q, n_blocks, block_k).any(3).any(1)
    assert torch.equal(visible_blocks(sq, sk, causal, *window, "cpu", *blocks), expected)


def test_create_block_mask_keeps_the_top_visible_blocks() -> None:
    scores = torch.randn(2, 3, 1000)
    scores[0, 0, 256:384] = -torch.inf  # a key block that can never be kept
    kept = create_block_mask(scores, 3, seqlen_q=900, is_causal=True)
    m_blocks, n_blocks = block_counts(900, 1000)
    assert kept.shape == (2, 3, m_blocks, n_blocks)
    visible = visible_blocks(900, 1000, True, -1, -1, "cpu")
    padded = torch.nn.functional.pad(scores, (0, n_blocks * BLOCK - 1000), value=-torch.inf)
    block_scores = padded.view(2, 3, n_blocks, BLOCK).amax(3)
    for b in range(2):
        for h in range(3):
            for m in range(m_blocks):
                candidates = [
                    (block_scores[b, h, n].item(), n)
                    for n in range(n_blocks)
                    if visible[m, n] and block_scores[b, h, n] > -torch.inf
                ]
                want = {n for _, n in sorted(candidates, reverse=True)[:3]}
                assert set(kept[b, h, m].nonzero().flatten().tolist()) == want


@pytest.mark.parametrize(("tile_m", "tile_n"), [(64, 128), (128, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize("rows", [1, 3])
def test_kernel_bits_are_the_tiles_of_the_element_mask(tile_m, tile_n, rows) -> None:
    """Bits of each (tile_m, tile_n) tile: 0 where its block is False, VISIBLE | FULL where
    True, VISIBLE only on the tail tiles of Sq and Sk (the kernel reads their mask tile)."""
    sq, sk, heads = 300, 520, 4
    problem = Problem.from_tensors(
        torch.empty(2, sq, heads, 32), torch.empty(2, sk, 2, 32), softmax_scale=1.0,
        is_causal=False, softcap=0.0, window_left=-1, window_right=-1, deterministic=False,
    )  # fmt: skip
    block_mask = random_block_mask((2, 2, rows, 5), 0.5, "cpu")
    bits = block_bits(block_mask, problem, tile_m, tile_n, heads)
    m_tiles, n_tiles = -(-sq // tile_m), -(-sk // tile_n)
    element = element_mask(block_mask, sq, sk).repeat_interleave(2, 1)  # [2, 4, Sq|1, Sk]
    for m in range(m_tiles):
        for n in range(n_tiles):
            tile = element[:, :, 0 if rows == 1 else slice(m * tile_m, (m + 1) * tile_m)]
            tile = tile[..., n * tile_n : (n + 1) * tile_n].flatten(2)
            tail = m == m_tiles - 1 and sq % tile_m or n == n_tiles - 1 and sk % tile_n
            any_true, all_true = tile.any(2), tile.all(2)
            want = any_true.to(torch.uint8) * VISIBLE
            if not tail:
                want |= all_true.to(torch.uint8) * FULL
            got = bits[:, :, min(m, bits.shape[2] - 1), n].expand(2, heads)
            assert torch.equal(got, want), (m, n)


def problem_300_520() -> Problem:
    """B2 Sq300 Sk520 H4/2 D32, no causal/window limits."""
    return Problem.from_tensors(
        torch.empty(2, 300, 4, 32), torch.empty(2, 520, 2, 32), softmax_scale=1.0,
        is_causal=False, softcap=0.0, window_left=-1, window_right=-1, deterministic=False,
    )  # fmt: skip


def test_block_bits_are_memoized_per_tensor_and_version() -> None:
    """A block mask's bits are built once per (tensor, version, tiles): a second call returns
    the same tensor; an in-place change of the block mask, or another tensor, rebuilds them."""
    problem = problem_300_520()
    block_mask = random_block_mask((2, 2, 3, 5), 0.5, "cpu")
    first = block_bits(block_mask, problem, 128, 128, 4)
    assert block_bits(block_mask, problem, 128, 128, 4) is first
    assert block_bits(block_mask, problem, 64, 128, 4) is not first  # other tiles
    block_mask[:, :, :, 0] = ~block_mask[:, :, :, 0]
    changed = block_bits(block_mask, problem, 128, 128, 4)
    assert changed is not first
    assert torch.equal(changed[..., 0] != 0, block_mask[:, :, :, 0].repeat_interleave(2, 1))
    other = block_mask.clone()
    assert block_bits(other, problem, 128, 128, 4) is not changed
    with torch.inference_mode():
        frozen = block_mask.clone()
    assert torch.equal(block_bits(frozen, problem, 128, 128, 4), changed)


def test_a_block_mask_per_layer_keeps_its_bits_and_order() -> None:
    """A model with a block mask per layer (each from its own bias): while the masks live,
    each one's bits (forward and backward tiles) and launch order are built once, not again
    every step (a table of 16 emptied when full rebuilt all of them for 40 layers)."""
    from dmattn_cute.kernels.launch_order import forward_order

    problem = problem_300_520()
    layers = [random_block_mask((2, 2, 3, 5), 0.5, "cpu") for _ in range(40)]

    def step():
        made = []
        for block_mask in layers:
            bits = [block_bits(block_mask, problem, tile, 128, 4) for tile in (128, 64)]
            made += [*bits, forward_order(block_mask, bits[0], problem, 128, 128, 2)]
        return made

    first = step()
    assert all(a is b for a, b in zip(step(), first, strict=True))


def test_joint_mask_widens_by_stride_0_or_declines() -> None:
    problem = problem_300_520()
    block_mask = torch.ones(2, 4, 1, 5, dtype=torch.bool)
    joint = joint_mask(None, block_mask, problem)  # a key mask of Sk True bytes
    assert joint.shape == (2, 4, 1, 520) and joint.stride()[:3] == (0, 0, 0) and joint.all()
    # one view per block-mask shape, not one per call; another shape gets its own
    assert joint_mask(None, block_mask.clone(), problem) is joint
    assert joint_mask(None, block_mask[:1, :2], problem).shape == (1, 2, 1, 520)
    mask = broadcast_view(torch.rand(1, 1, 300, 520) < 0.5)
    joint = joint_mask(mask, block_mask, problem)
    assert joint.shape == (2, 4, 300, 520) and joint.stride()[:2] == (0, 0)
    assert joint.data_ptr() == mask.data_ptr()
    per_kv_head = broadcast_view(torch.rand(2, 2, 300, 520) < 0.5)
    assert joint_mask(per_kv_head, block_mask, problem) is None  # one head divisor for both
    assert joint_mask(per_kv_head, block_mask[:, :2], problem).shape == (2, 2, 300, 520)


def test_kernel_bits_view_widens_only_what_needs_it() -> None:
    """Bits [Bm, Hm, 1 or query tiles, key tiles] as the kernels index them: stride 0 on each
    size-1 batch, head or query-tile dim; bits already so come back as they are (no view op
    per call)."""
    from dmattn_cute.kernels.block_bits_launch import kernel_bits_view

    bits = torch.randint(0, 4, (2, 4, 3, 5), dtype=torch.uint8)
    assert kernel_bits_view(bits, 3) is bits
    row = bits[:1, :, :1].contiguous()  # one batch entry, one row of blocks for every query tile
    view = kernel_bits_view(row, 3)
    assert view.shape == (1, 4, 3, 5) and view.stride() == (0, 5, 0, 1)
    assert torch.equal(view, row.expand(1, 4, 3, 5))
    per_kv = bits[:, :1].contiguous()
    assert kernel_bits_view(per_kv, 3).stride() == (15, 0, 5, 1)


def test_forward_reads_the_block_mask_as_bits(launches) -> None:
    from dmattn_cute.kernels.block_bits_launch import kernel_bits_view
    from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec

    block_mask = random_block_mask((2, 4, 3, 5), 0.5, "cpu")
    problem, _ = launch_block_mask(64, None, block_mask)
    ((spec, args),) = launches["calls"]  # no pre-pass: there is no attn_mask to read
    assert isinstance(spec, Sm90FwdSpec)
    assert spec.ordered and spec.blocks_full  # a visible block needs no mask tile
    mask, bits = args[6], args[8]
    assert mask.shape == (2, 4, 1, 520) and mask.stride()[:3] == (0, 0, 0) and mask.all()
    tile_m, tile_n = spec.tile.tile_m, spec.tile.tile_n
    want = kernel_bits_view(block_bits(block_mask, problem, tile_m, tile_n, 4), -(-300 // tile_m))
    assert torch.equal(bits, want)


def test_forward_with_a_mask_reads_its_tiles(launches) -> None:
    """With attn_mask ANDed in, a visible block may be partial: the forward's mask tiles are
    read where the bits say so (not blocks_full)."""
    from dmattn_cute.kernels.sm90.fwd import Sm90FwdSpec

    mask = torch.rand(1, 1, 300, 520) < 0.5
    launch_block_mask(64, mask, random_block_mask((2, 4, 3, 5), 0.5, "cpu"))
    _, (spec, _) = launches["calls"]  # the mask's pre-pass, the forward
    assert isinstance(spec, Sm90FwdSpec)
    assert spec.ordered and not spec.blocks_full


def test_wide_key_tiles_run_on_the_element_mask(launches) -> None:
    """D256's forward with the key mask a block mask pairs with has 80-key tiles, which
    straddle blocks: the block mask is expanded into an element mask instead."""
    block_mask = random_block_mask((2, 4, 3, 5), 0.5, "cpu")
    launch_block_mask(256, None, block_mask)
    (_, pre_args), (_, args) = launches["calls"]  # the pre-pass of the element mask, the forward
    assert args[6].shape == (2, 4, 300, 520)
    assert torch.equal(args[6].bool(), element_mask(block_mask, 300, 520))
    assert pre_args[0] is args[6]


def test_backward_ands_the_mask_bits_with_the_block_bits(launches) -> None:
    from dmattn_cute.kernels.sm90.bwd import Sm90BwdSpec

    mask = torch.rand(1, 1, 300, 520) < 0.5
    block_mask = random_block_mask((2, 1, 3, 5), 0.5, "cpu")
    launch_block_mask(128, mask, block_mask, backward=True)
    _, bits_pass, (spec, args) = launches["calls"]  # preprocess, the mask's pre-pass, the backward
    assert isinstance(spec, Sm90BwdSpec)
    joint = args[12]
    assert joint.shape == (2, 1, 300, 520) and joint.stride()[0] == 0  # mask widened to B
    assert bits_pass[1][0].data_ptr() == joint.data_ptr()
    bits = args[14]
    m_tiles, n_tiles = -(-300 // spec.tile.tile_m), -(-520 // spec.tile.tile_n)
    assert bits.shape == (2, 1, m_tiles, n_tiles)
    # where the block mask is False the bits are 0 whatever the pre-pass wrote
    rows = torch.arange(m_tiles) * spec.tile.tile_m // BLOCK
    cols = torch.arange(n_tiles) * spec.tile.tile_n // BLOCK
    hidden = ~block_mask[:, :, rows][:, :, :, cols]
    assert (bits[hidden] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_without_graph_breaks(device) -> None:
    """Under torch.compile the block mask becomes an element mask inside the graph."""
    q, k, v, _, bias = random_inputs(
        1, 200, 300, 2, 1, 32, torch.bfloat16, device, bias_shape=(1, 1, 1, 300)
    )
    block_mask = random_block_mask((1, 2, 2, 3), 0.6, device)

    def attend(q, k, v, bias, block_mask):
        return flash_dmattn_func(q, k, v, attn_bias=bias, is_causal=True, block_mask=block_mask)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(
        compiled(q, k, v, bias, block_mask), attend(q, k, v, bias, block_mask), atol=2e-2, rtol=0
    )


def test_the_bits_decision_is_made_once_per_layout(launches, monkeypatch) -> None:
    """Whether a kernel reads the block mask as bits is decided once per problem and layouts,
    not by building a variant in every call (forward and backward)."""
    from dmattn_cute.kernels import bwd_launch, fwd_launch

    built = []
    for module, name in ((fwd_launch, "fwd_spec"), (bwd_launch, "backward_spec_of")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _r=real, _n=name, **k: built.append(_n) or _r(*a, **k)
        )
        monkeypatch.setattr(module, "_VARIANTS", {})
    block_mask = random_block_mask((2, 4, 3, 5), 0.5, "cpu")
    for _ in range(3):
        launch_block_mask(64, None, block_mask)
        launch_block_mask(64, None, block_mask, backward=True)
    assert built.count("fwd_spec") == 1 and built.count("backward_spec_of") == 1
