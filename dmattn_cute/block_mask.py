"""Block masks: a compact mask of BLOCK x BLOCK (query, key) blocks, for long sequences where
an element mask [B, H, Sq, Sk] does not fit (at Sq = Sk = 128k: 16 GiB per head; its block
mask: 1 MiB).

    block_mask = create_block_mask(key_scores, keep_blocks=16, is_causal=True)
    out = flash_dmattn_func(q, k, v, attn_bias=bias, is_causal=True, block_mask=block_mask)

A block mask is bool [Bm, Hm, Mq, Mk] with Bm in {1, B}, Hm in {1, Hkv, H} (broadcast as
attn_mask is), Mq in {1, ceil(Sq / BLOCK)} and Mk = ceil(Sk / BLOCK). Query i sees key j only
where block_mask[b, h, i // BLOCK, j // BLOCK] (row 0 when Mq = 1) is True, on top of
attn_mask, causal and window limits: it is an element mask with each block's value repeated,
and expand_block_mask builds that (the float32 reference, CPU calls and torch.compile run it).

On CUDA in eager mode, the Hopper kernels read it as their block bits (kernels/
block_mask_launch.py): a False block is skipped like an all-False mask tile, a True one runs
without a mask tile where attn_mask has none there. Other paths (the mma.sync kernels of
SM80/86/89, a deterministic backward that sums a broadcast bias's gradient, head dims whose
key tiles do not divide BLOCK, an attn_mask per kv head with a block mask per query head)
expand it into an element mask first, of attn_mask's broadcast shape with the block mask's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmattn_cute.problem import check_bool, check_compact_mask, check_window_size

BLOCK = 128


def block_counts(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(query blocks, key blocks) of a problem: ceil(Sq / BLOCK), ceil(Sk / BLOCK)."""
    return -(-seqlen_q // BLOCK), -(-seqlen_k // BLOCK)


def check_block_mask(
    block_mask: object,
    batch: int,
    heads: int,
    heads_kv: int,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device,
) -> None:
    """Raise TypeError / ValueError unless block_mask is a bool [Bm, Hm, Mq, Mk] block mask
    of this problem (see the module) on `device`."""
    m_blocks, n_blocks = block_counts(seqlen_q, seqlen_k)
    check_compact_mask(
        "block_mask", block_mask, torch.bool, device,
        ((1, batch), (1, heads_kv, heads), (1, m_blocks), (n_blocks,)),
        lambda: f"[Bm, Hm, Mq, Mk] with Bm in {{1, {batch}}}, Hm in {{1, {heads_kv}, {heads}}}, "
        f"Mq in {{1, {m_blocks}}} (ceil(Sq / {BLOCK})) and Mk = {n_blocks} (ceil(Sk / {BLOCK}))",
    )  # fmt: skip


def expand_block_mask(block_mask: Tensor, seqlen_q: int, seqlen_k: int) -> Tensor:
    """The element mask [Bm, Hm, Sq (1 when Mq = 1), Sk] a block mask stands for."""
    rows = block_mask if block_mask.shape[2] == 1 else block_mask.repeat_interleave(BLOCK, 2)
    rows = rows[:, :, : min(rows.shape[2], seqlen_q)]
    return rows.repeat_interleave(BLOCK, 3)[..., :seqlen_k]


def with_block_mask(
    attn_mask: Tensor | None, block_mask: Tensor, seqlen_q: int, seqlen_k: int, group: int
) -> Tensor:
    """attn_mask and the block mask as one element mask (materialized: the paths that cannot
    read the block mask as block bits), of their broadcast shape. A 4-D or 3-D attn_mask;
    `group` = H / Hkv maps an Hkv head dim onto an H one."""
    return and_masks(attn_mask, expand_block_mask(block_mask, seqlen_q, seqlen_k), group)


def and_masks(attn_mask: Tensor | None, mask: Tensor, group: int) -> Tensor:
    """attn_mask (4-D, 3-D or None) ANDed with a 4-D element mask, of their broadcast shape;
    `group` = H / Hkv maps an Hkv head dim onto an H one."""
    if attn_mask is None:
        return mask
    first = attn_mask.unsqueeze(2) if attn_mask.dim() == 3 else attn_mask
    heads = max(first.shape[1], mask.shape[1])
    first, mask = (
        t.repeat_interleave(group, 1) if 1 < t.shape[1] < heads else t for t in (first, mask)
    )
    return first & mask


def create_block_mask(
    key_scores: Tensor,
    keep_blocks: int,
    seqlen_q: int | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:
    """Keep, per query block, the `keep_blocks` visible key blocks of largest score.

    key_scores: float [Bm, Hm, Sk], one score per key (e.g. a per-key attn_bias); a key
    block's score is its keys' maximum. seqlen_q (default Sk): the query length, for the
    causal / window limits, aligned to the bottom-right corner as in flash_dmattn_func; a key
    block is visible from a query block when some (query, key) pair of theirs is.

    Returns bool [Bm, Hm, ceil(Sq / BLOCK), ceil(Sk / BLOCK)]: True at the min(keep_blocks,
    visible) visible key blocks of largest score in each query block row (ties as torch.topk
    breaks them; -inf scores never kept), for flash_dmattn_func's block_mask. Reads
    O(B * H * Sk) and sorts O(B * H * Mq * Mk) values: no element-sized tensor.
    """
    if not isinstance(key_scores, Tensor) or not key_scores.is_floating_point():
        raise TypeError("key_scores: expected a floating-point tensor [Bm, Hm, Sk]")
    if key_scores.dim() != 3:
        raise ValueError(
            f"key_scores: expected a 3-D tensor [Bm, Hm, Sk], got shape {tuple(key_scores.shape)}"
        )
    if isinstance(keep_blocks, bool) or not isinstance(keep_blocks, int) or keep_blocks < 1:
        raise ValueError(f"keep_blocks: expected an int >= 1, got {keep_blocks!r}")
    check_bool("is_causal", is_causal)
    left, right = check_window_size(window_size)
    seqlen_k = key_scores.shape[2]
    seqlen_q = seqlen_k if seqlen_q is None else seqlen_q
    m_blocks, n_blocks = block_counts(seqlen_q, seqlen_k)
    pad = n_blocks * BLOCK - seqlen_k
    padded = torch.nn.functional.pad(key_scores.float(), (0, pad), value=-torch.inf)
    block_scores = padded.unflatten(2, (n_blocks, BLOCK)).amax(3)  # [Bm, Hm, Mk]
    scores = block_scores[:, :, None, :].expand(-1, -1, m_blocks, -1)
    if is_causal or left >= 0 or right >= 0:
        scores = scores.masked_fill(
            ~visible_blocks(seqlen_q, seqlen_k, is_causal, left, right, key_scores.device),
            -torch.inf,
        )
    keep = min(keep_blocks, n_blocks)
    top = scores.topk(keep, dim=3)
    kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    kept.scatter_(3, top.indices, top.values > -torch.inf)
    return kept


def visible_blocks(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    left: int,
    right: int,
    device: torch.device,
    block_q: int = BLOCK,
    block_k: int = BLOCK,
) -> Tensor:
    """bool [ceil(Sq / block_q), ceil(Sk / block_k)]: whether a query block and a key block
    have a visible pair under the causal / window limits. Query i sees keys [i + shift - left,
    i + shift + right] (causal: right = 0), both ends rising with i: a block pair has a
    visible pair when its first key is below the last row's upper end and its last key above
    the first row's lower end."""
    m_blocks, n_blocks = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    first = torch.arange(m_blocks, device=device) * block_q
    last = torch.clamp(first + block_q - 1, max=seqlen_q - 1)
    key_first = torch.arange(n_blocks, device=device) * block_k
    key_last = torch.clamp(key_first + block_k - 1, max=seqlen_k - 1)
    shift = seqlen_k - seqlen_q  # bottom-right: query i sits at key i + shift
    visible = torch.ones(m_blocks, n_blocks, dtype=torch.bool, device=device)
    if causal or right >= 0:
        upper = last + shift + (0 if causal else right)
        visible &= key_first[None, :] <= upper[:, None]
    if left >= 0:
        visible &= key_last[None, :] >= (first + shift - left)[:, None]
    return visible


__all__ = [
    "BLOCK",
    "and_masks",
    "block_counts",
    "check_block_mask",
    "create_block_mask",
    "expand_block_mask",
    "visible_blocks",
    "with_block_mask",
]
