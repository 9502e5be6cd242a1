"""One bounded memo for the host side's per-call lookups (validated problems, launch plans,
block-bits pairings and decisions): the calls of a training or inference loop repeat a few
shapes, so a table that is emptied when full keeps them all without an eviction order."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

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


__all__ = ["remember"]
