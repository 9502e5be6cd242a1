"""create_mask: per query row, the `keep` visible keys of largest bias."""

from __future__ import annotations

import itertools

import pytest
import torch

from dmattn_cute.masks import create_mask


def visible_row(i, sq, sk, is_causal, window):
    """Keys query i may see under causal / window, bottom-right aligned (SPEC.md)."""
    diag = i + sk - sq
    left, right = window
    return [
        (not is_causal or j <= diag)
        and (left < 0 or j >= diag - left)
        and (right < 0 or j <= diag + right)
        for j in range(sk)
    ]


CASES = {
    "bias_4d": {"bias": (2, 3, 4, 9)},
    "bias_3d": {"bias": (2, 3, 9)},
    "mask_broadcasts_bias": {"bias": (1, 3, 1, 8), "mask": (2, 1, 5, 8)},
    "mask_3d": {"bias": (2, 2, 6, 7), "mask": (2, 1, 7)},
    "causal": {"bias": (1, 2, 5, 8), "causal": True},
    "causal_decode": {"bias": (2, 2, 10), "causal": True, "window": (4, -1)},
    "window": {"bias": (1, 1, 6, 6), "window": (2, 1)},
    "mask_causal_window": {
        "bias": (2, 2, 7, 9),
        "mask": (2, 2, 7, 9),
        "causal": True,
        "window": (5, 0),
    },
    "neg_inf_bias": {"bias": (1, 2, 4, 8), "neg_inf": True},
}


@pytest.mark.parametrize("keep", [1, 3, 8, 50])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_keeps_top_visible_keys(case, keep):
    gen = torch.Generator().manual_seed(keep)
    bias = torch.randn(case["bias"], generator=gen)
    if case.get("neg_inf"):
        bias[torch.rand(bias.shape, generator=gen) < 0.4] = float("-inf")
    mask = None
    if "mask" in case:
        mask = torch.rand(case["mask"], generator=gen) < 0.6
    is_causal, window = case.get("causal", False), case.get("window", (-1, -1))

    kept = create_mask(bias, keep, mask, is_causal, window)

    bias4 = bias if bias.dim() == 4 else bias.unsqueeze(2)
    mask4 = None if mask is None else (mask if mask.dim() == 4 else mask.unsqueeze(2))
    shape = bias4.shape if mask4 is None else torch.broadcast_shapes(bias4.shape, mask4.shape)
    assert kept.shape == shape and kept.dtype == torch.bool
    bias4 = bias4.expand(shape)
    mask4 = torch.ones(shape, dtype=torch.bool) if mask4 is None else mask4.expand(shape)
    _, _, sq, sk = shape
    for b, h, i in itertools.product(*(range(n) for n in shape[:3])):
        band = visible_row(i, sq, sk, is_causal, window)
        candidates = [
            j
            for j in range(sk)
            if band[j] and mask4[b, h, i, j] and bias4[b, h, i, j] > float("-inf")
        ]
        chosen = kept[b, h, i].nonzero().flatten().tolist()
        assert set(chosen) <= set(candidates)
        assert len(chosen) == min(keep, len(candidates))
        others = [j for j in candidates if j not in chosen]
        if chosen and others:
            assert bias4[b, h, i, chosen].min() >= bias4[b, h, i, others].max()


def test_keep_all_without_constraints_is_all_true():
    bias = torch.randn(2, 3, 4, 6)
    assert create_mask(bias, 6).all()


@pytest.mark.parametrize(
    ("arguments", "error", "fragment"),
    [
        ({"keep": 0}, ValueError, "keep"),
        ({"keep": -3}, ValueError, "keep"),
        ({"keep": 2.0}, TypeError, "keep"),
        ({"keep": True}, TypeError, "keep"),
        ({"attn_bias": torch.ones(1, 1, 4, dtype=torch.int64)}, TypeError, "attn_bias"),
        ({"attn_bias": torch.ones(4)}, ValueError, "attn_bias"),
        ({"attn_mask": torch.ones(1, 1, 4)}, TypeError, "attn_mask"),
        ({"attn_mask": torch.ones(1, 1, 1, 4, 1, dtype=torch.bool)}, ValueError, "attn_mask"),
        ({"attn_mask": torch.ones(1, 1, 1, 5, dtype=torch.bool)}, ValueError, "attn_mask"),
        ({"window_size": (-2, 0)}, ValueError, "window_size"),
        ({"is_causal": None}, TypeError, "is_causal"),
    ],
)
def test_bad_arguments_raise(arguments, error, fragment):
    call = {"attn_bias": torch.randn(2, 2, 3, 4), "keep": 2} | arguments
    with pytest.raises(error, match=fragment):
        create_mask(**call)
