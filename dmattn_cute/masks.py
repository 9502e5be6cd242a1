"""Mask utilities: build the boolean attn_mask of dynamic mask attention from a bias."""

from __future__ import annotations

import torch
from torch import Tensor

from dmattn_cute.problem import check_bool, check_window_size
from dmattn_cute.reference import visible_mask


def _as_4d(t: Tensor, name: str) -> Tensor:
    if t.dim() not in (3, 4):
        raise ValueError(
            f"{name}: expected a 3-D [Bm, Hm, Km] or 4-D [Bm, Hm, Qm, Km] tensor, "
            f"got {t.dim()}-D of shape {tuple(t.shape)}"
        )
    return t.unsqueeze(2) if t.dim() == 3 else t


def create_mask(
    attn_bias: Tensor,
    keep: int,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:
    """Keep, per query row, the `keep` visible keys of largest bias (flash-dmattn's dynamic mask).

    attn_bias: float [Bm, Hm, Km] or [Bm, Hm, Qm, Km] (3-D means Qm = 1).
    attn_mask: optional bool of the same rank rules, broadcastable with attn_bias; True = visible.
    is_causal, window_size: as in flash_dmattn_func, aligned to the bottom-right corner with
    Sq = Qm and Sk = Km of the broadcast shape (so Qm = 1 is the last query, as in decoding).

    Returns a bool tensor of the broadcast shape [Bm, Hm, Qm, Km] of bias and mask, True at the
    min(keep, visible) visible keys of largest bias in each row. Keys that are not visible or
    whose bias is -inf are never kept. Ties are broken as torch.topk breaks them. Pass the
    result as attn_mask together with the same bias.
    """
    if not isinstance(attn_bias, Tensor) or not attn_bias.is_floating_point():
        got = attn_bias.dtype if isinstance(attn_bias, Tensor) else type(attn_bias).__name__
        raise TypeError(f"attn_bias: expected a floating-point tensor, got {got}")
    if not isinstance(keep, int) or isinstance(keep, bool):
        raise TypeError(f"keep: expected an int, got {keep!r}")
    if keep < 1:
        raise ValueError(f"keep: expected >= 1, got {keep}")
    if attn_mask is not None and (
        not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool
    ):
        got = attn_mask.dtype if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
        raise TypeError(f"attn_mask: expected a torch.bool tensor or None, got {got}")
    check_bool("is_causal", is_causal)
    window = check_window_size(window_size)

    bias = _as_4d(attn_bias, "attn_bias")
    mask = None if attn_mask is None else _as_4d(attn_mask, "attn_mask")
    shape = bias.shape
    if mask is not None:
        try:
            shape = torch.broadcast_shapes(bias.shape, mask.shape)
        except RuntimeError as err:
            raise ValueError(
                f"attn_mask: expected a shape broadcastable with attn_bias {tuple(bias.shape)}, "
                f"got {tuple(mask.shape)}"
            ) from err
    batch, heads, seqlen_q, seqlen_k = shape

    visible = visible_mask(
        mask, batch, heads, seqlen_q, seqlen_k, is_causal, window, device=bias.device
    )
    scores = bias.detach().float().masked_fill(~visible, float("-inf"))
    top = scores.topk(min(keep, seqlen_k), dim=-1).indices
    kept = torch.zeros(shape, dtype=torch.bool, device=bias.device).scatter_(-1, top, True)
    # Rows with fewer than `keep` candidates pick some -inf scores in topk; drop those.
    return kept & (scores > float("-inf"))
