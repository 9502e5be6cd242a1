"""Causal top-w masks as per-key expiry rows (dmattn_cute/topw.py) against the mask built by
definition: for each query row, a stable descending sort of the scores it may see, first w."""

from __future__ import annotations

import pytest
import torch

from dmattn_cute.topw import expiry_mask, topw_expiry


def topw_by_definition(scores: torch.Tensor, w: int, seqlen_q: int) -> torch.Tensor:
    seqlen_k = scores.shape[-1]
    flat = scores.reshape(-1, seqlen_k)
    mask = torch.zeros(flat.shape[0], seqlen_q, seqlen_k, dtype=torch.bool)
    for n, row in enumerate(flat):
        for i in range(seqlen_q):
            last = i + seqlen_k - seqlen_q  # bottom-right aligned
            if last >= 0:
                top = torch.sort(row[: last + 1], descending=True, stable=True).indices[:w]
                mask[n, i, top] = True
    return mask.reshape(*scores.shape[:-1], seqlen_q, seqlen_k)


@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("w", [1, 3, 16, 65, 300])
@pytest.mark.parametrize("seqlen", [1, 2, 63, 65, 200])
def test_expiry_is_the_causal_topw_mask(seqlen, w, chunk) -> None:
    """Scores drawn from 7 values: ties rank by position."""
    scores = torch.randint(0, 7, (2, 3, seqlen)).float()
    expiry = topw_expiry(scores, w, chunk)
    assert expiry.shape == scores.shape and expiry.dtype == torch.int32
    assert torch.equal(expiry_mask(expiry, seqlen), topw_by_definition(scores, w, seqlen))


@pytest.mark.parametrize("seqlen_q", [1, 50, 129])
def test_fewer_queries_are_bottom_right_aligned(seqlen_q) -> None:
    scores = torch.randn(2, 129)
    expiry = topw_expiry(scores, 20)
    assert torch.equal(expiry_mask(expiry, seqlen_q), topw_by_definition(scores, 20, seqlen_q))


def test_expiry_by_hand() -> None:
    """w = 2: keys 0 and 2 (the two highest) never expire; key 1 expires at row 2 (keys 0 and
    2 rank above it), key 3 at row 1 (keys 0 and 1) and key 4 at row 2 (keys 0 and 2): the
    last two before they appear, so no row keeps them."""
    scores = torch.tensor([[5.0, 1.0, 4.0, 0.0, 3.0]])
    assert topw_expiry(scores, 2).tolist() == [[5, 2, 5, 1, 2]]


@pytest.mark.parametrize("w", [0, -1, 1.5, True])
def test_rejects_bad_w(w) -> None:
    with pytest.raises(ValueError, match="w: expected a positive int"):
        topw_expiry(torch.randn(1, 8), w)


def test_rejects_integer_scores() -> None:
    with pytest.raises(ValueError, match="scores: expected a float tensor"):
        topw_expiry(torch.arange(8), 2)


def test_rows_in_groups_give_the_same_expiry(monkeypatch) -> None:
    """Many rows are processed in groups that bound the temporaries: one row per group here."""
    from dmattn_cute import topw

    scores = torch.randint(0, 5, (3, 2, 100)).float()
    whole = topw_expiry(scores, 7)
    groups = []
    running = topw._running_wth_smallest
    monkeypatch.setattr(topw, "_TEMP_BYTES", 1)
    monkeypatch.setattr(
        topw,
        "_running_wth_smallest",
        lambda part, *a: groups.append(len(part)) or running(part, *a),
    )
    assert torch.equal(topw_expiry(scores, 7), whole)
    assert groups == [1] * 6
