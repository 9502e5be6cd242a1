"""One bounded memo for the host side's per-call lookups (validated problems, launch plans,
block-bits pairings and decisions): the calls of a training or inference loop repeat a few
shapes, so a table that is emptied when full keeps them all without an eviction order.
What is derived from a tensor (a mask's block bits, a block mask's launch order) is kept
while the tensor lives: a model may hold one mask per layer, dozens at once, and each is
made again every step."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

Value = TypeVar("Value")
_MISSING = object()


def remember(table: dict, key: Hashable, make: Callable[[], Value], limit: int = 256) -> Value:
    """table[key], made by make() and stored on a miss (a value of None is kept too); a full
    table is emptied first."""
    value = table.get(key, _MISSING)
    if value is _MISSING:
        if len(table) >= limit:
            table.clear()
        value = table[key] = make()
    return value


def remember_for(
    table: dict, tensor: torch.Tensor, key: Hashable, make: Callable[[], Value], limit: int = 128
) -> Value:
    """What make() derives from `tensor` (and key), remembered for that tensor while it is
    unchanged: it is held weakly (another tensor that takes a dead one's id misses) and keyed
    by its version (an in-place change misses). The entry goes when the tensor does (the
    previous step's masks, and their bits with them), so a table is emptied only when live
    tensors fill it. An inference tensor, which has no version counter, is not remembered."""
    if tensor.is_inference():
        return make()
    slot = (id(tensor), tensor._version, key)

    def entry():
        return weakref.ref(tensor, lambda _: table.pop(slot, None)), make()

    owner, value = remember(table, slot, entry, limit)
    if owner() is not tensor:
        owner, value = table[slot] = entry()
    return value


__all__ = ["remember", "remember_for"]
