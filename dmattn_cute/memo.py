"""One bounded memo for the host side's per-call lookups (validated problems, launch plans,
block-bits pairings and decisions): the calls of a training or inference loop repeat a few
shapes, so a table that is emptied when full keeps them all without an eviction order.
What is derived from a tensor (a mask's block bits, a block mask's launch order) is kept
while the tensor lives: a model may hold one mask per layer, dozens at once, and each is
made again every step.

Device data a kernel reads (bits, launch orders) takes care under CUDA graph capture
(`graphs=True`): a value made while a graph is captured is filled only when the graph
replays, so it is not remembered (an eager call before the first replay would read it
unfilled); a remembered value a graph captures is read at every replay, so it is held for
the process, past its table's emptying or its tensor's death (`captured`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

Value = TypeVar("Value")
_MISSING = object()
# Remembered values captured by CUDA graphs, by id (a value may be a tuple): held for the
# process, as a graph replays them for as long as it lives.
_CAPTURED: dict[int, object] = {}


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never, before CUDA is in use)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def captured(value, make: Callable[[], Value]) -> Value:
    """A memo's answer while a CUDA graph is captured: its remembered `value`, held for the
    process (_CAPTURED), or on a miss (_MISSING) make()'s value, not remembered."""
    if value is _MISSING:
        return make()
    _CAPTURED[id(value)] = value
    return value


def remember(
    table: dict, key: Hashable, make: Callable[[], Value], limit: int = 256, graphs: bool = False
) -> Value:
    """table[key], made by make() and stored on a miss (a value of None is kept too); a full
    table is emptied first. graphs: the values are device data, taken under CUDA graph
    capture as `captured` says."""
    value = table.get(key, _MISSING)
    if graphs and capturing():
        return captured(value, make)
    if value is _MISSING:
        if len(table) >= limit:
            table.clear()
        value = table[key] = make()
    return value


def remember_for(
    table: dict,
    tensor: torch.Tensor,
    key: Hashable,
    make: Callable[[], Value],
    limit: int = 128,
    graphs: bool = False,
) -> Value:
    """What make() derives from `tensor` (and key), remembered for that tensor while it is
    unchanged: it is held weakly (another tensor that takes a dead one's id misses) and keyed
    by its version (an in-place change misses). The entry goes when the tensor does (the
    previous step's masks, and their bits with them), so a table is emptied only when live
    tensors fill it. An inference tensor, which has no version counter, is not remembered.
    graphs: as remember's."""
    if tensor.is_inference():
        return make()
    slot = (id(tensor), tensor._version, key)
    if graphs and capturing():
        owner, value = table.get(slot, (None, _MISSING))
        return captured(value if owner is not None and owner() is tensor else _MISSING, make)

    def entry():
        return weakref.ref(tensor, lambda _: table.pop(slot, None)), make()

    owner, value = remember(table, slot, entry, limit)
    if owner() is not tensor:
        owner, value = table[slot] = entry()
    return value


__all__ = ["captured", "capturing", "remember", "remember_for"]
